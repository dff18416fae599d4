"""MNIST CNN at batch 1024: the runner's TFRecord pipeline vs in-memory numpy arrays (the classic notebooks' way).

Both variants train the same model (fresh, same seed) in this one process, interleaved A B A B so a busy
machine slows both alike; the first epoch of every fit (tracing) is left out. Prints the ratio of steady
examples/s, TFRecord over numpy. Goal: >= 0.97.

    .venv/bin/python benchmarks/tfrecord_vs_numpy.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics

from _common import BATCH, MNIST, epoch_clock, fresh_model, prepared  # first: puts the repository on sys.path

from runner.data import pipeline
from runner.prepare.datasets import load_dataset


def steady_rate(fit, examples_per_epoch: int, epochs: int) -> float:
    clock = epoch_clock()
    fit(clock, epochs)
    return examples_per_epoch / statistics.median(clock.seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs on 20 steps each")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 20) if args.quick else (args.rounds, 3, None)

    mnist = load_dataset("mnist")
    shards = pipeline.find_shards(f"{prepared(args.data)}/train-*.tfrecord")
    x = mnist.splits["train"]["image"].astype("float32")
    y = mnist.splits["train"]["label"]
    steps = steps or len(x) // BATCH
    examples = steps * BATCH
    dataset = pipeline.make_dataset(shards, BATCH, ("image",), "label", training=True, shuffle_buffer=10_000, seed=0)

    def tfrecord(clock, n):
        fresh_model(shards.features).fit(dataset, epochs=n, steps_per_epoch=steps, callbacks=[clock], verbose=0)

    def numpy(clock, n):
        # Sliced to whole batches so both variants do the same number of steps and examples.
        fresh_model(shards.features).fit(
            x[:examples], y[:examples], batch_size=BATCH, epochs=n, shuffle=True, callbacks=[clock], verbose=0
        )

    rates = {"tfrecord": [], "numpy": []}
    for round_ in range(rounds):
        order = (("numpy", numpy), ("tfrecord", tfrecord)) if round_ % 2 else (("tfrecord", tfrecord), ("numpy", numpy))
        for name, fit in order:
            rates[name].append(steady_rate(fit, examples, epochs))
            print(f"round {round_ + 1}: {name:8s} {rates[name][-1]:8.0f} examples/s", flush=True)
    tfr, npy = statistics.median(rates["tfrecord"]), statistics.median(rates["numpy"])
    print(f"\n{'variant':10s} {'examples/s':>12s}\n{'tfrecord':10s} {tfr:12.0f}\n{'numpy':10s} {npy:12.0f}")
    print(json.dumps({
        "benchmark": "tfrecord_vs_numpy", "ratio": round(tfr / npy, 3), "goal": ">= 0.97",
        "detail": {"tfrecord_examples_per_s": round(tfr), "numpy_examples_per_s": round(npy), "batch": BATCH,
                   "steps_per_epoch": steps, "epochs_per_fit": epochs, "rounds": rounds},
    }))


if __name__ == "__main__":
    main()
