"""The spec's columns against the data's manifest, without TensorFlow: every name in `data.inputs` and
`data.label` must be a feature of the records. A spec that leaves them at their defaults (`[image]`, `label`)
on data of another form would otherwise validate and then fail inside the input pipeline; `runner validate`
(runner/spec/load.py) and `runner run` (runner/data/integrity.py) both refuse it here, naming the manifest's
own features and, where the manifest records them (`runner prepare` does), its inputs and label as the fix.

The same two places refuse pixels on another scale than a built-in image model divides by (`pixels_problem`):
0..1 images under a model that divides by 255 train without an error, on values 255 times too small."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner import models
from runner.spec.types import DataSpec, ModelSpec


def columns_problem(data: DataSpec, manifest: Mapping[str, Any], manifest_path: str,
                    sample_weight: str | None = None) -> str | None:
    """What is wrong with data.inputs / data.label for the records `manifest` describes, or None."""
    features = manifest.get("features")
    if not isinstance(features, Mapping) or not features:
        return None  # an old manifest without a schema: the spec's data.features, checked elsewhere, say it
    has = ", ".join(features)
    problems, fixes = [], []
    for key, names in (("inputs", list(data.inputs)), ("label", [data.label])):
        missing = [name for name in names if name not in features]
        if not missing:
            continue
        how = "" if key in data.model_fields_set else " (the default)"
        written = f"[{', '.join(names)}]" if key == "inputs" else repr(names[0])
        problems.append(f"data.{key} is {written}{how}, but {manifest_path} has no feature "
                        f"{', '.join(map(repr, missing))} (its features: {has})")
        fix = _manifest_says(key, manifest, features, sample_weight)
        if fix:
            fixes.append(f"data.{key}: {fix}")
    if not problems:
        return None
    advice = (f"; the manifest records which: set {' and '.join(fixes)} in the spec" if fixes else
              "; name the features the model reads in data.inputs and the label in data.label")
    return "; ".join(problems) + advice


def _manifest_says(key: str, manifest: Mapping[str, Any], features: Mapping[str, Any],
                   sample_weight: str | None) -> str | None:
    """The manifest's own `inputs` or `label` (what `runner prepare` wrote), as YAML, when its features hold it;
    a feature the spec uses as train.sample_weight is not an input."""
    value = manifest.get(key)
    if key == "label":
        return value if isinstance(value, str) and value in features else None
    if not isinstance(value, list) or not all(isinstance(v, str) and v in features for v in value):
        return None
    inputs = [name for name in value if name != sample_weight and name != manifest.get("label")]
    return f"[{', '.join(inputs)}]" if inputs else None


def pixels_problem(model: ModelSpec, data: DataSpec, manifest: Mapping[str, Any], manifest_path: str) -> str | None:
    """What is wrong with the scale of the pixels `manifest` records (its `value_ranges`) for a built-in image
    model, or None. Values a factor of 2 or more beyond the model's `pixel_max`, or at most 1 under a
    `pixel_max` above 2, are another scale; data.preprocess may rescale them, so it is not judged then."""
    expected = models.pixel_max_of(model.name, dict(model.params))
    ranges = manifest.get("value_ranges")
    if expected is None or data.preprocess or len(data.inputs) != 1 or not isinstance(ranges, Mapping):
        return None
    name = data.inputs[0]
    found = ranges.get(name)
    if not isinstance(found, Mapping) or not all(isinstance(found.get(k), (int, float)) for k in ("min", "max")):
        return None
    low, high = float(found["min"]), float(found["max"])
    largest = max(abs(low), abs(high))
    if 0 < largest <= 1.0 < expected / 2:
        fix = "set `model.params.pixel_max: 1` (the images are already scaled), or prepare them as 0..255 pixels"
    elif largest > 2 * expected:
        fix = f"set `model.params.pixel_max: {255 if largest <= 255 else largest:g}` (the records' scale)"
    else:
        return None
    return (
        f"model {model.name} divides its input {name!r} by {expected:g} (model.params.pixel_max) and expects pixels "
        f"0..{expected:g}, but {manifest_path} records {found.get('dtype', '?')} values {low:g}..{high:g} "
        f"(value_ranges): it would train without an error on values of another scale and learn little; {fix}"
    )


def class_weight_problem(class_weight: Mapping[int, float] | str | None, manifest: Mapping[str, Any],
                         manifest_path: str) -> str | None:
    """What is wrong with train.class_weight for the labels `manifest` records (each shard's `label_range`), or
    None. Keras fit looks each label up in a table of the weights of class 0 up to the highest key: a label
    beyond it fails inside the input pipeline, and a missing id between fails before training. So every class id
    from 0 to the highest label needs its weight."""
    if not isinstance(class_weight, Mapping) or not class_weight:
        return None
    highs = [entry["label_range"][1] for split in (manifest.get("splits") or {}).values() if isinstance(split, Mapping)
             for entry in split.get("shards") or () if isinstance(entry, Mapping)
             and isinstance(entry.get("label_range"), list) and len(entry["label_range"]) == 2]
    highest = max([h for h in highs if isinstance(h, int)] + [max(class_weight)])
    missing = [c for c in range(highest + 1) if c not in class_weight]
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:12])) + (", ..." if len(missing) > 12 else "")
    labels = f"the labels run up to {highest} ({manifest_path}, label_range)" if highs else \
        f"its highest key is {max(class_weight)}"
    return (f"train.class_weight gives weights for classes {', '.join(map(str, sorted(class_weight)))}, but "
            f"{labels}: Keras needs a weight for every class id from 0 up; add {shown} (1.0 leaves a class "
            "as it is), or set train.class_weight: balanced")
