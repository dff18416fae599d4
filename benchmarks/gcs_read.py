"""The same MNIST shards read from gs:// (the GCS emulator behind the TLS proxy) vs from local disk.

Both sides run the runner's own input pipeline (data.make_dataset: interleave, batch 1024, decode) over
all training shards once per pass, in this one process, alternating local and gs:// passes so a busy
machine slows both alike; the first pass of each is a warm-up and is not counted. Also reported: the raw
record read (tf.data.TFRecordDataset, no decoding) in MB/s. Ratio: gs:// records/s over local records/s.
Goal: >= 0.9.

The emulator and the TLS proxy are single Python processes sharing this machine's two cores with
TensorFlow: the gs:// figure measures that test rig as much as TensorFlow's gs:// client. On a TPU VM
reading a bucket in its own region the ratio depends on GCS throughput instead.

    .venv/bin/python benchmarks/gcs_read.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.gcs import start_gcs  # noqa: E402

BATCH = 1024


def timed_pass(dataset) -> tuple[int, float]:
    began = time.monotonic()
    count = 0
    for item in dataset:
        count += 1
    return count, time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 counted rounds instead of 5")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data", default=str(REPO / "benchmarks" / "out" / "mnist"))
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds

    with tempfile.TemporaryDirectory(prefix="gcs-read-") as scratch, start_gcs(Path(scratch)) as gcs:
        os.environ.update(gcs.env)  # before TensorFlow loads: its gs:// client reads them once
        import tensorflow as tf

        from runner import data

        if not Path(args.data, "manifest.json").exists():
            from runner.prepare import prepare

            prepare("mnist", args.data)
        bucket = gcs.bucket()
        remote = gcs.upload_folder(Path(args.data), bucket, "mnist")
        sources = {"local": args.data, "gs://": remote}
        shards = {name: data.find_shards(f"{folder}/train-*.tfrecord") for name, folder in sources.items()}
        size = sum(Path(f).stat().st_size for f in shards["local"].files)

        def pipeline(name: str):
            return data.make_dataset(shards[name], BATCH, ("image",), "label", training=False)

        def raw(name: str):
            return tf.data.TFRecordDataset(list(shards[name].files), num_parallel_reads=4).batch(4096)

        rates: dict[str, list[float]] = {f"{kind} {name}": [] for kind in ("pipeline", "raw") for name in sources}
        for round_index in range(rounds + 1):
            order = list(sources) if round_index % 2 == 0 else list(reversed(sources))
            for name in order:
                batches, seconds = timed_pass(pipeline(name))
                raw_batches, raw_seconds = timed_pass(raw(name))
                if round_index == 0:
                    continue  # warm-up: tracing, page cache, connections
                rates[f"pipeline {name}"].append(batches * BATCH / seconds)
                rates[f"raw {name}"].append(size / 1e6 / raw_seconds)

    median = {key: statistics.median(values) for key, values in rates.items()}
    print(f"{shards['local'].records} records in {len(shards['local'].files)} shards ({size / 1e6:.1f} MB), {rounds} rounds")
    print(f"{'read':<18}{'median':>14}{'min':>14}{'max':>14}")
    for key, values in rates.items():
        unit = "records/s" if key.startswith("pipeline") else "MB/s"
        print(f"{key:<18}{median[key]:>14,.0f}{min(values):>14,.0f}{max(values):>14,.0f}  {unit}")
    ratio = median["pipeline gs://"] / median["pipeline local"]
    raw_ratio = median["raw gs://"] / median["raw local"]
    print(f"gs:// / local: pipeline {ratio:.3f}, raw read {raw_ratio:.3f}")
    detail = {
        "records_per_s_local": round(median["pipeline local"]),
        "records_per_s_gcs": round(median["pipeline gs://"]),
        "raw_mb_per_s_local": round(median["raw local"], 1),
        "raw_mb_per_s_gcs": round(median["raw gs://"], 1),
        "raw_ratio": round(raw_ratio, 3),
        "rounds": rounds,
        "megabytes": round(size / 1e6, 1),
    }
    print(json.dumps({"benchmark": "gcs_read", "ratio": round(ratio, 3), "goal": ">= 0.9", "detail": detail}))


if __name__ == "__main__":
    main()
