"""Why the records of a split could not be read or decoded, in the user's terms (`input_error`): the shards
that differ from their manifest, else the first shard whose first record does not fit the schema of the
manifest that lists it (a manifest edited by hand, or written for other records) with the command that writes
it again; TensorFlow's reason without its own wrapping (`{{function_node ...}}`, iterator names).
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Any

import tensorflow as tf

from runner import DataError
from runner.data import schema
from runner.data.pipeline import MANIFEST, corrupt_shards, find_shards
from runner.data.verify import WRITE_AGAIN

# TensorFlow's wrapping around the reason an input op failed: the function and iterator it ran in.
_TF_INTERNALS = (
    re.compile(r"\{\{function_node [^}]*\}\}\s*"),
    re.compile(r"^.*?transformation with iterator: "),
    re.compile(r"^Iterator::\S+: "),
    re.compile(r"^Name: [^,]*, "),
    re.compile(r"\s*\[Op:[^\]]*\]\s*$"),
)


def tf_reason(message: str) -> str:
    """The line of an input pipeline's TensorFlow error that says what went wrong, without TensorFlow's own
    names for where (`{{function_node __wrapped__IteratorGetNext...}}`, the iterator, `[[node ...]]`)."""
    lines = [line.strip() for line in message.splitlines() if line.strip() and not line.strip().startswith("[[")]
    line = next((x for x in lines if "transformation with iterator" in x), lines[-1] if lines else "")
    for internal in _TF_INTERNALS:
        line = internal.sub("", line)
    return " ".join(line.split()).rstrip(".") or "TensorFlow gave no reason"


@dataclasses.dataclass(frozen=True)
class Misfit:
    """A shard whose first record does not parse with the schema of the manifest that lists it."""

    shard: str
    manifest_path: str
    problems: tuple[str, ...]
    manifest: dict[str, Any]

    def describe(self) -> str:
        problems = "; ".join(self.problems)
        return f"{self.shard}: its first record does not fit the schema of {self.manifest_path}: {problems}"

    def fix(self) -> str:
        """How to write the manifest again, as this one was made."""
        folder = posixpath.dirname(self.manifest_path)
        if "(runner manifest)" in str(self.manifest.get("source")):
            return ("write it again from data.features declared as the records hold them: "
                    "`runner manifest SPEC --force` (SPEC: this job's spec file)")
        made = re.search(r"\(runner prepare (arrays|images|csv|tfds)\)", str(self.manifest.get("source")))
        if made:  # your own data: its files and flags are yours to give again
            return f"write it again from your data: `runner prepare {made.group(1)} ... --out {folder}`"
        if self.manifest.get("dataset"):  # a built-in dataset (its source names the package or download)
            return f"write it again, as it was made: `runner prepare {self.manifest['dataset']} --out {folder}`"
        return WRITE_AGAIN


def first_misfit(pattern: str) -> Misfit | None:
    """The first shard matching `pattern` whose first record does not parse with its manifest's schema (one
    record read per shard: cheap), or None (they all fit, or the shards or the manifest cannot be read)."""
    try:
        shards = find_shards(pattern)
    except (DataError, tf.errors.OpError):
        return None
    manifest_path = posixpath.join(posixpath.dirname(pattern), MANIFEST)
    for path in shards.files:
        try:
            record = next(iter(tf.data.TFRecordDataset(path).take(1)), None)
        except tf.errors.OpError:  # unreadable: corrupt_shards' to name
            continue
        if record is None:
            continue
        problems = schema.record_problems(record.numpy(), shards.features)
        if problems:
            return Misfit(path, manifest_path, tuple(problems), shards.manifest)
    return None


def miscounted(key: str, pattern: str, found: str, listed: int) -> DataError:
    """The shards hold another number of records than their manifest.json lists, named with the file to mend."""
    manifest = posixpath.join(posixpath.dirname(pattern), MANIFEST)
    return DataError(
        f"{key}: the shards matching {pattern!r} hold {found} records, their manifest lists {listed} (in {manifest}: "
        f"its `records` counts, edited by hand or written for other shards, do not describe these shards); "
        f"{WRITE_AGAIN}"
    )


def input_error(exc: Exception, pattern: str, key: str) -> DataError | None:
    """The DataError for a TensorFlow error that came out of the input pipeline of `key` (data.train,
    data.eval, data.validation: shards matching `pattern`), naming the shards that differ from their
    manifest, else the manifest and the first shard whose first record does not parse with its schema (a
    manifest edited, or written for other records), with the command that writes it again; TensorFlow's own
    wrapping (`{{function_node ...}}`, iterator names) left out. None for an error that did not come from the
    input."""
    if isinstance(exc, tf.errors.DataLossError):
        bad = corrupt_shards(pattern)
        where = (
            "; ".join(bad) if bad
            else f"a shard matching {pattern!r} (all match the manifest: re-run `runner prepare`)"
        )
        # Keras wraps the reader's error in "Graph execution error:" and a stack: keep the line about the record.
        lines = exc.message.splitlines()
        detail = next((line.strip() for line in lines if "record" in line.lower()), lines[0] if lines else "")
        what = {"data.train": "training", "data.eval": "evaluation", "data.validation": "validation"}.get(key, key)
        return DataError(f"corrupt {what} data in {where}: {detail}")
    # Evaluation batches hold exactly the records the manifest lists (make_dataset `weighted`).
    counted = re.search(
        r"expected to contain (\d+) elements but contained (only|at least) (\d+)", getattr(exc, "message", "")
    )
    if isinstance(exc, tf.errors.FailedPreconditionError) and counted:
        listed, how, found = counted.groups()
        return miscounted(key, pattern, f"{how} {found}", int(listed))
    # Keras tags the input iterator's op: only such errors are about a batch that could not be decoded.
    if not isinstance(exc, tf.errors.InvalidArgumentError) or "IteratorGetNext" not in exc.message:
        return None
    reason = tf_reason(exc.message)
    if "train.sample_weight" in reason:  # the weights' own check (runner/job/inputs.py with_sample_weight)
        reason = reason.rsplit(": ", 1)[-1]
        return DataError(f"{key}: {reason.strip('[]. ')} in a shard matching {pattern!r}: fix the records' weights")
    changed = corrupt_shards(pattern)
    if changed:
        return DataError(
            f"{key}: a batch could not be decoded ({reason}) in shards that differ from their manifest: "
            f"{'; '.join(changed)}; copy them again from their source, or {WRITE_AGAIN} if the data changed on purpose"
        )
    misfit = first_misfit(pattern)
    if misfit is not None:
        return DataError(f"{key}: {misfit.describe()}. The shards match their size and sha256 there, so the "
                         f"manifest's schema does not describe these records: {misfit.fix()}")
    manifest_path = posixpath.join(posixpath.dirname(pattern), MANIFEST)
    return DataError(
        f"{key}: a batch could not be decoded ({reason}) in a shard matching {pattern!r}; the shards match "
        f"{manifest_path} (size and sha256) and the first record of each fits its schema, so a later record does "
        "not fit it, or data.preprocess failed on it: run `runner manifest` again for your own records (it names "
        "the record) or `runner prepare` for a built-in dataset"
    )


def suspect_shards(pattern: str) -> str:
    """Where a record that could not be decoded came from: the shards that differ from their manifest, when
    some do, else the first shard whose first record does not fit the manifest's schema, else any shard the
    pattern matches."""
    changed = corrupt_shards(pattern)
    if changed:
        return f"shards that differ from their manifest: {'; '.join(changed)}"
    misfit = first_misfit(pattern)
    if misfit is not None:
        return f"{misfit.describe()}. The manifest's schema does not describe these records: {misfit.fix()}."
    return f"a shard matching {pattern!r} (listed in {posixpath.join(posixpath.dirname(pattern), MANIFEST)})"
