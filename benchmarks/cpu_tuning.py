"""Where the MNIST CNN's training step spends its time on this CPU, and which settings feed its units better.

`--profile`: one process trains the runner's MNIST Basic CNN (the data held in memory, as `data.in_memory: auto`
holds it) and traces a few steady steps with TensorFlow's profiler; the trace's host plane (xplane.pb) is read
directly and each op's time summed by op type (the TensorFlow op events are named `name:type`).

Variants: each a fresh process (settings such as oneDNN, threads or XLA are fixed at start), the order turning
every round, steady examples/s over `--epochs` epochs of `--steps` steps after one warm-up epoch:

    base        the runner's CPU defaults: bfloat16 (auto on this CPU), steps_per_execution 1, batch 1024
    xla         model.compile(jit_compile=True) (XLA on the CPU; few steps: it is slow here)
    spe8        steps_per_execution=8
    inter1      tf.config.threading inter-op threads 1 (intra-op keeps every core)
    b512 b2048  the global batch
    f32         float32
    eigen       TF_ENABLE_ONEDNN_OPTS=0 (TensorFlow's Eigen kernels, oneDNN off)

    .venv/bin/python benchmarks/cpu_tuning.py [--profile] [--variants base xla ...] [--rounds N]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MNIST, REPO, prepared

VARIANTS = {
    "base": {},
    "xla": {"jit_compile": True},
    "spe8": {"steps_per_execution": 8},
    "inter1": {"inter_op": 1},
    "b512": {"batch": 512},
    "b2048": {"batch": 2048},
    "f32": {"policy": "float32"},
    "eigen": {"env": {"TF_ENABLE_ONEDNN_OPTS": "0"}},
}


def load_mnist(folder: Path):
    """The training split as numpy arrays (images float32 0..255, labels int64), as the runner holds it."""
    import numpy as np
    import tensorflow as tf

    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    images, labels = [], []
    files = sorted(str(p) for p in folder.glob("train-*.tfrecord"))
    for record in tf.data.TFRecordDataset(files).batch(10_000):
        parsed = tf.io.parse_example(record, spec)
        images.append(tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), (-1, 28, 28, 1)).numpy())
        labels.append(parsed["label"].numpy())
    return np.concatenate(images).astype("float32"), np.concatenate(labels)


def build(settings: dict):
    """The runner's MNIST model and optimizer, compiled with the variant's settings."""
    import tensorflow as tf

    from runner import models
    from runner.data.schema import Feature

    tf.keras.utils.set_random_seed(0)
    tf.keras.mixed_precision.set_global_policy(
        "float32" if settings.get("policy") == "float32" else "mixed_bfloat16")
    model = models.build("mnist_cnn", {}, {"image": Feature(shape=(28, 28, 1), dtype="float32")}, ("image",))
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=settings.get("steps_per_execution", 1),
                  jit_compile=settings.get("jit_compile", False))
    return model


def dataset(x, y, batch: int):
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False  # as the runner sets it (docs/performance.md)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10_000, seed=0).batch(batch, drop_remainder=True)
    return data.repeat().prefetch(2).with_options(options)


def child(name: str, steps: int, epochs: int, data: Path) -> None:
    """One variant in this process: prints its steady examples/s and epoch seconds as one JSON line."""
    import tensorflow as tf

    settings = VARIANTS[name]
    if "inter_op" in settings:
        tf.config.threading.set_inter_op_parallelism_threads(settings["inter_op"])
    batch = settings.get("batch", 1024)
    x, y = load_mnist(data)
    model = build(settings)
    if settings.get("jit_compile"):
        steps = max(2, steps // 5)  # XLA on this CPU is slow: a few steps tell
    seconds = []

    class Clock(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.monotonic()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.monotonic() - self.began)

    model.fit(dataset(x, y, batch), steps_per_epoch=steps, epochs=epochs + 1, callbacks=[Clock()], verbose=0)
    steady = statistics.median(seconds[1:])
    print(json.dumps({"variant": name, "examples_per_sec": round(steps * batch / steady, 1),
                      "epoch_s": [round(s, 3) for s in seconds], "steps": steps, "batch": batch,
                      "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS")}))


def profile(steps: int, data: Path, policy: str) -> dict:
    """Op time by op type over `steps` traced steady steps (after one warm-up epoch)."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    x, y = load_mnist(data)
    model = build({"policy": policy})
    batches = dataset(x, y, 1024)
    model.fit(batches, steps_per_epoch=10, epochs=1, verbose=0)
    logdir = tempfile.mkdtemp(prefix="cpu_tuning-")
    tf.profiler.experimental.start(logdir)
    began = time.monotonic()
    model.fit(batches, steps_per_epoch=steps, epochs=1, verbose=0)
    wall = time.monotonic() - began
    tf.profiler.experimental.stop()
    path = next(Path(logdir).rglob("*.xplane.pb"))
    space = xplane_pb2.XSpace.FromString(path.read_bytes())
    by_type: collections.Counter = collections.Counter()
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                # TensorFlow op executions are named "scope/op_name:OpType"; the executor's and the function's
                # own events ("...:Process", "...:Run", "__inference_...") enclose them and are left out.
                op_name, _, op_type = names.get(event.metadata_id, "").rpartition(":")
                if "/" in op_name and op_type.isidentifier() and op_type not in ("Process", "Run"):
                    by_type[op_type] += event.duration_ps / 1e12
    total = sum(by_type.values())
    return {"policy": policy, "steps": steps, "wall_s": round(wall, 3), "op_s": round(total, 3),
            "by_type": {k: round(v / total, 4) for k, v in by_type.most_common(15)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--policy", default="bfloat16")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    data = prepared(Path(args.data))
    if args.child:
        child(args.child, args.steps, args.epochs, data)
        return
    if args.profile:
        print(json.dumps(profile(args.steps, data, args.policy)))
        return
    results: dict[str, list[dict]] = {name: [] for name in args.variants}
    for round_ in range(args.rounds):
        shift = round_ % len(args.variants)
        for name in args.variants[shift:] + args.variants[:shift]:
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **VARIANTS[name].get("env", {})}
            done = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps),
                                   "--epochs", str(args.epochs), "--data", str(data)],
                                  cwd=REPO, env=env, capture_output=True, text=True)
            if done.returncode:
                print(f"round {round_ + 1}: {name} failed:\n{done.stderr[-2000:]}", flush=True)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append(result)
            print(f"round {round_ + 1}: {name:7s} {result['examples_per_sec']:8.0f} examples/s  "
                  f"epochs {result['epoch_s']}", flush=True)
    base = statistics.median(r["examples_per_sec"] for r in results.get("base", [])) if results.get("base") else None
    for name, runs in results.items():
        if not runs:
            continue
        rate = statistics.median(r["examples_per_sec"] for r in runs)
        print(json.dumps({"benchmark": f"cpu_tuning[{name}]", "ratio": round(rate / base, 3) if base else None,
                          "goal": "measured (vs base)", "detail": {
                              "examples_per_sec": " ".join(f"{r['examples_per_sec']:.0f}" for r in runs),
                              "steps": runs[0]["steps"], "batch": runs[0]["batch"], "rounds": len(runs)}}))


if __name__ == "__main__":
    main()
