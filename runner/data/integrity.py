"""The data a job promises, checked before its run folder is touched (`data.verify`, docs/data.md; the
manifest and byte checks themselves are runner/data/verify.py's).

`runner run` calls check_job_data first: a job whose data is not what its manifest says stops with exit 2
naming the shard (or the manifest field) and what differs, and nothing is written to the run folder: no
spec.json, no attempt, no checkpoint rotated, no summary there (stdout still gets one).

For every pattern the job reads (data.train, data.eval, and data.validation unless validation is `never`; unset,
the splits beside data.train: runner/data/splits.py):
  - the manifest is well formed (`splits`, per shard `file` and `records`, split totals that add up),
  - every file the pattern matches is listed, every listed shard it names is there, and it names whole
    splits: steps per epoch are the manifest's record count, never what happens to be on disk,
  - the labels the manifest records (`label_range`) are classes the model has (built-in classifiers; every
    other model once built, against its output width and loss: `check_labels_fit`, called by runner/job/run.py),
  - train.sample_weight names a numeric scalar feature of its schema (its values are checked as they are read),
  - data.verify: size (default) stats each shard: present, exactly its listed size (a shard emptied, cut at
    a record boundary or inside a record, or replaced); sha256 also reads every byte once and compares its
    hash, and the summary's `data_verify` reports what that cost; off skips both byte checks.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from typing import Any

import numpy as np
import tensorflow as tf

from runner import DataError, RunnerError, models
from runner.data import pipeline, schema, splits, storage, verify
from runner.spec.columns import class_weight_problem, columns_problem, pixels_problem
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JobData:
    """The shards of each pattern the job reads (by spec key: data.train, data.eval, data.validation), found
    and checked once, and the summary's `data_verify` record."""

    shards: dict[str, pipeline.Shards]
    record: dict[str, Any]


def check_job_data(spec: JobSpec) -> JobData:
    """Raises DataError (exit 2) when the job's data is not what its manifests promise (or what the spec's
    data.features declare), StorageError (exit 3) when a bucket does not answer."""
    patterns = {"data.train": spec.data.train}
    found: dict[str, pipeline.Shards] = {}
    try:
        listed: dict[str, verify.Listed] = {}
        found["data.train"] = pipeline.find_shards(spec.data.train, "data.train")
        # Which split evaluates, validates and selects: runner/data/splits.py, from the manifest beside data.train.
        patterns = splits.patterns(spec, found["data.train"].manifest)
        for key, pattern in patterns.items():
            shards = found.get(key) or pipeline.find_shards(pattern, key)
            found[key] = shards
            pipeline.check_declared(spec.data.features, shards)
            manifest_path = posixpath.join(posixpath.dirname(shards.pattern), pipeline.MANIFEST)
            columns = columns_problem(spec.data, shards.manifest, manifest_path, spec.train.sample_weight)
            columns = columns or pixels_problem(spec.model, spec.data, shards.manifest, manifest_path)
            if key == "data.train":
                columns = columns or class_weight_problem(spec.train.class_weight, shards.manifest, manifest_path)
            if columns:
                raise DataError(f"{key}: {columns}")
            check_whole_splits(shards, key)
            check_labels(spec, shards)
            check_sample_weight(spec.train.sample_weight, shards, key, spec.data.label)
            for shard in pipeline.listed_in(shards):
                listed.setdefault(shard.path, shard)
        _check_sizes_listed(spec, list(listed.values()))
        checked = verify.check_bytes(list(listed.values()), spec.data.verify, spec.storage.timeout_s)
    except RunnerError:
        raise
    except tf.errors.OpError as exc:
        raise storage.storage_error(exc, patterns.values(), spec.storage.timeout_s) or DataError(
            f"cannot read the data of {', '.join(patterns)}: {exc.message.splitlines()[0]}"
        ) from None
    if checked.problems:
        raise DataError(
            f"data.verify ({spec.data.verify}): {len(checked.problems)} of the {checked.shards} shards the job reads "
            "differ from their manifest:\n  " + "\n  ".join(checked.problems) + "\nNothing was written to the run "
            "folder. Copy the shards again from their source; if the data changed on purpose, write its manifest "
            "again (`runner prepare` for a built-in dataset, `runner manifest SPEC --force` for your own records; "
            "SPEC: this job's spec file)"
        )
    if spec.data.verify != "off":
        rate = f", {checked.mb_per_s:,.0f} MB/s on {checked.threads} threads" if checked.mb_per_s else ""
        log.info(
            "data.verify %s: %d shards, %.1f MB as listed, in %.2f s%s",
            spec.data.verify, checked.shards, checked.bytes / 1e6, checked.seconds, rate,
        )
    return JobData(found, checked.to_dict())


