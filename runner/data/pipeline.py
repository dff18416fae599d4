"""TFRecord shards: finding them through their manifest (`find_shards`) and reading them (`make_dataset`).
Writing them is `runner prepare`'s (runner/prepare/shards.py); checking them against the manifest is
runner/data/verify.py's, before a job trains runner/data/integrity.py's.

A prepared dataset is a folder (local or gs://) of `<split>-NNNNN-of-MMMMM.tfrecord` shards of
tf.train.Example plus `manifest.json`: the feature schema, and per split its shards, each with its record
count, size in bytes and sha256 (format: docs/data.md). Every read goes through tf.io.gfile, so the same code
serves a folder and a bucket.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import posixpath
from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

from runner import DataError
from runner.data import schema, verify
from runner.data.schema import Feature
from runner.data.verify import WRITE_AGAIN, Checked, Listed, check_bytes, sha256_of  # noqa: F401 (sha256_of: for callers)
from runner.spec.datacheck import no_match_hint
from runner.spec.types import FeatureSpec

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


# --- reading the manifest ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shards:
    """The shard files a glob matched, with their manifest schema and record count."""

    pattern: str
    files: tuple[str, ...]
    records: int
    features: dict[str, Feature]
    manifest: dict[str, Any]


def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest beside the shards, its structure checked: a DataError names the file and the field."""
    path = posixpath.join(folder, MANIFEST)
    try:
        with tf.io.gfile.GFile(path, "r") as handle:
            manifest = json.loads(handle.read())
    except tf.errors.NotFoundError:
        raise DataError(
            f"{path} not found: for your own TFRecords, declare data.features and run `runner manifest SPEC`; "
            f"for a built-in dataset, `runner prepare DATASET --out {folder}`"
        ) from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path} holds a JSON {type(manifest).__name__}, not a manifest (an object with `splits`)")
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise DataError(f"{path}: manifest_version {manifest.get('manifest_version')!r} is not {MANIFEST_VERSION}")
    verify.check_manifest(manifest, path)
    return manifest


def manifest_entries(manifest: dict[str, Any]) -> dict[str, tuple[str, int, dict[str, Any]]]:
    """file name -> (split, index in the split's shards, the entry)."""
    return {
        entry["file"]: (split, index, entry)
        for split, info in manifest["splits"].items()
        for index, entry in enumerate(info["shards"])
    }


def find_shards(pattern: str, key: str | None = None) -> Shards:
    """Globs `pattern` and matches the files against the manifest beside it, both ways: every file is listed,
    and every listed shard the pattern names is there, so the record count (and steps per epoch) is the
    manifest's, never what happens to be on disk. `key` (data.train, ...) names the pattern in errors."""
    folder = posixpath.dirname(pattern)
    what = f"{pattern!r} ({key})" if key else repr(pattern)
    files = tuple(sorted(tf.io.gfile.glob(pattern)))
    if not files and not tf.io.gfile.exists(posixpath.join(folder, MANIFEST)):
        hint = no_match_hint(pattern)
        raise DataError(f"no files match {what}{'; ' + hint if hint else ''}; check data.train / data.eval or run "
                        "`runner prepare` (`runner validate SPEC` checks the data before TensorFlow loads)")
    manifest = read_manifest(folder)
    manifest_path = posixpath.join(folder, MANIFEST)
    entries = manifest_entries(manifest)
    unknown = [f for f in files if posixpath.basename(f) not in entries]
    if unknown:
        raise DataError(f"{unknown[0]} matches {what} but is not listed in {manifest_path}")
    present = {posixpath.basename(f) for f in files}
    missing = [
        name for name in entries
        if fnmatch.fnmatchcase(name, posixpath.basename(pattern)) and name not in present
        and not tf.io.gfile.exists(posixpath.join(folder, name))  # a glob dialect that differs from fnmatch's
    ]
    if missing:
        split, index, entry = entries[missing[0]]
        more = ""
        if len(missing) > 1:
            more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}{'...' if len(missing) > 4 else ''})"
        raise DataError(
            f"{posixpath.join(folder, missing[0])}: missing{more}; {manifest_path} lists it "
            f"(splits.{split}.shards[{index}]: {entry['records']:,} records) and {what} names it. Training on the "
            "shards that are left would change the records and steps per epoch: copy the missing shards back, "
            f"or {WRITE_AGAIN} if they are gone for good"
        )
    if not files:
        hint = no_match_hint(pattern)
        raise DataError(f"no files match {what} and {manifest_path} lists none it names; "
                        f"{hint or 'check the pattern'}")
    features = schema.features_from_manifest(manifest, manifest_path)
    records = sum(entries[posixpath.basename(f)][2]["records"] for f in files)
    return Shards(pattern, files, records, features, manifest)


