"""The feature schema of tf.train.Example records: how each feature is parsed, decoded and checked.

A manifest's `features:` and a spec's `data.features` share one form (spec.FeatureSpec), per feature:
  dtype    uint8 | int64 | float32 | string: the tensor the model gets (uint8 arrives as float32 0..255)
  shape    the static shape of one example's tensor
  var_len  a list of any length in the record, padded with 0 (or "") or cut to shape[0]
  decode   raw (bytes -> uint8, reshaped), png or jpeg (bytes -> uint8 [height, width, channels]),
           or none (int64, float32 and string values, stored as such)
Variable-length lists become dense [batch, max_length] tensors rather than ragged ones: XLA on a TPU
compiles one program per input shape, and a padded shape compiles once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import tensorflow as tf
from pydantic import ValidationError

from runner import DataError, SpecError
from runner.spec.types import FeatureSpec


@dataclasses.dataclass(frozen=True)
class Feature:
    """What the model gets for one example: dtype and static shape."""

    dtype: str  # uint8 | int64 | float32
    shape: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


def plain(fn: Any, user: Any = None) -> Any:
    """`fn` marked for tf.data and tf.function to trace as it is written, not rewritten by AutoGraph first: the
    runner's own input functions branch on Python values only, and AutoGraph's rewrite cost 2-3.6 s of every
    job's start on a 2-core AMD EPYC (0.1-0.8 s a function). When `fn` calls a `user` function (data.preprocess),
    which may branch on tensors, AutoGraph converts it as before."""
    return fn if user is not None else tf.autograph.experimental.do_not_convert(fn)


# The tf.train.Example list each kind of feature is stored in.
_LIST_OF = {"int64": "int64_list", "float32": "float_list", "string": "bytes_list", "uint8": "bytes_list"}
_TF_DTYPE = {"int64": tf.int64, "float32": tf.float32, "string": tf.string}


@dataclasses.dataclass(frozen=True)
class StoredFeature(Feature):
    """A Feature (what the model gets) plus how it is stored in the record."""

    var_len: bool = False
    decode: str = "none"

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "var_len": self.var_len, "decode": self.decode}


def from_dict(doc: Any, where: str) -> StoredFeature:
    """A schema entry (manifest or spec form) checked by the spec's rules; `where` names it in errors."""
    try:
        checked = FeatureSpec.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        raise DataError(f"{where}{'.' + key if key else ''}: {first['msg'].removeprefix('Value error, ')}") from None
    return StoredFeature(checked.dtype, tuple(checked.shape), checked.var_len, checked.decode)


def stored(feature: Feature) -> StoredFeature:
    """The full schema of a feature; a plain Feature (written by `runner prepare`) is stored raw."""
    if isinstance(feature, StoredFeature):
        return feature
    return StoredFeature(feature.dtype, tuple(feature.shape), False, "raw" if feature.dtype == "uint8" else "none")


def features_from_manifest(manifest: dict[str, Any], path: str) -> dict[str, StoredFeature]:
    return {name: from_dict(doc, f"{path}: features.{name}") for name, doc in manifest["features"].items()}


def describe(feature: Feature) -> str:
    full = stored(feature)
    return (
        f"{{dtype: {full.dtype}, shape: {list(full.shape)}, var_len: {str(full.var_len).lower()}, "
        f"decode: {full.decode}}}"
    )


# --- reading records ---------------------------------------------------------------------------


def parse_spec(features: dict[str, Feature]) -> dict[str, tf.io.FixedLenFeature | tf.io.VarLenFeature]:
    spec: dict[str, tf.io.FixedLenFeature | tf.io.VarLenFeature] = {}
    for name, feature in features.items():
        full = stored(feature)
        if full.decode != "none":
            spec[name] = tf.io.FixedLenFeature([], tf.string)
        elif full.var_len:
            spec[name] = tf.io.VarLenFeature(_TF_DTYPE[full.dtype])
        else:
            spec[name] = tf.io.FixedLenFeature(full.shape, _TF_DTYPE[full.dtype])
    return spec


def parse_batch(serialized: tf.Tensor, features: dict[str, Feature]) -> dict[str, tf.Tensor]:
    """A batch of serialized Examples -> dense tensors of static shape [batch, *shape], one per feature,
    in the dtypes the model gets."""
    return for_model(parse_stored(serialized, features), features)


def for_model(decoded: dict[str, tf.Tensor], features: dict[str, Feature]) -> dict[str, tf.Tensor]:
    """Decoded tensors as the model gets them: uint8 features as float32 (0..255), the rest unchanged."""
    # Cast on the host: TPU infeed prefers float32/bfloat16 to uint8, and models rescale themselves.
    return {
        name: tf.cast(tensor, tf.float32) if stored(features[name]).dtype == "uint8" else tensor
        for name, tensor in decoded.items()
    }


def parse_stored(serialized: tf.Tensor, features: dict[str, Feature]) -> dict[str, tf.Tensor]:
    """A batch of serialized Examples -> dense tensors of static shape [batch, *shape], uint8 features still
    uint8 (a quarter of the memory float32 takes: runner/data/in_memory.py holds them so)."""
    parsed = tf.io.parse_example(serialized, parse_spec(features))
    batch = serialized.shape[0]  # static when batches drop their remainder; kept static for XLA
    decoded = {}
    for name, tensor in parsed.items():
        full = stored(features[name])
        if full.var_len:
            tensor = _pad(tensor, full, batch)
        elif full.decode == "raw":
            tensor = tf.reshape(tf.io.decode_raw(tensor, tf.uint8), (batch or -1, *full.shape))
        elif full.decode in ("png", "jpeg"):
            tensor = _decode_images(tensor, full, batch)
        decoded[name] = tensor
    return decoded


