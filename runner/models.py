"""The built-in models: MODELS maps a spec's `model.name` to a function that builds an uncompiled Keras model.

A build function takes the spec's `model.params` (a dict) and the input features (name -> Feature) and
returns a `keras.Model`. The table is explicit: no import-time registration.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any, Callable

import tensorflow as tf

from runner.device import precision
from runner.spec import usercode
from runner.data.schema import Feature
from runner import SpecError
from runner.spec.types import JobSpec

keras = tf.keras
log = logging.getLogger(__name__)


def _image_input(features: dict[str, Feature], inputs: tuple[str, ...]) -> tuple[Any, Any]:
    (name,) = inputs
    inp = keras.Input(shape=features[name].shape, name=name)
    # Pixels arrive as float32 in 0..255; rescaling inside the model keeps predict() on raw images honest.
    return inp, keras.layers.Rescaling(1.0 / 255)(inp)


def mnist_cnn(params: dict[str, Any], features: dict[str, Feature], inputs: tuple[str, ...]) -> keras.Model:
    """The Basic CNN of the classic Colab TPU MNIST example."""
    params = _params(params, {"classes": 10}, "mnist_cnn")
    layers = keras.layers
    inp, x = _image_input(features, inputs)
    x = layers.Conv2D(64, 2, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Dropout(0.3)(x)
    x = layers.Conv2D(32, 2, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Dropout(0.3)(x)
    x = layers.Flatten()(x)
    x = layers.Dense(256, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    # The output stays float32 under mixed precision: softmax in bfloat16 loses the small probabilities.
    out = layers.Dense(params["classes"], activation="softmax", dtype="float32")(x)
    return keras.Model(inp, out, name="mnist_cnn")


def _params(params: dict[str, Any], defaults: dict[str, Any], model: str) -> dict[str, Any]:
    """The model's params over its defaults; an unknown key is an error, never a silently ignored typo."""
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        close = difflib.get_close_matches(unknown[0], defaults, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SpecError(f"model.params: {model} has no param {unknown[0]!r}{hint} (it takes: {', '.join(defaults)})")
    return {**defaults, **params}


def _one_input(features: dict[str, Feature], inputs: tuple[str, ...], dtype: str, rank: int, model: str, what: str) -> Any:
    """The model's single input layer, after checking the feature is what the model reads."""
    feature = features[inputs[0]] if len(inputs) == 1 else None
    if feature is None or feature.dtype != dtype or len(feature.shape) != rank:
        got = f"{len(inputs)} inputs" if feature is None else f"{inputs[0]!r}: {feature.dtype} {list(feature.shape)}"
        raise SpecError(f"model.name: {model} reads one {dtype} feature of {what}; data.inputs gives {got}")
    return keras.Input(shape=feature.shape, dtype=dtype, name=inputs[0])


def cifar10_cnn(params: dict[str, Any], features: dict[str, Feature], inputs: tuple[str, ...]) -> keras.Model:
    """The CIFAR-10 CNN of the classic Colab TPU example: (BatchNorm, Conv x2, pool, dropout) x2, Dense 512."""
    p = _params(params, {"classes": 10}, "cifar10_cnn")
    layers = keras.layers
    inp, x = _image_input(features, inputs)
    for filters in (32, 64):
        x = layers.BatchNormalization()(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D(2)(x)
        x = layers.Dropout(0.25)(x)
    x = layers.Flatten()(x)
    x = layers.Dense(512, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    out = layers.Dense(p["classes"], activation="softmax", dtype="float32")(x)
    return keras.Model(inp, out, name="cifar10_cnn")


def imdb_lstm(params: dict[str, Any], features: dict[str, Feature], inputs: tuple[str, ...]) -> keras.Model:
    """The IMDB sentiment LSTM: word ids -> Embedding(15000, 32) -> LSTM(100) -> probability of positive."""
    p = _params(params, {"vocab_size": 15000, "embedding_dim": 32, "units": 100}, "imdb_lstm")
    layers = keras.layers
    inp = _one_input(features, inputs, "int64", 1, "imdb_lstm", "token ids [length] (runner prepare imdb)")
    # Ids at or above vocab_size fail on a CPU but read as zeros on a TPU: the data's vocab_size must match.
    x = layers.Embedding(p["vocab_size"], p["embedding_dim"])(inp)
    x = layers.LSTM(p["units"])(x)
    out = layers.Dense(1, activation="sigmoid", dtype="float32")(x)
    return keras.Model(inp, out, name="imdb_lstm")


_RNN_CELLS = {"gru": keras.layers.GRU, "lstm": keras.layers.LSTM}


def weather_rnn(params: dict[str, Any], features: dict[str, Feature], inputs: tuple[str, ...]) -> keras.Model:
    """Past hours of weather [window, features] -> GRU or LSTM -> the next hour's value (a regression).

    With `target_feature` (the target's column among the inputs, manifest `preprocessing.target_index`)
    the network predicts the change from the last hour, starting out as the persistence forecast.
    """
    p = _params(params, {"cell": "gru", "units": 64, "dropout": 0.0, "target_feature": None}, "weather_rnn")
    if p["cell"] not in _RNN_CELLS:
        raise SpecError(f"model.params.cell: {p['cell']!r} is not one of {', '.join(_RNN_CELLS)}")
    inp = _one_input(features, inputs, "float32", 2, "weather_rnn", "[window, features] (runner prepare weather)")
    x = _RNN_CELLS[p["cell"]](p["units"], dropout=p["dropout"])(inp)
    index = p["target_feature"]
    if index is None:
        return keras.Model(inp, keras.layers.Dense(1, dtype="float32")(x), name="weather_rnn")
    width = features[inputs[0]].shape[-1]
    if not isinstance(index, int) or not 0 <= index < width:
        raise SpecError(f"model.params.target_feature ({index!r}) must be a feature index from 0 to {width - 1}")
    # Zero-initialised, so training starts from "the next hour equals the last one" and learns the change.
    change = keras.layers.Dense(1, kernel_initializer="zeros", dtype="float32")(x)
    last = inp[:, -1, index : index + 1]
    return keras.Model(inp, keras.layers.Add(dtype="float32")([last, change]), name="weather_rnn")


BuildFn = Callable[[dict[str, Any], dict[str, Feature], tuple[str, ...]], "keras.Model"]

MODELS: dict[str, BuildFn] = {
    "mnist_cnn": mnist_cnn,
    "cifar10_cnn": cifar10_cnn,
    "imdb_lstm": imdb_lstm,
    "weather_rnn": weather_rnn,
}

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
    if spec.model.name not in MODELS:
        raise SpecError(f"model.name: unknown model {spec.model.name!r}; built in: {', '.join(sorted(MODELS))}")
    return MODELS[spec.model.name](dict(spec.model.params), features, spec.data.inputs)


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