def label_counts(shards: Shards) -> list[int] | None:
    """Records per class id over the shards (the manifest's label_counts, summed); None when a shard's entry
    has none (a manifest written before they were recorded, or labels that are no class ids)."""
    entries = manifest_entries(shards.manifest)
    total: list[int] = []
    for path in shards.files:
        counts = entries[posixpath.basename(path)][2].get("label_counts")
        if counts is None:
            return None
        total = [a + b for a, b in zip(total + [0] * (len(counts) - len(total)),
                                       counts + [0] * (len(total) - len(counts)), strict=True)]
    return total


def check_declared(declared: dict[str, FeatureSpec] | None, shards: Shards) -> None:
    """Refuses a spec whose `data.features` differ from the manifest; names each feature and both schemas."""
    if declared is None:
        return
    found = shards.features
    manifest_path = posixpath.join(posixpath.dirname(shards.pattern), MANIFEST)
    problems = []
    for name, spec_feature in declared.items():
        mine = schema.from_dict(spec_feature.to_dict(), f"data.features.{name}")
        if name not in found:
            problems.append(
                f"data.features.{name}: the spec declares {schema.describe(mine)}, but {manifest_path} has no feature "
                f"{name!r} (it has: {', '.join(sorted(found))})"
            )
        elif schema.stored(found[name]) != mine:
            problems.append(
                f"data.features.{name}: the spec declares {schema.describe(mine)}, but {manifest_path} says "
                f"{schema.describe(found[name])}"
            )
    if problems:
        raise DataError(
            "\n".join(problems) + "\nfix data.features in the spec, or re-write the manifest from it with "
            "`runner manifest SPEC --force` if the records changed"
        )


def listed_in(shards: Shards) -> list[Listed]:
    """The manifest's entries for the shards a pattern matched."""
    folder = posixpath.dirname(shards.pattern)
    entries = manifest_entries(shards.manifest)
    return [_listed(folder, *entries[posixpath.basename(f)]) for f in shards.files]


def _listed(folder: str, split: str, index: int, entry: dict[str, Any]) -> Listed:
    path = posixpath.join(folder, entry["file"])
    where = f"{posixpath.join(folder, MANIFEST)}: splits.{split}.shards[{index}]"
    return Listed(path, where, entry["records"], entry.get("bytes"), entry.get("sha256"))


def verify_folder(
    folder: str, splits: Iterable[str] | None = None, mode: str = "sha256"
) -> tuple[Checked, dict[str, Any]]:
    """Every shard the manifest lists (in `splits`, else all), checked by check_bytes; and the manifest."""
    manifest = read_manifest(folder)
    wanted = None if splits is None else set(splits)
    listed = [
        _listed(folder, split, index, entry)
        for split, index, entry in manifest_entries(manifest).values()
        if wanted is None or split in wanted
    ]
    return check_bytes(listed, mode), manifest


def verify_shards(folder: str, splits: Iterable[str] | None = None) -> list[str]:
    """Checks every shard listed in the manifest: present, same size and sha256. Returns the problems found."""
    return verify_folder(folder, splits)[0].problems


def corrupt_shards(pattern: str) -> list[str]:
    """The shards matching `pattern` whose bytes differ from the manifest: names the file a read failed on."""
    return check_bytes(listed_in(find_shards(pattern)), "sha256").problems


# --- reading examples --------------------------------------------------------------------------


def _decoder(features: dict[str, Feature], inputs: tuple[str, ...], label: str, preprocess: Callable | None = None):
    used = {n: features[n] for n in (*inputs, label)}

    def decode(serialized: tf.Tensor):
        # Uint8 features arrive as float32, var-len ones padded: static shapes (see runner/data/schema.py).
        parsed = schema.parse_batch(serialized, used)
        if preprocess is not None:
            parsed = preprocess(parsed)
        return model_inputs(parsed, inputs), parsed[label]

    return schema.plain(decode, preprocess)


def example_inputs(features: dict[str, Feature], inputs: tuple[str, ...], preprocess: Callable | None = None):
    """serialized Examples -> the model's inputs, as in training but without a label (the SavedModel's
    `serve_examples`, runner/rundir/serving.py)."""
    used = {n: features[n] for n in inputs}

    def to_inputs(serialized: tf.Tensor):
        parsed = schema.parse_batch(serialized, used)
        if preprocess is not None:
            parsed = preprocess(parsed)
        return model_inputs(parsed, inputs)

    return schema.plain(to_inputs, preprocess)


