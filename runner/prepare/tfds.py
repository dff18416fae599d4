"""A TensorFlow Datasets dataset already on disk, read from its files (`tensorflow-datasets` is not needed).

`tfds.load`/`tfds build` leave a dataset as DATA_DIR/NAME[/CONFIG]/VERSION/ holding dataset_info.json (the
splits, each with `shardLengths`; `supervisedKeys`), features.json (the FeaturesDict) and the records,
`NAME-SPLIT.tfrecord-NNNNN-of-MMMMM`, tf.train.Example with one key per feature (nested dicts joined with
"/"). ClassLabel names come from `<feature>.labels.txt` beside them. Read here:

    Image        encoded bytes (encodingFormat png or jpeg) of a fixed [height, width, channels]
    ClassLabel   an int64 class id
    Tensor       numbers of a fixed shape (ints as int64, floats as float32), or a text scalar
    Text         a text scalar

Anything else (a variable image size, a Sequence, a bytes-encoded tensor) is refused naming the feature:
`--features` may leave it out. The records are re-written by runner/prepare/shards.py: the runner's own
shard sizes, sha256 and value ranges. Record counts are checked against `shardLengths`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from runner import DataError, SpecError
from runner.data.schema import StoredFeature
from runner.prepare.datasets import Dataset
from runner.prepare.shards import progress_bar

_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool")
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def find_version(data_dir: str, name: str) -> Path:
    """DATA_DIR/NAME[/CONFIG]/VERSION for `name` ("mnist", "mnist:3.0.1", "name/config[:version]")."""
    base, _, version = name.partition(":")
    folder = Path(data_dir) / base
    if not folder.is_dir():
        raise DataError(f"{folder} not found: --data-dir names the folder tfds writes to (by default "
                        "~/tensorflow_datasets) and NAME the dataset in it")
    if version:
        chosen = folder / version
        if not (chosen / "dataset_info.json").is_file():
            raise DataError(f"{chosen} holds no dataset_info.json: no version {version} of {base} in {data_dir}")
        return chosen
    versions = [p for p in folder.iterdir() if (p / "dataset_info.json").is_file()]
    if not versions:
        raise DataError(f"{folder} holds no VERSION/dataset_info.json; name the config too (NAME/CONFIG)")
    return max(versions, key=lambda p: tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.]", p.name)))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} not found: a tfds dataset folder holds dataset_info.json and features.json") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _dims(doc: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(d) for d in doc.get("shape", {}).get("dimensions", []))


def _flatten(features: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    flat = {}
    for key, doc in features.items():
        if "featuresDict" in doc:
            flat.update(_flatten(doc["featuresDict"].get("features", {}), f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = doc
    return flat


def schema_of(features_json: dict[str, Any], where: str) -> dict[str, StoredFeature | str]:
    """feature -> its schema, or the reason it cannot be read (a string)."""
    root = features_json.get("featuresDict", {}).get("features")
    if not isinstance(root, dict):
        raise DataError(f"{where}: no featuresDict.features; this is not a tfds features.json")
    found: dict[str, StoredFeature | str] = {}
    for name, doc in _flatten(root).items():
        kind = doc.get("pythonClassName", "?").rsplit(".", 1)[-1]
        if "image" in doc:
            shape, fmt = _dims(doc["image"]), doc["image"].get("encodingFormat", "png")
            if len(shape) != 3 or min(shape) < 1 or fmt not in ("png", "jpeg"):
                found[name] = f"an Image of shape {list(shape)} stored as {fmt!r} (a fixed size, png or jpeg is read)"
            else:
                found[name] = StoredFeature("uint8", shape, False, fmt)
        elif "classLabel" in doc:
            found[name] = StoredFeature("int64", ())
        elif "tensor" in doc or "text" in doc or kind == "Text":
            tensor = doc.get("tensor", {"dtype": "string"})
            shape, dtype = _dims(tensor), tensor.get("dtype", "?")
            if tensor.get("encoding", "none") not in ("none", "NONE", ""):
                found[name] = f"a Tensor stored with encoding {tensor['encoding']!r}"
            elif any(d < 1 for d in shape):
                found[name] = f"a Tensor of variable shape {list(shape)}"
            elif dtype in _INTS:
                found[name] = StoredFeature("int64", shape)
            elif dtype in _FLOATS:
                found[name] = StoredFeature("float32", shape)
            elif dtype == "string" and not shape:
                found[name] = StoredFeature("string", ())
            else:
                found[name] = f"a Tensor of dtype {dtype} and shape {list(shape)}"
        else:
            found[name] = f"a {kind} feature"
    return found


def _supervised(info: dict[str, Any]) -> tuple[str, str] | None:
    keys = info.get("supervisedKeys") or {}
    items = keys.get("tuple", {}).get("items")
    if items and len(items) == 2 and all("featureKey" in i for i in items):
        return items[0]["featureKey"], items[1]["featureKey"]
    if "input" in keys and "output" in keys:
        return keys["input"], keys["output"]
    return None


def _parse_spec(features: dict[str, StoredFeature]) -> dict[str, tf.io.FixedLenFeature]:
    spec = {}
    for name, feature in features.items():
        if feature.decode != "none" or feature.dtype == "string":
            spec[name] = tf.io.FixedLenFeature([], tf.string)
        else:
            spec[name] = tf.io.FixedLenFeature(feature.shape, tf.int64 if feature.dtype == "int64" else tf.float32)
    return spec


def tfds_dataset(name: str, data_dir: str, features: tuple[str, ...] = (), label: str | None = None) -> Dataset:
    """The on-disk tfds dataset `name` as a Dataset (see the module docstring)."""
    folder = find_version(data_dir, name)
    info = _read_json(folder / "dataset_info.json")
    if info.get("fileFormat", "tfrecord") not in ("tfrecord", "TFRECORD"):
        raise DataError(f"{folder}: file format {info['fileFormat']!r}; only tfds's tfrecord files are read")
    found = schema_of(_read_json(folder / "features.json"), str(folder / "features.json"))
    supervised = _supervised(info)
    if label is None and supervised is None:
        raise SpecError(f"{folder / 'dataset_info.json'} names no supervisedKeys: pass --features and --label")
    label = label or supervised[1]
    inputs = tuple(features) or ((supervised[0],) if supervised else ())
    if not inputs:
        raise SpecError(f"{folder}: pass --features (the dataset's features: {', '.join(found)})")
    for key in (*inputs, label):
        if key not in found:
            raise DataError(f"{folder / 'features.json'} has no feature {key!r}; it has: {', '.join(found)}")
        if isinstance(found[key], str):
            raise DataError(f"{folder / 'features.json'}: feature {key!r} is {found[key]}, which is not read here")
    schema = {key: found[key] for key in (*inputs, label)}
    tfds_name = info.get("name", folder.parent.name)
    splits, class_names = {}, ()
    labels_file = folder / f"{label.replace('/', '-')}.labels.txt"
    if labels_file.is_file():
        class_names = tuple(line for line in labels_file.read_text().splitlines() if line)
    listed = info.get("splits", [])
    if not listed:
        raise DataError(f"{folder / 'dataset_info.json'} lists no splits")
    total = sum(sum(int(n) for n in s.get("shardLengths", [])) for s in listed)
    with progress_bar() as progress:
        task = progress.add_task(f"reading {tfds_name} from {folder}", total=total)
        for entry in sorted(listed, key=lambda s: (s["name"] != "train", s["name"])):
            splits[entry["name"]] = _read_split(folder, tfds_name, entry, schema, lambda n: progress.advance(task, n))
    ranges = {}
    train = splits.get("train") or next(iter(splits.values()))
    for key in inputs:
        if schema[key].decode in ("png", "jpeg"):
            low, high = 255, 0
            for data in train[key]:
                pixels = tf.io.decode_image(data, channels=schema[key].shape[2], expand_animations=False).numpy()
                low, high = min(low, int(pixels.min())), max(high, int(pixels.max()))
            ranges[key] = {"dtype": "uint8", "min": low, "max": high}
    version = info.get("version", folder.name)
    return Dataset(
        tfds_name, splits, schema, inputs, label,
        source=f"TensorFlow Datasets {tfds_name} {version} read from {folder} (runner prepare tfds)",
        license=(info.get("redistributionInfo") or {}).get("license") or "as the dataset's catalog page states",
        class_names=class_names, value_ranges=ranges,
    )


def _read_split(folder: Path, name: str, entry: dict[str, Any], schema: dict[str, StoredFeature], advance) -> dict:
    split = entry["name"]
    files = sorted(str(p) for p in folder.glob(f"{name}-{split}.tfrecord-*"))
    lengths = [int(n) for n in entry.get("shardLengths", [])]
    if len(files) != len(lengths):
        raise DataError(
            f"{folder}: split {split!r} lists {len(lengths)} shards in dataset_info.json, {len(files)} files "
            f"named {name}-{split}.tfrecord-* are there"
        )
    columns: dict[str, list[np.ndarray]] = {key: [] for key in schema}
    spec = _parse_spec(schema)
    for path, expected in zip(files, lengths, strict=True):
        count = 0
        try:
            for batch in tf.data.TFRecordDataset(path).batch(256).map(lambda b: tf.io.parse_example(b, spec)):
                for key, tensor in batch.items():
                    columns[key].append(tensor.numpy())
                size = len(next(iter(batch.values())).numpy())
                count += size
                advance(size)
        except tf.errors.OpError as exc:
            raise DataError(f"{path}: cannot be read with features.json ({exc.message.splitlines()[0]})") from None
        if count != expected:
            raise DataError(f"{path}: {count} records, dataset_info.json's shardLengths lists {expected}")
    arrays = {}
    for key, parts in columns.items():
        values = np.concatenate(parts) if parts else np.zeros((0,))
        if values.dtype == object:
            values = np.array(list(values), dtype=object)
        arrays[key] = values
    return arrays
