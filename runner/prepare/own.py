"""Your own data for `runner prepare`: numpy arrays and CSV tables as a `Dataset`, every value checked.

    arrays  a .npz file or a folder of .npy files. `--features x --label y` name the arrays; `x_train`,
            `x_test`, ... (keys or file stems) are ready-made splits, plain `x` and `y` are split by
            `--split`. Lengths must agree, labels and inputs hold no NaN or infinity.
    csv     a table with a header row. Each column becomes one feature of shape []: whole numbers int64,
            other numbers float32, anything else a category stored as an int64 id into a vocabulary kept
            in the manifest (`preprocessing.vocabularies`). A text label becomes class ids with
            `class_names`; a number label stays a number (a regression target is float32). A missing
            value (MISSING: empty, NA, NaN, null, ...) in a column used is never made a number or a
            category: every one is reported in one pass, or `--missing` drops or fills them
            (runner/prepare/missing.py).

A problem stops the run before anything is written (runner/prepare/shards.py publishes only a whole
dataset) and names the file and the key, row or column: DataError, exit 2.
Images are runner/prepare/images.py's, TensorFlow Datasets folders runner/prepare/tfds.py's.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import zipfile
from pathlib import Path

import numpy as np

from runner import DataError, SpecError
from runner.data import rows as rows_of
from runner.data.schema import Feature
from runner.prepare import missing
from runner.prepare.datasets import Dataset

log = logging.getLogger(__name__)

# The order records are shuffled in before a --split cut: fixed, so preparing twice gives the same shards.
SPLIT_SEED = 0
# Three splits: a job that selects by its validation figures (early stopping, learning-rate cuts) does so on
# `validation`, never on `test`, whose figures the summary reports (runner/data/splits.py).
DEFAULT_SPLIT = "train=0.8,validation=0.1,test=0.1"


def parse_split(text: str) -> dict[str, float]:
    """`train=0.9,test=0.1` -> {"train": 0.9, "test": 0.1}; fractions above 0 that add up to 1."""
    fractions: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        try:
            fraction = float(value)
        except ValueError:
            fraction = math.nan
        if not sep or not name.strip() or not math.isfinite(fraction) or not 0 < fraction <= 1:
            raise SpecError(f"--split {text!r}: {part.strip()!r} must look like name=fraction (e.g. train=0.9)")
        if not name.strip().isidentifier():
            raise SpecError(f"--split {text!r}: split name {name.strip()!r} must be a plain name such as train or test")
        fractions[name.strip()] = fraction
    total = sum(fractions.values())
    if abs(total - 1) > 1e-6:
        raise SpecError(
            f"--split {text!r}: the fractions add up to {total:g}; they must add up to 1, "
            f"e.g. --split {_adding_up(fractions)}"
        )
    return fractions


def _adding_up(fractions: dict[str, float]) -> str:
    """The fractions made to add up to 1: the last one takes the difference, or all are scaled when it cannot."""
    *first, last = fractions
    rest = 1 - sum(fractions[name] for name in first)
    fixed = {**fractions, last: rest} if rest > 1e-6 else {name: v / sum(fractions.values()) for name, v in
                                                            fractions.items()}
    return ",".join(f"{name}={round(value, 4):g}" for name, value in fixed.items())


def split_rows(count: int, fractions: dict[str, float], where: str) -> dict[str, np.ndarray]:
    """Row indices per split: a fixed shuffle (SPLIT_SEED), cut by the fractions, each split sorted."""
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    bounds = np.round(np.cumsum([0.0, *fractions.values()]) * count).astype(int)
    rows = {name: np.sort(order[bounds[i] : bounds[i + 1]]) for i, name in enumerate(fractions)}
    empty = [name for name, chosen in rows.items() if not len(chosen)]
    if empty:
        raise DataError(
            f"{where}: {count} records leave split {empty[0]!r} empty with --split "
            f"{','.join(f'{k}={v:g}' for k, v in fractions.items())}; give it a larger fraction or add records"
        )
    return rows


# --- arrays ---------------------------------------------------------------------------------------


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """name -> array from a .npz file or a folder of .npy files; never unpickles (a pickle runs code)."""
    try:
        if path.is_dir():
            files = sorted(path.glob("*.npy"))
            if not files:
                raise DataError(f"{path} holds no .npy files; name a .npz file or a folder of .npy arrays")
            arrays = {}
            for file in files:
                try:
                    arrays[file.stem] = np.load(file, allow_pickle=False)
                except (ValueError, OSError) as exc:
                    raise DataError(f"{file}: not a readable .npy array ({exc})") from None
            return arrays
        with np.load(path, allow_pickle=False) as archive:
            if not hasattr(archive, "files"):
                return {path.stem: np.asarray(archive)}
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise DataError(f"{path} not found: name a .npz file or a folder of .npy files") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npz/.npy file ({exc})") from None


def _feature_of(array: np.ndarray, where: str) -> Feature:
    if array.dtype == np.uint8:
        return Feature("uint8", tuple(array.shape[1:]))
    if array.dtype.kind in "biu":
        return Feature("int64", tuple(array.shape[1:]))
    if array.dtype.kind == "f":
        return Feature("float32", tuple(array.shape[1:]))
    raise DataError(f"{where}: dtype {array.dtype} is not a number; store numbers (uint8, integers or floats)")


_CASTS = {"uint8": np.uint8, "int64": np.int64, "float32": np.float32}


def _check_finite(array: np.ndarray, where: str) -> None:
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array.reshape(len(array), -1)).all(axis=1)
        if bad.any():
            raise DataError(
                f"{where}: record {int(np.argmax(bad))} (counting from 0) holds NaN or infinity "
                f"({int(bad.sum())} records do); replace or drop them"
            )


def arrays_dataset(path: str, features: tuple[str, ...], label: str, split: str | None = None) -> Dataset:
    """A .npz file or a folder of .npy files as a Dataset (see the module docstring)."""
    source = Path(path)
    arrays = _read_arrays(source)
    names = (*features, label)
    presplit = {
        key[len(label) + 1 :] for key in arrays if key.startswith(f"{label}_") and label not in arrays
    }
    if presplit:
        if split is not None:
            raise SpecError(f"{source} holds ready-made splits ({', '.join(sorted(presplit))}); drop --split")
        tables = {}
        for part in sorted(presplit, key=lambda s: (s != "train", s)):
            tables[part] = {name: _array(arrays, f"{name}_{part}", source) for name in names}
            for name, values in tables[part].items():
                _check_finite(values, f"{source}: {name}_{part}")
    else:
        table = {name: _array(arrays, name, source) for name in names}
        _same_length(table, source)
        for name, values in table.items():  # before the split: record numbers are the file's
            _check_finite(values, f"{source}: {name}")
        rows = split_rows(len(table[label]), parse_split(split or DEFAULT_SPLIT), str(source))
        tables = {part: {name: values[chosen] for name, values in table.items()} for part, chosen in rows.items()}
    kinds: dict[str, Feature] = {}
    for part, table in tables.items():
        _same_length(table, source, part)
        for name, values in table.items():
            key = name if not presplit else f"{name}_{part}"
            feature = _feature_of(values, f"{source}: {key}")
            if kinds.setdefault(name, feature) != feature:
                raise DataError(
                    f"{source}: {key} is {feature.dtype} of shape {list(feature.shape)}, but another split's "
                    f"{name} is {kinds[name].dtype} of shape {list(kinds[name].shape)}; every split must agree"
                )
    splits = {
        part: {name: table[name].astype(_CASTS[kinds[name].dtype], copy=False) for name in names}
        for part, table in tables.items()
    }
    return Dataset(
        source.stem if source.is_file() else source.name, splits, kinds, tuple(features), label,
        source=f"numpy arrays {source} (runner prepare arrays)", license="as the data's owner states",
    )


def _array(arrays: dict[str, np.ndarray], key: str, source: Path) -> np.ndarray:
    if key not in arrays:
        raise DataError(f"{source} has no array {key!r}; it holds: {', '.join(sorted(arrays)) or 'nothing'}")
    value = arrays[key]
    if value.ndim == 0:
        raise DataError(f"{source}: {key} is a single value, not one value per record")
    return value


def _same_length(table: dict[str, np.ndarray], source: Path, part: str | None = None) -> None:
    lengths = {name: len(values) for name, values in table.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name}{'_' + part if part else ''}: {n:,}" for name, n in lengths.items())
        raise DataError(f"{source}: the arrays hold different numbers of records ({shown}); they must match")


# --- CSV ------------------------------------------------------------------------------------------


_INT64 = np.iinfo(np.int64)


def _numbers(cells: list[str], kind: str, lines: list[int], path: Path, column: str) -> np.ndarray:
    if kind != "float32":  # a 20-digit id is a whole number numpy cannot hold as int64
        wide = next((i for i, c in enumerate(cells) if not _INT64.min <= int(c) <= _INT64.max), None)
        if wide is not None:
            raise DataError(
                f"{path}:{lines[wide]}: column {column!r} is {cells[wide]}, beyond a 64-bit integer: an identifier "
                "is no number to learn from; leave the column out (--features names the ones to keep)"
            )
    values = np.array([float(c) for c in cells] if kind == "float32" else [int(c) for c in cells])
    if kind == "float32":
        bad = ~np.isfinite(values)
        if bad.any():
            first = int(np.argmax(bad))
            raise DataError(
                f"{path}:{lines[first]}: column {column!r} is {cells[first]!r}; numbers must be finite: fill or "
                f"drop that row ({int(bad.sum())} rows of this column are NaN or infinite)"
            )
    return values.astype(_CASTS[kind])


def _did_you_mean(name: str, columns: list[str]) -> str:
    close = difflib.get_close_matches(name, columns, n=1) or [c for c in columns if c.lower() == name.lower()]
    return f" (did you mean {close[0]!r}?)" if close else ""


def csv_dataset(path: str, label: str, features: tuple[str, ...] = (), split: str | None = None,
                missing_cells: str | None = None) -> Dataset:
    """A CSV table as a Dataset (see the module docstring): one feature per column, types inferred;
    `missing_cells`: --missing (runner/prepare/missing.py)."""
    source = Path(path)
    rule = missing.parse_missing(missing_cells)
    header, rows, lines = rows_of.read_csv(source)
    if label not in header:
        raise DataError(f"{source}: no column {label!r} for --label{_did_you_mean(label, header)}; the columns "
                        f"are: {', '.join(header)}")
    unknown = [name for name in features if name not in header]
    if unknown:
        raise DataError(f"{source}: no column {unknown[0]!r} for --features{_did_you_mean(unknown[0], header)}; "
                        f"the columns are: {', '.join(header)}")
    inputs = tuple(features) or tuple(name for name in header if name != label)
    if label in inputs:
        raise SpecError(f"--features names the label column {label!r}; the label is not an input")
    columns = {name: [row[header.index(name)].strip() for row in rows] for name in (*inputs, label)}
    # Before the kinds: one 'NA' would make a column of ages a category, a 'NaN' label a class.
    gaps = missing.gaps_of(columns)
    if rule is None:
        missing.refuse(gaps, columns, lines, source, label)
    kept = (missing.kept_records(gaps, rule, label, list(columns), source, len(rows)) if rule
            else list(range(len(rows))))
    columns = {name: [cells[i] for i in kept] for name, cells in columns.items()}
    lines = [lines[i] for i in kept]
    fractions = parse_split(split or DEFAULT_SPLIT)
    done = {}
    if rule is not None:
        left = missing.gaps_of(columns)
        # The cut that follows, made now: a median is taken over the training split only.
        cut = split_rows(len(lines), fractions, str(source)) if left else {}
        training = cut.get("train", next(iter(cut.values()), None))
        filled = missing.fill(columns, left, rule, training.tolist(), source) if left else {}
        done = {"missing": {"rule": "drop" if rule.drop else "fill", "dropped": len(rows) - len(kept),
                            **({"filled": filled} if filled else {})}}
        log.info("--missing %s: %d of %d records left out%s", missing_cells, len(rows) - len(kept), len(rows),
                 "".join(f"; {n}: {f['cells']} cells filled with {f['value']!r}" for n, f in filled.items()))
    values: dict[str, np.ndarray] = {}
    kinds: dict[str, Feature] = {}
    vocabularies: dict[str, list[str]] = {}
    class_names: tuple[str, ...] = ()
    for name, cells in columns.items():
        kind = rows_of.column_kind(cells)
        if name == label and kind == "float32":
            nan = [i for i, cell in enumerate(cells) if not math.isfinite(float(cell))]
            if nan:
                raise DataError(f"{source}:{lines[nan[0]]}: label {label!r} is {cells[nan[0]]!r}; every label must "
                                "be a finite number or a class name: fix or drop that row")
        if kind == "category":
            vocabulary = sorted(set(cells))
            index = {word: i for i, word in enumerate(vocabulary)}
            values[name] = np.array([index[c] for c in cells], dtype=np.int64)
            kinds[name] = Feature("int64", ())
            if name == label:
                class_names = tuple(vocabulary)
            else:
                vocabularies[name] = vocabulary
        else:
            values[name] = _numbers(cells, kind, lines, source, name)
            kinds[name] = Feature(kind, ())
    chosen = split_rows(len(lines), fractions, str(source))
    splits = {part: {name: column[at] for name, column in values.items()} for part, at in chosen.items()}
    preprocessing = {
        "columns": {name: ("category" if name in vocabularies else kinds[name].dtype) for name in inputs},
        **({"vocabularies": vocabularies} if vocabularies else {}),
        **done,
        "split": {"fractions": fractions, "seed": SPLIT_SEED},
    }
    return Dataset(
        source.stem, splits, kinds, inputs, label, source=f"CSV table {source} (runner prepare csv)",
        license="as the data's owner states", preprocessing=preprocessing, class_names=class_names,
    )


def default_out(form: str, location: str) -> str:
    """`data/<name>` for a form's input when --out is not given."""
    stem = Path(location.rstrip("/")).name
    stem = stem.split(".")[0] if form in ("arrays", "csv", "text") else stem
    return os.path.join("data", stem or form)
