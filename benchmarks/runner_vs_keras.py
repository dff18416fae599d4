"""The runner end to end vs a plain Keras script doing the same training: wall time of the whole process.

Both train the MNIST Basic CNN on the same prepared TFRecords, same batch, epochs and steps, then
evaluate on the test split and save the model; each is a fresh process timed from launch to exit
(TensorFlow import included on both sides). The runner also validates the spec, checkpoints every epoch,
writes TensorBoard scalars and the summary, and times input waits: that is the overhead measured here.
Each round runs both back to back, in alternating order (runner first, then plain first, ...), so a busy
machine slows both alike; the ratio is the median over rounds of runner wall / plain wall within a round.
Goal: <= 1.05.

    .venv/bin/python benchmarks/runner_vs_keras.py [--quick] [--rounds N] [--epochs N]
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
import time
from pathlib import Path

from _common import BATCH, MNIST, REPO, prepared


def timed(command: list[str]) -> tuple[float, str]:
    began = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - began
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:4])}... exited {result.returncode}:\n{result.stderr[-3000:]}")
    return wall, result.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 20 steps: start-up dominates")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 20) if args.quick else (args.rounds, args.epochs, None)
    data = prepared(Path(args.data))
    out = Path(tempfile.mkdtemp(prefix="runner_vs_keras-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # run folders and models: not kept

    def runner(index: int) -> tuple[float, dict]:
        sets = [
            f"name=bench-{index}", f"output.dir={out}", f"data.train={data}/train-*.tfrecord",
            f"data.eval={data}/test-*.tfrecord", f"data.global_batch_size={BATCH}", f"train.epochs={epochs}",
            "accelerator.kind=cpu",
        ] + ([f"train.steps_per_epoch={steps}"] if steps else [])
        wall, last = timed([sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml", *(a for s in sets for a in ("--set", s))])
        return wall, json.loads(last)

    def plain(index: int) -> tuple[float, dict]:
        command = [sys.executable, "benchmarks/_plain_keras.py", str(data), str(out / f"plain-{index}"),
                   "--batch", str(BATCH), "--epochs", str(epochs)] + (["--steps-per-epoch", str(steps)] if steps else [])
        wall, last = timed(command)
        return wall, json.loads(last)

    walls: dict[str, list[float]] = {"runner": [], "plain": []}
    summaries = []
    for round_ in range(rounds):
        order = (("runner", runner), ("plain", plain)) if round_ % 2 == 0 else (("plain", plain), ("runner", runner))
        for name, run in order:
            wall, doc = run(round_)
            walls[name].append(wall)
            if name == "runner":
                summaries.append(doc)
            print(f"round {round_ + 1}: {name:6s} {wall:7.1f} s  accuracy {doc.get('accuracy', doc.get('metrics', {}).get('accuracy')):.4f}", flush=True)

    runner_wall, plain_wall = statistics.median(walls["runner"]), statistics.median(walls["plain"])
    ratios = [r / p for r, p in zip(walls["runner"], walls["plain"])]
    timing = summaries[-1]["timing"]
    print(f"\n{'round':>5s} {'runner s':>9s} {'plain s':>9s} {'ratio':>6s}")
    for index, (r, p) in enumerate(zip(walls["runner"], walls["plain"]), 1):
        print(f"{index:5d} {r:9.1f} {p:9.1f} {r / p:6.3f}")
    print(
        "runner phases (last run): "
        + ", ".join(f"{k.removesuffix('_s')} {timing[k]:.1f}" for k in ("import_s", "train_s", "checkpoint_s", "eval_s", "export_s"))
    )
    print(json.dumps({
        "benchmark": "runner_vs_keras", "ratio": round(statistics.median(ratios), 3), "goal": "<= 1.05",
        "detail": {
            "round_ratios": " ".join(f"{r:.3f}" for r in ratios),
            "runner_wall_s": round(runner_wall, 1), "plain_wall_s": round(plain_wall, 1), "batch": BATCH,
            "epochs": epochs, "steps_per_epoch": summaries[-1]["steps_per_epoch"], "rounds": rounds,
            "runner_checkpoint_s": timing["checkpoint_s"], "runner_export_s": timing["export_s"], "quick": args.quick,
        },
    }))


if __name__ == "__main__":
    main()
