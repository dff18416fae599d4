"""Writes a small image folder the way a Keras user keeps one: one subfolder per class, PNG files.

    python make_images.py [--out data/lines] [--count 200]

Grey noise with one bright line, horizontal or vertical (the class), 20x20 pixels, in data/lines/train/<class>/
and data/lines/test/<class>/. Offline: the pixels come from numpy and are written by Pillow.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def write(folder: Path, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for name in ("horizontal", "vertical"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            pixels = rng.integers(0, 60, (20, 20), dtype=np.uint8)
            at = rng.integers(2, 18)
            if name == "horizontal":
                pixels[at, :] = 255
            else:
                pixels[:, at] = 255
            Image.fromarray(pixels).save(folder / name / f"{index:04d}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/lines"))
    parser.add_argument("--count", type=int, default=200, help="training images per class (a quarter for test)")
    args = parser.parse_args()
    write(args.out / "train", args.count, seed=0)
    write(args.out / "test", max(1, args.count // 4), seed=1)
    print(f"{args.out}: {2 * args.count} training and {2 * max(1, args.count // 4)} test images")


if __name__ == "__main__":
    main()
