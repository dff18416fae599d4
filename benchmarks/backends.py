"""The runner under each backend against plain Keras `fit` under the same backend, on the same data.

Four arms, each a fresh process, over the MNIST Basic CNN at the same batch, epochs and precision (float32 by
default, so that no arm gains from a bfloat16 choice the others lack): `runner run jobs/mnist_cnn.yaml` with
`accelerator.backend` tensorflow and jax, and benchmarks/_plain_keras.py (the classic notebook's fit on numpy
arrays) with KERAS_BACKEND tensorflow and jax. The arms' order turns by one every round so that a busy machine
slows them alike. Reported, as medians over rounds of steady examples/s (epochs after the first: the first
holds the compile):

    jax_overhead   runner on JAX / plain Keras on JAX                     goal >= 0.95 (no overhead of its own)
    tf_overhead    runner on TensorFlow / plain Keras on TensorFlow       measured (runner_vs_keras.py has goals)
    cpu_choice     runner on TensorFlow / runner on JAX                   the figure `auto`'s CPU choice cites
    first_step     the runner's first step on JAX, cold, then resumed with the run folder's compilation cache

    .venv/bin/python benchmarks/backends.py [--quick] [--rounds N] [--epochs N] [--steps N] [--policy P]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _common import BATCH, MNIST, prepared
from runner_vs_keras import cpu, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 10 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="steps per epoch (XLA on a CPU is slow)")
    parser.add_argument("--policy", default="float32", choices=("float32", "mixed_bfloat16"))
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 10) if args.quick else (args.rounds, args.epochs, args.steps)
    data = prepared(Path(args.data))
    out = Path(tempfile.mkdtemp(prefix="backends-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    precision = "float32" if args.policy == "float32" else "bfloat16"

    def runner(backend: str):
        def run(index: int, *extra: str) -> dict:
            sets = [
                f"name={backend}-{index}", f"output.dir={out}", f"data.train={data}/train-*.tfrecord",
                f"data.eval={data}/test-*.tfrecord", f"data.global_batch_size={BATCH}", f"train.epochs={epochs}",
                f"train.steps_per_epoch={steps}", f"train.mixed_precision={precision}", "train.allow_chance=true",
                f"accelerator.backend={backend}", *extra,
            ]
            wall, summary = timed([sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml",
                                   *(a for s in sets for a in ("--set", s))])
            return {"examples_per_sec": summary["timing"]["examples_per_sec"], "wall_s": wall,
                    "first_step_s": summary["timing"]["first_step_s"], "accuracy": summary["metrics"]["accuracy"]}
        return run

    def plain(backend: str):
        def run(index: int) -> dict:
            os.environ["KERAS_BACKEND"] = backend  # the child's Keras reads it when it loads
            try:
                wall, doc = timed([sys.executable, "benchmarks/_plain_keras.py", str(data),
                                   str(out / f"plain-{backend}-{index}"), "--batch", str(BATCH), "--epochs",
                                   str(epochs), "--steps-per-epoch", str(steps), "--policy", args.policy])
            finally:
                os.environ.pop("KERAS_BACKEND", None)
            return {"examples_per_sec": doc["steady_examples_per_sec"], "wall_s": wall, "accuracy": doc["accuracy"]}
        return run

    arms = {"runner_tf": runner("tensorflow"), "plain_tf": plain("tensorflow"),
            "runner_jax": runner("jax"), "plain_jax": plain("jax")}
    names = list(arms)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            result = arms[name](round_)
            runs[name].append(result)
            print(f"round {round_ + 1}: {name:10s} {result['examples_per_sec']:8.0f} examples/s  "
                  f"wall {result['wall_s']:6.1f} s  accuracy {result['accuracy']:.4f}", flush=True)

    def median(name: str) -> float:
        return statistics.median(r["examples_per_sec"] for r in runs[name])

    # The compilation cache: the same JAX job run again one epoch further, in the same run folder.
    resumed = arms["runner_jax"](0, f"train.epochs={epochs + 1}")
    machine = cpu()
    detail = {**machine, "batch": BATCH, "epochs": epochs, "steps_per_epoch": steps, "rounds": rounds,
              "precision": precision, **{f"{n}_examples_per_sec": round(median(n), 1) for n in names}}
    for name, (a, b), goal in (("jax_overhead", ("runner_jax", "plain_jax"), ">= 0.95"),
                               ("tf_overhead", ("runner_tf", "plain_tf"), "measured"),
                               ("cpu_choice", ("runner_tf", "runner_jax"), "measured")):
        print(json.dumps({"benchmark": f"backends[{name}]", "ratio": round(median(a) / median(b), 3), "goal": goal,
                          "detail": detail}))
    cold = statistics.median(r["first_step_s"] for r in runs["runner_jax"])
    print(json.dumps({"benchmark": "backends[first_step_cached]", "ratio": round(resumed["first_step_s"] / cold, 3),
                      "goal": "measured", "detail": {"cold_first_step_s": cold,
                                                     "cached_first_step_s": resumed["first_step_s"], **machine}}))


if __name__ == "__main__":
    main()
