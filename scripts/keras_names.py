"""Writes runner/spec/keras_names.json: what the installed Keras accepts in a spec's `train.optimizer`,
`train.loss`, `train.metrics` and `train.schedule`, so `runner validate` checks class names and config keys
without importing TensorFlow or Keras.

The table is read from Keras itself: the names are the dictionaries Keras's own `keras.optimizers.get`,
`keras.losses.get`, `keras.metrics.get` and `keras.optimizers.schedules.deserialize` look names up in (their
module's `ALL_OBJECTS_DICT`, or the schedules module's globals), and each class's arguments are its
constructor's, followed through `**kwargs` into its base classes. Run it again after upgrading Keras:

    .venv/bin/python scripts/keras_names.py            # rewrites the table
    .venv/bin/python scripts/keras_names.py --check    # exit 1 when the table differs from the installed Keras

tests/test_keras_configs.py regenerates it and compares.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parents[1] / "runner" / "spec" / "keras_names.json"

# Base classes and wrappers that Keras's lookups hold but that cannot be named alone in a spec: each needs a
# function, an inner optimizer or a subclass's own computation.
NOT_NAMEABLE = {
    "optimizers": {"Optimizer", "LossScaleOptimizer", "MultiOptimizer", "OptimizerMap"},
    "losses": {"Loss", "LossFunctionWrapper"},
    "metrics": {"Metric", "MeanMetricWrapper", "Reduce"},
    "schedules": {"LearningRateSchedule"},
}
# Metric names `model.compile` itself resolves before keras.metrics.get (keras/src/trainers/compile_utils.py,
# get_metric: "accuracy" and "acc" pick binary, categorical or sparse categorical accuracy from the shapes).
COMPILE_METRIC_NAMES = ("acc", "accuracy")


def constructor_arguments(cls: type) -> list[str]:
    """The keyword arguments `cls(...)` accepts: its __init__'s, and through `**kwargs` its bases'."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        for parameter in parameters:
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and parameter.name != "self":
                if parameter.name not in names:
                    names.append(parameter.name)
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return sorted(names)


def _classes(lookup: dict[str, Any], base: type, kind: str) -> dict[str, list[str]]:
    found = {v.__name__: v for v in lookup.values() if inspect.isclass(v) and issubclass(v, base)}
    return {name: constructor_arguments(cls) for name, cls in sorted(found.items()) if name not in NOT_NAMEABLE[kind]}


def _names(lookup: dict[str, Any], kind: str) -> list[str]:
    """The text names a lookup accepts (class names, snake_case forms, aliases), bases and wrappers left out."""
    return sorted(n for n, v in lookup.items() if callable(v) and getattr(v, "__name__", n) not in NOT_NAMEABLE[kind])


def generate() -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    optimizers = keras.optimizers.get.__globals__["ALL_OBJECTS_DICT"]
    losses = keras.losses.get.__globals__["ALL_OBJECTS_DICT"]
    metrics = keras.metrics.get.__globals__["ALL_OBJECTS_DICT"]
    schedules = keras.optimizers.schedules.deserialize.__globals__
    base_schedule = keras.optimizers.schedules.LearningRateSchedule
    table: dict[str, Any] = {
        "keras": keras.__version__,
        "optimizers": _classes(optimizers, keras.optimizers.Optimizer, "optimizers"),
        "losses": _classes(losses, keras.losses.Loss, "losses"),
        "metrics": _classes(metrics, keras.metrics.Metric, "metrics"),
        "schedules": _classes(schedules, base_schedule, "schedules"),
    }
    # Names as text: keras.optimizers.get lowercases the class name; losses and metrics are looked up as written.
    table["optimizer_names"] = sorted(name.lower() for name in table["optimizers"])
    table["loss_names"] = _names(losses, "losses")
    table["metric_names"] = sorted({*_names(metrics, "metrics"), *COMPILE_METRIC_NAMES})
    return table


def render(table: dict[str, Any]) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the written table instead of writing it")
    args = parser.parse_args()
    text = render(generate())
    if args.check:
        same = TABLE.read_text() == text
        print(f"{TABLE}: {'matches' if same else 'differs from'} the installed Keras", file=sys.stderr)
        return 0 if same else 1
    TABLE.write_text(text)
    print(f"wrote {TABLE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
