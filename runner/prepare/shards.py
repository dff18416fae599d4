"""`runner prepare`: a real dataset -> sharded TFRecords + manifest.json in a folder or bucket.

For gs:// the shards are written and hashed in a local staging folder, then uploaded in parallel with
google-cloud-storage (retried, checksummed, bounded by `storage_timeout_s`; runner/data/storage.py). The
manifest goes up last, so a manifest in the bucket always lists shards that are all there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from runner.data import pipeline, storage, verify
from runner.data.schema import Feature
from runner.prepare.datasets import Dataset, load_dataset

log = logging.getLogger(__name__)
_TARGET_SHARD_BYTES = 8 << 20


def prepare(
    name: str, out: str, source: str = "offline", shards: int | None = None,
    limit: int | None = None, params: dict[str, str] | None = None,
    storage_timeout_s: float = storage.DEFAULT_TIMEOUT_S,
) -> str:
    """Writes every split of dataset `name` under `out` (each cut to `limit` records if set); returns the
    manifest's path."""
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
        names = sorted(n for n in os.listdir(staging) if n != pipeline.MANIFEST)
        with _progress() as progress:
            total = sum(os.path.getsize(os.path.join(staging, n)) for n in names)
            task = progress.add_task(f"uploading {len(names)} shards to {out}", total=total)
            pairs = [(os.path.join(staging, n), f"{out}/{n}") for n in names]
            uploader.upload(pairs, lambda size: progress.advance(task, size))
            transfer = uploader.upload([(local_manifest, f"{out}/{pipeline.MANIFEST}")])
    log.info(
        "uploaded %d files, %.1f MB, to %s in %.1f s (%d retries)",
        transfer.files, transfer.bytes / 1e6, out, transfer.seconds, transfer.retries,
    )
    return f"{out}/{pipeline.MANIFEST}"


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
            count = shards or shard_count(dataset, split)
            entries[split] = write_split(dataset, split, out, count, lambda n: progress.advance(task, n))
            log.info("%s: %d records in %d shards", split, sum(e["records"] for e in entries[split]), count)
    return write_manifest(out, manifest_for(dataset, entries))


def _example(features: dict[str, Feature], row: dict[str, np.ndarray]) -> bytes:
    fields = {}
    for name, feature in features.items():
        value = row[name]
        if feature.dtype == "uint8":
            fields[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value.tobytes()]))
        elif feature.dtype == "int64":
            fields[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=np.ravel(value)))
        else:
            fields[name] = tf.train.Feature(float_list=tf.train.FloatList(value=np.ravel(value)))
    return tf.train.Example(features=tf.train.Features(feature=fields)).SerializeToString()


def shard_count(dataset: Dataset, split: str) -> int:
    arrays = dataset.splits[split]
    size = sum(array.nbytes for array in arrays.values())
    return max(1, min(1024, math.ceil(size / _TARGET_SHARD_BYTES)))


def write_split(
    dataset: Dataset, split: str, out_dir: str, shards: int, progress: Callable[[int], None] = lambda n: None
) -> list[dict[str, Any]]:
    """Writes one split as `shards` TFRecord files; returns the manifest entries (file, records, bytes, sha256,
    and label_range for class-id labels: docs/data.md)."""
    arrays = dataset.splits[split]
    count = len(next(iter(arrays.values())))
    entries = []
    for index, rows in enumerate(np.array_split(np.arange(count), shards)):
        name = f"{split}-{index:05d}-of-{shards:05d}.tfrecord"
        path = posixpath.join(out_dir, name)
        with tf.io.TFRecordWriter(path) as writer:
            for row in rows:
                writer.write(_example(dataset.features, {k: v[row] for k, v in arrays.items()}))
                progress(1)
        entry = {"file": name, "records": int(len(rows)), "bytes": tf.io.gfile.stat(path).length}
        entry["sha256"] = verify.sha256_of(path)
        labels = label_range(arrays[dataset.label][rows], dataset.features[dataset.label])
        entries.append({**entry, **({"label_range": labels} if labels else {})})
    return entries


def holds_class_ids(feature: Feature) -> bool:
    """Whether a label feature holds one class id per record (int64, a single value)."""
    return feature.dtype == "int64" and int(np.prod(feature.shape)) == 1


def label_range(labels: np.ndarray, feature: Feature) -> list[int] | None:
    """[lowest, highest] of class-id labels, for checking them against a model's classes before training;
    None for other labels and for no records."""
    if not holds_class_ids(feature) or not len(labels):
        return None
    return [int(np.min(labels)), int(np.max(labels))]


def manifest_for(dataset: Dataset, splits: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "manifest_version": pipeline.MANIFEST_VERSION,
        "dataset": dataset.name,
        "source": dataset.source,
        "license": dataset.license,
        "features": {name: feature.to_dict() for name, feature in dataset.features.items()},
        "inputs": list(dataset.inputs),
        "label": dataset.label,
        **({"preprocessing": dataset.preprocessing} if dataset.preprocessing else {}),
        "splits": {
            split: {"records": sum(e["records"] for e in entries), "shards": entries}
            for split, entries in splits.items()
        },
    }


def write_manifest(out_dir: str, manifest: dict[str, Any]) -> str:
    """Writes manifest.json whole or not at all (a temporary name, then a rename), so a reader never sees half."""
    path = posixpath.join(out_dir, pipeline.MANIFEST)
    partial = f"{path}.partial"
    with tf.io.gfile.GFile(partial, "w") as handle:
        handle.write(json.dumps(manifest, indent=2) + "\n")
    tf.io.gfile.rename(partial, path, overwrite=True)
    return path
