"""Each job's model FLOPs and MFU on this machine: `runner run jobs/NAME.yaml` briefly (2 epochs of at most
`--steps` steps, its own batch and precision), then the summary's steady examples/s turned into the throughput
block by runner/train/flops.py's `throughput_block`, with the model counted by `flops.count` (built from the
spec and the data's manifest, as the job builds it) and the peak from runner/device/peak.py (this CPU's measured
matmul peak in the job's precision, cached).

    .venv/bin/python benchmarks/job_mfu.py [JOB ...] [--data-root DIR] [--steps N]

`--data-root` holds `<workload>/` folders made by `runner prepare` (mnist, imdb, weather, cifar10, ...).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO

from runner.data import pipeline
from runner.device import peak
from runner.spec.load import load_spec
from runner.train import build, flops

WORKLOADS = {"mnist_cnn": "mnist", "fashion_mnist_cnn": "fashion_mnist", "imdb_lstm": "imdb",
             "weather_rnn": "weather", "cifar10_cnn": "cifar10"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", default=["mnist_cnn", "imdb_lstm", "weather_rnn", "cifar10_cnn"])
    parser.add_argument("--data-root", default=str(REPO / "data"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--peak-cache", default=None)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="job_mfu-"))
    for name in args.jobs:
        folder = Path(args.data_root) / WORKLOADS[name]
        sets = [f"name=mfu-{name}", f"output.dir={out}", f"data.train={folder}/train-*.tfrecord", "data.eval=null",
                "train.epochs=2", f"train.steps_per_epoch={args.steps}"]
        if name == "weather_rnn":
            sets.append(f"data.validation={folder}/validation-*.tfrecord")  # its early stopping watches val_loss
        done = subprocess.run([sys.executable, "-m", "runner", "run", f"jobs/{name}.yaml",
                               *(a for s in sets for a in ("--set", s))], cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: runner run exited {done.returncode}: {done.stderr[-1500:]}", flush=True)
            continue
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        spec = load_spec(REPO / "jobs" / f"{name}.yaml", sets)
        features = pipeline.find_shards(spec.data.train).features
        policy = summary["accelerator"]["precision"]["policy"]
        import tensorflow as tf

        tf.keras.mixed_precision.set_global_policy("float32" if policy == "float32" else f"mixed_{policy}")
        model = build.build_model(spec, features)
        per_example, method = flops.count(model, spec.data.global_batch_size)
        value, source = peak.peak_tflops("cpu", None, policy, cache_dir=args.peak_cache)
        block = flops.throughput_block(per_example, method, summary["timing"]["examples_per_sec"],
                                       summary["accelerator"]["replicas"], value, source)
        print(json.dumps({"job": name, "policy": policy, "batch": spec.data.global_batch_size,
                          "examples_per_sec": summary["timing"]["examples_per_sec"],
                          "epoch_s": [e["seconds"] for e in summary["epochs"]], "throughput": block}), flush=True)


if __name__ == "__main__":
    main()
