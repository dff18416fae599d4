"""data.in_memory: the training split held in host memory, decoded, instead of streamed from its shards.

Why: where the host's cores also compute the training steps (a CPU, or a GPU machine with few cores), a
streaming pipeline reads, parses and batches every record every epoch on threads that take CPU from the
steps. Held, each batch is one gather of a block of shuffled indices: no reads, no parsing, no per-record
work. On 2 cores the weather job and the PNG Fashion-MNIST example waited for input 2.8% and 3.3% of their
training streamed, 1.3% and 1.1% held, and trained 1.14x and 1.34x faster (benchmarks/input_wait.py,
benchmarks/RESULTS.md).

    auto   held when one worker trains on a CPU or GPUs and the decoded split takes at most AUTO_MAX_BYTES
           and an eighth of the memory this process may use (runner/device/host.py: the machine's, or its
           container's limit); streamed otherwise, and on a TPU (not measured there).
    true   held; refused when it cannot be: several workers, a TPU, or more than half of the memory.
    false  streamed (runner/data/pipeline.py make_dataset).

What the model sees is what streaming gives it: the same decode (runner/data/schema.py), uint8 features cast to
float32 per batch (they are held as uint8), data.preprocess on every batch. The order differs: each pass over
the split is a fresh permutation of all of it (from train.seed and the pass number), cut into records // batch
full batches, so a pass holds every record at most once and the records left over change from pass to pass.
data.shuffle_buffer 0 or 1 keeps the records in shard order. Loading reads every record once, before
training: a record that cannot be decoded, or a split holding other than its manifest's count, stops the job
then, naming the shards.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import posixpath
import time
from collections.abc import Callable
from typing import Any, Literal

import tensorflow as tf

from runner import DataError, SpecError
from runner.data import faults, pipeline, schema

log = logging.getLogger(__name__)

# Above this auto streams: loading then takes seconds per GB, and a host's memory is shared with the model.
AUTO_MAX_BYTES = 1 << 30
_ITEM_BYTES = {"uint8": 1, "int64": 8, "float32": 4}
# Records parsed per tensor while loading: large enough that per-call costs vanish.
_LOAD_BLOCK = 4096


@dataclasses.dataclass(frozen=True)
class Choice:
    """Whether the training split is held in memory, and why (the summary's `train_input`)."""

    held: bool
    why: str
    bytes: int  # the decoded split's size as held (uint8 stays uint8)
    load_s: float | None = None  # reading and decoding it, when held

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "in_memory" if self.held else "streamed", "why": self.why, "bytes": self.bytes,
                "load_s": self.load_s}


def held_bytes(shards: pipeline.Shards, names: tuple[str, ...]) -> int:
    """The size of the named features of every record once decoded, as held. Text has no fixed size: a
    string feature counts as the shards' whole size (an upper bound of the text they hold)."""
    per_record, text = 0, False
    for name in names:
        full = schema.stored(shards.features[name])
        if full.dtype == "string":
            text = True
        else:
            per_record += _ITEM_BYTES[full.dtype] * math.prod(full.shape)
    total = per_record * shards.records
    if text:
        entries = pipeline.manifest_entries(shards.manifest)
        total += sum(int(entries[posixpath.basename(f)][2].get("bytes") or 0) for f in shards.files)
    return total


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:,.0f} MiB" if n >= 10 << 20 else f"{n / 2**20:.1f} MiB"