def _pad(sparse: tf.SparseTensor, feature: StoredFeature, batch: int | None) -> tf.Tensor:
    (length,) = feature.shape
    fill = "" if feature.dtype == "string" else 0
    dense = tf.sparse.to_dense(sparse, default_value=tf.constant(fill, sparse.dtype))[:, :length]
    dense = tf.pad(dense, [[0, 0], [0, length - tf.shape(dense)[1]]], constant_values=fill)
    return tf.ensure_shape(dense, (batch, length))


def _decode_images(encoded: tf.Tensor, feature: StoredFeature, batch: int | None) -> tf.Tensor:
    channels = feature.shape[2]
    decoder = tf.io.decode_png if feature.decode == "png" else tf.io.decode_jpeg
    images = tf.map_fn(
        lambda data: decoder(data, channels=channels),
        encoded,
        fn_output_signature=tf.TensorSpec((None, None, channels), tf.uint8),
    )
    # Every image must have the declared size; `runner manifest` checks every record of every shard.
    return tf.ensure_shape(images, (batch, *feature.shape))


def record_problems(record: bytes, features: dict[str, Feature]) -> list[str]:
    """What keeps one serialized tf.train.Example from being read with the schema (empty when it fits)."""
    try:
        example = tf.train.Example.FromString(record)
    except Exception as exc:  # protobuf's DecodeError and friends: the record is not an Example
        return [f"the record is not a tf.train.Example ({type(exc).__name__})"]
    stored_as = example.features.feature
    problems = []
    for name, feature in features.items():
        full = stored(feature)
        if full.var_len and (name not in stored_as or stored_as[name].WhichOneof("kind") is None):
            continue  # a variable-length list may be empty, or left out of the record
        if name not in stored_as:
            has = ", ".join(sorted(stored_as)) or "nothing"
            problems.append(f"feature {name!r} is missing (the record has: {has})")
            continue
        kind = stored_as[name].WhichOneof("kind")
        if kind != _LIST_OF[full.dtype]:
            problems.append(
                f"feature {name!r} is stored as {kind or 'an empty feature'}, but {describe(full)} is read "
                f"from a {_LIST_OF[full.dtype]}"
            )
            continue
        values = getattr(stored_as[name], kind).value
        problem = _value_problem(list(values), full)
        if problem:
            problems.append(f"feature {name!r} {problem} ({describe(full)})")
    return problems


def _value_problem(values: list, feature: StoredFeature) -> str | None:
    if feature.var_len:
        return None
    if feature.decode == "none":
        size = math.prod(feature.shape)
        if len(values) != size:
            return f"holds {len(values)} values, but shape {list(feature.shape)} needs {size}"
        return None
    if len(values) != 1:
        return f"holds {len(values)} byte strings; one is needed"
    if feature.decode == "raw":
        size = math.prod(feature.shape)
        if len(values[0]) != size:
            return f"holds {len(values[0])} bytes, but shape {list(feature.shape)} needs {size}"
        return None
    try:
        image = tf.io.decode_image(values[0], channels=feature.shape[2], expand_animations=False).numpy()
    except tf.errors.InvalidArgumentError as exc:
        return f"is not a decodable {feature.decode} image ({exc.message.splitlines()[0]})"
    fmt = "png" if values[0][:8] == b"\x89PNG\r\n\x1a\n" else "jpeg" if values[0][:2] == b"\xff\xd8" else "other"
    if fmt != feature.decode:
        return f"is a {fmt} image, not {feature.decode}"
    if image.shape != tuple(feature.shape):
        return f"decodes to an image of shape {list(image.shape)}, but the schema says {list(feature.shape)}"
    return None


# --- user preprocessing ------------------------------------------------------------------------


def check_preprocess(preprocess: Any, features: dict[str, Feature], needed: tuple[str, ...]) -> None:
    """Traces data.preprocess once on the decoded batch's specs, so a wrong return is a clear start-up error."""
    name = f"{preprocess.__module__}:{preprocess.__qualname__}"
    given = {n: _batch_spec(stored(features[n])) for n in needed}
    try:
        result = tf.function(preprocess, autograph=True).get_concrete_function(given).structured_outputs
    except Exception as exc:  # the user's function failed on symbolic tensors: show its own message
        raise SpecError(
            f"data.preprocess: {name} raised {type(exc).__name__} on a batch of {_shapes(given)}: {exc}"
        ) from exc
    if not isinstance(result, dict):
        raise SpecError(
            f"data.preprocess: {name} returned a {type(result).__name__}; it must return the dict of "
            f"features it was given ({_shapes(given)})"
        )
    missing = [n for n in needed if n not in result]
    if missing:
        raise SpecError(
            f"data.preprocess: {name} returned no {', '.join(map(repr, missing))} (named by data.inputs or "
            f"data.label); it returned: {', '.join(sorted(result)) or 'an empty dict'}"
        )


def _batch_spec(feature: StoredFeature) -> tf.TensorSpec:
    dtype = tf.float32 if feature.dtype == "uint8" else _TF_DTYPE[feature.dtype]
    return tf.TensorSpec((None, *feature.shape), dtype)


def _shapes(specs: dict[str, tf.TensorSpec]) -> str:
    return ", ".join(f"{n}: {s.dtype.name}{list(s.shape)}" for n, s in specs.items())
