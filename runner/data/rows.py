"""The user's own files as `runner prepare` reads them: a CSV's header, records and missing cells, an image
decoded and resized. `runner prepare` (runner/prepare/) writes shards from them; predict (runner/job/predict.py)
reads rows for the model from them, so a row given to predict is read exactly as a training record was.
"""

from __future__ import annotations

import csv
import io
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
