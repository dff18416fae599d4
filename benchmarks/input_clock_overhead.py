"""What measuring the input wait costs: training throughput with and without the runner's timing stage.

The MNIST Basic CNN at batch 1024 trains on the runner's TFRecord pipeline (`data.make_dataset`), once as
is and once wrapped by `observe.InputClock` (the stage behind the summary's `input_wait_s`), in this one
process, alternating A B B A ... so a busy machine slows both alike; the first epoch of every fit (tracing)
is left out. Ratio: steady examples/s with the clock over without, median of same-round ratios. Goal: >= 0.98.

    .venv/bin/python benchmarks/input_clock_overhead.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics

import tensorflow as tf
from _common import BATCH, MNIST, epoch_clock, fresh_model, prepared  # first: puts the repository on sys.path

from runner.data import pipeline
from runner.device.strategy import Accelerator
from runner.train import observe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 10 steps")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 10) if args.quick else (args.rounds, 3, 30)
    shards = pipeline.find_shards(f"{prepared(args.data)}/train-*.tfrecord")

    def rate(with_clock: bool) -> tuple[float, float | None]:
        model = fresh_model(shards.features)
        dataset = pipeline.make_dataset(shards, BATCH, ("image",), "label", training=True, shuffle_buffer=10_000,
                                        seed=0)
        clock = observe.InputClock(Accelerator(tf.distribute.get_strategy(), "cpu", 1)) if with_clock else None
        if clock:
            dataset = clock.wrap(dataset)
        timer = epoch_clock()
        model.fit(dataset, epochs=epochs, steps_per_epoch=steps, callbacks=[timer], verbose=0)
        return steps * BATCH / statistics.median(timer.seconds[1:]), clock.seconds() if clock else None

    ratios, rates = [], {"clock": [], "plain": []}
    for round_ in range(rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        result = {}
        for with_clock in order:
            result[with_clock] = rate(with_clock)
        rates["clock"].append(result[True][0])
        rates["plain"].append(result[False][0])
        ratios.append(result[True][0] / result[False][0])
        print(f"round {round_ + 1}: without {result[False][0]:7.0f}  with clock {result[True][0]:7.0f} examples/s  "
              f"ratio {ratios[-1]:.3f}  (input wait measured: {result[True][1]:.2f} s)", flush=True)
    print(f"\n{'variant':12s} {'examples/s':>12s}\n{'without':12s} {statistics.median(rates['plain']):12.0f}\n"
          f"{'with clock':12s} {statistics.median(rates['clock']):12.0f}")
    print(json.dumps({
        "benchmark": "input_clock_overhead", "ratio": round(statistics.median(ratios), 3), "goal": ">= 0.98",
        "detail": {"round_ratios": " ".join(f"{r:.3f}" for r in ratios), "batch": BATCH, "steps_per_epoch": steps,
                   "epochs_per_fit": epochs, "rounds": rounds, "quick": args.quick},
    }))


if __name__ == "__main__":
    main()
