"""A job's input pipelines, built once from the shards the data check found: the training batches (held in
memory or streamed), and the evaluation and per-epoch validation batches when the spec asks for them.

What Keras fit reads besides the inputs and the label is settled here too: train.sample_weight's feature
split off as the batches' sample weights, the labels one-hot encoded for a loss that takes them
(`encode_labels`), whether and how often to validate (`validation_every`), and the class weights."""

from __future__ import annotations

import dataclasses
import logging

import keras
import tensorflow as tf

from runner import DataError, SpecError
from runner.data import in_memory, integrity, pipeline, schema, splits
from runner.device import host
from runner.device.accelerator import Accelerator
from runner.rundir.attempt import Facts
from runner.spec import usercode
from runner.spec.train import AUTO_VALIDATION_SHARE, TrainSpec
from runner.spec.types import JobSpec
from runner.train import build, observe

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Evaluation:
    """Weighted batches holding every record of a split once, the last batch padded (runner/data/pipeline.py)."""

    dataset: tf.data.Dataset
    steps: int
    records: int


@dataclasses.dataclass
class Inputs:
    """The job's input pipelines: training batches, and the evaluation and per-epoch validation batches."""

    train: pipeline.Shards
    train_ds: tf.data.Dataset
    steps_per_epoch: int
    eval: Evaluation | None
    validation: Evaluation | None
    preprocess: object
    clock: observe.InputClock | None
    input_method: str
    class_weight: dict[int, float] | None = None
    callbacks: list = dataclasses.field(default_factory=list)  # the user's own (train.callbacks), built
    validation_every: int | None = None  # Keras fit's validation_freq; None: no per-epoch validation
    unclocked: tf.data.Dataset | None = None  # train_ds before the input clock's stage

    def encode_labels(self, classes: int | None) -> None:
        """One-hot labels of `classes` classes in every pipeline (runner/train/build.py `label_classes`: a loss
        that takes one-hot labels, records that hold class ids); None leaves them as stored."""
        if classes is None:
            return
        log.info("train.loss takes one-hot labels: the class ids are one-hot encoded to %d classes", classes)
        self.train_ds = one_hot_labels(self.unclocked or self.train_ds, classes)
        if self.clock is not None:
            self.train_ds = self.clock.wrap(self.train_ds)
        for split in {id(s): s for s in (self.eval, self.validation) if s is not None}.values():
            split.dataset = one_hot_labels(split.dataset, classes)


def make_inputs(spec: JobSpec, shards: dict[str, pipeline.Shards], accelerator: Accelerator, facts: Facts) -> Inputs:
    """The pipelines over `shards` (by spec key, from runner/data/integrity.py's check). The summary's
    train_input is recorded in `facts` as soon as it is decided, so a load that fails is reported with it."""
    batch, workers, d = spec.data.global_batch_size, accelerator.workers, spec.data
    # Under JAX each process makes its own part of every batch (runner/data/pipeline.py `host_share`).
    share = accelerator.engine.input_share(accelerator.worker_index, workers)
    preprocess = (
        usercode.load_callable(d.preprocess, "data.preprocess", ("features",), spec.code_roots)
        if d.preprocess
        else None
    )

    weight = spec.train.sample_weight
    # The weight feature is decoded beside the model's inputs, then split off (with_sample_weight).
    read = (*d.inputs, weight) if weight else d.inputs

    def weighed(dataset: tf.data.Dataset) -> tf.data.Dataset:
        return with_sample_weight(dataset, d.inputs, weight) if weight else dataset

    def evaluation(key: str) -> Evaluation:
        steps = pipeline.eval_steps(shards[key], batch, key)
        dataset = pipeline.make_dataset(
            shards[key], batch, read, d.label, training=False, preprocess=preprocess, workers=workers,
            autotune=d.autotune, weighted=True, share=share,
        )
        return Evaluation(weighed(dataset), steps, shards[key].records)

    train_shards = shards["data.train"]
    steps_per_epoch = spec.train.steps_per_epoch or pipeline.steps_in(train_shards, batch, "data.train")
    columns = (*read, d.label)
    held = in_memory.choose(d.in_memory, train_shards, columns, accelerator.kind, workers, host.memory_bytes(), batch)
    facts.train_input = held.to_dict()
    if held.held:
        log.info("loading data.train into memory: %d records (%s)", train_shards.records, held.why)
        loaded = in_memory.load(train_shards, columns, "data.train")
        held = dataclasses.replace(held, load_s=round(loaded.seconds, 3))
        facts.train_input = held.to_dict()
        log.info("data.train held in memory: %d records loaded in %.1f s", loaded.records, loaded.seconds)
        train_ds = in_memory.make_dataset(
            loaded, train_shards.features, batch, read, d.label, shuffle=d.shuffle_buffer > 1,
            seed=spec.train.seed, preprocess=preprocess,
        )
    else:
        train_ds = pipeline.make_dataset(
            train_shards, batch, read, d.label, training=True, shuffle_buffer=d.shuffle_buffer,
            seed=spec.train.seed, preprocess=preprocess, workers=workers, autotune=d.autotune, share=share,
        )
    unclocked = train_ds = weighed(train_ds)
    clock, input_method = observe.input_clock_for(accelerator)
    if clock is not None:
        train_ds = clock.wrap(train_ds)
    eval_ = evaluation("data.eval") if "data.eval" in shards else None
    # data.validation (or the validation split beside data.train), else the eval shards, watched only: nothing
    # selects on them (runner/data/splits.py).
    key = "data.validation" if "data.validation" in shards else "data.eval" if eval_ else None
    every = validation_every(spec.train, key, shards[key].records if key else 0, steps_per_epoch * batch)
    validation = None
    if every is not None:
        validation = evaluation(key) if key == "data.validation" else eval_
    callbacks = user_callbacks(spec)
    watching = monitoring_validation(callbacks)
    if watching and not splits.apart({k: s.pattern for k, s in shards.items()}):
        # data.eval must never choose (runner/data/splits.py)
        raise splits.refusal(*watching[0], d.train, getattr(shards.get("data.validation"), "pattern", None))
    selectors = [*spec.train.selects_on_validation(), *(k for k, _ in watching)]
    facts.splits = splits.record(spec, shards, key if every is not None else None, selectors)
    if share[1] > 1:
        facts.processes = {**(facts.processes or {}), "data": shared_out(shards, *share)}
    return Inputs(
        train_shards, train_ds, steps_per_epoch, eval_, validation, preprocess, clock, input_method,
        class_weight_of(spec.train.class_weight, train_shards), callbacks, every, unclocked,
    )


