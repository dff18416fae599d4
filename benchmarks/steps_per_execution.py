"""What `train.steps_per_execution` does to training throughput here: runner runs at 1, 8 and 32.

Each setting is a fresh `runner run` of the MNIST Basic CNN at batch 1024 on the same prepared TFRecords;
the figure is the summary's steady examples/s (the compiling first epoch left out). Each round runs every
setting back to back, in a rotating order; the ratio (examples/s at N over at 1 in the same round) is the
median over rounds, so load that drifts between rounds cancels out.
No goal: it measures whether fewer host round trips pay off on this device (they matter on a TPU, where
the runner's `auto` picks 32; on CPU and GPU it picks 1).

    .venv/bin/python benchmarks/steps_per_execution.py [--quick] [--rounds N] [--epochs N]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import BATCH, MNIST, REPO, prepared


def run(data: Path, out: Path, name: str, spe: int, epochs: int, steps: int | None) -> dict:
    sets = [
        f"name={name}", f"output.dir={out}", f"data.train={data}/train-*.tfrecord", "data.eval=null",
        f"data.global_batch_size={BATCH}", f"train.epochs={epochs}", f"train.steps_per_execution={spe}",
        "accelerator.kind=cpu", "output.tensorboard=false",
    ] + ([f"train.steps_per_epoch={steps}"] if steps else [])
    result = subprocess.run(
        [sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml", *(a for s in sets for a in ("--set", s))],
        cwd=REPO, capture_output=True, text=True,
    )
    if result.returncode:
        raise SystemExit(f"steps_per_execution={spe}: runner run exited {result.returncode}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, settings 1 and 8, 2 epochs of 16 steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    settings, rounds, epochs, steps = ((1, 8), 1, 2, 16) if args.quick else ((1, 8, 32), args.rounds, args.epochs, None)
    data = prepared(Path(args.data))
    out = Path(tempfile.mkdtemp(prefix="steps_per_execution-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # run folders and models: not kept

    rates: dict[int, list[float]] = {spe: [] for spe in settings}
    first: dict[int, list[float]] = {spe: [] for spe in settings}
    for round_ in range(rounds):
        order = settings[round_ % len(settings):] + settings[: round_ % len(settings)]
        for spe in order:
            summary = run(data, out, f"spe{spe}-r{round_}", spe, epochs, steps)
            rates[spe].append(summary["timing"]["examples_per_sec"])
            first[spe].append(summary["timing"]["first_epoch_s"])
            print(f"round {round_ + 1}: steps_per_execution {spe:3d}  {rates[spe][-1]:8.0f} examples/s  "
                  f"first epoch {first[spe][-1]:.1f} s", flush=True)

    median = {spe: statistics.median(r) for spe, r in rates.items()}
    ratios = {spe: [n / one for n, one in zip(rates[spe], rates[1], strict=True)] for spe in settings}
    print(f"\n{'steps_per_execution':>20s} {'examples/s':>12s} {'first epoch s':>14s} {'vs 1':>6s}")
    for spe in settings:
        print(f"{spe:20d} {median[spe]:12.0f} {statistics.median(first[spe]):14.1f} "
              f"{statistics.median(ratios[spe]):6.2f}")
    for spe in settings[1:]:
        print(json.dumps({
            "benchmark": "steps_per_execution", "ratio": round(statistics.median(ratios[spe]), 3),
            "goal": "none (measured)",
            "detail": {"case": f"{spe} vs 1", "round_ratios": " ".join(f"{r:.3f}" for r in ratios[spe]),
                       "examples_per_s": {str(k): round(v) for k, v in median.items()},
                       "batch": BATCH, "epochs": epochs, "rounds": rounds, "device": "cpu", "quick": args.quick},
        }))


if __name__ == "__main__":
    main()
