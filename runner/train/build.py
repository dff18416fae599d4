"""The model a job trains, evaluates and predicts with: built (a built-in one from runner/models.py's table, or
the user's own build function), compiled with the spec's optimizer, loss and metrics, and restored from a
checkpoint. Training, evaluation and prediction share it.

The optimizer, a serialized loss or metric and the learning-rate schedule are made by Keras's own
deserialization (`keras.optimizers.get`, `keras.losses.get`, `keras.metrics.get`,
`keras.optimizers.schedules.deserialize`) from what runner/spec/keras.py checked; a loss or metric name is
handed to `compile` as it is (`accuracy` is resolved there from the shapes). Before training, the loss must
agree with the model's output: a loss that expects probabilities on a model that ends in logits (or the
reverse) trains without an error and learns the wrong thing, so it is refused here (`check_loss_agreement`)
or, when the output layer's activation cannot be read, on the first batch's outputs (`check_first_outputs`).
"""

from __future__ import annotations

import inspect
import logging
import posixpath
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from runner import SpecError, models
from runner.data.schema import Feature
from runner.device import engine, precision
from runner.rundir import matching
from runner.spec import usercode
from runner.spec.keras import TABLE, Serialized
from runner.spec.train import TrainSpec
from runner.spec.types import JobSpec
from runner.train import match

log = logging.getLogger(__name__)

# Output activations that make probabilities; a loss without from_logits expects them.
_PROBABILITY_ACTIVATIONS = ("softmax", "sigmoid")
# How far outside [0, 1] a probability may stray through rounding (bfloat16 holds 1.0 exactly; float16 sums of
# softmax terms can pass it by a few thousandths).
_ROUNDING = 1e-2


def build_model(spec: JobSpec, features: dict[str, Feature], manifest: dict[str, Any] | None = None) -> keras.Model:
    """Builds the spec's model; call inside the strategy's scope so variables are placed on its devices.

    A `package.module:function` name is imported here, inside the scope, so a module that creates
    variables when imported places them on the strategy's devices too. `manifest`: data.train's, which a
    built-in model that fits itself to the data (`tabular`) reads.
    """
    if usercode.is_import_path(spec.model.name):
        return _build_user_model(spec.model.name, dict(spec.model.params), features, spec.data.inputs, spec.code_roots)
    path = posixpath.join(posixpath.dirname(spec.data.train), "manifest.json")
    columns = models.Columns(manifest, path, spec.data.label) if manifest is not None else None
    return models.build(spec.model.name, dict(spec.model.params), features, spec.data.inputs, columns)


def _build_user_model(
    path: str, params: dict[str, Any], features: dict[str, Feature], inputs: tuple[str, ...], roots: usercode.CodeRoots
) -> keras.Model:
    build = usercode.load_callable(path, "model.name", ("params", "features", "inputs"), roots, keywords=params)
    try:
        model = build(params, features, inputs)
    except Exception as exc:  # the user's code refused these params or features: a start-up error, not training
        computes = engine.active()
        hint = computes.build_hint(exc, path.split(":")[0])
        hint = f"; it cannot run under the {computes.name} backend: {hint}" if hint else ""
        raise SpecError(
            f"model.name: {path!r} raised {type(exc).__name__} while building: {exc} "
            f"(model.params: {params}, data.inputs: {list(inputs)}){hint}"
        ) from exc
    if not isinstance(model, keras.Model):
        found = f"{type(model).__module__}.{type(model).__qualname__}"
        raise SpecError(
            f"model.name: {path!r} returned a {found}; return an uncompiled keras.Model built with Keras 3 "
            f"(`import keras`, or tf.keras: here {keras.Model.__module__})"
        )
    return model


def _from_keras(key: str, deserialize: Callable[[Any], Any], value: Any) -> Any:
    """Keras's own deserialization of a checked spec value; what Keras still refuses (a value of the wrong kind
    for an argument, an argument this Keras lacks) is a spec error naming the key."""
    try:
        return deserialize(value)
    except (ValueError, TypeError, KeyError) as exc:
        raise SpecError(f"{key}: Keras ({keras.__name__} {keras.__version__}) cannot build {value}: {exc}") from exc


def make_optimizer(train: TrainSpec) -> Any:
    """The spec's optimizer, made by keras.optimizers.get, at its settled learning rate or schedule."""
    serialized = train.optimizer_for_keras()
    if train.schedule is not None:
        serialized["config"]["learning_rate"] = _from_keras(
            "train.schedule", keras.optimizers.schedules.deserialize, train.schedule.to_keras()
        )
    return _from_keras("train.optimizer", keras.optimizers.get, serialized)


