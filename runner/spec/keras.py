"""Keras's own vocabulary in a spec: `train.optimizer`, `train.loss`, `train.metrics` and `train.schedule` take a
name Keras accepts (`adam`, `sparse_categorical_crossentropy`, `accuracy`) or Keras's serialized form
(`{class_name: AdamW, config: {learning_rate: 0.001, weight_decay: 0.01}}`), which runner/train/build.py hands to
Keras's own `keras.optimizers.get`, `keras.losses.get`, `keras.metrics.get` and
`keras.optimizers.schedules.deserialize`.

Both forms are checked here without TensorFlow or Keras, against keras_names.json: the names and each class's
constructor arguments, read from the installed Keras by scripts/keras_names.py (tests/test_keras_configs.py
regenerates it and compares). A config holds plain values only (numbers, text, booleans, null, lists of them):
a mapping inside it would be deserialized by Keras as an object of its own, which a spec names only through
its own keys (a schedule goes in `train.schedule`).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Discriminator, Field, Tag, field_validator, model_validator

from runner.spec.base import LEARNING_RATE_RANGE, Strict, invisible_character
from runner.spec.usercode import check_import_path, is_import_path

TABLE: dict[str, Any] = json.loads((Path(__file__).parent / "keras_names.json").read_text())
# Tags of the two forms (a name, a serialized object); runner/spec/load.py leaves them out of the key it names.
NAME_TAG, SERIALIZED_TAG = "keras-name", "keras-serialized"
# Config keys that hold a learning rate: held to the same range as train.learning_rate.
_RATE_KEYS = ("learning_rate", "initial_learning_rate", "end_learning_rate", "warmup_target")
_KINDS = {  # kind -> (the table's classes, the table's names as text, what Keras calls them)
    "optimizer": ("optimizers", "optimizer_names", "keras.optimizers"),
    "loss": ("losses", "loss_names", "keras.losses"),
    "metric": ("metrics", "metric_names", "keras.metrics"),
    "schedule": ("schedules", None, "keras.optimizers.schedules"),
}


def did_you_mean(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """'; did you mean 'x'?' for the closest choice (case aside), else ''."""
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
    # A short name typed for a longer one (`f1` for `f1_score`) is too far for a ratio, close as a prefix.
    close = close or sorted((c for c in lowered if len(value) >= 2 and c.startswith(value.lower())), key=len)[:1]
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


def class_names(kind: str) -> list[str]:
    return list(TABLE[_KINDS[kind][0]])


def optimizer_class(name: str) -> str:
    """The Keras class an optimizer name stands for (`adam` -> `Adam`): keras.optimizers.get ignores case."""
    return {c.lower(): c for c in TABLE["optimizers"]}[name.lower()]


def check_name(kind: str, value: str) -> str:
    """A Keras name of `kind` (or, for losses and metrics, `package.module:function`); ValueError otherwise."""
    _, names_key, module = _KINDS[kind]
    if not value.strip():
        if kind == "optimizer":
            raise ValueError("an empty optimizer name: write a Keras name such as 'adam'")
        raise ValueError(f"an empty {kind} name: write a Keras name such as 'accuracy' or `package.module:function`")
    if kind in ("loss", "metric") and is_import_path(value):
        return check_import_path(value)
    names = TABLE[names_key]
    known = value.lower() in names if kind == "optimizer" else value in names
    if not known:
        own = ", or your own `package.module:function`" if kind != "optimizer" else ""
        raise ValueError(
            f"{_shown(value)} is not {_a(kind)} name {module} knows{did_you_mean(value, names)} "
            f"(Keras {TABLE['keras']}: {_listing(names)}{own})"
        )
    return value


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _listing(names: list[str]) -> str:
    shown = [n for n in names if n.islower()] or names
    return ", ".join(shown[:12]) + (", ..." if len(shown) > 12 else "")


def _shown(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:76] + "...'"


class Serialized(Strict):
    """Keras's serialized form of one object: `{class_name: AdamW, config: {weight_decay: 0.01}}`."""

    kind: ClassVar[str]
    class_name: str = Field(max_length=128)
    config: dict[str, Any] = Field(default_factory=dict, max_length=64)
    # What keras.*.serialize writes beside them (`{"module": "keras.optimizers", ..., "registered_name": null}`),
    # so its output pastes as it is; a Keras module and no registered (custom) class only. Not kept in dumps:
    # they say nothing the class name does not.
    module: str | None = Field(None, max_length=128, exclude=True)
    registered_name: str | None = Field(None, max_length=128, exclude=True)

    @field_validator("module")
    @classmethod
    def _keras_module(cls, value: str | None) -> str | None:
        if value is not None and value.split(".")[0] != "keras":
            raise ValueError(f"{_shown(value)} is not one of Keras's modules: the runner builds Keras's own "
                             "classes from a spec; your own class goes in by import path (docs/specs.md)")
        return value

    @field_validator("registered_name")
    @classmethod
    def _not_registered(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(f"{_shown(value)} is a class registered with Keras by your code, which a spec cannot "
                             "import this way: name your own object by import path (docs/specs.md)")
        return value

    @field_validator("class_name")
    @classmethod
    def _known_class(cls, value: str) -> str:
        classes = class_names(cls.kind)
        if value in classes:
            return value
        if cls.kind == "optimizer" and value.lower() in {c.lower() for c in classes}:
            return optimizer_class(value)  # Keras's own lookup ignores the case of optimizer names
        raise ValueError(
            f"{_shown(value)} is not a class {_KINDS[cls.kind][2]} can build{did_you_mean(value, classes)} "
            f"(Keras {TABLE['keras']}: {', '.join(classes)})"
        )

    @model_validator(mode="after")
    def _known_arguments(self) -> Serialized:
        allowed = TABLE[_KINDS[self.kind][0]][self.class_name]
        for key, value in self.config.items():
            if key == "label_smoothing" and self.class_name == "SparseCategoricalCrossentropy" and key not in allowed:
                raise ValueError(_sparse_smoothing(self.config))
            if key not in allowed:
                raise ValueError(
                    f"config: {self.class_name} takes no argument {_shown(str(key))}{did_you_mean(str(key), allowed)} "
                    f"(it takes: {', '.join(allowed)})"
                )
            _check_plain(value, f"config.{key}")
            _check_number(key, value)
            if key in _RATE_KEYS and value is not None:
                check_learning_rate(value, f"config.{key}", zero_ok=_may_be_zero(key, self.config))
        return self

    def to_keras(self) -> dict[str, Any]:
        """What Keras's deserialization reads (a fresh dict: Keras rewrites the one it is given). A rate written
        as a whole number (`initial_learning_rate: 0`, as CosineDecay's docstring writes its warmup) goes as a
        float: Keras's CosineDecay multiplies it with float tensors and fails on an int ("cannot compute Mul")."""
        config = {key: float(value) if key in _RATE_KEYS and type(value) is int else value
                  for key, value in self.config.items()}
        return {"class_name": self.class_name, "config": config}


class SerializedOptimizer(Serialized):
    kind: ClassVar[str] = "optimizer"


class SerializedLoss(Serialized):
    kind: ClassVar[str] = "loss"


class SerializedMetric(Serialized):
    kind: ClassVar[str] = "metric"


class SerializedSchedule(Serialized):
    kind: ClassVar[str] = "schedule"


def _sparse_smoothing(config: dict[str, Any]) -> str:
    """Keras's SparseCategoricalCrossentropy has no label_smoothing (keras/src/losses/losses.py: its __init__ takes
    from_logits, ignore_class, reduction, axis, name, dtype); CategoricalCrossentropy has, on one-hot labels, and
    the runner one-hot encodes class-id labels for it (runner/train/build.py `label_classes`)."""
    kept = {k: v for k, v in config.items() if k in TABLE["losses"]["CategoricalCrossentropy"]}
    kept["label_smoothing"] = config["label_smoothing"]
    shown = ", ".join(f"{k}: {json.dumps(v)}" for k, v in kept.items())
    return (
        f"config: SparseCategoricalCrossentropy takes no label_smoothing (Keras {TABLE['keras']}): write "
        f"{{class_name: CategoricalCrossentropy, config: {{{shown}}}}}; the runner one-hot encodes class-id labels "
        "for CategoricalCrossentropy (docs/specs.md)"
    )


def _check_plain(value: Any, where: str) -> None:
    """Numbers (finite), text, booleans, null, and lists of them: nothing Keras would deserialize as an object."""
    if isinstance(value, list):
        if len(value) > 10_000:
            raise ValueError(f"{where}: a list of {len(value):,} values; at most 10,000")
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif isinstance(value, dict):
        raise ValueError(
            f"{where} is a mapping: a config holds plain values (Keras would build a mapping as an object of its "
            "own); a learning-rate schedule goes in train.schedule"
        )
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: use a finite number")
    elif isinstance(value, str) and (bad := invisible_character(value)):
        raise ValueError(f"{where} holds {bad}: remove it")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{where} is a {type(value).__name__}: use a number, text, true/false or a list")


# Arguments of Keras's optimizers, losses, metrics and schedules whose values have a range (Keras's docstrings:
# label_smoothing "Float in [0, 1]", the Adam family's betas and momentum "a float value" of an average, a clip
# norm that must clip). Out of range they train without an error and mean nothing: label_smoothing 50 gave a
# loss of -218. (low, high, whether low itself is allowed.)
_RANGES: dict[str, tuple[float, float, bool]] = {
    "label_smoothing": (0.0, 1.0, True), "momentum": (0.0, 1.0, True), "ema_momentum": (0.0, 1.0, True),
    "beta_1": (0.0, 1.0, True), "beta_2": (0.0, 1.0, True), "rho": (0.0, 1.0, True), "alpha": (0.0, 1.0, True),
    "weight_decay": (0.0, 1e6, True), "clipnorm": (0.0, 1e12, False), "clipvalue": (0.0, 1e12, False),
    "global_clipnorm": (0.0, 1e12, False), "epsilon": (0.0, 1.0, False), "decay_rate": (0.0, 1e6, False),
}
# A number written as text (quoted, or a form no YAML reads as a number) would reach Keras as a string.
_NUMBER_AS_TEXT = re.compile(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _check_number(key: str, value: Any) -> None:
    """A config value that YAML read as text but is a number, or a number out of its argument's range."""
    if isinstance(value, str) and _NUMBER_AS_TEXT.fullmatch(value.strip()) and key not in ("name", "dtype"):
        mantissa, _, exponent = value.strip().lower().partition("e")
        fixed = f"{mantissa}.0e{exponent}" if exponent and "." not in mantissa else value.strip().replace("_", "")
        raise ValueError(f"config.{key} is the text {_shown(value)}, not a number: write {fixed}, unquoted")
    if key not in _RANGES or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high, low_ok = _RANGES[key]
    if not (low < value <= high or (low_ok and value == low)):
        shown = f"[{low:g}, {high:g}]" if low_ok else f"({low:g}, {high:g}]"
        raise ValueError(f"config.{key} is {value:g}: Keras takes it in {shown}; out of it, training runs and means "
                         "nothing")


def _may_be_zero(key: str, config: dict[str, Any]) -> bool:
    """A rate a schedule may start or end at without training at it: a warmup from 0 (`initial_learning_rate`
    beside `warmup_target`, as the warmup example of CosineDecay's docstring writes it: keras/src/optimizers/
    schedules/learning_rate_schedule.py) or a decay to 0 (`end_learning_rate`)."""
    return key == "end_learning_rate" or (key == "initial_learning_rate" and config.get("warmup_target") is not None)


def check_learning_rate(value: Any, where: str, zero_ok: bool = False) -> float:
    low, high = LEARNING_RATE_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} is {_shown(str(value))}: a learning rate is a number from {low:g} to {high:g}")
    if zero_ok and value == 0:
        return value
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{where} is {value:g}: a learning rate is a number from {low:g} to {high:g}")
    return value


def _form(value: Any) -> str | None:
    if isinstance(value, str):
        return NAME_TAG
    if isinstance(value, (dict, Serialized)):
        return SERIALIZED_TAG
    return None


def _either(kind: str, serialized: type[Serialized], example: str) -> Any:
    """A name (checked by check_name) or Keras's serialized form, each validated by its own rules only."""
    name = Annotated[str, Field(max_length=256)]

    def checked(value: str) -> str:
        return check_name(kind, value)

    return Annotated[
        Annotated[Annotated[name, AfterValidator(checked)], Tag(NAME_TAG)] | Annotated[serialized, Tag(SERIALIZED_TAG)],
        Discriminator(
            _form, custom_error_type=f"keras_{kind}",
            custom_error_message=(
                f"write {_a(kind)} name ({example}) or Keras's form {{class_name: ..., config: {{...}}}}"
            ),
        ),
    ]


Optimizer = _either("optimizer", SerializedOptimizer, "adam")
Loss = _either("loss", SerializedLoss, "sparse_categorical_crossentropy")
Metric = _either("metric", SerializedMetric, "accuracy")


def identity(value: str | Serialized) -> str:
    """A metric's or loss's identity, to find one listed twice."""
    return value if isinstance(value, str) else json.dumps(value.to_keras(), sort_keys=True)
