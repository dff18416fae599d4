"""The plain Keras script runner_vs_keras.py compares the runner with: the classic notebook way, written by
hand (no runner import). The MNIST arrays are loaded into memory as numpy (here read back from the prepared
TFRecords, as `keras.datasets.mnist.load_data()` would hand them over), the Basic CNN trains in float32 with
`model.fit(x, y, batch_size=...)`, then evaluates and saves. Prints one JSON line: test accuracy, epoch
seconds and steady examples/s (epochs after the first). Not a benchmark on its own (run_all.py skips "_" files).

`--policy mixed_bfloat16` is the Keras expert's version of the same script: Keras's mixed precision policy set
by hand before the model is built (`keras.mixed_precision.set_global_policy`), the softmax layer kept in
float32 as Keras's mixed precision guide advises, everything else unchanged.

    python benchmarks/_plain_keras.py DATA_DIR OUT_DIR --batch 1024 --epochs 3 [--steps-per-epoch N] [--policy P]
"""

import argparse
import glob
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras

parser = argparse.ArgumentParser()
parser.add_argument("data")
parser.add_argument("out")
parser.add_argument("--batch", type=int, default=1024)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=None)
parser.add_argument("--policy", default="float32", choices=("float32", "mixed_bfloat16"))
args = parser.parse_args()


def load(split):
    """The split as numpy arrays: images (N, 28, 28, 1) uint8, labels (N,) int64."""
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    images, labels = [], []
    files = sorted(glob.glob(os.path.join(args.data, f"{split}-*.tfrecord")))
    for record in tf.data.TFRecordDataset(files).batch(10_000):
        parsed = tf.io.parse_example(record, spec)
        images.append(tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), (-1, 28, 28, 1)).numpy())
        labels.append(parsed["label"].numpy())
    return np.concatenate(images), np.concatenate(labels)


(x_train, y_train), (x_test, y_test) = load("train"), load("test")
x_train, x_test = x_train.astype("float32"), x_test.astype("float32")  # the notebooks' float32 arrays
if args.steps_per_epoch:
    x_train, y_train = x_train[: args.steps_per_epoch * args.batch], y_train[: args.steps_per_epoch * args.batch]

keras.utils.set_random_seed(0)
keras.mixed_precision.set_global_policy(args.policy)  # before the layers are built: they take it at creation
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
    layers.Dense(10, activation="softmax", dtype="float32"),  # float32 under either policy: the same in float32
])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])


class EpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.monotonic() - self._start)


clock = EpochClock()
model.fit(x_train, y_train, batch_size=args.batch, epochs=args.epochs, shuffle=True, callbacks=[clock], verbose=0)
results = model.evaluate(x_test, y_test, batch_size=args.batch, return_dict=True, verbose=0)
os.makedirs(args.out, exist_ok=True)
model.save(os.path.join(args.out, "model.keras"))
steady = statistics.median(clock.seconds[1:]) if len(clock.seconds) > 1 else clock.seconds[0]
print(json.dumps({
    "accuracy": float(results["accuracy"]), "examples_per_epoch": len(x_train),
    "epoch_s": [round(s, 3) for s in clock.seconds], "steady_examples_per_sec": round(len(x_train) / steady, 1),
    "policy": keras.mixed_precision.global_policy().name,
}))