def _loss_or_metric(value: str | Serialized, key: str, roots: usercode.CodeRoots) -> Any:
    """A Keras name stays a name (`compile` resolves it); Keras's serialized form becomes the Keras object;
    `package.module:function` becomes the imported (y_true, y_pred) function."""
    if isinstance(value, Serialized):
        get = keras.losses.get if key == "train.loss" else keras.metrics.get
        return _from_keras(key, get, value.to_keras())
    if usercode.is_import_path(value):
        return usercode.load_callable(value, key, ("y_true", "y_pred"), roots)
    return value


# --- class-id labels for a loss that takes one-hot labels --------------------------------------------------

# Keras's CategoricalCrossentropy (the loss with label_smoothing) takes one-hot labels; records hold class ids.
_ONE_HOT_LOSSES = ("categorical_crossentropy", "CategoricalCrossentropy")
# Metrics written for class-id labels, and their one-hot counterparts (the same measure on one-hot labels).
_ONE_HOT_METRICS = {
    "SparseCategoricalAccuracy": "CategoricalAccuracy",
    "SparseTopKCategoricalAccuracy": "TopKCategoricalAccuracy",
    "SparseCategoricalCrossentropy": "CategoricalCrossentropy",
}
_ONE_HOT_METRIC_NAMES = {
    "sparse_categorical_accuracy": "CategoricalAccuracy",
    "sparse_top_k_categorical_accuracy": "TopKCategoricalAccuracy",
    "sparse_categorical_crossentropy": "CategoricalCrossentropy",
}


def label_classes(train: TrainSpec, label: Feature | None, model: Any) -> int | None:
    """How many classes to one-hot encode the records' labels to, or None to feed them as stored.

    With train.loss CategoricalCrossentropy and labels that are class ids (an int64 scalar), the input pipeline
    one-hot encodes them to the model's output width (runner/job/inputs.py), so label_smoothing works on class
    ids. Keras then reads them as it reads any one-hot labels: `accuracy` resolves to CategoricalAccuracy from
    the shapes (keras/src/trainers/compile_utils.py `get_metric`), class_weight looks up each label's argmax
    (keras/src/trainers/data_adapters/tf_dataset_adapter.py `make_class_weight_map_fn`)."""
    name = train.loss.class_name if isinstance(train.loss, Serialized) else train.loss
    if name not in _ONE_HOT_LOSSES or label is None or label.dtype != "int64" or tuple(label.shape) not in ((), (1,)):
        return None
    try:
        width = model.output_shape[-1]
    except (AttributeError, TypeError, IndexError, ValueError):  # a subclassed model, several outputs
        width = None
    if not isinstance(width, int) or width < 2:
        # One unit is a binary or regression head, where sparse_categorical_crossentropy is as wrong; a model
        # whose width is unknown (subclassed, several outputs) may well end in one unit per class.
        fix = ("use train.loss binary_crossentropy for labels 0 and 1, or end the model in one output per class"
               if width == 1 else "use train.loss sparse_categorical_crossentropy (it takes the class ids as they "
               "are), or a model ending in one output per class")
        raise SpecError(
            f"train.loss {name} takes one-hot labels and the records' labels are class ids, which the runner "
            f"one-hot encodes to the model's output width; model {getattr(model, 'name', '?')!r} has no single "
            f"output of 2 or more classes (its output shape: {getattr(model, 'output_shape', 'unknown')}): {fix}"
        )
    return width


def _for_one_hot(metric: Any, key: str) -> Any:
    """A metric written for class-id labels, as its one-hot counterpart under the name it would have had (so the
    summary's keys do not change); any other metric as it is."""
    if isinstance(metric, str) and metric in _ONE_HOT_METRIC_NAMES:
        return getattr(keras.metrics, _ONE_HOT_METRIC_NAMES[metric])(name=metric)
    if not isinstance(metric, Serialized) or metric.class_name not in _ONE_HOT_METRICS:
        return metric
    counterpart = _ONE_HOT_METRICS[metric.class_name]
    dropped = [k for k in metric.config if k not in TABLE["metrics"][counterpart]]
    if dropped:
        raise SpecError(
            f"{key}: {metric.class_name} is for class-id labels, which train.loss (CategoricalCrossentropy) has "
            f"one-hot encoded; its one-hot counterpart {counterpart} takes no {', '.join(dropped)}: remove it"
        )
    name = metric.config.get("name") or getattr(keras.metrics, metric.class_name)().name
    return getattr(keras.metrics, counterpart)(**{**metric.config, "name": name})


