"""The user's own files as `runner prepare` reads them: a CSV's header, records and missing cells, an image
decoded and resized. `runner prepare` (runner/prepare/) writes shards from them; predict (runner/job/predict.py)
reads rows for the model from them, so a row given to predict is read exactly as a training record was.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import tensorflow as tf

from runner import DataError

# What keras.utils.image_dataset_from_directory lists (its ALLOWLIST_FORMATS).
IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")
CHANNELS = {"rgb": 3, "grayscale": 1, "rgba": 4}

# The cells that say "no value": pandas' default na_values for read_csv, exact and case-sensitive, compared
# after the cell's spaces are stripped. Tables written by pandas (NaN as ''), R ('NA'), spreadsheets ('#N/A')
# and databases ('NULL') mark a gap so. Not one is a number, and as a category it would teach a model that "no
# value" is a class (or, in a label, be one): so a missing cell is refused unless `--missing` says what to do.
MISSING = frozenset({
    "", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
    "NA", "NULL", "NaN", "None", "n/a", "nan", "null",
})


def read_csv(path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """The header, the records and each record's first line in the file (blank lines and quoted line breaks
    make it other than the record's number + 2, and an error must name the line the user opens)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{path} not found") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise DataError(f"{path}: not a readable UTF-8 text file ({exc})") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except StopIteration:
        raise DataError(f"{path} is empty; a CSV needs a header row and records") from None
    header = [name.strip() for name in header]
    if len(set(header)) != len(header) or not all(header):
        raise DataError(f"{path}:1: the header names every column once ({', '.join(map(repr, header))})")
    rows, lines = [], []
    end = reader.line_num  # the header's last line
    try:
        for row in reader:
            start, end = end + 1, reader.line_num
            if not row:
                continue  # a blank line
            if len(row) != len(header):
                raise DataError(
                    f"{path}:{start}: {len(row)} fields, the header has {len(header)}; "
                    "fix that row (a comma inside a value needs quotes)"
                )
            rows.append(row)
            lines.append(start)
    except csv.Error as exc:
        raise DataError(f"{path}:{reader.line_num}: {exc}") from None
    if not rows:
        raise DataError(f"{path} holds a header and no records")
    return header, rows, lines