def check_whole_splits(shards: pipeline.Shards, key: str) -> None:
    """A pattern names whole splits of its manifest: one naming part of a split would train on (or evaluate)
    other records than the split's, with other steps per epoch, whenever a shard is added or lost."""
    names = {posixpath.basename(f) for f in shards.files}
    folder = posixpath.dirname(shards.pattern)
    for split, info in shards.manifest["splits"].items():
        listed = [entry["file"] for entry in info["shards"]]
        left = [name for name in listed if name not in names]
        if left and len(left) < len(listed):
            example = f" (e.g. {folder}/{split}-*.tfrecord)" if all(n.startswith(f"{split}-") for n in listed) else ""
            raise DataError(
                f"{key} ({shards.pattern!r}) names {len(listed) - len(left)} of the {len(listed)} shards of split "
                f"{split!r} in {posixpath.join(folder, pipeline.MANIFEST)}; not named: {', '.join(left[:3])}"
                f"{' ...' if len(left) > 3 else ''}. A pattern must name whole splits, so that what is trained and "
                f"evaluated, and the steps per epoch, are the manifest's: name all of {split!r}{example}. For fewer "
                "steps set train.steps_per_epoch; for fewer records prepare a smaller split (`runner prepare "
                "--limit N`) or `runner manifest` a folder that holds only those shards"
            )


def check_sample_weight(weight: str | None, shards: pipeline.Shards, key: str, label: str | None = None) -> None:
    """train.sample_weight's feature is in the split's schema, and a number per record (or, for a label of
    several values such as a language model's next tokens, one per label value): it weighs training and
    evaluation alike, so every split the job reads must hold it."""
    if weight is None:
        return
    manifest = posixpath.join(posixpath.dirname(shards.pattern), pipeline.MANIFEST)
    feature = shards.features.get(weight)
    if feature is None:
        raise DataError(
            f"train.sample_weight names {weight!r}, but {manifest} (the schema of {key}) has no such feature; it has: "
            f"{', '.join(sorted(shards.features))}. Name one of them, or write the weights into the records (every "
            "split the job reads: training, evaluation and validation are weighted alike)"
        )
    per_value = label in shards.features and len(shards.features[label].shape) == 1 and tuple(feature.shape) == (
        tuple(shards.features[label].shape)) and feature.shape[0] > 1
    if feature.dtype not in ("int64", "float32") or (tuple(feature.shape) not in ((), (1,)) and not per_value):
        raise DataError(
            f"train.sample_weight names {weight!r}, which {manifest} declares as {schema.describe(feature)}: a "
            "sample weight is one number per record (int64 or float32, shape [] or [1]) or one per value of a "
            "label of several (its shape); name such a feature"
        )


def classes_of(spec: JobSpec) -> int | None:
    """The number of classes of a built-in classifier (its `classes` param), None for other models."""
    return None if spec.model.hub else models.classes_of(spec.model.name, dict(spec.model.params))


def check_labels(spec: JobSpec, shards: pipeline.Shards) -> None:
    """The manifest's label ranges (written by `runner prepare` and `runner manifest`) against the model's
    classes. A label outside them fails on a CPU but is read as garbage on a TPU or GPU: refuse it here,
    naming the shard and its first record that holds one."""
    classes, label = classes_of(spec), spec.data.label
    if classes is None or shards.manifest.get("label") != label:
        return
    unrecorded, entries = 0, pipeline.manifest_entries(shards.manifest)
    for shard in pipeline.listed_in(shards):
        entry = entries[posixpath.basename(shard.path)][2]
        labels = entry.get("label_range")
        if labels is None:
            unrecorded += entry["records"] > 0
            continue
        low, high = labels
        if low >= 0 and high < classes:
            continue
        field = f"{shard.where}.label_range"
        allowed = f"the {classes} classes of model {spec.model.name} (0 to {classes - 1}, model.params.classes)"
        found = _first_label_outside(shard.path, shards.features[label], label, classes)
        if found is None:
            raise DataError(
                f"{field} is [{low}, {high}], outside {allowed}, but the shard's records are all inside them: "
                f"the manifest is wrong; {verify.WRITE_AGAIN}"
            )
        record, value = found
        raise DataError(
            f"{shard.path}: record {record} (counting from 0) has {label} {value}, outside {allowed}; "
            f"{field} is [{low}, {high}]. Set model.params.classes to at least {high + 1}, or fix the labels"
        )
    if unrecorded:
        log.warning(
            "%s records no label_range for %d shard(s): labels are not checked against the %d classes of model %s; "
            "write the manifest again to have them checked",
            posixpath.join(posixpath.dirname(shards.pattern), pipeline.MANIFEST), unrecorded, classes, spec.model.name,
        )


