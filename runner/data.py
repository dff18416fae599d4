"""TFRecord shards: checking them against their manifest (`verify`) and reading them (`make_dataset`).
Writing them is `runner prepare`'s (runner/prepare/shards.py).

A prepared dataset is a folder (local or gs://) of `<split>-NNNNN-of-MMMMM.tfrecord` shards of
tf.train.Example plus `manifest.json`: the feature schema, and per shard its record count and sha256.
Every read and write goes through tf.io.gfile, so the same code serves a folder and a bucket.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import posixpath
from typing import Any, Callable, Iterable

import tensorflow as tf

from runner import schema
from runner.schema import Feature
from runner.errors import DataError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as handle:
        while chunk := handle.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()



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
    path = posixpath.join(folder, MANIFEST)
    try:
        with tf.io.gfile.GFile(path, "r") as handle:
            manifest = json.loads(handle.read())
    except tf.errors.NotFoundError:
        raise DataError(f"{path} not found: prepare the data with `runner prepare DATASET --out {folder}`") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise DataError(f"{path}: manifest_version {manifest.get('manifest_version')!r} is not {MANIFEST_VERSION}")
    return manifest


def find_shards(pattern: str) -> Shards:
    """Globs `pattern` and matches every file against the manifest beside it."""
    folder = posixpath.dirname(pattern)
    files = tuple(sorted(tf.io.gfile.glob(pattern)))
    if not files:
        raise DataError(f"no files match {pattern!r}; check data.train / data.eval or run `runner prepare`")
    manifest = read_manifest(folder)
    known = {e["file"]: e for split in manifest["splits"].values() for e in split["shards"]}
    unknown = [f for f in files if posixpath.basename(f) not in known]
    if unknown:
        raise DataError(f"{unknown[0]} matches {pattern!r} but is not listed in {folder}/{MANIFEST}")
    features = schema.features_from_manifest(manifest, posixpath.join(folder, MANIFEST))
    records = sum(known[posixpath.basename(f)]["records"] for f in files)
    return Shards(pattern, files, records, features, manifest)


def verify_shards(folder: str, splits: Iterable[str] | None = None) -> list[str]:
    """Checks every shard listed in the manifest: present, same sha256. Returns the problems found."""
    manifest = read_manifest(folder)
    problems = []
    for split, info in manifest["splits"].items():
        if splits is not None and split not in splits:
            continue
        for entry in info["shards"]:
            path = posixpath.join(folder, entry["file"])
            if not tf.io.gfile.exists(path):
                problems.append(f"{path}: missing")
            elif (digest := sha256_of(path)) != entry["sha256"]:
                problems.append(f"{path}: sha256 {digest[:12]}... does not match the manifest's {entry['sha256'][:12]}...")
    return problems


def corrupt_shards(pattern: str) -> list[str]:
    """The shards matching `pattern` whose bytes differ from the manifest: names the file a read failed on."""
    shards = find_shards(pattern)
    folder = posixpath.dirname(pattern)
    names = {posixpath.basename(f) for f in shards.files}
    return [p for p in verify_shards(folder) if posixpath.basename(p.split(": ")[0]) in names]


# --- reading examples --------------------------------------------------------------------------


def _decoder(features: dict[str, Feature], inputs: tuple[str, ...], label: str, preprocess: Callable | None = None):
    used = {n: features[n] for n in (*inputs, label)}

    def decode(serialized: tf.Tensor):
        # Uint8 features arrive as float32, var-len ones padded: static shapes (see runner/schema.py).
        parsed = schema.parse_batch(serialized, used)
        if preprocess is not None:
            parsed = preprocess(parsed)
        return _model_inputs(parsed, inputs), parsed[label]

    return decode


def example_inputs(features: dict[str, Feature], inputs: tuple[str, ...], preprocess: Callable | None = None):
    """serialized Examples -> the model's inputs, as in training but without a label (the SavedModel's
    `serve_examples`, runner/serving.py)."""
    used = {n: features[n] for n in inputs}

    def to_inputs(serialized: tf.Tensor):
        parsed = schema.parse_batch(serialized, used)
        if preprocess is not None:
            parsed = preprocess(parsed)
        return _model_inputs(parsed, inputs)

    return to_inputs


def _model_inputs(parsed: dict[str, tf.Tensor], inputs: tuple[str, ...]):
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

    records = files.interleave(read, cycle_length=cycle, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
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
) -> tf.data.Dataset:
    """Batches of (inputs, label) from the shards; training data repeats forever and is shuffled.

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
    files = tf.data.Dataset.from_tensor_slices(list(shards.files))
    if training:
        files = files.shuffle(len(shards.files), seed=seed, reshuffle_each_iteration=True)
    cycle = min(len(shards.files), MAX_OPEN_SHARDS)
    records = _interleave_records(files, cycle, block or block_for(batch_size, cycle), deterministic=not training)
    if training:
        if shuffle_buffer > 1:
            records = records.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        records = records.repeat()
    # TPUs need static shapes: every batch is full, the remainder of an epoch is dropped.
    batches = records.batch(batch_size, drop_remainder=True)
    batches = batches.map(_decoder(shards.features, inputs, label, preprocess), num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    # Multi-worker: each worker reads its own files when there are enough to go round, else every
    # worker reads all files and keeps its share of the records.
    enough = len(shards.files) >= workers
    policy = tf.data.experimental.AutoShardPolicy.FILE if enough else tf.data.experimental.AutoShardPolicy.DATA
    options.experimental_distribute.auto_shard_policy = policy
    options.autotune.enabled = autotune
    if training:
        options.deterministic = False
    return batches.with_options(options).prefetch(tf.data.AUTOTUNE)


def steps_in(shards: Shards, batch_size: int, key: str) -> int:
    steps = shards.records // batch_size
    if steps == 0:
        raise DataError(
            f"{key}: {shards.records} records in {shards.pattern!r} make no full batch of "
            f"data.global_batch_size ({batch_size}); lower the batch size or add data"
        )
    return steps


def split_of(pattern: str, manifest: dict[str, Any]) -> str | None:
    """The manifest split whose shards the pattern names, if one does."""
    base = posixpath.basename(pattern)
    for split, info in manifest["splits"].items():
        if any(fnmatch.fnmatch(e["file"], base) for e in info["shards"]):
            return split
    return None


# --- naming the shard behind an input error ----------------------------------------------------


def input_error(exc: Exception, pattern: str, key: str) -> DataError | None:
    """The DataError for a TensorFlow error that came out of the input pipeline of `key` (data.train,
    data.eval, data.validation: shards matching `pattern`), naming the shards that differ from their
    manifest; None for an error that did not come from the input."""
    if isinstance(exc, tf.errors.DataLossError):
        bad = corrupt_shards(pattern)
        where = "; ".join(bad) if bad else f"a shard matching {pattern!r} (all match the manifest: re-run `runner prepare`)"
        # Keras wraps the reader's error in "Graph execution error:" and a stack: keep the line about the record.
        lines = exc.message.splitlines()
        detail = next((line.strip() for line in lines if "record" in line.lower()), lines[0] if lines else "")
        what = {"data.train": "training", "data.eval": "evaluation", "data.validation": "validation"}.get(key, key)
        return DataError(f"corrupt {what} data in {where}: {detail}; the run stopped, checkpoints kept")
    # Keras tags the input iterator's op: only such errors are about a batch that could not be decoded.
    if not isinstance(exc, tf.errors.InvalidArgumentError) or "IteratorGetNext" not in exc.message:
        return None
    changed = corrupt_shards(pattern)
    # TensorFlow's line ends "...transformation with iterator: Iterator::Root::ParallelMapV2: <the reason>."
    lines = [line.strip() for line in exc.message.splitlines() if line.strip() and not line.strip().startswith("[[")]
    reason = next((line for line in lines if "transformation with iterator" in line), lines[-1] if lines else "")
    reason = reason.rsplit(": ", 1)[-1]
    where = f"shards that differ from their manifest: {'; '.join(changed)}" if changed else f"a shard matching {pattern!r}"
    return DataError(
        f"{key}: a batch could not be decoded ({reason}) in {where}; a record does not fit data.features, or "
        "data.preprocess failed on it: run `runner manifest` again for your own records (it names the record) "
        "or `runner prepare` for a built-in dataset; the run stopped, checkpoints kept"
    )
