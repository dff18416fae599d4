"""gs:// training throughput: `runner run` of the MNIST job with its data on the GCS emulator vs on local
disk, steady examples/s (epochs after the first, from the job's own summary).

The real job (`jobs/mnist_cnn.yaml`: Basic CNN, batch 1024, defaults otherwise) in a child process, its
training and test shards read from local files or from a gs:// bucket on the emulator (tests/support/gcs.py:
the Python emulator behind the TLS proxy that TensorFlow's client is sent to; both run on this machine's
cores too); the run folder is local in both, so only reading differs. Rounds alternate the order.
The training split is streamed (`data.in_memory=false`): held in memory (the default for MNIST on a CPU,
runner/data/in_memory.py) it would be read once before training, and training would read no bucket at all; a
split too large to hold, or a TPU, streams, and that is what this measures.

    ratio  gs:// steady examples/s / local, median over rounds    goal >= 0.97

    .venv/bin/python benchmarks/gcs_training.py [--quick] [--rounds N] [--epochs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.gcs import start_gcs  # noqa: E402


def run_job(data: str, out: str, name: str, epochs: int, steps: int | None, env: dict[str, str]) -> dict:
    overrides = [
        f"data.train={data}/train-*.tfrecord", f"data.eval={data}/test-*.tfrecord", f"train.epochs={epochs}",
        f"output.dir={out}", "output.tensorboard=false", f"name={name}", "data.in_memory=false",
        *([f"train.steps_per_epoch={steps}"] if steps else []),
    ]
    command = [sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml",
               *(a for o in overrides for a in ("--set", o))]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600, env=env)
    if result.returncode != 0:
        raise SystemExit(f"runner run failed ({result.returncode}): {result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 20 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data", default=str(REPO / "benchmarks" / "out" / "mnist"))
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 20) if args.quick else (args.rounds, args.epochs, None)
    base_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if not Path(args.data, "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "runner", "prepare", "mnist", "--out", args.data], cwd=REPO, check=True)

    rates: dict[str, list[float]] = {"local": [], "gs://": []}
    waits: dict[str, list[float | None]] = {"local": [], "gs://": []}
    with tempfile.TemporaryDirectory(prefix="gcs-training-") as scratch, start_gcs(Path(scratch) / "gcs") as gcs:
        bucket = gcs.bucket()
        url = gcs.upload_folder(Path(args.data), bucket, "mnist")
        for round_ in range(rounds):
            order = ("local", "gs://") if round_ % 2 == 0 else ("gs://", "local")
            for where in order:
                data, env = (args.data, base_env) if where == "local" else (url, {**base_env, **gcs.env})
                name = f"r{round_}-{where.rstrip(':/')}"
                summary = run_job(data, str(Path(scratch) / "runs"), name, epochs, steps, env)
                rates[where].append(summary["timing"]["examples_per_sec"])
                waits[where].append(summary["timing"]["input_wait_fraction"])
                print(f"round {round_ + 1} {where:6s}: {summary['timing']['examples_per_sec']:8.0f} examples/s steady, "
                      f"input wait {summary['timing']['input_wait_fraction']}, "
                      f"accuracy {summary['metrics']['accuracy']:.4f}", flush=True)
    ratios = [g / loc for g, loc in zip(rates["gs://"], rates["local"], strict=True)]
    print(f"\ngs:// / local per round: {', '.join(f'{r:.3f}' for r in ratios)}")
    detail = {
        "local_examples_per_sec": round(statistics.median(rates["local"]), 1),
        "gcs_examples_per_sec": round(statistics.median(rates["gs://"]), 1),
        "round_ratios": " ".join(f"{r:.3f}" for r in ratios),
        "input_wait_fraction_local": " ".join(str(w) for w in waits["local"]),
        "input_wait_fraction_gcs": " ".join(str(w) for w in waits["gs://"]),
        "epochs": epochs, "rounds": rounds, "quick": args.quick,
    }
    print(json.dumps({"benchmark": "gcs_training", "ratio": round(statistics.median(ratios), 3), "goal": ">= 0.97",
                      "detail": detail}))


if __name__ == "__main__":
    main()