def check_labels_fit(spec: JobSpec, found: dict[str, pipeline.Shards], expected: tuple[int, int, str] | None) -> None:
    """The manifest's label ranges (and counts) against what the built model and its loss learn from
    (`expected`: lowest, highest, why; runner/train/build.py `label_expectation`), for every model, the user's
    own included: labels 1 to 3 under 3 outputs end in a TensorFlow error on a CPU and train on garbage on a
    TPU. DataError (exit 2) naming the split, the range, the record and the fix; a data.preprocess may map the
    labels, so then the ranges are not judged (said once)."""
    if expected is None:
        return
    low, high, why = expected
    label = spec.data.label
    for key, shards in found.items():
        if shards.manifest.get("label") != label:
            continue
        entries = pipeline.manifest_entries(shards.manifest)
        ranges = [(shard, entries[posixpath.basename(shard.path)][2].get("label_range"))
                  for shard in pipeline.listed_in(shards)]
        ranges = [(shard, r) for shard, r in ranges if isinstance(r, list) and len(r) == 2]
        if not ranges:
            continue
        lowest, highest = min(r[0] for _, r in ranges), max(r[1] for _, r in ranges)
        if low <= lowest and highest <= high:
            continue
        manifest = posixpath.join(posixpath.dirname(shards.pattern), pipeline.MANIFEST)
        if spec.data.preprocess:
            log.warning("%s: the labels run from %d to %d (%s, label_range), where %s; data.preprocess (%s) may "
                        "map them, so they are not refused here", key, lowest, highest, manifest, why,
                        spec.data.preprocess)
            return
        raise DataError(_labels_outside(key, shards, manifest, ranges, (lowest, highest), expected))


def _labels_outside(key: str, shards: pipeline.Shards, manifest: str, ranges: list, found: tuple[int, int],
                    expected: tuple[int, int, str]) -> str:
    (lowest, highest), (low, high, why) = found, expected
    label = shards.manifest.get("label")
    counts = pipeline.label_counts(shards)
    counted = f"; label_counts {counts}" if counts else ""
    shard, _ = next((shard, r) for shard, r in ranges if r[0] < low or r[1] > high)
    first = _first_label_outside(shard.path, shards.features[label], label, high + 1, low)
    where = f"; {shard.path}: record {first[0]} (counting from 0) has {label} {first[1]}" if first else ""
    said = (f"{key}: the labels run from {lowest} to {highest} ({manifest}: label_range{counted}){where}, but "
            f"{why}: TensorFlow stops on such a label on a CPU, and a TPU trains on garbage. ")
    offset = lowest - low
    if offset > 0 and highest - offset <= high and (not counts or not any(counts[:offset])):
        return said + (
            f"No record is labelled {low if offset == 1 else f'{low} to {lowest - 1}'}: the labels count from "
            f"{lowest}. Make them count from {low}: write the labels again as {low} to {highest - offset} (or as "
            f"words, which `runner prepare csv` numbers from 0) and prepare the data again with `runner prepare`; or "
            f"subtract {offset} in a data.preprocess function (`features[{label!r}] = features[{label!r}] - "
            f"{offset}`); or end the model in {highest + 1} outputs (class{'es' * (offset > 1)} "
            f"{', '.join(map(str, range(low, lowest)))} then never seen)"
        )
    if why.endswith("takes labels 0 and 1"):
        return said + (f"Label the records 0 and 1 and prepare the data again with `runner prepare`, or choose a "
                       f"loss for {highest - lowest + 1} classes (sparse_categorical_crossentropy, and a model "
                       f"ending in {highest + 1} outputs)")
    return said + (f"End the model in {highest + 1} outputs (one per class id 0 to {highest}), or write the labels "
                   f"again as {low} to {high} and prepare the data again with `runner prepare`")


def _first_label_outside(path: str, feature: schema.Feature, label: str, classes: int,
                         low: int = 0) -> tuple[int, int] | None:
    """(record index, label) of the shard's first record whose label is not a class id (`low` to classes - 1),
    if its bytes read."""
    records = tf.data.TFRecordDataset(path).batch(4096)
    parsed = records.map(schema.plain(lambda batch: schema.parse_batch(batch, {label: feature})[label]))
    seen = 0
    try:
        for batch in parsed:
            values = batch.numpy().reshape(len(batch), -1)[:, 0]
            outside = np.flatnonzero((values < low) | (values >= classes))
            if outside.size:
                return seen + int(outside[0]), int(values[outside[0]])
            seen += len(values)
    except tf.errors.OpError:  # a shard that does not read names itself in the byte checks
        return None
    return None


def _check_sizes_listed(spec: JobSpec, listed: list[verify.Listed]) -> None:
    if spec.data.verify != "size":
        return
    unsized = [shard for shard in listed if shard.bytes is None]
    if not unsized:
        return
    manifests = sorted({shard.where.split(": ")[0] for shard in unsized})
    folders = " ".join(posixpath.dirname(m) for m in manifests)
    raise DataError(
        f"data.verify (size): {', '.join(manifests)} lists no size for {len(unsized)} of the {len(listed)} shards "
        f"(e.g. {unsized[0].where}.bytes): it was written before manifests recorded sizes. Record them once with "
        f"`runner verify {folders} --record-sizes` (it checks every shard's sha256 first), or write the manifest "
        "again (`runner prepare`, or `runner manifest SPEC --force` with SPEC this job's spec file); or run with "
        "--set data.verify=sha256 (reads every byte) or --set data.verify=off"
    )
