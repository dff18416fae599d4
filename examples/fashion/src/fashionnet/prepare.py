"""Writes Fashion-MNIST as sharded TFRecords of PNG images: the kind of data a user brings.

    python -m fashionnet.prepare --out data/fashion [--train 60000] [--eval 10000] [--shards 4]

Reads the original idx files (Debian's dataset-fashion-mnist puts them in /usr/share/datasets/fashion-mnist).
Each record is a tf.train.Example with `image` (PNG bytes, 28x28 grey) and `label` (int64, 0-9).
--out may be a local folder or gs://bucket/prefix. Then `runner manifest job.yaml` indexes the shards.
"""

from __future__ import annotations

import argparse
import gzip
import posixpath
from pathlib import Path

import numpy as np
import tensorflow as tf

SOURCE = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "eval": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def example(image: np.ndarray, label: int) -> bytes:
    png = tf.io.encode_png(image[..., np.newaxis]).numpy()
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_split(split: str, count: int, out: str, shards: int, source: Path) -> None:
    images_file, labels_file = FILES[split]
    images, labels = read_idx(source / images_file)[:count], read_idx(source / labels_file)[:count]
    for index, rows in enumerate(np.array_split(np.arange(len(images)), shards)):
        path = posixpath.join(out, f"{split}-{index:05d}-of-{shards:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in rows:
                writer.write(example(images[row], int(labels[row])))
    print(f"{split}: {len(images)} records in {shards} shards under {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder or gs:// prefix for the shards")
    parser.add_argument("--source", type=Path, default=SOURCE, help="folder of the idx .gz files")
    parser.add_argument("--train", type=int, default=60_000, help="training images to write")
    parser.add_argument("--eval", type=int, default=10_000, help="evaluation images to write")
    parser.add_argument("--shards", type=int, default=4, help="shards per split")
    args = parser.parse_args()
    tf.io.gfile.makedirs(args.out)
    write_split("train", args.train, args.out, args.shards, args.source)
    write_split("eval", args.eval, args.out, max(1, args.shards // 4), args.source)


if __name__ == "__main__":
    main()