def steps_per_execution(spec: JobSpec, accelerator_kind: str) -> int:
    """The spec's value, or for `auto` 32 on a TPU (dividing checkpoint.every_steps when set) and 1 elsewhere."""
    value = spec.train.steps_per_execution
    if value != "auto":
        return value
    if accelerator_kind != "tpu":
        return 1
    every = spec.checkpoint.every_steps
    return max(n for n in range(1, 33) if every is None or every % n == 0)


def compile_model(model: keras.Model, spec: JobSpec, accelerator_kind: str = "cpu", one_hot: bool = False) -> None:
    """`one_hot`: the labels arrive one-hot encoded (label_classes): metrics written for class ids are compiled
    as their one-hot counterparts."""
    metrics = [_for_one_hot(m, f"train.metrics[{i}]") if one_hot else m for i, m in enumerate(spec.train.metrics)]
    model.compile(
        optimizer=make_optimizer(spec.train),
        loss=_loss_or_metric(spec.train.loss, "train.loss", spec.code_roots),
        # Weighted: evaluation pads its last batch with records of sample weight 0 (runner/data/pipeline.py), and
        # Keras hands sample weights (those and train.sample_weight's) only to weighted_metrics. Same names.
        weighted_metrics=[
            m if isinstance(m, keras.metrics.Metric) else _loss_or_metric(m, "train.metrics", spec.code_roots)
            for m in metrics
        ],
        steps_per_execution=steps_per_execution(spec, accelerator_kind),
    )


def build_compiled(
    spec: JobSpec, features: dict[str, Feature], accelerator: Any, chosen: precision.Precision | None = None,
    manifest: dict[str, Any] | None = None,
) -> keras.Model:
    """The spec's model, built and compiled under the accelerator's strategy; the run folder's checkpoint store
    (runner/train/store.py) saves and restores its weights, optimizer state and step.

    `chosen`: the precision the job set (runner/device/precision.py). The output layer stays float32: a model whose
    output is not is built again in float32 when `auto` chose bfloat16, and warned about when asked for."""
    if spec.model.hub is not None:  # a KerasHub causal LM, on its own loss and metrics (runner/train/hub.py)
        from runner.train import hub

        with accelerator.scope():
            model = hub.build_causal_lm(spec, accelerator, chosen.policy if chosen is not None else None)
            hub.check_records(model, manifest, spec.model.hub)
            hub.compile_causal_lm(model, make_optimizer(spec.train), steps_per_execution(spec, accelerator.kind))
        return model
    with accelerator.scope():
        seeds = precision.random_state()
        model = build_model(spec, features, manifest)
        if chosen is not None and chosen.policy != "float32" and (why := precision.output_not_float32(model)):
            if chosen.auto:
                reason, first = chosen.reason, precision.output_layers(model)
                chosen.fall_back(f"{reason}, but model {spec.model.name!r}: {why}: float32")
                precision.set_random_state(seeds)  # the weights a float32 host starts from, seed for seed
                model = build_model(spec, features, manifest)
                # Keras names the rebuilt layers anew (dense -> dense_1): the line names the layers of the model
                # that trains, as every later message does.
                for old, new in zip(first, precision.output_layers(model), strict=False):
                    why = why.replace(repr(old), repr(new))
                chosen.reason = f"{reason}, but model {spec.model.name!r}: {why}: float32"
            else:
                log.warning("train.mixed_precision %s: model %r: %s", chosen.policy, spec.model.name, why)
        if chosen is not None:  # the one precision line of a run: the decision as final, with its reason
            log.info("precision: %s (%s)", chosen.policy, chosen.reason)
        one_hot = label_classes(spec.train, features.get(spec.data.label), model) is not None
        compile_model(model, spec, accelerator.kind, one_hot)
        check_loss_agreement(model, model.loss)
        accelerator.engine.check_model(model, spec.model.name)
    return model


