"""`runner prepare`: a dataset -> sharded TFRecords + manifest.json in a folder or bucket.

Every form goes through `publish`: the inputs are read and checked whole first (a bad file stops the run
before anything is written), then the shards and the manifest are written into a staging folder (a hidden
`.prepare-*` folder inside a local --out, so publishing is a rename on the same disk; a local temporary
folder for gs://, uploaded in parallel with google-cloud-storage: retried, checksummed, bounded by
`storage_timeout_s`, runner/data/storage.py). Publishing removes the old manifest first, moves the shards
in, removes the shards only the old manifest listed, and puts the new manifest in last: a folder whose
manifest is there is always a complete one, and one left by a failed publish has no manifest at all.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import shutil
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

from runner import DataError, StorageError
from runner.data import pipeline, schema, storage, verify
from runner.data.schema import Feature
from runner.prepare.datasets import Dataset, load_dataset

log = logging.getLogger(__name__)
_TARGET_SHARD_BYTES = 8 << 20
_NUMERIC = ("uint8", "int64", "float32")


def prepare(
    name: str, out: str, source: str = "offline", shards: int | None = None,
    limit: int | None = None, params: dict[str, str] | None = None,
    storage_timeout_s: float = storage.DEFAULT_TIMEOUT_S,
) -> str:
    """Writes every split of the built-in dataset `name` under `out` (each cut to `limit` records if set);
    returns the manifest's path."""
    return publish(lambda: _load(name, source, limit, params), out, shards, storage_timeout_s)


