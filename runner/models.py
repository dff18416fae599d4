"""The built-in models: one table with everything known about each, read without TensorFlow.

`BUILTIN` maps a spec's `model.name` to a `BuiltinModel`: the function that builds it (uncompiled), the default
of its `classes` param when it is a classifier (labels are class ids 0 .. classes - 1), and the devices where
`train.mixed_precision: auto` keeps it in float32 (bfloat16 measured slower or less accurate there). Spec
validation reads the names without TensorFlow; the build functions import Keras only when called.

A build function takes the spec's `model.params` (a dict), the input features (name -> Feature: `.shape`,
`.dtype`) and the input names, and returns a `keras.Model`; `tabular` also takes the training data's manifest
(`Columns`: vocabularies, value ranges, classes), so a CSV trains without copying them into `model.params`.
The table is explicit: no import-time registration.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from runner import SpecError


def _keras() -> Any:
    """Keras 3, imported when a model is built: the table itself loads without it (runner/spec reads it)."""
    import keras

    return keras


# The image models' pixels: 0..PIXEL_MAX as the records hold them, divided by `pixel_max` inside the model.
PIXEL_MAX = 255


def _image_input(features: dict[str, Any], inputs: tuple[str, ...], pixel_max: float) -> tuple[Any, Any]:
    if isinstance(pixel_max, bool) or not isinstance(pixel_max, (int, float)) or not pixel_max > 0:
        raise SpecError(f"model.params.pixel_max: {pixel_max!r} is not a positive number (255 for 0..255 pixels, "
                        "1 for pixels already scaled to 0..1)")
    keras = _keras()
    (name,) = inputs
    inp = keras.Input(shape=features[name].shape, name=name)
    # Pixels arrive as float32 in 0..255; rescaling inside the model keeps predict() on raw images honest.
    # `pixel_max: 1` takes images already scaled to 0..1 (runner/spec/columns.py refuses the mismatch).
    return inp, keras.layers.Rescaling(1.0 / pixel_max)(inp)


def mnist_cnn(params: dict[str, Any], features: dict[str, Any], inputs: tuple[str, ...]) -> Any:
    """The Basic CNN of the classic Colab TPU MNIST example."""
    params = _params(params, "mnist_cnn")
    keras = _keras()
    layers = keras.layers
    inp, x = _image_input(features, inputs, params["pixel_max"])
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


def _params(params: dict[str, Any], model: str) -> dict[str, Any]:
    """The model's params over its defaults (BUILTIN); an unknown key is an error, never an ignored typo."""
    problem = params_problem(model, params)
    if problem:
        raise SpecError(f"model.params: {problem}")
    return {**BUILTIN[model].params, **params}


def params_problem(model: str, params: dict[str, Any]) -> str | None:
    """What is wrong with `params` for the built-in `model` (an unknown param, with did-you-mean), or None;
    spec validation asks it without TensorFlow."""
    defaults = BUILTIN[model].params
    unknown = sorted(set(params) - set(defaults))
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], defaults, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{model} has no param {unknown[0]!r}{hint} (it takes: {', '.join(defaults)})"


def _one_input(features: dict[str, Any], inputs: tuple[str, ...], dtype: str, rank: int, model: str, what: str) -> Any:
    """The model's single input layer, after checking the feature is what the model reads."""
    feature = features[inputs[0]] if len(inputs) == 1 else None
    if feature is None or feature.dtype != dtype or len(feature.shape) != rank:
        got = f"{len(inputs)} inputs" if feature is None else f"{inputs[0]!r}: {feature.dtype} {list(feature.shape)}"
        raise SpecError(f"model.name: {model} reads one {dtype} feature of {what}; data.inputs gives {got}")
    return _keras().Input(shape=feature.shape, dtype=dtype, name=inputs[0])


def cifar10_cnn(params: dict[str, Any], features: dict[str, Any], inputs: tuple[str, ...]) -> Any:
    """The CIFAR-10 CNN of the classic Colab TPU example: (BatchNorm, Conv x2, pool, dropout) x2, Dense 512."""
    p = _params(params, "cifar10_cnn")
    keras = _keras()
    layers = keras.layers
    inp, x = _image_input(features, inputs, p["pixel_max"])
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


def imdb_lstm(params: dict[str, Any], features: dict[str, Any], inputs: tuple[str, ...]) -> Any:
    """The IMDB sentiment LSTM: word ids -> Embedding(15000, 32) -> LSTM(100) -> probability of positive."""
    p = _params(params, "imdb_lstm")
    keras = _keras()
    layers = keras.layers
    inp = _one_input(features, inputs, "int64", 1, "imdb_lstm", "token ids [length] (runner prepare imdb)")
    # Ids at or above vocab_size fail on a CPU but read as zeros on a TPU: the data's vocab_size must match.
    x = layers.Embedding(p["vocab_size"], p["embedding_dim"])(inp)
    x = layers.LSTM(p["units"])(x)
    out = layers.Dense(1, activation="sigmoid", dtype="float32")(x)
    return keras.Model(inp, out, name="imdb_lstm")