def json_lines(path: str, lines: list[str]) -> Iterator[tuple[int, str, object]]:
    """(line number, line, its JSON value) of each non-blank line of a JSONL file: what `runner prepare text` and
    `runner predict` on prompts read alike; a line that is not JSON is a DataError naming the file and line."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, line, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not a JSON object ({exc.msg}); each line holds one object") from None


def column_kind(cells: list[str]) -> str:
    """int64 when every cell is a whole number, float32 when every cell is a number, else category."""

    def parses(cast) -> bool:
        try:
            for cell in cells:
                cast(cell)
        except ValueError:
            return False
        return True

    if parses(int):
        return "int64"
    if parses(float):
        return "float32"
    return "category"


def decode_image(path: Path, channels: int, size: tuple[int, int] | None) -> np.ndarray:
    """An image file as uint8 [height, width, channels]: decoded by TensorFlow (a GIF's first frame), resized
    to `size` with bilinear interpolation (Keras's default) and rounded when it has another size."""
    try:
        data = path.read_bytes()
        image = tf.io.decode_image(data, channels=channels, expand_animations=False)
    except (OSError, tf.errors.InvalidArgumentError, tf.errors.UnknownError) as exc:
        reason = getattr(exc, "message", str(exc)).splitlines()[0]
        raise DataError(f"{path}: not a readable image ({reason}); fix or remove it") from None
    if size is not None and tuple(image.shape[:2]) != tuple(size):
        resized = tf.image.resize(image, size, method="bilinear")
        image = tf.cast(tf.round(tf.clip_by_value(resized, 0, 255)), tf.uint8)
    return image.numpy()


# --- rows for predict, read as `runner prepare` read the training data -------------------------------------


def vocabulary_of(manifest: dict, name: str) -> list[str] | None:
    """A category column's words (id = position) from the manifest, None for a column of numbers."""
    words = (manifest.get("preprocessing") or {}).get("vocabularies", {}).get(name)
    return words if isinstance(words, list) else None


def word_ids(words: list[str], vocabulary: list[str], known_in: str, where: Callable[[int], str]) -> np.ndarray:
    """Category words as the ids training stored; a word never seen in training stops, naming where it is
    (`where(row)`), the words the model knows and where they are recorded (`known_in`): an unknown category
    has no id that means it."""
    index = {word: i for i, word in enumerate(vocabulary)}
    for i, word in enumerate(words):
        if word not in index:
            close = [w for w in vocabulary if w.lower() == word.lower()] or difflib.get_close_matches(
                word, vocabulary, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = ", ".join(map(repr, vocabulary[:20])) + (", ..." if len(vocabulary) > 20 else "")
            raise DataError(f"{where(i)}: {word!r} is not a category the model was trained on{hint}; {known_in} "
                            f"knows {known}: give one of those")
    return np.array([index[word] for word in words], dtype=np.int64)


def csv_inputs(path: Path, inputs: tuple[str, ...], features: dict, manifest: dict,
               manifest_path: str) -> tuple[dict[str, np.ndarray], list[int]]:
    """The inputs of every record of a CSV (other columns, the label among them, are ignored): category words
    mapped through the manifest's vocabularies, missing cells filled as `--missing fill` filled them in training
    (`preprocessing.missing`), numbers as the feature's dtype. Returns the arrays and each record's line."""
    header, records, lines = read_csv(path)
    absent = [name for name in inputs if name not in header]
    if absent:
        raise DataError(f"{path}: no column {absent[0]!r}, an input of the model (data.inputs: {', '.join(inputs)}); "
                        f"the columns are: {', '.join(header)}")
    missing = (manifest.get("preprocessing") or {}).get("missing") or {}
    filled = missing.get("filled") or {}
    arrays = {}
    for name in inputs:
        cells = [record[header.index(name)].strip() for record in records]
        for i, cell in enumerate(cells):
            if cell not in MISSING:
                continue
            if name not in filled:
                how = {"drop": "training left out records with a gap (--missing drop)",
                       "fill": f"training filled no gap in {name!r}"}.get(missing.get("rule"), "training had none")
                raise DataError(f"{path}:{lines[i]}: column {name!r} is missing ({cell!r}); {how}: fill it in")
            cells[i] = filled[name]["value"]
        vocabulary = vocabulary_of(manifest, name)
        if vocabulary is not None:
            arrays[name] = word_ids(cells, vocabulary, f"{manifest_path} (preprocessing.vocabularies)",
                                    lambda i, name=name: f"{path}:{lines[i]}: column {name!r}")
            continue
        arrays[name] = _numbers(cells, features[name].dtype, name, path, lines)
    return arrays, lines


def csv_labels(path: Path, label: str, dtype: str, class_names: list[str] | None, manifest_path: str) -> np.ndarray:
    """A CSV's label column as training stored it: class ids through `class_names` for text labels, else
    numbers; a missing label stops (no label was made up in training either)."""
    header, records, lines = read_csv(path)
    if label not in header:
        raise DataError(f"{path}: no column {label!r} (data.label): evaluate needs the labels; the columns are: "
                        f"{', '.join(header)}")
    cells = [record[header.index(label)].strip() for record in records]
    gap = next((i for i, cell in enumerate(cells) if cell in MISSING), None)
    if gap is not None:
        raise DataError(f"{path}:{lines[gap]}: label {label!r} is missing ({cells[gap]!r}): fill it in or drop the row")
    if class_names:
        return word_ids(cells, list(class_names), f"{manifest_path} (class_names)",
                        lambda i: f"{path}:{lines[i]}: label {label!r}")
    values = _numbers(cells, dtype, label, path, lines)
    return values.astype(np.int64 if dtype == "int64" else np.float32)


def _numbers(cells: list[str], dtype: str, name: str, path: Path, lines: list[int]) -> np.ndarray:
    values = []
    for i, cell in enumerate(cells):
        try:
            values.append(float(cell))
        except ValueError:
            raise DataError(f"{path}:{lines[i]}: column {name!r} is {cell!r}; the model was trained on numbers "
                            f"there ({dtype}): give a number") from None
    return np.array(values, dtype=np.float64)  # checked against the training range by the caller, then cast


def image_inputs(path: Path, shape: tuple[int, ...]) -> tuple[np.ndarray, list[str], list[str]]:
    """An image file, or every image in a folder (sorted; other files skipped, as `prepare images` skips them),
    as uint8 [height, width, channels] of the model's input `shape`: decoded into its channels and resized
    (bilinear, as `prepare images --size` resizes) when of another size. Returns the images, each one's path,
    and notes."""
    if len(shape) != 3 or shape[2] not in CHANNELS.values():
        raise DataError(f"{path}: the model's input is not an image ([height, width, channels]: {list(shape)})")
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise DataError(f"{path} holds no {'/'.join(IMAGE_EXTENSIONS)} images")
    images, resized = [], []
    for file in files:
        image = decode_image(file, shape[2], None)
        if image.shape != tuple(shape):
            resized.append(f"{file.name} ({image.shape[0]}x{image.shape[1]})")
            image = decode_image(file, shape[2], shape[:2])
        images.append(image)
    notes = [f"resized to {shape[0]}x{shape[1]} (bilinear, as `runner prepare images --size` does): "
             f"{', '.join(resized[:5])}{', ...' if len(resized) > 5 else ''}"] if resized else []
    names = [str(f.relative_to(path)) if path.is_dir() else f.name for f in files]
    return np.stack(images), names, notes