def shared_out(shards: dict[str, pipeline.Shards], index: int, processes: int) -> dict:
    """How the job's processes divided each split (runner/data/pipeline.py `host_share`), for the summary."""
    found = {}
    for key, split in shards.items():
        by = pipeline.host_share(split, processes, training=key == "data.train")
        entry = {"by": by, "shards": len(split.files)}
        if by == "files":
            entry["shards_per_process"] = [len(split.files[i::processes]) for i in range(processes)]
        found[key] = entry
    return found


def evaluation_batches(spec: JobSpec, shards: pipeline.Shards, batch: int, preprocess, model, key: str):
    """Every record of `shards` once, as a trained `model` is evaluated in the job (`runner evaluate`): padded
    and weighted, train.sample_weight's weights split off, labels one-hot for a loss that takes them."""
    d, weight = spec.data, spec.train.sample_weight
    integrity.check_sample_weight(weight, shards, key, d.label)
    dataset = pipeline.make_dataset(
        shards, batch, (*d.inputs, weight) if weight else d.inputs, d.label, training=False, preprocess=preprocess,
        autotune=d.autotune, weighted=True,
    )
    if weight:
        dataset = with_sample_weight(dataset, d.inputs, weight)
    classes = build.label_classes(spec.train, shards.features.get(d.label), model)
    return dataset if classes is None else one_hot_labels(dataset, classes)


def validation_every(train: TrainSpec, key: str | None, records: int, per_epoch: int) -> int | None:
    """Keras fit's validation_freq for train.validation_every, None for no per-epoch validation; `key`: the
    split validated on (None: the job has none), holding `records`; `per_epoch`: the records one epoch trains.
    auto's decision is logged with its figures."""
    asked = train.validation_every
    if asked == "never" or key is None:
        return None
    if asked != "auto":
        return asked
    share = records / per_epoch
    figures = (f"{key} holds {records:,} records, {share:.1%} of the {per_epoch:,} one epoch trains "
               f"(auto validates at most {AUTO_VALIDATION_SHARE:.0%})")
    if asking := train.needs_validation():
        log.info("train.validation_every auto: every epoch, as %s watches val_loss; %s", asking, figures)
        return 1
    if key == "data.validation":
        # The job's own validation split: Keras's validation_data runs after every epoch, and so does this.
        log.info("train.validation_every auto: every epoch, as Keras's validation_data: %s is the job's validation "
                 "split (%s records, %.1f%% of the %s one epoch trains: about %.1f%% more work per epoch, a "
                 "validation step being a forward pass only; the summary's timing.eval_s measures it); "
                 "train.validation_every: never turns it off", key, f"{records:,}", share * 100, f"{per_epoch:,}",
                 share * 100 / 3)
        return 1
    if share <= AUTO_VALIDATION_SHARE:
        log.info("train.validation_every auto: every epoch: %s", figures)
        return 1
    log.info("train.validation_every auto: never: %s; set train.validation_every: N to validate", figures)
    return None