_RNN_CELLS = ("gru", "lstm")


def weather_rnn(params: dict[str, Any], features: dict[str, Any], inputs: tuple[str, ...]) -> Any:
    """Past hours of weather [window, features] -> GRU or LSTM -> the next hour's value (a regression).

    With `target_feature` (the target's column among the inputs, manifest `preprocessing.target_index`)
    the network predicts the change from the last hour, starting out as the persistence forecast.
    """
    p = _params(params, "weather_rnn")
    if p["cell"] not in _RNN_CELLS:
        raise SpecError(f"model.params.cell: {p['cell']!r} is not one of {', '.join(_RNN_CELLS)}")
    inp = _one_input(features, inputs, "float32", 2, "weather_rnn", "[window, features] (runner prepare weather)")
    keras = _keras()
    cell = keras.layers.GRU if p["cell"] == "gru" else keras.layers.LSTM
    x = cell(p["units"], dropout=p["dropout"])(inp)
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


@dataclasses.dataclass(frozen=True)
class Columns:
    """What the training data's manifest records about its columns, for a model that fits itself to them:
    `preprocessing.vocabularies` (a category column's words, id = position), `value_ranges` (each number's
    lowest and highest value over the training split), `class_names` and the shards' `label_range`."""

    manifest: dict[str, Any]
    path: str  # the manifest's path, named in errors
    label: str

    def vocabulary_size(self, name: str) -> int | None:
        words = (self.manifest.get("preprocessing") or {}).get("vocabularies", {}).get(name)
        return len(words) if isinstance(words, list) and words else None

    def value_range(self, name: str) -> tuple[float, float] | None:
        found = (self.manifest.get("value_ranges") or {}).get(name)
        if not isinstance(found, dict) or not all(isinstance(found.get(k), (int, float)) for k in ("min", "max")):
            return None
        return float(found["min"]), float(found["max"])

    def classes(self) -> int | None:
        """Class names, else one past the highest label of any split; None when neither is recorded."""
        if self.manifest.get("class_names"):
            return len(self.manifest["class_names"])
        highs = [entry["label_range"][1] for split in (self.manifest.get("splits") or {}).values()
                 for entry in split.get("shards") or () if isinstance(entry.get("label_range"), list)]
        return max(highs) + 1 if highs else None


def tabular(params: dict[str, Any], features: dict[str, Any], inputs: tuple[str, ...], columns: Columns) -> Any:
    """One scalar input per column (`runner prepare csv`): a category through an embedding of its vocabulary,
    a number scaled to 0..1 by its training range, then Dense layers; softmax over the classes for a class label,
    one linear output for a number label (a regression: set train.loss, e.g. mse).

    Keras layers only (no TensorFlow calls), so it builds under any Keras backend."""
    p = _params(params, "tabular")
    units = p["units"]
    if not isinstance(units, list) or not units or not all(isinstance(u, int) and u > 0 for u in units):
        raise SpecError(f"model.params.units: {units!r} must be a list of positive layer widths, e.g. [64, 32]")
    keras = _keras()
    layers = keras.layers
    given, encoded = {}, []
    for name in inputs:
        feature = features[name]
        if tuple(feature.shape) not in ((), (1,)):
            raise SpecError(f"model.name: tabular reads one value per column; input {name!r} has shape "
                            f"{list(feature.shape)} ({columns.path}): name scalar columns in data.inputs")
        categories, found = columns.vocabulary_size(name), columns.value_range(name)
        integer = feature.dtype == "int64"
        given[name] = keras.Input(shape=tuple(feature.shape), dtype="int64" if integer else "float32", name=name)
        column = layers.Reshape((1,))(given[name])
        if categories is not None:
            # An embedding, not one-hot: a column of thousands of words stays a few numbers wide.
            vector = layers.Embedding(categories, min(p["embedding_dim"], categories), name=f"{name}_embedding")(column)
            encoded.append(layers.Flatten()(vector))
        elif found is not None:
            low, high = found
            span = high - low or 1.0  # a constant column: any scale keeps it constant
            encoded.append(layers.Rescaling(1 / span, offset=-low / span, name=f"{name}_scaled")(column))
        else:
            raise SpecError(
                f"model.name: tabular scales each number by its training range and embeds each category by its "
                f"vocabulary, but {columns.path} records neither for input {name!r} (value_ranges, "
                f"preprocessing.vocabularies): write it again with `runner prepare csv`"
            )
    x = layers.Concatenate()(encoded) if len(encoded) > 1 else encoded[0]
    for width in units:
        x = layers.Dense(width, activation="relu")(x)
        if p["dropout"]:
            x = layers.Dropout(p["dropout"])(x)
    label = features.get(columns.label)
    if label is not None and label.dtype == "float32":
        return keras.Model(given, layers.Dense(1, dtype="float32")(x), name="tabular")
    classes = columns.classes()
    if classes is None:
        raise SpecError(f"model.name: tabular finds no classes for label {columns.label!r} in {columns.path} "
                        "(class_names, or the shards' label_range): write it again with `runner prepare csv`")
    out = layers.Dense(max(classes, 2), activation="softmax", dtype="float32")(x)
    return keras.Model(given, out, name="tabular")


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """What is known about one built-in model."""

    build: Callable[..., Any]  # (params, features, inputs), and a Columns when reads_columns
    # Its params (model.params) and their defaults: the build function takes these and no other.
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The default of its `classes` param for a classifier (labels 0 .. classes - 1); None for other models.
    classes: int | None = None
    # Device kinds where `auto` precision keeps it in float32, with the reason measured side by side
    # (benchmarks/RESULTS.md, "accuracy: auto against float32"): bfloat16 cost more accuracy than
    # benchmarks/accuracy.py allows (0.3 points of accuracy, 2% of MAE), or ran slower than float32. Measured on
    # this project's CPUs only, so listed for "cpu": a TPU computes them in bfloat16. (A job whose data, not its
    # model, loses accuracy says float32 in its own spec: jobs/fashion_mnist_cnn.yaml.)
    float32_under_auto: dict[str, str] = dataclasses.field(default_factory=dict)
    # An image model: the default of its `pixel_max` param (it divides its input by it inside).
    pixel_max: float | None = None
    # It fits itself to the training data's manifest: its build function also takes a `Columns`.
    reads_columns: bool = False


