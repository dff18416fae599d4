"""The same MNIST shards read from gs:// (the GCS emulator behind the TLS proxy) vs from local disk.

Both sides run the runner's training input pipeline (data.make_dataset with training=True: shuffled
shards, parallel interleave, batch 1024, decode, repeat), as `runner run` configures TensorFlow's gs://
client (storage.configure_tensorflow, before TensorFlow loads). A pass streams EPOCHS epochs of batches,
as training does, so reopening every shard each epoch is counted and one-off start-up is not all there
is. Local and gs:// passes alternate so a busy machine slows both alike; the first pass of each is a
warm-up and is not counted. Also reported: the CPU-seconds per pass of this process (TensorFlow's gs://
client runs in it) and of the rig's servers (emulator and TLS proxy), steadier than wall time. Ratio: gs:// records/s
over local records/s. Goal: >= 0.9.

The emulator and the TLS proxy are Python processes sharing this machine's two cores with TensorFlow: the
gs:// figure measures that test rig as much as TensorFlow's gs:// client. On a TPU VM reading a bucket in
its own region the ratio depends on GCS throughput instead.

    .venv/bin/python benchmarks/gcs_read.py [--quick] [--rounds N] [--block-mb MB]

`--block-mb` sets GCS_READ_CACHE_BLOCK_SIZE_MB in place of the runner's default (storage.READ_BLOCK_MB);
TensorFlow's own default is 64.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import BATCH, MNIST, prepared

from tests.support.gcs import start_gcs

EPOCHS = 5


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def timed_pass(dataset, rig: list[int]) -> tuple[int, float, float, float]:
    """(elements, wall seconds, CPU seconds of this process, CPU seconds of the rig's servers)."""
    began, cpu, rig_cpu = time.monotonic(), time.process_time(), sum(map(cpu_seconds, rig))
    count = 0
    for _ in dataset:
        count += 1
    return count, time.monotonic() - began, time.process_time() - cpu, sum(map(cpu_seconds, rig)) - rig_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 counted rounds instead of 7")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block-mb", type=int, help="TensorFlow's gs:// read block in MB (default: the runner's)")
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds

    with tempfile.TemporaryDirectory(prefix="gcs-read-") as scratch, start_gcs(Path(scratch)) as gcs:
        os.environ.update(gcs.env)  # before TensorFlow loads: its gs:// client reads them once
        if args.block_mb:
            os.environ["GCS_READ_CACHE_BLOCK_SIZE_MB"] = str(args.block_mb)
        from runner.data import storage

        storage.configure_tensorflow(storage.DEFAULT_TIMEOUT_S)
        from runner.data import pipeline

        local = prepared(args.data)
        remote = gcs.upload_folder(local, gcs.bucket(), "mnist")
        sources = {"local": str(local), "gs://": remote}
        shards = {name: pipeline.find_shards(f"{folder}/train-*.tfrecord") for name, folder in sources.items()}
        size = sum(Path(f).stat().st_size for f in shards["local"].files)
        steps = shards["local"].records // BATCH * EPOCHS

        def pipeline(name: str):
            dataset = pipeline.make_dataset(shards[name], BATCH, ("image",), "label", training=True, seed=0)
            return dataset.take(steps)

        rates: dict[str, list[float]] = {name: [] for name in sources}
        cpu: dict[str, list[float]] = {name: [] for name in (*sources, "rig")}
        for round_index in range(rounds + 1):
            order = list(sources) if round_index % 2 == 0 else list(reversed(sources))
            for name in order:
                batches, seconds, own_cpu, rig_cpu = timed_pass(pipeline(name), gcs.pids)
                if round_index == 0:
                    continue  # warm-up: tracing, page cache, connections
                rates[name].append(batches * BATCH / seconds)
                cpu[name].append(own_cpu)
                if name == "gs://":
                    cpu["rig"].append(rig_cpu)

    block = os.environ["GCS_READ_CACHE_BLOCK_SIZE_MB"]
    median = {key: statistics.median(values) for key, values in rates.items()}
    print(
        f"{shards['local'].records} records in {len(shards['local'].files)} shards ({size / 1e6:.1f} MB), "
        f"{EPOCHS} epochs per pass, {rounds} rounds, gs:// read block {block} MB"
    )
    print(f"{'read':<18}{'median':>14}{'min':>14}{'max':>14}")
    for name, values in rates.items():
        print(f"{name:<18}{median[name]:>14,.0f}{min(values):>14,.0f}{max(values):>14,.0f}  records/s")
    for name, values in cpu.items():
        print(f"{'cpu ' + name:<18}{statistics.median(values):>14.2f}{min(values):>14.2f}{max(values):>14.2f}"
              "  CPU-s per pass")
    ratio = median["gs://"] / median["local"]
    print(f"gs:// / local: {ratio:.3f}")
    detail = {
        "records_per_s_local": round(median["local"]),
        "records_per_s_gcs": round(median["gs://"]),
        "cpu_s_per_pass_local": round(statistics.median(cpu["local"]), 2),
        "cpu_s_per_pass_gcs": round(statistics.median(cpu["gs://"]), 2),
        "cpu_s_per_pass_rig": round(statistics.median(cpu["rig"]), 2),
        "read_block_mb": int(block),
        "epochs_per_pass": EPOCHS,
        "rounds": rounds,
        "megabytes": round(size / 1e6, 1),
    }
    print(json.dumps({"benchmark": "gcs_read", "ratio": round(ratio, 3), "goal": ">= 0.9", "detail": detail}))
    # What TensorFlow's gs:// client costs per GB read, beyond reading the same bytes from local files: the
    # figure to carry to a real VM (the rig's own CPU, the emulator and TLS proxy, is left out).
    gigabytes = size * EPOCHS / 1e9
    extra = (statistics.median(cpu["gs://"]) - statistics.median(cpu["local"])) / gigabytes
    print(f"TensorFlow's gs:// client: {extra:.2f} CPU-s per GB read beyond local reads "
          f"({statistics.median(cpu['gs://']) / gigabytes:.2f} CPU-s per GB for the whole gs:// pipeline, "
          f"{statistics.median(cpu['local']) / gigabytes:.2f} local; "
          f"rig {statistics.median(cpu['rig']) / gigabytes:.2f})")
    cpu_detail = {
        "gcs_pipeline_cpu_s_per_gb": round(statistics.median(cpu["gs://"]) / gigabytes, 3),
        "local_pipeline_cpu_s_per_gb": round(statistics.median(cpu["local"]) / gigabytes, 3),
        "rig_cpu_s_per_gb": round(statistics.median(cpu["rig"]) / gigabytes, 3),
        "gigabytes_per_pass": round(gigabytes, 3),
        "read_block_mb": int(block),
    }
    print(json.dumps({"benchmark": "gcs_read[client_cpu_s_per_gb]", "ratio": round(extra, 3), "goal": "measured",
                      "detail": cpu_detail}))


if __name__ == "__main__":
    main()