def with_sample_weight(dataset: tf.data.Dataset, inputs: tuple[str, ...], weight: str) -> tf.data.Dataset:
    """Batches decoded with train.sample_weight's feature among the inputs, as (inputs, label, weight): the
    feature leaves the inputs and weighs each record; an evaluation batch's padding weight (0 for padding,
    runner/data/pipeline.py) is multiplied in. A negative or non-finite weight stops the read (a DataError
    naming the shards, exit 2: runner/data/faults.py `input_error`)."""

    def split(features: dict[str, tf.Tensor], label: tf.Tensor, *padding: tf.Tensor):
        weights = tf.cast(features[weight], tf.float32)
        # One weight a record is a vector of the batch; one a token (a language model's target_mask) stays (B, T).
        per_token = weights.shape.rank == 2 and weights.shape[-1] != 1
        weights = weights if per_token else tf.reshape(weights, [-1])
        valid = tf.reduce_all(tf.math.is_finite(weights) & (weights >= 0))
        # No ": " in the message: input_error keeps what follows the last one.
        checked = tf.debugging.Assert(
            valid, [f"train.sample_weight feature {weight} holds a negative or non-finite weight (each must be >= 0)"]
        )
        with tf.control_dependencies([checked]):
            weights = tf.identity(weights if not padding else weights * (padding[0][:, None] if per_token else
                                                                          padding[0]))
        return pipeline.model_inputs(features, inputs), label, weights

    return dataset.map(schema.plain(split), num_parallel_calls=tf.data.AUTOTUNE)


def one_hot_labels(dataset: tf.data.Dataset, classes: int) -> tf.data.Dataset:
    """Batches whose class-id labels are one-hot (float32, `classes` wide); sample weights kept."""

    def encode(features, label, *weights):
        return (features, tf.one_hot(tf.reshape(tf.cast(label, tf.int32), [-1]), classes), *weights)

    return dataset.map(schema.plain(encode), num_parallel_calls=tf.data.AUTOTUNE)


def class_weight_of(asked: dict[int, float] | str | None, shards: pipeline.Shards) -> dict[int, float] | None:
    """train.class_weight as Keras fit takes it; `balanced` from the manifest's label counts."""
    if asked != "balanced":
        return dict(asked) if asked else None
    counts = pipeline.label_counts(shards)
    if not counts:
        raise DataError(
            f"train.class_weight: balanced needs the records per class, which the manifest beside "
            f"{shards.pattern} does not list (label_counts): write it again with `runner prepare` (a built-in or "
            "your own data) or `runner manifest SPEC --force` (SPEC: this job's spec file, data.features declared), "
            "or give the weights as {class id: weight}"
        )
    total, classes = sum(counts), len(counts)
    weights = {index: (total / (classes * n) if n else 1.0) for index, n in enumerate(counts)}
    log.info("train.class_weight balanced: %s", ", ".join(f"{k}: {v:.3g}" for k, v in weights.items()))
    return weights


def monitoring_validation(callbacks: list) -> list[tuple[str, str]]:
    """(train.callbacks[i], metric) for each of the user's callbacks that acts on a `val_` metric (Keras's
    EarlyStopping, ReduceLROnPlateau and ModelCheckpoint keep it in `monitor`)."""
    return [
        (f"train.callbacks[{index}]", monitor) for index, callback in enumerate(callbacks)
        if isinstance(monitor := getattr(callback, "monitor", None), str) and monitor.startswith("val_")
    ]


def user_callbacks(spec: JobSpec) -> list:
    """train.callbacks: each `package.module:Class` imported from the spec's code roots and called with no
    arguments; it must give a Keras callback."""
    built = []
    for index, path in enumerate(spec.train.callbacks):
        key = f"train.callbacks[{index}]"
        make = usercode.load_callable(path, key, (), spec.code_roots)
        try:
            callback = make()
        except Exception as exc:  # the user's code refused to start: a start-up error, not training
            raise SpecError(
                f"{key}: {path!r} raised {type(exc).__name__} when called with no arguments: {exc}"
            ) from exc
        if not isinstance(callback, keras.callbacks.Callback):
            raise SpecError(
                f"{key}: {path!r} gave a {type(callback).__name__}, not a keras.callbacks.Callback (subclass "
                "tf.keras.callbacks.Callback, and take no arguments in __init__)"
            )
        built.append(callback)
    return built
