"""The plain KerasHub script lm_throughput.py compares the runner with (no runner import): the preset's CausalLM
loaded without its preprocessor, LoRA enabled, compiled as KerasHub's CausalLM is (sparse categorical
cross-entropy of the logits, reduced over the weighted tokens) and fitted on the records' token ids read into
numpy, with the padding/prompt mask as sample weights, under Keras on JAX. Prints one JSON line: epoch seconds
and steady tokens/s (epochs after the first). Not a benchmark on its own (run_all.py skips "_" files).

    KERAS_BACKEND=jax python benchmarks/_plain_keras_lm.py PRESET DATA_DIR --batch 8 --epochs 3 --lora-rank 4
        [--policy mixed_bfloat16] [--learning-rate 0.01] [--mesh 2x4]

--mesh BxM: the model sharded as the Gemma distributed-tuning guide does it, over JAX's CPU devices (set
JAX_NUM_CPU_DEVICES to B x M): keras.distribution.DeviceMesh((B, M), ["batch", "model"]), the backbone's own
get_layout_map, ModelParallel with the batch on "batch", set before the model is built.
"""

import argparse
import glob
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("preset")
parser.add_argument("data")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lora-rank", type=int, default=4)
parser.add_argument("--learning-rate", type=float, default=0.01)
parser.add_argument("--policy", default="float32", choices=("float32", "mixed_bfloat16"))
parser.add_argument("--mesh", default=None, help="BxM: shard over a (batch B, model M) mesh of CPU devices")
args = parser.parse_args()

manifest = json.load(open(os.path.join(args.data, "manifest.json")))
length = manifest["preprocessing"]["sequence_length"]
spec = {name: tf.io.FixedLenFeature([length], tf.float32 if name == "target_mask" else tf.int64)
        for name in ("token_ids", "padding_mask", "target_ids", "target_mask")}
files = sorted(glob.glob(os.path.join(args.data, "train-*.tfrecord")))
parsed = [tf.io.parse_example(batch, spec) for batch in tf.data.TFRecordDataset(files).batch(100_000)]
arrays = {name: np.concatenate([p[name].numpy() for p in parsed]) for name in spec}

keras.utils.set_random_seed(0)
if args.mesh:
    rows, columns = (int(n) for n in args.mesh.split("x"))
    mesh = keras.distribution.DeviceMesh((rows, columns), ["batch", "model"],
                                         devices=keras.distribution.list_devices())
    config = json.load(open(os.path.join(args.preset, "config.json")))
    backbone = getattr(keras_hub.models, config["class_name"])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=backbone.get_layout_map(mesh), batch_dim_name="batch"))
model = keras_hub.models.CausalLM.from_preset(args.preset, preprocessor=None, dtype=args.policy)
if args.lora_rank:
    model.backbone.enable_lora(args.lora_rank)
model.compile(
    optimizer=keras.optimizers.Adam(args.learning_rate),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
    weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
)


class EpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.monotonic() - self._start)


clock = EpochClock()
steps = len(arrays["token_ids"]) // args.batch
x = {"token_ids": arrays["token_ids"], "padding_mask": arrays["padding_mask"]}
history = model.fit(x, arrays["target_ids"], sample_weight=arrays["target_mask"], batch_size=args.batch,
                    epochs=args.epochs, steps_per_epoch=steps, callbacks=[clock], verbose=0, shuffle=True)
steady = clock.seconds[1:]
per_s = steps * args.batch * length / statistics.median(steady) if steady else None
print(json.dumps({"epoch_s": clock.seconds, "steady_tokens_per_sec": per_s, "tokens_per_example": length,
                  "loss": [float(v) for v in history.history["loss"]], "steps_per_epoch": steps}))
