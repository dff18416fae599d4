"""`runner manifest`: a manifest.json for TFRecords written outside the runner (your own data).

The job spec says where the shards are (`data.train`, `data.eval`) and what each record holds
(`data.features`). Every shard is read once: its records are counted, its size and sha256 are recorded (so
`runner run` can check the shards before training, data.verify, and `runner verify` works), and every
record is parsed and decoded as training will, so a record that does not fit the schema fails here, naming
the shard, the record and the feature, rather than in the middle of training. For class-id labels (int64,
one per record) the lowest and highest label of each shard is recorded too (`label_range`), so a label
outside the model's classes stops the job before it starts, and the dtype and [min, max] of each numeric input
over the training split (`value_ranges`). Format: docs/data.md.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any

import tensorflow as tf

from runner import DataError, SpecError
from runner.data import pipeline, schema, verify
from runner.prepare.shards import holds_class_ids, label_counts, label_range, training_split, write_manifest
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)


def write_user_manifests(spec: JobSpec, spec_path: str, force: bool = False) -> list[str]:
    """Writes one manifest per folder that data.train / data.eval point into; returns their paths."""
    if spec.data.features is None:
        raise SpecError(
            f"{spec_path}: data.features is not set; `runner manifest` needs the schema of your records, "
            "e.g. `features: {image: {dtype: uint8, shape: [28, 28, 1], decode: png}, label: {dtype: int64}}`"
        )
    features = {n: schema.from_dict(f.to_dict(), f"data.features.{n}") for n, f in spec.data.features.items()}
    folders = _shards_by_folder(spec)
    written = []
    for folder, splits in folders.items():
        path = posixpath.join(folder, pipeline.MANIFEST)
        if tf.io.gfile.exists(path) and not force:
            raise DataError(f"{path} exists; pass --force to replace it with one made from {spec_path}")
        indexed = {split: [_index_shard(f, features, spec.data.label, spec.data.inputs) for f in files]
                   for split, files in splits.items()}
        entries = {split: [entry for entry, _ in shards] for split, shards in indexed.items()}
        training = training_split(indexed)
        ranges = _merge_ranges([found for _, found in indexed[training]]) if training else {}
        manifest: dict[str, Any] = {
            "manifest_version": pipeline.MANIFEST_VERSION,
            "dataset": spec.name,
            "source": f"TFRecords described by data.features of {spec_path} (runner manifest)",
            "license": None,
            "features": {name: feature.to_dict() for name, feature in features.items()},
            "inputs": list(spec.data.inputs),
            "label": spec.data.label,
            "value_ranges": ranges,
            "splits": {
                split: {"records": sum(e["records"] for e in shards), "shards": shards}
                for split, shards in entries.items()
            },
        }
        written.append(write_manifest(folder, manifest))
        for split, shards in entries.items():
            log.info("%s: %s: %d records in %d shards", path, split, sum(e["records"] for e in shards), len(shards))
    return written


def _shards_by_folder(spec: JobSpec) -> dict[str, dict[str, list[str]]]:
    """folder -> split -> shard paths; every shard lies in its pattern's folder, in one split only."""
    patterns = {"train": spec.data.train, **({"eval": spec.data.eval} if spec.data.eval else {})}
    folders: dict[str, dict[str, list[str]]] = {}
    owner: dict[str, str] = {}
    for split, pattern in patterns.items():
        folder = posixpath.dirname(pattern)
        files = sorted(tf.io.gfile.glob(pattern))
        if not files and split == "eval" and spec.data.eval_is_derived:
            continue  # data.eval unset names the test split beside data.train only when there is one
        if not files:
            hint = "; set data.eval to your evaluation shards, or to null for none" if split == "eval" else ""
            raise DataError(f"data.{split}: no files match {pattern!r}{hint}")
        for path in files:
            if posixpath.dirname(path) != folder:
                raise DataError(
                    f"data.{split}: {path} is not directly in {folder!r}; the shards of a split must share "
                    "the folder that holds their manifest (no wildcards in folder names)"
                )
            if path in owner:
                raise DataError(
                    f"{path} matches both data.{owner[path]} and data.{split}; give their shards distinct names"
                )
            owner[path] = split
        folders.setdefault(folder, {})[split] = files
    return folders


# Records parsed at a time while indexing: a batch that fails is then checked record by record.
_CHECK_BATCH = 256