def load_keras_file(model: Any, path: str) -> None:
    """Loads model.keras's weights into `model` all or nothing: Keras's own load leaves a layer the file has and
    the model lacks unread, without a word; here every variable is matched both ways first."""
    matching.check(path, match.keras_file_saved(path), match.keras_file_live(model), store="model.keras")
    with warnings.catch_warnings():
        # The file's optimizer slots meet an optimizer that has none yet (evaluate and predict train nothing):
        # Keras skips them and warns "Skipping variable loading for optimizer ..." on every use. The model's own
        # variables were matched above, all or nothing.
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        model.load_weights(path)


def keeping_rate(optimizer: Any, restore: Callable[[], Any]) -> int:
    """Runs `restore` (of either backend's store); returns the optimizer step the checkpoint was saved at.

    The learning rate stays the spec's: Keras keeps a constant rate in a variable the checkpoint restores, so
    without this a resumed run would go on at the rate it was saved with (a rate lowered by ReduceLROnPlateau
    included) whatever the spec now says. A schedule is no variable: it continues from the restored step."""
    rate = None if _has_schedule(optimizer) else to_float(optimizer.learning_rate)
    restore()
    if rate is not None:
        optimizer.learning_rate = rate
    return int(to_float(optimizer.iterations))


def to_float(value: Any) -> float:
    """A scalar variable or tensor as a float, under either backend."""
    if hasattr(value, "value") and not isinstance(value, tf.Variable):  # a Keras 3 variable (JAX holds an array)
        value = value.value
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return float(np.asarray(tf.convert_to_tensor(value)))


def _has_schedule(optimizer: Any) -> bool:
    return isinstance(getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule)


# --- the labels the model can learn from ------------------------------------------------------------------

# Losses that take class ids 0 to width - 1 (the categorical ones one-hot encoded by the runner: an id outside
# becomes a row of zeros, without an error), and those that take 0 and 1 on one output.
_CLASS_ID_LOSSES = ("SparseCategoricalCrossentropy", "CategoricalCrossentropy", "CategoricalFocalCrossentropy",
                    "SparseCategoricalFocalCrossentropy")
_BINARY_LOSSES = ("BinaryCrossentropy", "BinaryFocalCrossentropy")


def label_expectation(model: Any, loss: Any, name: str | None = None) -> tuple[int, int, str] | None:
    """(lowest, highest, why): the class ids a compiled model and its loss learn from, for checking the
    manifest's label_range before training (runner/data/integrity.py `check_labels_fit`); None when the loss or
    the output width does not say (a regression, a loss of the user's, several outputs). `name`: the spec's
    model.name, for the message (Keras's own name of a model differs from process to process)."""
    try:
        width = model.output_shape[-1]
        written, class_name = _loss_text(loss)
    except (AttributeError, TypeError, IndexError, ValueError):
        return None
    if not isinstance(width, int):
        return None
    ends = f"model {name or getattr(model, 'name', '?')!r} ends in {width} output{'s' * (width != 1)}"
    if class_name in _CLASS_ID_LOSSES and width >= 2:
        return 0, width - 1, f"{ends} and train.loss {written} takes class ids 0 to {width - 1}"
    if class_name in _BINARY_LOSSES and width == 1:
        return 0, 1, f"{ends} and train.loss {written} takes labels 0 and 1"
    return None


# --- the loss agrees with the model's output ------------------------------------------------------------


def _expects(loss: Any) -> str | None:
    """"probabilities", "logits", or None (a loss that takes either, or whose wish cannot be read): what a
    Keras loss (a name, a serialized form, a function or a Loss object) expects of the model's output."""
    if isinstance(loss, Serialized):
        loss = loss.to_keras()
    if isinstance(loss, (str, dict)):
        if isinstance(loss, str) and usercode.is_import_path(loss):
            return None
        try:
            loss = keras.losses.get(loss)
        except (ValueError, TypeError, KeyError):
            return None
    config = loss.get_config() if hasattr(loss, "get_config") and not inspect.isfunction(loss) else None
    if isinstance(config, dict) and "from_logits" in config:
        return "logits" if config["from_logits"] else "probabilities"
    if inspect.isfunction(loss) and getattr(loss, "__module__", "").startswith("keras"):
        parameter = inspect.signature(loss).parameters.get("from_logits")
        if parameter is not None:
            return "logits" if parameter.default else "probabilities"
    return None


