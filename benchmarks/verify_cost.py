"""What checking the data before training costs (data.verify: size, sha256), beside one epoch of training,
and how fast `runner verify` reads.

1. MNIST (60,000 + 10,000 records, 7 shards, 58.7 MB): the check `runner run` makes before touching its run
   folder (runner/data/integrity.py check_job_data: manifests, globs, then one stat per shard or every byte
   hashed), local and on gs:// (the GCS emulator behind the TLS proxy, tests/support/gcs.py), median of
   ROUNDS each with the page cache warm, over the steady epoch of `runner run jobs/mnist_cnn.yaml` with the
   same data (2 epochs, the runner's defaults). Ratios: verify seconds / epoch seconds.
2. A larger set: COPIES hard-linked copies of the MNIST shards under one manifest (the bytes come from the
   page cache, so this measures the reader, not the disk): `runner verify` as a user runs it (a child
   process; its own MB/s line), check_bytes on 1 thread and on every core, the reader it replaced (tf.io.gfile,
   4 MB reads, one shard after another), and hashlib's sha256 over bytes already in memory (the ceiling per
   core). Goal: `runner verify` >= 800 MB/s locally on 2 cores.

    .venv/bin/python benchmarks/verify_cost.py [--quick] [--copies N] [--rounds N] [--no-gcs]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MNIST, REPO, prepared

from tests.support.gcs import start_gcs


def timed(call, rounds: int) -> tuple[float, object]:
    """Median wall seconds of `rounds` calls (after one warm-up call), and the last result."""
    call()
    seconds, result = [], None
    for _ in range(rounds):
        began = time.monotonic()
        result = call()
        seconds.append(time.monotonic() - began)
    return statistics.median(seconds), result


def epoch_seconds(folder: Path, out: str) -> dict:
    """The steady epoch of the MNIST job on this data (2 epochs, defaults otherwise)."""
    overrides = [
        f"data.train={folder}/train-*.tfrecord", f"data.eval={folder}/test-*.tfrecord", "train.epochs=2",
        f"output.dir={out}", "output.tensorboard=false", "name=verify_cost",
    ]
    command = [sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml",
               *(a for o in overrides for a in ("--set", o))]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"runner run failed ({result.returncode}): {result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def hard_linked_copies(source: Path, target: Path, copies: int) -> int:
    """`copies` hard links of every shard in `source` under one manifest in `target`; returns the shard count."""
    manifest = json.loads((source / "manifest.json").read_text())
    shards = [entry for info in manifest["splits"].values() for entry in info["shards"]]
    entries = []
    for copy in range(copies):
        for entry in shards:
            name = f"c{copy:04d}-{entry['file']}"
            os.link(source / entry["file"], target / name)
            entries.append({**entry, "file": name})
    manifest["splits"] = {"all": {"records": sum(e["records"] for e in entries), "shards": entries}}
    (target / "manifest.json").write_text(json.dumps(manifest))
    return len(entries)


def rates(call) -> tuple[float, float, object]:
    """(MB/s of wall time, MB per CPU-second of this process, the result) of `call`, which returns
    (megabytes read, result). CPU time counts every thread and is steadier than wall time on a busy machine."""
    began, cpu = time.monotonic(), time.process_time()
    megabytes, result = call()
    return megabytes / (time.monotonic() - began), megabytes / (time.process_time() - cpu), result


def old_reader(paths: list[str]) -> tuple[float, None]:
    """The reader before: tf.io.gfile in 4 MB reads, one shard after another."""
    import tensorflow as tf

    size = 0
    for path in paths:
        digest = hashlib.sha256()
        with tf.io.gfile.GFile(path, "rb") as handle:
            while chunk := handle.read(4 << 20):
                digest.update(chunk)
                size += len(chunk)
    return size / 1e6, None


def hashlib_in_memory(block: bytes) -> tuple[float, None]:
    """sha256 over bytes already in memory, on one thread: the ceiling of one core."""
    hashlib.sha256(block).hexdigest()
    return len(block) / 1e6, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 20 copies, no gs://")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--copies", type=int, default=100, help="hard-linked copies of the MNIST shards (7 each)")
    parser.add_argument("--no-gcs", action="store_true", help="leave out gs://")
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    rounds, copies = (3, 20) if args.quick else (args.rounds, args.copies)
    with_gcs = not (args.quick or args.no_gcs)
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="verify-cost-") as scratch, (
        start_gcs(Path(scratch) / "gcs") if with_gcs else contextlib.nullcontext()
    ) as gcs:
        if gcs is not None:
            os.environ.update(gcs.env)  # before TensorFlow loads: its gs:// client reads them once
        from runner.data import storage

        storage.configure_tensorflow(storage.DEFAULT_TIMEOUT_S)
        from runner.data import integrity, pipeline, verify
        from runner.spec.types import JobSpec

        local = prepared(args.data)
        sources = {"local": str(local)}
        if gcs is not None:
            sources["gs://"] = gcs.upload_folder(local, gcs.bucket(), "mnist")

        def check(folder: str, mode: str):
            spec = JobSpec.model_validate({"data": {
                "train": f"{folder}/train-*.tfrecord", "eval": f"{folder}/test-*.tfrecord", "verify": mode,
            }})
            return lambda: integrity.check_job_data(spec).record

        costs = {}
        for where, folder in sources.items():
            for mode in ("size", "sha256"):
                seconds, record = timed(check(folder, mode), rounds)
                costs[(where, mode)] = (seconds, record)

        summary = epoch_seconds(local, str(Path(scratch) / "runs"))
        epoch = summary["timing"]["steady_epoch_s"]

        big = local.parent / "verify-links"  # beside the shards: hard links stay on their file system
        shutil.rmtree(big, ignore_errors=True)
        big.mkdir()
        shards = hard_linked_copies(local, big, copies)
        manifest = pipeline.read_manifest(str(big))
        entries = [
            verify.Listed(str(big / e["file"]), "", e["records"], e["bytes"], e["sha256"])
            for e in manifest["splits"]["all"]["shards"]
        ]
        size_bytes = sum(e.bytes for e in entries)
        cli = subprocess.run(
            [sys.executable, "-m", "runner", "verify", str(big)], cwd=REPO, capture_output=True, text=True, timeout=3600
        )
        if cli.returncode != 0:
            raise SystemExit(f"runner verify failed ({cli.returncode}): {cli.stderr[-3000:]}")
        cli_rate = float(re.search(r"([\d,.]+) MB/s", cli.stdout).group(1).replace(",", ""))
        cores = len(os.sched_getaffinity(0))

        def checked(threads: int | None):
            def call():
                result = verify.check_bytes(entries, "sha256", threads=threads)
                return result.bytes_read / 1e6, result

            return call

        block = os.urandom(256 << 20)
        readers = {
            "check_bytes sha256, 1 thread": rates(checked(1)),
            f"check_bytes sha256, {cores} threads (runner verify's reader)": rates(checked(None)),
            "before: tf.io.gfile 4 MB reads, 1 shard at a time": rates(
                lambda: old_reader([e.path for e in entries[: max(7, len(entries) // 5)]])),
            "hashlib sha256 of 256 MB in memory, 1 thread": rates(lambda: hashlib_in_memory(block)),
        }
        shutil.rmtree(big)
    load_after = os.getloadavg()

    print(f"MNIST: 7 shards, {costs[('local', 'size')][1]['bytes'] / 1e6:.1f} MB; {rounds} rounds each, medians; "
          f"steady epoch of jobs/mnist_cnn.yaml: {epoch:.2f} s")
    print(f"{'check':<20}{'seconds':>10}{'MB/s':>10}{'/ epoch':>10}")
    results = []
    for (where, mode), (seconds, record) in costs.items():
        rate = record["bytes_read"] / 1e6 / seconds if record["bytes_read"] else None
        ratio = seconds / epoch
        print(f"{where + ' ' + mode:<20}{seconds:>10.4f}{'' if rate is None else f'{rate:,.0f}':>10}{ratio:>10.4f}")
        results.append({
            "benchmark": f"verify_cost:{where.rstrip(':/')}_{mode}", "ratio": round(ratio, 5),
            "goal": "<= 0.01" if mode == "size" else "measured",
            "detail": {"verify_s": round(seconds, 4), "steady_epoch_s": epoch, "mb_per_s": rate and round(rate),
                       "rounds": rounds},
        })
    print(f"\n{shards} shards ({copies} hard-linked copies of 7), {size_bytes / 1e6:,.0f} MB from the page cache, "
          f"{cores} cores")
    print(f"{'reader':<62}{'MB/s':>8}{'MB/CPU-s':>10}")
    print(f"{'runner verify (the CLI: the MB/s it prints)':<62}{cli_rate:>8,.0f}")
    for name, (wall, per_cpu, _) in readers.items():
        print(f"{name:<62}{wall:>8,.0f}{per_cpu:>10,.0f}")
    reader = readers[f"check_bytes sha256, {cores} threads (runner verify's reader)"]
    print(f"{cores} idle cores would give about {cores} x {reader[1]:,.0f} = {cores * reader[1]:,.0f} MB/s "
          "(CPU-bound: MB/CPU-s x cores)")
    print(f"load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    results.append({
        "benchmark": "verify_cost:runner_verify_mb_per_s", "ratio": round(cli_rate), "goal": ">= 800",
        "detail": {"shards": shards, "megabytes": round(size_bytes / 1e6), "cores": cores,
                   **{name: {"mb_per_s": round(w), "mb_per_cpu_s": round(c)} for name, (w, c, _) in readers.items()},
                   "load_before": round(load_before[0], 2), "load_after": round(load_after[0], 2)},
    })
    for line in results:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