def model_inputs(parsed: dict[str, tf.Tensor], inputs: tuple[str, ...]):
    """One input: its tensor; several: a dict by name (the model's named inputs)."""
    return parsed[inputs[0]] if len(inputs) == 1 else {n: parsed[n] for n in inputs}


def check_columns(shards: Shards, inputs: tuple[str, ...], label: str) -> None:
    for key, name in [*(("data.inputs", n) for n in inputs), ("data.label", label)]:
        if name not in shards.features:
            raise DataError(
                f"{key} names feature {name!r}, but the manifest for {shards.pattern!r} has: "
                f"{', '.join(sorted(shards.features))}"
            )


MAX_OPEN_SHARDS = 16
# Records a shard reader hands over at a time (at most): see block_for.
MAX_READ_BLOCK = 64


def block_for(batch_size: int, cycle: int) -> int:
    """How many consecutive records each shard reader hands to the interleave at a time.

    Handing records over one by one costs a cross-thread handoff each: blocks of 64 made the MNIST training
    pipeline (batch 1024, 6 shards) 1.84x faster, 315,000 records/s vs 172,000 on 2 cores, with 1.60 CPU-s
    per 5 epochs instead of 2.56 (benchmarks/input_pipeline.py). A batch still draws on every open shard
    about equally as long as a block is at most batch_size / cycle records, so that bounds it.
    """
    return max(1, min(MAX_READ_BLOCK, batch_size // max(cycle, 1)))


def _interleave_records(files: tf.data.Dataset, cycle: int, block: int, deterministic: bool) -> tf.data.Dataset:
    """Serialized records of `cycle` shards read in parallel, `block` consecutive records of one shard at a time."""
    if block == 1:
        read = tf.data.TFRecordDataset
    else:

        def read(path: tf.Tensor) -> tf.data.Dataset:
            return tf.data.TFRecordDataset(path).batch(block)

    records = files.interleave(
        schema.plain(read), cycle_length=cycle, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic
    )
    return records if block == 1 else records.unbatch()


def make_dataset(
    shards: Shards,
    batch_size: int,
    inputs: tuple[str, ...],
    label: str,
    training: bool,
    shuffle_buffer: int = 0,
    seed: int | None = None,
    preprocess: Callable[[dict[str, tf.Tensor]], dict[str, tf.Tensor]] | None = None,
    workers: int = 1,
    autotune: bool = False,
    block: int | None = None,
    weighted: bool = False,
    share: tuple[int, int] = (0, 1),
) -> tf.data.Dataset:
    """Batches of (inputs, label) from the shards; training data repeats forever and is shuffled.

    `share` (this process's index, the job's processes): each process makes its batch_size / processes part of
    every batch (`host_share` says how it is divided).

    `weighted` (evaluation and validation): batches of (inputs, label, sample weight) holding every record
    exactly once, in eval_steps() batches: the last batch is padded to the full batch size (TPUs need one
    static shape) and its padding weighs 0 in every metric and in the loss (see _weighted_records).
    Without it, the records that do not fill a last batch are left out.

    `preprocess` (data.preprocess) gets each decoded batch as a dict of tensors and returns the dict.

    `autotune` (data.autotune) turns on tf.data's model-based autotuner. It is off by default: its thread
    sleeps between tuning rounds (20 ms doubling up to 60 s) and destroying the iterator waited for that
    sleep to end, so `model.fit` returned up to a minute after its last epoch. Off, AUTOTUNE parallelism
    means one call per core; training ran as fast either way (benchmarks/autotune_teardown.py).

    `block`: records each shard reader hands over at a time, block_for(batch_size, shards open) unless
    given; 1 hands them over one by one.
    """
    check_columns(shards, inputs, label)
    if preprocess is not None:
        schema.check_preprocess(preprocess, shards.features, (*inputs, label))
    index, processes = share
    by = host_share(shards, processes, training)
    names = list(shards.files)[index::processes] if by == "files" else list(shards.files)
    files = tf.data.Dataset.from_tensor_slices(names)
    if training:
        files = files.shuffle(len(names), seed=seed, reshuffle_each_iteration=True)
    cycle = min(len(names), MAX_OPEN_SHARDS)
    # Records shared out by position need one order on every process: a deterministic read. One shard has
    # nothing to interleave: its order is kept too, so that a run of it is repeatable, on any number of processes.
    ordered = not training or by == "records" or len(names) == 1
    records = _interleave_records(files, cycle, block or block_for(batch_size, cycle), deterministic=ordered)
    if training:
        if shuffle_buffer > 1:
            records = records.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        records = records.repeat()
    decode = _decoder(shards.features, inputs, label, preprocess)
    if weighted:
        if training:
            raise ValueError("weighted batches are for evaluation: training=False")
        records = _weighted_records(records, shards, batch_size)
        decode = _weighted(decode, preprocess)
    if by == "records":
        # Process i keeps records i, i+n, ...: its batch k and the others' make up the job's batch k exactly.
        records = records.shard(processes, index)
    batch_size //= processes
    # TPUs need static shapes: every batch is full (evaluation pads its last one, see above).
    batches = records.batch(batch_size, drop_remainder=True)
    batches = batches.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    # Multi-worker: each worker reads its own files when there are enough to go round, else every
    # worker reads all files and keeps its share of the records. Weighted (evaluation) batches are
    # padded for the whole split, so every worker reads all of it and keeps its share of the batches.
    enough = len(shards.files) >= workers and not weighted
    policy = tf.data.experimental.AutoShardPolicy.FILE if enough else tf.data.experimental.AutoShardPolicy.DATA
    options.experimental_distribute.auto_shard_policy = policy
    options.autotune.enabled = autotune
    options.deterministic = ordered
    return batches.with_options(options).prefetch(tf.data.AUTOTUNE)


def host_share(shards: Shards, processes: int, training: bool) -> str | None:
    """How the processes of a job divide a split: None (one process); "files" (training with at least as many
    shards as processes: each reads only its own, shards i, i+n, ...); else "records" (each reads every shard
    in one order and keeps every n-th record: evaluation always, so that each process's padded batches add up
    to the job's)."""
    if processes == 1:
        return None
    return "files" if training and len(shards.files) >= processes else "records"


def _weighted_records(records: tf.data.Dataset, shards: Shards, batch_size: int) -> tf.data.Dataset:
    """(serialized record, sample weight): the split's records, then copies of its first record as padding
    up to eval_steps() whole batches.

    Real records weigh padded / records, padding 0. Any constant weight gives the weighted metrics (mean of
    value x weight over the sum of the weights) their exact value over the real records. The loss needs this
    one: Keras reduces a batch's weighted losses over the batch size, not the sum of the weights, and then
    averages batches by their size, so the evaluated loss is sum(loss x weight) / padded = the mean over
    the records. Both hold on any number of replicas: each reduces its share the same way.
    A split holding more or fewer records than its manifest says fails the read (assert_cardinality)
    instead of being evaluated on what was there.
    """
    padded = eval_steps(shards, batch_size, "evaluation") * batch_size
    weight = tf.constant(padded / shards.records, tf.float32)
    counted = records.apply(tf.data.experimental.assert_cardinality(shards.records))
    real = counted.map(schema.plain(lambda record: (record, weight)))
    if padded == shards.records:
        return real
    padding = records.take(1).repeat(padded - shards.records)
    padding = padding.map(schema.plain(lambda record: (record, tf.constant(0.0))))
    return real.concatenate(padding)


def _weighted(decode: Callable, preprocess: Callable | None):
    def decode_weighted(serialized: tf.Tensor, weight: tf.Tensor):
        return (*decode(serialized), weight)

    return schema.plain(decode_weighted, preprocess)


def eval_steps(shards: Shards, batch_size: int, key: str) -> int:
    """Batches that evaluate every record of the shards once (the last one padded: make_dataset `weighted`)."""
    if shards.records == 0:
        raise DataError(f"{key}: {shards.pattern!r} holds no records to evaluate on (its manifest lists 0)")
    return -(-shards.records // batch_size)


def steps_in(shards: Shards, batch_size: int, key: str) -> int:
    steps = shards.records // batch_size
    if steps == 0:
        raise DataError(
            f"{key}: {shards.records} records in {shards.pattern!r} make no full batch of "
            f"data.global_batch_size ({batch_size}); set data.global_batch_size to at most {shards.records} or add data"
        )
    return steps


def split_of(pattern: str, manifest: dict[str, Any]) -> str | None:
    """The manifest split whose shards the pattern names, if one does."""
    base = posixpath.basename(pattern)
    for split, info in manifest["splits"].items():
        if any(fnmatch.fnmatch(e["file"], base) for e in info["shards"]):
            return split
    return None
