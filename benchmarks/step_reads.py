"""What a callback's read of the step costs under JAX: the device reads the step counting removed.

Until the recorder and the checkpointer counted the step from Keras's batch numbers (runner/train/fit.py
`StepCount`), they read `model.optimizer.iterations` at every batch's end whenever `checkpoint.every_steps` was
set or several processes ran. Under JAX that read goes through `Callback.model`, which copies the whole train
state out of the jitted loop into the model's variables (keras/src/backend/jax/trainer.py `jax_state_sync`),
and the next step gathers it again; the read itself then waits for the step to finish, so the host cannot
queue the next one ahead.

Three arms in one process, Keras 3 on JAX on the CPU, the same model, data and batch, interleaved round by
round so that a busy machine slows them alike; a fresh model per fit, the first epoch (the compile) left out:

    none     no callback of the runner's
    counted  the runner's `fit.StepCount` (the step read once per fit, then counted from `batch`)
    read     the old behaviour: `int(self.model.optimizer.iterations.numpy())` at every batch's end

Two models: the MNIST Basic CNN of jobs/mnist_cnn.yaml (8 variables, 16 optimizer slots) and an MLP of many
small layers (where the per-variable copy shows). Reported: median ms per step per arm, on the wall clock and
in this process's CPU time (less moved by other work on a shared machine), and the read's cost per step over
counting.

    .venv/bin/python benchmarks/step_reads.py [--quick] [--rounds N] [--steps N] [--batch N] [--devices N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 10 steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="per fit; the first is left out")
    parser.add_argument("--steps", type=int, default=30, help="the CNN's steps per epoch (the MLP's: 10x)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--devices", type=int, default=1, help="JAX CPU devices (DataParallel over several)")
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 10) if args.quick else (args.rounds, args.epochs, args.steps)
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.devices > 1:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    import jax
    import keras
    import numpy as np

    from runner.train.fit import StepCount

    if args.devices > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices("cpu")))

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.step = int(self.model.optimizer.iterations.numpy())

    class EpochClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: list[tuple[float, float]] = []  # (wall, this process's CPU) per epoch

        def on_epoch_begin(self, epoch, logs=None):
            self._start = (time.perf_counter(), time.process_time())

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append((time.perf_counter() - self._start[0], time.process_time() - self._start[1]))

    def cnn():
        return keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(), keras.layers.Dropout(0.25),
            keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"), keras.layers.Dropout(0.5),
            keras.layers.Dense(10),
        ])

    def mlp():
        return keras.Sequential([keras.Input((64,)), *(keras.layers.Dense(64, activation="relu") for _ in range(32)),
                                 keras.layers.Dense(10)])

    rng = np.random.default_rng(0)
    n = steps * args.batch
    data = {
        "cnn": (cnn, rng.random((n, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, n)),
        "mlp": (mlp, rng.random((10 * n, 64), dtype=np.float32), rng.integers(0, 10, 10 * n)),
    }
    arms = {"none": lambda: [], "counted": lambda: [StepCount()], "read": lambda: [Read()]}
    per_step: dict[tuple[str, str], list[float]] = {}
    cpu_step: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        order = list(arms)[r % 3:] + list(arms)[:r % 3]
        for name, (make, x, y) in data.items():
            for arm in order:
                keras.utils.set_random_seed(0)
                model = make()
                model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                clock = EpochClock()
                model.fit(x, y, batch_size=args.batch, epochs=epochs, verbose=0, shuffle=False,
                          callbacks=[*arms[arm](), clock])
                steps_run = len(x) / args.batch
                per_step.setdefault((name, arm), []).extend(w / steps_run * 1000 for w, _ in clock.seconds[1:])
                cpu_step.setdefault((name, arm), []).extend(c / steps_run * 1000 for _, c in clock.seconds[1:])
    state = {name: len(make().weights) for name, (make, _, _) in data.items()}
    print(f"keras {keras.__version__}, jax {jax.__version__}, {args.devices} CPU device(s), batch {args.batch}, "
          f"{rounds} round(s) x {epochs - 1} timed epoch(s) of {steps} (cnn) and {10 * steps} (mlp) steps")
    print("| model (variables) | clock | none ms/step | counted ms/step | read ms/step | read - counted, ms/step | "
          "read / counted |")
    print("|---|---|---|---|---|---|---|")
    for name in data:
        for clock_name, table in (("wall", per_step), ("CPU", cpu_step)):
            none, counted, read = (statistics.median(table[(name, a)]) for a in ("none", "counted", "read"))
            print(f"| {name} ({state[name]}) | {clock_name} | {none:.2f} | {counted:.2f} | {read:.2f} | "
                  f"{read - counted:+.2f} | {read / counted:.3f} |")


if __name__ == "__main__":
    main()
