"""A folder of images, one subfolder per class, as `runner prepare images` reads it.

The layout `keras.utils.image_dataset_from_directory` reads (labels "inferred"): FOLDER/<class>/<image>,
classes in sorted order of their subfolder names (class id = position), files ending .bmp .gif .jpeg .jpg
.png (other files are skipped, as Keras skips them). Splits: FOLDER/train/<class>/..., FOLDER/test/<class>/...
when every subfolder of FOLDER holds only folders, else `--split` cuts one pool (runner/prepare/own.py).

Each image is decoded by TensorFlow (`tf.io.decode_image`, the first frame of a GIF) into `color` channels
(rgb: 3, grayscale: 1, rgba: 4, as Keras's `color_mode`), resized to `size` with bilinear interpolation
(Keras's default) and rounded to uint8, or, without `size`, must have the first image's size. It is stored
re-encoded as PNG (lossless: the pixels decoded here) or raw (`store`). An image that does not decode
stops the run naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

from runner import DataError, SpecError
from runner.data import rows
from runner.data.schema import StoredFeature
from runner.prepare import own
from runner.prepare.datasets import Dataset
from runner.prepare.shards import progress_bar

EXTENSIONS, CHANNELS = rows.IMAGE_EXTENSIONS, rows.CHANNELS
STORES = ("png", "raw")


def parse_size(text: str) -> tuple[int, int]:
    """`180x180` -> (180, 180): height x width, as Keras's image_size."""
    height, sep, width = text.lower().partition("x")
    if not sep or not height.strip().isdigit() or not width.strip().isdigit() or "0" in (height.strip(), width.strip()):
        raise SpecError(f"--size {text!r} must be HEIGHTxWIDTH in pixels, e.g. --size 180x180")
    return int(height), int(width)


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)


def _classes(folder: Path) -> dict[str, list[Path]]:
    subfolders = sorted(p for p in folder.iterdir() if p.is_dir())
    if not subfolders:
        raise DataError(f"{folder} has no subfolders: put each class's images in a subfolder named for the class")
    return {p.name: _images_in(p) for p in subfolders}


def _layout(folder: Path) -> dict[str, dict[str, list[Path]]] | None:
    """split -> class -> files when FOLDER holds split folders (each holding only class folders), else None."""
    subfolders = sorted(p for p in folder.iterdir() if p.is_dir())
    if subfolders and all(
        any(c.is_dir() for c in s.iterdir()) and not any(c.is_file() and c.suffix.lower() in EXTENSIONS
                                                          for c in s.iterdir())
        for s in subfolders
    ):
        return {s.name: _classes(s) for s in sorted(subfolders, key=lambda s: (s.name != "train", s.name))}
    return None


def images_dataset(
    location: str, size: str | None = None, color: str = "rgb", store: str = "png", split: str | None = None
) -> Dataset:
    """The image folder as a Dataset: feature `image` (uint8 [height, width, channels], PNG or raw) and
    `label` (int64 class id), class names in the manifest."""
    folder = Path(location)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder: name the folder whose subfolders hold each class's images")
    if color not in CHANNELS:
        raise SpecError(f"--color {color!r}: one of {', '.join(CHANNELS)}")
    if store not in STORES:
        raise SpecError(f"--store {store!r}: png (encoded, smaller) or raw (decoded, faster to read)")
    asked = shape = parse_size(size) if size else None
    layout = _layout(folder)
    if layout is not None and split is not None:
        raise SpecError(f"{folder} holds split folders ({', '.join(layout)}); drop --split")
    if layout is not None:
        names = sorted(layout["train"]) if "train" in layout else sorted(next(iter(layout.values())))
        for part, classes in layout.items():
            extra = sorted(set(classes) - set(names))
            if extra:
                raise DataError(f"{folder / part / extra[0]}: class {extra[0]!r} is not among the training classes "
                                f"({', '.join(names)}); every split must use the same class folders")
        files = {part: [(path, names.index(c)) for c in sorted(classes) for path in classes[c]]
                 for part, classes in layout.items()}
    else:
        classes = _classes(folder)
        names = sorted(classes)
        pool = [(path, names.index(c)) for c in names for path in classes[c]]
        if not pool:
            raise DataError(f"{folder}: its class folders hold no {'/'.join(EXTENSIONS)} images")
        cut = own.split_rows(len(pool), own.parse_split(split or own.DEFAULT_SPLIT), str(folder))
        files = {part: [pool[i] for i in chosen] for part, chosen in cut.items()}
    empty = [part for part, listed in files.items() if not listed]
    if empty:
        raise DataError(f"{folder / empty[0]} holds no {'/'.join(EXTENSIONS)} images")
    channels = CHANNELS[color]
    total = sum(len(listed) for listed in files.values())
    splits, low, high = {}, 255, 0
    with progress_bar() as progress:
        task = progress.add_task(f"reading {total} images", total=total)
        for part, listed in files.items():
            images, labels = [], []
            for path, label in listed:
                pixels = rows.decode_image(path, channels, asked)  # only --size resizes; else every image must match
                if shape is None:
                    shape = pixels.shape[:2]
                elif pixels.shape[:2] != tuple(shape):
                    raise DataError(
                        f"{path}: {pixels.shape[0]}x{pixels.shape[1]} pixels, but the images before it are "
                        f"{shape[0]}x{shape[1]}; pass --size HEIGHTxWIDTH to resize every image to one size (e.g. "
                        f"--size {shape[0]}x{shape[1]}, the size of the first)"
                    )
                if part == "train" or (part == next(iter(files)) and "train" not in files):
                    low, high = min(low, int(pixels.min())), max(high, int(pixels.max()))
                images.append(tf.io.encode_png(pixels).numpy() if store == "png" else pixels)
                labels.append(label)
                progress.advance(task)
            stored = np.empty(len(images), dtype=object) if store == "png" else np.stack(images)
            if store == "png":
                stored[:] = images
            splits[part] = {"image": stored, "label": np.array(labels, dtype=np.int64)}
    feature = StoredFeature("uint8", (*shape, channels), False, "png" if store == "png" else "raw")
    return Dataset(
        folder.resolve().name, splits, {"image": feature, "label": StoredFeature("int64", ())}, ("image",), "label",
        source=f"image folder {folder} (runner prepare images; {color}, stored {store})",
        license="as the images' owner states", class_names=tuple(names),
        value_ranges={"image": {"dtype": "uint8", "min": low, "max": high}},
        preprocessing={"images": {"color": color, "size": list(shape), "resize": "bilinear" if size else "none",
                                  "stored": store}},
    )
