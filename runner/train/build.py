"""The model a job trains, evaluates and predicts with: built (a built-in one from runner/models.py's table, or
the user's own build function), compiled with the spec's optimizer, loss and metrics, and restored from a
checkpoint. Training, evaluation and prediction share it.
"""

from __future__ import annotations

import logging
from typing import Any

import tensorflow as tf

from runner import SpecError, models
from runner.data.schema import Feature
from runner.device import precision
from runner.spec import usercode
from runner.spec.types import JobSpec

keras = tf.keras
log = logging.getLogger(__name__)

_OPTIMIZERS = {
    "adam": lambda lr: keras.optimizers.Adam(learning_rate=lr),
    "adamw": lambda lr: keras.optimizers.AdamW(learning_rate=lr),
    "sgd": lambda lr: keras.optimizers.SGD(learning_rate=lr, momentum=0.9),
    "rmsprop": lambda lr: keras.optimizers.RMSprop(learning_rate=lr),
}


def build_model(spec: JobSpec, features: dict[str, Feature]) -> keras.Model:
    """Builds the spec's model; call inside the strategy's scope so variables are placed on its devices.

    A `package.module:function` name is imported here, inside the scope, so a module that creates
    variables when imported places them on the strategy's devices too.
    """
    if usercode.is_import_path(spec.model.name):
        return _build_user_model(spec.model.name, dict(spec.model.params), features, spec.data.inputs, spec.code_roots)
    return models.build(spec.model.name, dict(spec.model.params), features, spec.data.inputs)


def _build_user_model(
    path: str, params: dict[str, Any], features: dict[str, Feature], inputs: tuple[str, ...], roots: usercode.CodeRoots
) -> keras.Model:
    build = usercode.load_callable(path, "model.name", ("params", "features", "inputs"), roots)
    try:
        model = build(params, features, inputs)
    except Exception as exc:  # the user's code refused these params or features: a start-up error, not training
        raise SpecError(
            f"model.name: {path!r} raised {type(exc).__name__} while building: {exc} "
            f"(model.params: {params}, data.inputs: {list(inputs)})"
        ) from exc
    if not isinstance(model, keras.Model):
        found = f"{type(model).__module__}.{type(model).__qualname__}"
        raise SpecError(
            f"model.name: {path!r} returned a {found}; return an uncompiled keras.Model built with tf.keras "
            f"(here {keras.Model.__module__}: Keras 3, or tf-keras on TPU images and multi-worker runs)"
        )
    return model


def _loss_or_metric(value: str, key: str, roots: usercode.CodeRoots) -> Any:
    """A Keras name stays a name; `package.module:function` becomes the imported (y_true, y_pred) function."""
    if usercode.is_import_path(value):
        return usercode.load_callable(value, key, ("y_true", "y_pred"), roots)
    return value


def steps_per_execution(spec: JobSpec, accelerator_kind: str) -> int:
    """The spec's value, or for `auto` 32 on a TPU (dividing checkpoint.every_steps when set) and 1 elsewhere."""
    value = spec.train.steps_per_execution
    if value != "auto":
        return value
    if accelerator_kind != "tpu":
        return 1
    every = spec.checkpoint.every_steps
    return max(n for n in range(1, 33) if every is None or every % n == 0)


def compile_model(model: keras.Model, spec: JobSpec, accelerator_kind: str = "cpu") -> None:
    model.compile(
        optimizer=_OPTIMIZERS[spec.train.optimizer](spec.train.learning_rate),
        loss=_loss_or_metric(spec.train.loss, "train.loss", spec.code_roots),
        # Weighted: evaluation pads its last batch with records of sample weight 0 (runner/data/pipeline.py), and
        # Keras hands sample weights only to weighted_metrics. Same names; unweighted training is unchanged.
        weighted_metrics=[_loss_or_metric(m, "train.metrics", spec.code_roots) for m in spec.train.metrics],
        steps_per_execution=steps_per_execution(spec, accelerator_kind),
    )


def build_compiled(
    spec: JobSpec, features: dict[str, Feature], accelerator: Any, chosen: precision.Precision | None = None
) -> tuple[keras.Model, tf.train.Checkpoint]:
    """The spec's model, built and compiled under the accelerator's strategy, and the checkpoint object that
    saves and restores its weights, optimizer state and step (training, evaluation and prediction share it).

    `chosen`: the precision the job set (runner/device/precision.py). The output layer stays float32: a model whose
    output is not is built again in float32 when `auto` chose bfloat16, and warned about when asked for."""
    with accelerator.strategy.scope():
        model = build_model(spec, features)
        if chosen is not None and chosen.policy != "float32" and (why := precision.output_not_float32(model)):
            if chosen.auto:
                chosen.fall_back(f"{chosen.reason}, but model {spec.model.name!r}: {why}: float32")
                model = build_model(spec, features)
            else:
                log.warning("train.mixed_precision %s: model %r: %s", chosen.policy, spec.model.name, why)
        compile_model(model, spec, accelerator.kind)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    return model, checkpoint


def restore(checkpoint: tf.train.Checkpoint, path: str) -> int:
    """Restores a checkpoint (weights, optimizer, step); returns the optimizer step it was saved at."""
    checkpoint.restore(path).expect_partial()
    return int(checkpoint.optimizer.iterations.numpy())
