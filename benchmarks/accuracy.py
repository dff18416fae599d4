"""Trains each classic workload with its own job spec, as a user would, and prints the result against its goal.

Not part of CI: each job trains for its full epochs (minutes to tens of minutes on 2 CPU cores). Data is
prepared with `runner prepare` into --data if its manifest is missing; every job runs through the CLI
(`runner run jobs/<job>.yaml`) under a fresh name, so nothing is resumed. Goals:
  mnist_cnn          test accuracy >= 98.5%
  fashion_mnist_cnn  test accuracy >= 90%
  imdb_lstm          the review stand-in: test accuracy >= the majority class's share + 10 points
  weather_rnn        test MAE below the persistence forecast's ("the next hour equals this one")

    .venv/bin/python benchmarks/accuracy.py [JOB ...] [--data data] [--out benchmarks/out/accuracy] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOBS = {  # job -> dataset
    "mnist_cnn": "mnist",
    "fashion_mnist_cnn": "fashion_mnist",
    "imdb_lstm": "imdb",
    "weather_rnn": "weather",
}


def runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=REPO, capture_output=True, text=True)


def prepare(dataset: str, folder: Path) -> None:
    if (folder / "manifest.json").exists():
        return
    result = runner("prepare", dataset, "--out", str(folder))
    if result.returncode:
        sys.exit(f"runner prepare {dataset} failed:\n{result.stderr}")


def eval_arrays(folder: Path, inputs: str, label: str):
    """The whole test split as numpy arrays, read back from the prepared TFRecords."""
    import numpy as np

    from runner.data import pipeline

    shards = pipeline.find_shards(f"{folder}/test-*.tfrecord")
    batches = pipeline.make_dataset(shards, 1, (inputs,), label, training=False)
    x, y = zip(*((a.numpy(), b.numpy()) for a, b in batches), strict=True)
    return np.concatenate(x), np.concatenate(y)


def goal_for(job: str, folder: Path, summary: dict) -> tuple[str, float, float, bool, str]:
    """(metric, measured, goal, met, note) for one finished job."""
    import numpy as np

    metrics = summary["metrics"]
    if job == "mnist_cnn":
        return "accuracy", metrics["accuracy"], 0.985, metrics["accuracy"] >= 0.985, ""
    if job == "fashion_mnist_cnn":
        return "accuracy", metrics["accuracy"], 0.90, metrics["accuracy"] >= 0.90, ""
    if job == "imdb_lstm":
        _, labels = eval_arrays(folder, "tokens", "label")
        majority = max(labels.mean(), 1 - labels.mean())
        goal = majority + 0.10
        return "accuracy", metrics["accuracy"], goal, metrics["accuracy"] >= goal, f"majority class {majority:.4f}"
    windows, targets = eval_arrays(folder, "window", "target")
    prep = json.loads((folder / "manifest.json").read_text())["preprocessing"]
    t = prep["target_index"]
    persistence = float(np.mean(np.abs(targets - windows[:, -1, t])))
    degrees = prep["std"][t]
    # The job evaluates whole batches only; the persistence MAE covers every test window.
    note = f"MAE {metrics['mae'] * degrees:.3f} vs persistence {persistence * degrees:.3f} ({prep['target']})"
    return "mae", metrics["mae"], persistence, metrics["mae"] < persistence, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Checked below, not with `choices`: argparse tests an empty nargs="*" against them as one value, [].
    parser.add_argument("jobs", nargs="*", metavar="JOB", help=f"one of {', '.join(JOBS)} (default: every one)")
    parser.add_argument("--data", default="data", help="folder of prepared datasets (data/<dataset>)")
    parser.add_argument("--out", default="benchmarks/out/accuracy", help="output.dir for the runs")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="extra --set for every job, e.g. train.mixed_precision=bfloat16 (the default is auto)")
    args = parser.parse_args()
    unknown = [job for job in args.jobs if job not in JOBS]
    if unknown:
        parser.error(f"no job {', '.join(unknown)}: choose from {', '.join(JOBS)}")
    args.jobs = args.jobs or list(JOBS)
    rows = []
    for job in args.jobs:
        folder = (REPO / args.data / JOBS[job]).resolve()
        prepare(JOBS[job], folder)
        name = f"{job}-{time.strftime('%Y%m%d-%H%M%S')}"
        sets = [f"name={name}", f"output.dir={(REPO / args.out).resolve()}",
                f"data.train={folder}/train-*.tfrecord", f"data.eval={folder}/test-*.tfrecord"]
        if job == "weather_rnn":
            sets.append(f"data.validation={folder}/validation-*.tfrecord")
        sets += args.sets
        began = time.monotonic()
        result = runner("run", f"jobs/{job}.yaml", *(a for s in sets for a in ("--set", s)))
        wall = time.monotonic() - began
        if result.returncode:
            print(f"{job}: runner run failed (exit {result.returncode}):\n{result.stderr[-3000:]}", file=sys.stderr)
            continue
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        metric, measured, goal, met, note = goal_for(job, folder, summary)
        row = {
            "job": job, "metric": metric, "measured": round(float(measured), 4), "goal": round(float(goal), 4),
            "met": bool(met), "epochs": len(summary["epochs"]),
            "examples_per_sec": summary["timing"]["examples_per_sec"], "wall_s": round(wall, 1), "note": note,
            "precision": summary["accelerator"].get("precision", {}).get("policy"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'job':<20}{'metric':<10}{'measured':>10}{'goal':>10}  met  epochs  examples/s  wall s  note")
    for r in rows:
        print(f"{r['job']:<20}{r['metric']:<10}{r['measured']:>10.4f}{r['goal']:>10.4f}"
              f"  {'yes' if r['met'] else 'NO ':<3}"
              f"  {r['epochs']:>6}  {r['examples_per_sec'] or 0:>10.0f}  {r['wall_s']:>6.0f}  {r['note']}")
    if not all(r["met"] for r in rows) or len(rows) < len(args.jobs):
        sys.exit(1)


if __name__ == "__main__":
    main()