def _index_shard(
    path: str, features: dict[str, schema.StoredFeature], label: str, inputs: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    records, labels, ranges, counts = _check_records(path, features, label, inputs)
    entry = {"file": posixpath.basename(path), "records": records, "bytes": tf.io.gfile.stat(path).length}
    entry["sha256"] = verify.sha256_of(path)
    if labels:
        entry["label_range"] = labels
    if labels and counts:
        entry["label_counts"] = counts
    return entry, ranges


def _merge_ranges(found: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for ranges in found:
        for name, doc in ranges.items():
            if name in merged:
                doc = {**doc, "min": min(doc["min"], merged[name]["min"]), "max": max(doc["max"], merged[name]["max"])}
            merged[name] = doc
    return merged


def _range_of(values: Any, dtype: str) -> dict[str, Any]:
    low, high = float(tf.reduce_min(values)), float(tf.reduce_max(values))
    if dtype == "float32":
        return {"dtype": dtype, "min": low, "max": high}
    return {"dtype": dtype, "min": int(low), "max": int(high)}


def _check_records(
    path: str, features: dict[str, schema.StoredFeature], label: str, inputs: tuple[str, ...] = ()
) -> tuple[int, list[int] | None, dict[str, dict[str, Any]], list[int]]:
    """Counts the shard's records, parsing and decoding all of them with the training pipeline's own parser;
    returns the count, the label_range of class-id labels, the value range of each numeric input (as
    decoded: an image's pixels) and the records per class id (label_counts; [] for other labels).

    A batch that fails is read again record by record (schema.record_problems), so the error names the
    record and the feature. The first record also gets that check up front: it sees what decoding forgives
    (a PNG where JPEG is declared decodes all the same).
    """
    batches = tf.data.TFRecordDataset(path).batch(_CHECK_BATCH)
    count, ranges, found, counts = 0, [], [], []
    numeric = [n for n in inputs if n in features and features[n].dtype != "string"]
    class_ids = label in features and holds_class_ids(features[label])
    try:
        head = next(iter(batches.take(1)), None)
        if head is not None and schema.record_problems(head.numpy()[0], features):
            raise _misfit(path, head.numpy(), 0, None, features)
        sized = batches.map(lambda serialized: (tf.shape(serialized)[0], schema.parse_batch(serialized, features)))
        for size, parsed in sized:
            count += int(size)
            if class_ids and int(size):
                ids = parsed[label].numpy().reshape(-1)
                ranges.append(label_range(ids, features[label]))
                if ids.min() >= 0:
                    counted = label_counts(ids)
                    counts = [a + b for a, b in zip(counts + [0] * (len(counted) - len(counts)),
                                                    counted + [0] * (len(counts) - len(counted)), strict=True)]
            if int(size):
                found.append({n: _range_of(parsed[n], features[n].dtype) for n in numeric})
    except tf.errors.DataLossError as exc:
        raise DataError(
            f"{path} is not a readable TFRecord file ({exc.message.splitlines()[0]}); "
            "write uncompressed TFRecords of tf.train.Example"
        ) from None
    except tf.errors.InvalidArgumentError as exc:
        batch = next(iter(batches.skip(count // _CHECK_BATCH).take(1))).numpy()
        raise _misfit(path, batch, count, exc, features) from None
    labels = [min(r[0] for r in ranges), max(r[1] for r in ranges)] if ranges else None
    return count, labels, _merge_ranges(found), counts


def _misfit(path: str, records, first: int, exc: tf.errors.OpError | None, features: dict) -> DataError:
    """The DataError for the first of `records` (record `first` of the shard onwards) that does not fit."""
    for offset, record in enumerate(records):
        problems = schema.record_problems(record, features)
        if problems:
            where = "the first record" if first + offset == 0 else f"record {first + offset} (counting from 0)"
            return DataError(f"{path}: {where} does not fit data.features:\n  " + "\n  ".join(problems))
    why = exc.message.splitlines()[0] if exc is not None else "TensorFlow gave no reason"
    return DataError(f"{path}: records {first} to {first + len(records) - 1} do not parse with data.features ({why})")


def record_sizes(folder: str, manifest: dict[str, Any], found: dict[str, int]) -> tuple[str, int]:
    """Adds each shard's size (`bytes`) to a manifest written before sizes were recorded, from the sizes
    `runner verify` found after every shard matched its sha256; returns the manifest's path and how many
    sizes were added."""
    added = 0
    for info in manifest["splits"].values():
        for entry in info["shards"]:
            if entry.get("bytes") is None:
                entry["bytes"] = found[posixpath.join(folder, entry["file"])]
                added += 1
    return write_manifest(folder, manifest), added
