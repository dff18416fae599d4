"""Checkpoint overhead at the default cadence: seconds spent saving as a share of training time.

Runs the real MNIST job (`runner run jobs/mnist_cnn.yaml`: Basic CNN, batch 1024, 58 steps per epoch) as
a user does, in a child process, with the default checkpoint cadence (one save per epoch, `checkpoint.keep`
3), once into a local run folder and once into a gs:// bucket on the GCS emulator. The share is the
summary's `checkpoint_s` over `train_s + checkpoint_s` (the training loop's wall time, saves included;
`train_s` excludes them). Goal: <= 0.02 for each.

    .venv/bin/python benchmarks/checkpoint_overhead.py [--quick] [--epochs N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.gcs import start_gcs  # noqa: E402


def run_job(data: str, out: str, epochs: int, steps: int | None, env: dict[str, str]) -> dict:
    overrides = [
        f"data.train={data}/train-*.tfrecord", "data.eval=null", f"train.epochs={epochs}", f"output.dir={out}",
        "output.tensorboard=false", "name=checkpoint_overhead",
    ]
    if steps:
        overrides.append(f"train.steps_per_epoch={steps}")
    command = [sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml",
               *(a for o in overrides for a in ("--set", o))]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600, env=env)
    if result.returncode != 0:
        raise SystemExit(f"runner run failed ({result.returncode}): {result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs of 20 steps (the share is then a rough figure)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data", default=str(REPO / "benchmarks" / "out" / "mnist"))
    args = parser.parse_args()
    epochs, steps = (2, 20) if args.quick else (args.epochs, None)
    base_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if not Path(args.data, "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "runner", "prepare", "mnist", "--out", args.data], cwd=REPO, check=True)

    results = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-overhead-") as scratch, start_gcs(Path(scratch) / "gcs") as gcs:
        results["local"] = run_job(args.data, str(Path(scratch) / "runs"), epochs, steps, base_env)
        bucket = gcs.bucket()
        results["gs://"] = run_job(args.data, f"gs://{bucket}/runs", epochs, steps, {**base_env, **gcs.env})

    print(f"MNIST CNN, batch 1024, {epochs} epochs{f' of {steps} steps' if steps else ''}, one checkpoint per epoch")
    print(f"{'run folder':<12}{'train_s':>10}{'checkpoint_s':>14}{'saves':>7}{'s/save':>9}{'share':>9}")
    lines = []
    for where, summary in results.items():
        timing = summary["timing"]
        saves = len(summary["epochs"])
        share = timing["checkpoint_s"] / (timing["train_s"] + timing["checkpoint_s"])
        print(f"{where:<12}{timing['train_s']:>10.2f}{timing['checkpoint_s']:>14.3f}{saves:>7}"
              f"{timing['checkpoint_s'] / saves:>9.3f}{share:>9.4f}")
        detail = {"run_folder": where, "train_s": timing["train_s"], "checkpoint_s": timing["checkpoint_s"],
                  "saves": saves, "epochs": epochs, "steps_per_epoch": summary["steps_per_epoch"]}
        lines.append({"benchmark": f"checkpoint_overhead[{where.rstrip(':/')}]", "ratio": round(share, 4),
                      "goal": "<= 0.02", "detail": detail})
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
