"""`runner prepare`: a real dataset -> sharded TFRecords + manifest.json in a folder or bucket.

For gs:// the shards are written and hashed in a local staging folder, then uploaded in parallel with
google-cloud-storage (retried, checksummed, bounded by `storage_timeout_s`; runner/storage.py). The
manifest goes up last, so a manifest in the bucket always lists shards that are all there.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import tensorflow as tf
from rich.progress import (
    BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
)

from runner import data, storage
from runner.datasets import load_dataset

log = logging.getLogger(__name__)


def prepare(
    name: str, out: str, source: str = "offline", shards: int | None = None,
    limit: int | None = None, params: dict[str, str] | None = None,
    storage_timeout_s: float = storage.DEFAULT_TIMEOUT_S,
) -> str:
    """Writes every split of dataset `name` under `out` (each cut to `limit` records if set); returns the manifest's path."""
    out = out.rstrip("/")
    if not storage.is_gcs(out):
        dataset = _load(name, source, limit, params)
        tf.io.gfile.makedirs(out)
        return _write(dataset, out, shards)
    uploader = storage.Uploader(storage_timeout_s)
    uploader.check_bucket(out)  # before the slow part: a wrong bucket fails in seconds
    dataset = _load(name, source, limit, params)
    with tempfile.TemporaryDirectory(prefix="runner-prepare-") as staging:
        local_manifest = _write(dataset, staging, shards)
        names = sorted(n for n in os.listdir(staging) if n != data.MANIFEST)
        with _progress() as progress:
            total = sum(os.path.getsize(os.path.join(staging, n)) for n in names)
            task = progress.add_task(f"uploading {len(names)} shards to {out}", total=total)
            pairs = [(os.path.join(staging, n), f"{out}/{n}") for n in names]
            uploader.upload(pairs, lambda size: progress.advance(task, size))
            transfer = uploader.upload([(local_manifest, f"{out}/{data.MANIFEST}")])
    log.info(
        "uploaded %d files, %.1f MB, to %s in %.1f s (%d retries)",
        transfer.files, transfer.bytes / 1e6, out, transfer.seconds, transfer.retries,
    )
    return f"{out}/{data.MANIFEST}"


def _load(name: str, source: str, limit: int | None, params: dict[str, str] | None):
    dataset = load_dataset(name, source, params)
    return dataset.head(limit) if limit is not None else dataset


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
        disable=not sys.stderr.isatty(),
    )


def _write(dataset, out: str, shards: int | None) -> str:
    total = sum(len(next(iter(arrays.values()))) for arrays in dataset.splits.values())
    entries = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        disable=not sys.stderr.isatty(), console=None,
    ) as progress:
        task = progress.add_task(f"writing {dataset.name} to {out}", total=total)
        for split in dataset.splits:
            count = shards or data.shard_count(dataset, split)
            entries[split] = data.write_split(dataset, split, out, count, lambda n: progress.advance(task, n))
            log.info("%s: %d records in %d shards", split, sum(e["records"] for e in entries[split]), count)
    return data.write_manifest(out, data.manifest_for(dataset, entries))