def publish(
    load: Callable[[], Dataset], out: str, shards: int | None = None,
    storage_timeout_s: float = storage.DEFAULT_TIMEOUT_S,
) -> str:
    """Loads the dataset (`load` reads and checks every input), writes it as shards + manifest into a staging
    folder, then publishes it under `out` (see the module docstring); returns the manifest's path."""
    out = out.rstrip("/")
    remote = storage.is_gcs(out)
    uploader = None
    if remote:
        uploader = storage.Uploader(storage_timeout_s)
        uploader.check_bucket(out)  # before the slow part: a wrong bucket fails in seconds
    dataset = load()
    if not remote:
        os.makedirs(out, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".prepare-", dir=None if remote else out)
    try:
        manifest = write_dataset(dataset, staging, shards)
        write_manifest(staging, manifest)
        if uploader is not None:
            _publish_gcs(uploader, staging, out, manifest)
        else:
            _publish_local(staging, out, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return posixpath.join(out, pipeline.MANIFEST)


def _load(name: str, source: str, limit: int | None, params: dict[str, str] | None):
    dataset = load_dataset(name, source, params)
    return dataset.head(limit) if limit is not None else dataset


def progress_bar(transfer: bool = False) -> Progress:
    """A Rich progress bar on stderr when it is a terminal (records, or bytes with `transfer`); silent otherwise."""
    columns = (DownloadColumn(), TransferSpeedColumn()) if transfer else (MofNCompleteColumn(),)
    return Progress(
        TextColumn("{task.description}"), BarColumn(), *columns, TimeRemainingColumn(),
        disable=not sys.stderr.isatty(),
    )


def _listed_files(manifest: dict[str, Any] | None) -> set[str]:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
        return set()
    return {
        entry["file"] for info in manifest["splits"].values() if isinstance(info, dict)
        for entry in info.get("shards", []) if isinstance(entry, dict) and isinstance(entry.get("file"), str)
        and "/" not in entry["file"]
    }


def _publish_local(staging: str, out: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(out, pipeline.MANIFEST)
    try:
        with open(path, encoding="utf-8") as handle:
            old = json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        old = None
    if os.path.exists(path):
        os.remove(path)  # it would describe shards about to be replaced
    names = _listed_files(manifest)
    for name in sorted(names):
        os.replace(os.path.join(staging, name), os.path.join(out, name))
    for name in sorted(_listed_files(old) - names):  # shards of the old manifest this one does not list
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    os.replace(os.path.join(staging, pipeline.MANIFEST), path)


def _publish_gcs(uploader: storage.Uploader, staging: str, out: str, manifest: dict[str, Any]) -> None:
    from google.api_core import exceptions

    bucket_name, prefix = storage.split_gcs(out)
    bucket = uploader.client.bucket(bucket_name)

    def blob_name(name: str) -> str:
        return posixpath.join(prefix, name) if prefix else name

    def call(what: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except exceptions.NotFound:
            return None
        except Exception as exc:  # noqa: BLE001 - google-cloud-storage's errors, named with the object
            raise StorageError(f"gs://{bucket_name}/{what}: {type(exc).__name__}: {str(exc)[:300]}") from None

    request = {"retry": uploader.retry, "timeout": uploader.request_timeout}
    manifest_blob = bucket.blob(blob_name(pipeline.MANIFEST))
    text = call(blob_name(pipeline.MANIFEST), lambda: manifest_blob.download_as_bytes(**request))
    try:
        old = json.loads(text) if text else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        old = None
    if text is not None:
        call(blob_name(pipeline.MANIFEST), lambda: manifest_blob.delete(**request))
    names = sorted(_listed_files(manifest))
    with progress_bar(transfer=True) as progress:
        total = sum(os.path.getsize(os.path.join(staging, n)) for n in names)
        task = progress.add_task(f"uploading {len(names)} shards to {out}", total=total)
        pairs = [(os.path.join(staging, n), f"{out}/{n}") for n in names]
        uploader.upload(pairs, lambda size: progress.advance(task, size))
    for name in sorted(_listed_files(old) - set(names)):
        call(blob_name(name), lambda name=name: bucket.blob(blob_name(name)).delete(**request))
    transfer = uploader.upload([(os.path.join(staging, pipeline.MANIFEST), f"{out}/{pipeline.MANIFEST}")])
    log.info(
        "uploaded %d files, %.1f MB, to %s in %.1f s (%d retries)",
        transfer.files, transfer.bytes / 1e6, out, transfer.seconds, transfer.retries,
    )


def write_dataset(dataset: Dataset, out: str, shards: int | None = None) -> dict[str, Any]:
    """Writes every split of `dataset` as shards into `out`; returns the manifest (not yet written)."""
    total = sum(len(next(iter(arrays.values()))) for arrays in dataset.splits.values())
    entries = {}
    with progress_bar() as progress:
        task = progress.add_task(f"writing {dataset.name}", total=total)
        for split in dataset.splits:
            count = shards or shard_count(dataset, split)
            entries[split] = write_split(dataset, split, out, count, lambda n: progress.advance(task, n))
            log.info("%s: %d records in %d shards", split, sum(e["records"] for e in entries[split]), count)
    return manifest_for(dataset, entries)


def _example(features: dict[str, Feature], row: dict[str, Any]) -> bytes:
    fields = {}
    for name, feature in features.items():
        value, full = row[name], schema.stored(feature)
        if full.decode in ("png", "jpeg") or full.dtype == "string":  # encoded bytes, stored as they are
            data = value if isinstance(value, bytes) else str(value).encode()
            fields[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
        elif full.dtype == "uint8":
            fields[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[np.asarray(value).tobytes()]))
        elif full.dtype == "int64":
            fields[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=np.ravel(value)))
        else:
            fields[name] = tf.train.Feature(float_list=tf.train.FloatList(value=np.ravel(value)))
    return tf.train.Example(features=tf.train.Features(feature=fields)).SerializeToString()


def _nbytes(array: np.ndarray) -> int:
    """Bytes the values take in a record: an object array holds encoded bytes (images), counted one by one."""
    if array.dtype == object:
        return sum(len(value) for value in array)
    return array.nbytes


def shard_count(dataset: Dataset, split: str) -> int:
    arrays = dataset.splits[split]
    size = sum(_nbytes(array) for array in arrays.values())
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
        if labels:
            entry["label_range"] = labels
            entry["label_counts"] = label_counts(arrays[dataset.label][rows])
        entries.append(entry)
    return entries


def training_split(splits: Any) -> str | None:
    """The split value ranges describe: `train` when there is one, else the first."""
    names = list(splits)
    return "train" if "train" in names else (names[0] if names else None)


def value_range(values: np.ndarray, dtype: str) -> dict[str, Any] | None:
    """{"dtype", "min", "max"} of a numeric feature's values (None for none); ints stay ints."""
    if dtype not in _NUMERIC or values.size == 0:
        return None
    low, high = np.min(values), np.max(values)
    if dtype == "float32":
        return {"dtype": dtype, "min": float(low), "max": float(high)}
    return {"dtype": dtype, "min": int(low), "max": int(high)}


def value_ranges(dataset: Dataset) -> dict[str, dict[str, Any]]:
    """The dtype and [min, max] of every numeric input over the training split (docs/data.md, value_ranges)."""
    split = training_split(dataset.splits)
    ranges = {}
    for name in dataset.inputs:
        if name in dataset.value_ranges:
            ranges[name] = dataset.value_ranges[name]
            continue
        full = schema.stored(dataset.features[name])
        values = dataset.splits[split][name] if split is not None else None
        if values is None or full.decode in ("png", "jpeg") or values.dtype == object:
            continue
        found = value_range(values, full.dtype)
        if found is not None and not all(map(math.isfinite, (found["min"], found["max"]))):
            raise DataError(
                f"{dataset.name}: feature {name!r} holds NaN or infinite values in split {split!r}; "
                "a model cannot learn from them: replace or drop those records"
            )
        if found is not None:
            ranges[name] = found
    return ranges


def holds_class_ids(feature: Feature) -> bool:
    """Whether a label feature holds one class id per record (int64, a single value)."""
    return feature.dtype == "int64" and int(np.prod(feature.shape)) == 1


def label_range(labels: np.ndarray, feature: Feature) -> list[int] | None:
    """[lowest, highest] of class-id labels, for checking them against a model's classes before training;
    None for other labels and for no records."""
    if not holds_class_ids(feature) or not len(labels):
        return None
    return [int(np.min(labels)), int(np.max(labels))]


def label_counts(labels: np.ndarray) -> list[int]:
    """How many records hold each class id, 0 up to the highest (train.class_weight: balanced reads them)."""
    return [int(n) for n in np.bincount(np.asarray(labels).reshape(-1).astype(np.int64))]


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
        **({"class_names": list(dataset.class_names)} if dataset.class_names else {}),
        "value_ranges": value_ranges(dataset),
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
