"""What the benchmark scripts share: the repository root, the batch they measure at, the prepared MNIST
TFRecords, a fresh MNIST model, and a Keras callback that times epochs. Importing it loads no TensorFlow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BATCH = 1024
MNIST = REPO / "benchmarks" / "out" / "mnist"


def prepared(folder: str | Path) -> Path:
    """The MNIST TFRecords in `folder`, written by `runner prepare` the first time."""
    folder = Path(folder)
    if not (folder / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "runner", "prepare", "mnist", "--out", str(folder)], cwd=REPO, check=True)
    return folder


def fresh_model(features):
    """The runner's MNIST Basic CNN, built and compiled for the CPU from seed 0: a new one for every fit."""
    import tensorflow as tf

    from runner.spec.types import JobSpec
    from runner.train import build

    tf.keras.utils.set_random_seed(0)
    spec = JobSpec()  # steps_per_execution auto: 1 on a CPU
    model = build.build_model(spec, features)
    build.compile_model(model, spec, "cpu")
    return model


def epoch_clock():
    """A Keras callback whose `.seconds` lists each epoch's wall time."""
    import tensorflow as tf

    class EpochClock(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.monotonic()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.monotonic() - self._start)

    return EpochClock()