BUILTIN: dict[str, BuiltinModel] = {
    "mnist_cnn": BuiltinModel(mnist_cnn, {"classes": 10, "pixel_max": PIXEL_MAX}, classes=10, pixel_max=PIXEL_MAX),
    "cifar10_cnn": BuiltinModel(cifar10_cnn, {"classes": 10, "pixel_max": PIXEL_MAX}, classes=10,
                                pixel_max=PIXEL_MAX),
    "imdb_lstm": BuiltinModel(imdb_lstm, {"vocab_size": 15000, "embedding_dim": 32, "units": 100}, float32_under_auto={
        "cpu": "bfloat16 ran its LSTM 20% slower than float32 on a CPU, 0.46 points less accurate",
    }),
    "weather_rnn": BuiltinModel(weather_rnn, {"cell": "gru", "units": 64, "dropout": 0.0, "target_feature": None},
                                float32_under_auto={
        "cpu": "bfloat16 ran its GRU 14% slower than float32 on a CPU, its MAE 1.4% higher",
    }),
    "tabular": BuiltinModel(tabular, {"units": [64, 32], "dropout": 0.1, "embedding_dim": 8}, reads_columns=True),
}
MODEL_NAMES = tuple(BUILTIN)


def float32_under_auto(model_name: str, kind: str) -> str | None:
    """Why `auto` keeps this built-in model in float32 on a device of `kind`; None when it does not."""
    known = BUILTIN.get(model_name)
    return known.float32_under_auto.get(kind) if known else None


def classes_of(model_name: str, params: dict[str, Any]) -> int | None:
    """The number of classes of a built-in classifier (its `classes` param), None for other models."""
    known = BUILTIN.get(model_name)
    if known is None or known.classes is None:
        return None
    classes = params.get("classes", known.classes)
    return classes if isinstance(classes, int) and not isinstance(classes, bool) else None


def pixel_max_of(model_name: str, params: dict[str, Any]) -> float | None:
    """The largest pixel value a built-in image model expects (its `pixel_max` param), None for other models."""
    known = BUILTIN.get(model_name)
    if known is None or known.pixel_max is None:
        return None
    value = params.get("pixel_max", known.pixel_max)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def build(model_name: str, params: dict[str, Any], features: dict[str, Any], inputs: tuple[str, ...],
          columns: Columns | None = None) -> Any:
    """Builds the built-in model `model_name` (uncompiled); call inside the strategy's scope. `columns`: the
    training data's manifest, for a model that reads it (`reads_columns`)."""
    if model_name not in BUILTIN:
        raise SpecError(f"model.name: unknown model {model_name!r}; built in: {', '.join(sorted(BUILTIN))}")
    known = BUILTIN[model_name]
    if not known.reads_columns:
        return known.build(dict(params), features, inputs)
    if columns is None:
        raise SpecError(f"model.name: {model_name} is built from the training data's manifest; none was given")
    return known.build(dict(params), features, inputs, columns)
