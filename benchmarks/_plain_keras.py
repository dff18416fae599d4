"""The plain Keras script runner_vs_keras.py compares the runner with: what a user writes by hand for the
same training (no runner import). Reads the prepared MNIST TFRecords, trains the Basic CNN, evaluates,
saves the model. Not a benchmark on its own (run_all.py skips files starting with "_").

    python benchmarks/_plain_keras.py DATA_DIR OUT_DIR --batch 1024 --epochs 3 [--steps-per-epoch N]
"""

import argparse
import glob
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

keras = tf.keras

parser = argparse.ArgumentParser()
parser.add_argument("data")
parser.add_argument("out")
parser.add_argument("--batch", type=int, default=1024)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=None)
args = parser.parse_args()

manifest = json.load(open(os.path.join(args.data, "manifest.json")))
train_records = manifest["splits"]["train"]["records"]
test_records = manifest["splits"]["test"]["records"]
spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}


def parse(serialized):
    parsed = tf.io.parse_example(serialized, spec)
    image = tf.cast(tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), (-1, 28, 28, 1)), tf.float32)
    return image, parsed["label"]


def dataset(pattern, training):
    files = sorted(glob.glob(os.path.join(args.data, pattern)))
    records = tf.data.TFRecordDataset(files, num_parallel_reads=tf.data.AUTOTUNE)
    if training:
        records = records.shuffle(10_000, seed=0).repeat()
    batches = records.batch(args.batch, drop_remainder=True).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    # The runner's default (data.autotune: false): with the autotuner on, fit and evaluate return only when
    # its thread wakes, up to a minute late (benchmarks/autotune_teardown.py), which would time TensorFlow.
    options = tf.data.Options()
    options.autotune.enabled = False
    return batches.with_options(options).prefetch(tf.data.AUTOTUNE)


keras.utils.set_random_seed(0)
layers = keras.layers
model = keras.Sequential([
    keras.Input((28, 28, 1)),
    layers.Rescaling(1.0 / 255),
    layers.Conv2D(64, 2, padding="same", activation="relu"),
    layers.MaxPooling2D(2),
    layers.Dropout(0.3),
    layers.Conv2D(32, 2, padding="same", activation="relu"),
    layers.MaxPooling2D(2),
    layers.Dropout(0.3),
    layers.Flatten(),
    layers.Dense(256, activation="relu"),
    layers.Dropout(0.5),
    layers.Dense(10, activation="softmax"),
])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
steps = args.steps_per_epoch or train_records // args.batch
model.fit(dataset("train-*.tfrecord", True), epochs=args.epochs, steps_per_epoch=steps, verbose=0)
results = model.evaluate(dataset("test-*.tfrecord", False), steps=test_records // args.batch, return_dict=True, verbose=0)
os.makedirs(args.out, exist_ok=True)
model.save(os.path.join(args.out, "model.keras"))
print(json.dumps({"accuracy": float(results["accuracy"]), "steps_per_epoch": steps}))