def _loss_text(loss: Any) -> tuple[str, str]:
    """(how the spec writes the loss, its Keras class name) for a message."""
    written = loss if isinstance(loss, str) else type(loss).__name__
    resolved = keras.losses.get(loss) if isinstance(loss, str) else loss
    if inspect.isfunction(resolved):  # sparse_categorical_crossentropy -> SparseCategoricalCrossentropy
        return written, "".join(part.capitalize() for part in resolved.__name__.split("_"))
    return written, type(resolved).__name__


def _output_activation(model: Any) -> tuple[Any, str] | None:
    """(the output layer, its activation's name) when the model has one output whose activation can be read."""
    try:
        outputs = list(model.outputs or [])
    except (AttributeError, ValueError):  # a subclassed model has no graph of layers to read
        return None
    history = getattr(outputs[0], "_keras_history", None) if len(outputs) == 1 else None
    layer = history[0] if history else None  # the layer that made the one output (Functional, Sequential)
    if layer is None:
        return None
    if isinstance(layer, keras.layers.Softmax):
        return layer, "softmax"
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    return (layer, name) if isinstance(name, str) else None


def output_kind(model: Any) -> str | None:
    """"logits" or "probabilities": what a compiled model's output is, by its loss (from_logits) or else its
    output layer's softmax or sigmoid; None for neither (a regression, a loss that does not say)."""
    expects = _expects(model.loss)
    if expects is not None:
        return expects
    found = _output_activation(model)
    return "probabilities" if found is not None and found[1] in _PROBABILITY_ACTIVATIONS else None


def check_loss_agreement(model: Any, loss: Any) -> None:
    """SpecError (exit 2) when the loss expects probabilities and the output layer gives logits, or the reverse.

    `loss`: what `compile` was given (`model.loss`): a Keras name, function or Loss object."""
    expects, output = _expects(loss), _output_activation(model)
    if expects is None or output is None:
        return
    layer, activation = output
    gives_probabilities = activation in _PROBABILITY_ACTIVATIONS
    described = f"the model's output layer {layer.name!r} ({type(layer).__name__}, activation {activation})"
    written, class_name = _loss_text(loss)
    if expects == "probabilities" and not gives_probabilities:
        raise SpecError(
            f"train.loss: {written} expects probabilities, but {described} gives logits: it would train without "
            f"an error and learn the wrong thing. Set `train.loss: {{class_name: {class_name}, config: "
            f"{{from_logits: true}}}}`, or end the model with a softmax (sigmoid for one output)"
        )
    if expects == "logits" and gives_probabilities:
        raise SpecError(
            f"train.loss: {written} has from_logits: true, but {described} already gives probabilities: it would "
            f"apply {activation} twice. Set `train.loss: {{class_name: {class_name}, config: "
            f"{{from_logits: false}}}}`, or remove the model's final {activation}"
        )


def check_first_outputs(model: Any, loss: Any, batch_outputs: Any) -> None:
    """SpecError (exit 2) when a loss that expects probabilities meets outputs outside [0, 1] on a first batch:
    the check for models whose output activation cannot be read (check_loss_agreement covers the others).

    `loss`: `model.loss` or the spec's `train.loss`; `batch_outputs`: the model's outputs on one batch (a
    tensor or array; a model with several outputs is not checked)."""
    if _expects(loss) != "probabilities" or isinstance(batch_outputs, (list, tuple, dict)):
        return
    values = np.asarray(tf.convert_to_tensor(batch_outputs), dtype=np.float64)
    if values.size == 0 or not np.isfinite(values).all():
        return  # a non-finite output is the divergence check's to report
    low, high = float(values.min()), float(values.max())
    if low >= -_ROUNDING and high <= 1 + _ROUNDING:
        return
    written, class_name = _loss_text(loss if not isinstance(loss, Serialized) else keras.losses.get(loss.to_keras()))
    raise SpecError(
        f"train.loss: {written} expects probabilities, but model {getattr(model, 'name', '?')!r} gave outputs from "
        f"{low:.4g} to {high:.4g} on the first batch (logits): set `train.loss: {{class_name: {class_name}, config: "
        "{from_logits: true}}`, or end the model with a softmax (sigmoid for one output)"
    )


def check_first_batch(model: Any, loss: Any, dataset: Any) -> None:
    """`check_first_outputs` on the model's outputs for one batch of `dataset`, for a model whose output
    activation cannot be read (a subclassed model); the others were checked when compiled."""
    if _expects(loss) != "probabilities" or _output_activation(model) is not None:
        return
    inputs = next(iter(dataset))[0]
    check_first_outputs(model, loss, model(inputs, training=False))
