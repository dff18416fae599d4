"""A job's input pipelines, built once from the shards the data check found: the training batches (held in
memory or streamed), and the evaluation and per-epoch validation batches when the spec asks for them."""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

from runner import DataError, SpecError
from runner.data import in_memory, pipeline
from runner.device import host
from runner.device.strategy import Accelerator
from runner.rundir.attempt import Facts
from runner.spec import usercode
from runner.spec.types import JobSpec
from runner.train import observe

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


def make_inputs(spec: JobSpec, shards: dict[str, pipeline.Shards], accelerator: Accelerator, facts: Facts) -> Inputs:
    """The pipelines over `shards` (by spec key, from runner/data/integrity.py's check). The summary's
    train_input is recorded in `facts` as soon as it is decided, so a load that fails is reported with it."""
    batch, workers, d = spec.data.global_batch_size, accelerator.workers, spec.data
    preprocess = (
        usercode.load_callable(d.preprocess, "data.preprocess", ("features",), spec.code_roots)
        if d.preprocess
        else None
    )

    def evaluation(key: str) -> Evaluation:
        steps = pipeline.eval_steps(shards[key], batch, key)
        dataset = pipeline.make_dataset(
            shards[key], batch, d.inputs, d.label, training=False, preprocess=preprocess, workers=workers,
            autotune=d.autotune, weighted=True,
        )
        return Evaluation(dataset, steps, shards[key].records)

    train_shards = shards["data.train"]
    steps_per_epoch = spec.train.steps_per_epoch or pipeline.steps_in(train_shards, batch, "data.train")
    columns = (*d.inputs, d.label)
    held = in_memory.choose(d.in_memory, train_shards, columns, accelerator.kind, workers, host.memory_bytes(), batch)
    facts.train_input = held.to_dict()
    if held.held:
        log.info("loading data.train into memory: %d records (%s)", train_shards.records, held.why)
        loaded = in_memory.load(train_shards, columns, "data.train")
        held = dataclasses.replace(held, load_s=round(loaded.seconds, 3))
        facts.train_input = held.to_dict()
        log.info("data.train held in memory: %d records loaded in %.1f s", loaded.records, loaded.seconds)
        train_ds = in_memory.make_dataset(
            loaded, train_shards.features, batch, d.inputs, d.label, shuffle=d.shuffle_buffer > 1,
            seed=spec.train.seed, preprocess=preprocess,
        )
    else:
        train_ds = pipeline.make_dataset(
            train_shards, batch, d.inputs, d.label, training=True, shuffle_buffer=d.shuffle_buffer,
            seed=spec.train.seed, preprocess=preprocess, workers=workers, autotune=d.autotune,
        )
    clock, input_method = observe.input_clock_for(accelerator)
    if clock is not None:
        train_ds = clock.wrap(train_ds)
    eval_ = evaluation("data.eval") if "data.eval" in shards else None
    validation = None
    if spec.train.validate_every_epoch:  # data.validation, else the eval shards (the spec checks one is set)
        validation = evaluation("data.validation") if "data.validation" in shards else eval_
    return Inputs(
        train_shards, train_ds, steps_per_epoch, eval_, validation, preprocess, clock, input_method,
        class_weight_of(spec.train.class_weight, train_shards), user_callbacks(spec),
    )


def class_weight_of(asked: dict[int, float] | str | None, shards: pipeline.Shards) -> dict[int, float] | None:
    """train.class_weight as Keras fit takes it; `balanced` from the manifest's label counts."""
    if asked != "balanced":
        return dict(asked) if asked else None
    counts = pipeline.label_counts(shards)
    if not counts:
        raise DataError(
            f"train.class_weight: balanced needs the records per class, which the manifest beside "
            f"{shards.pattern} does not list (label_counts): write it again with `runner prepare` (a built-in or "
            "your own data) or `runner manifest SPEC --force`, or give the weights as {class id: weight}"
        )
    total, classes = sum(counts), len(counts)
    weights = {index: (total / (classes * n) if n else 1.0) for index, n in enumerate(counts)}
    log.info("train.class_weight balanced: %s", ", ".join(f"{k}: {v:.3g}" for k, v in weights.items()))
    return weights


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
        if not isinstance(callback, tf.keras.callbacks.Callback):
            raise SpecError(
                f"{key}: {path!r} gave a {type(callback).__name__}, not a keras.callbacks.Callback (subclass "
                "tf.keras.callbacks.Callback, and take no arguments in __init__)"
            )
        built.append(callback)
    return built