def choose(
    setting: bool | Literal["auto"], shards: pipeline.Shards, names: tuple[str, ...], kind: str, workers: int,
    memory: int | None, batch_size: int,
) -> Choice:
    """Whether to hold data.train in memory (see the module docstring); `memory`: what this process may use
    (host.memory_bytes()). Raises SpecError for `true` when the split cannot be held."""
    size = held_bytes(shards, names)
    if setting is False:
        return Choice(False, "data.in_memory: false", size)
    blocked = None
    if workers > 1:
        blocked = f"{workers} workers each read their share of the shards"
    elif kind == "tpu":
        blocked = "the job runs on a TPU, where holding the split in memory is not measured by this runner"
    elif shards.records < batch_size:  # a pass is whole batches; streamed, batches run across passes
        blocked = f"its {shards.records} records make no full batch of data.global_batch_size ({batch_size})"
    if setting is True:
        half = None if memory is None else memory // 2
        if blocked is None and half is not None and size > half:
            blocked = (f"the split takes {_size(size)} decoded, "
                       f"more than half of the {_size(memory)} this process may use")
        if blocked:
            raise SpecError(f"data.in_memory: true cannot be honoured: {blocked}; set data.in_memory: auto or false")
        return Choice(True, "data.in_memory: true", size)
    if blocked:
        return Choice(False, f"auto: streamed, {blocked}", size)
    limit = AUTO_MAX_BYTES if memory is None else min(AUTO_MAX_BYTES, memory // 8)
    if size > limit:
        return Choice(False, f"auto: streamed, the split takes {_size(size)} decoded, "
                             f"over auto's limit of {_size(limit)}", size)
    return Choice(True, f"auto: {_size(size)} decoded, within auto's limit of {_size(limit)}, one worker on {kind}",
                  size)


@dataclasses.dataclass(frozen=True)
class Held:
    """Every record of a split, decoded: one tensor per feature, records in shard order."""

    columns: dict[str, tf.Tensor]
    records: int
    seconds: float


def load(shards: pipeline.Shards, names: tuple[str, ...], key: str) -> Held:
    """Reads and decodes every record of the shards once (uint8 kept as uint8); a DataError names the shards
    when a record cannot be read or decoded, or their records are not the manifest's count."""
    used = {name: shards.features[name] for name in names}
    began = time.monotonic()
    files = tf.data.Dataset.from_tensor_slices(list(shards.files))

    def read(path: tf.Tensor) -> tf.data.Dataset:
        return tf.data.TFRecordDataset(path).batch(_LOAD_BLOCK).map(
            schema.plain(lambda block: schema.parse_stored(block, used)))

    # In shard order (deterministic), several shards read at once.
    blocks = files.interleave(schema.plain(read), cycle_length=min(len(shards.files), pipeline.MAX_OPEN_SHARDS),
                              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    parts: dict[str, list[tf.Tensor]] = {name: [] for name in used}
    try:
        for block in blocks:
            for name, tensor in block.items():
                parts[name].append(tensor)
    except tf.errors.OpError as exc:
        raise _load_error(exc, shards, key) from None
    columns = {name: tf.concat(tensors, axis=0) for name, tensors in parts.items()}
    records = int(columns[names[0]].shape[0])
    if records != shards.records:
        raise faults.miscounted(key, shards.pattern, str(records), shards.records)
    return Held(columns, records, time.monotonic() - began)


def _load_error(exc: tf.errors.OpError, shards: pipeline.Shards, key: str) -> DataError:
    if isinstance(exc, tf.errors.DataLossError):  # a damaged record: faults.input_error names the shard
        return faults.input_error(exc, shards.pattern, key)
    where = faults.suspect_shards(shards.pattern)
    reason = faults.tf_reason(exc.message) if exc.message.strip() else type(exc).__name__  # no TF wrapping
    return DataError(
        f"{key}: a record could not be decoded while loading it into memory ({reason}) in {where}; a record "
        "does not fit data.features: for your own records, `runner manifest SPEC --force` (SPEC: this job's spec "
        "file) names the record and what does not fit; a built-in dataset, `runner prepare` it again"
    )


def make_dataset(
    held: Held,
    features: dict[str, schema.Feature],
    batch_size: int,
    inputs: tuple[str, ...],
    label: str,
    shuffle: bool,
    seed: int,
    preprocess: Callable[[dict[str, tf.Tensor]], dict[str, tf.Tensor]] | None = None,
) -> tf.data.Dataset:
    """Training batches of (inputs, label) from the held split, repeating forever: pass after pass, each a
    permutation (or, without `shuffle`, the shard order) cut into records // batch_size full batches."""
    steps = held.records // batch_size
    if steps == 0:
        raise DataError(f"{held.records} records make no full batch of data.global_batch_size ({batch_size})")
    records, kept = held.records, steps * batch_size
    # Captured once: every batch reads these tensors in place; nothing is copied per pass.
    columns = held.columns

    def one_pass(index: tf.Tensor) -> tf.data.Dataset:
        order = tf.range(records, dtype=tf.int64)
        if shuffle:
            order = tf.random.experimental.stateless_shuffle(order, seed=tf.stack([tf.constant(seed, tf.int64), index]))
        return tf.data.Dataset.from_tensor_slices(tf.reshape(order[:kept], (steps, batch_size)))

    def take(indices: tf.Tensor):
        batch = schema.for_model({name: tf.gather(tensor, indices) for name, tensor in columns.items()}, features)
        if preprocess is not None:
            batch = preprocess(batch)
        return pipeline.model_inputs(batch, inputs), batch[label]

    if preprocess is not None:
        schema.check_preprocess(preprocess, features, (*inputs, label))
    options = tf.data.Options()
    options.autotune.enabled = False  # see runner/data/pipeline.py make_dataset: its tuner delays the end of fit
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # one worker
    passes = tf.data.Dataset.range(2**62)  # unending, as a streamed training split repeats
    # A batch is one gather: two ready ahead are enough for the step never to wait on the next.
    mapped = passes.flat_map(schema.plain(one_pass)).map(schema.plain(take, preprocess))
    return mapped.with_options(options).prefetch(2)
