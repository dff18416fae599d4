"""tf.data's autotuner on vs off (data.autotune): training throughput and the wait when a fit ends.

The MNIST Basic CNN at batch 1024 trains on the runner's TFRecord pipeline (`data.make_dataset`) in this one
process, alternating autotune off / on / on / off ... so a busy machine slows both alike. Each fit is
`epochs` epochs of `steps` steps; measured per fit: steady examples/s (the first, tracing epoch left
out) and the teardown, the seconds `model.fit` takes to return after `on_train_end`. With the autotuner
on, destroying the input iterator waits until the tuner's thread wakes from its current sleep (20 ms
doubling up to 60 s, woken by nothing else), so the teardown grows with the length of the fit.
Ratio: steady examples/s with the autotuner off over on, median of same-round ratios. Goal: >= 0.97
(turning it off must not slow training); the teardown is reported beside it.

    .venv/bin/python benchmarks/autotune_teardown.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import tensorflow as tf
from _common import BATCH, MNIST, epoch_clock, fresh_model, prepared  # first: puts the repository on sys.path

from runner.data import pipeline


class TrainEnd(tf.keras.callbacks.Callback):
    at = 0.0

    def on_train_end(self, logs=None):
        self.at = time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 epochs of 10 steps")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    rounds, epochs, steps = (2, 2, 10) if args.quick else (args.rounds, 3, 30)
    shards = pipeline.find_shards(f"{prepared(args.data)}/train-*.tfrecord")

    def fit(autotune: bool) -> tuple[float, float]:
        model = fresh_model(shards.features)
        dataset = pipeline.make_dataset(
            shards, BATCH, ("image",), "label", training=True, shuffle_buffer=10_000, seed=0, autotune=autotune
        )
        timer, end = epoch_clock(), TrainEnd()
        model.fit(dataset, epochs=epochs, steps_per_epoch=steps, callbacks=[timer, end], verbose=0)
        return steps * BATCH / statistics.median(timer.seconds[1:]), time.monotonic() - end.at

    ratios, rates, teardown = [], {True: [], False: []}, {True: [], False: []}
    for round_ in range(rounds):
        result = {}
        for autotune in ((False, True) if round_ % 2 == 0 else (True, False)):
            result[autotune] = fit(autotune)
            rates[autotune].append(result[autotune][0])
            teardown[autotune].append(result[autotune][1])
        ratios.append(result[False][0] / result[True][0])
        print(
            f"round {round_ + 1}: off {result[False][0]:7.0f} examples/s, teardown {result[False][1]:6.2f} s | "
            f"on {result[True][0]:7.0f} examples/s, teardown {result[True][1]:6.2f} s | ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(f"\n{'autotune':10s} {'examples/s':>12s} {'teardown median':>16s} {'teardown max':>13s}")
    for autotune in (False, True):
        print(f"{'on' if autotune else 'off':10s} {statistics.median(rates[autotune]):12.0f} "
              f"{statistics.median(teardown[autotune]):15.2f}s {max(teardown[autotune]):12.2f}s")
    ratio = statistics.median(ratios)
    detail = {
        "examples_per_s_off": round(statistics.median(rates[False])),
        "examples_per_s_on": round(statistics.median(rates[True])),
        "teardown_s_off": [round(s, 2) for s in teardown[False]],
        "teardown_s_on": [round(s, 2) for s in teardown[True]],
        "round_ratios": [round(r, 3) for r in ratios],
        "epochs": epochs,
        "steps_per_epoch": steps,
    }
    print(json.dumps({"benchmark": "autotune_teardown", "ratio": round(ratio, 3), "goal": ">= 0.97", "detail": detail}))


if __name__ == "__main__":
    main()
