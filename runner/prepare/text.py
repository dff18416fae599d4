"""Labelled texts -> fixed-length token sequences, the way the IMDB LSTM example feeds its model.

`keras.datasets.imdb` hands out word ids already; a text corpus is tokenised here with Keras'
`TextVectorization` (vocabulary from the training split only, so the test split holds unseen words as
out-of-vocabulary). Both paths end with `keras.utils.pad_sequences`: zeros in front and the newest
tokens kept, so an LSTM reads the review last, right before it predicts.
"""

from __future__ import annotations

import bz2
import csv

import numpy as np

from runner import DataError

PAD, OOV = 0, 1  # TextVectorization's reserved ids


def read_reviews(path: str, positive: str, negative: str) -> tuple[list[str], np.ndarray]:
    """(texts, 0/1 labels) from a CSV (optionally .bz2) with `category` and `text` columns; other rows skipped."""
    opener = bz2.open if path.endswith(".bz2") else open
    with opener(path, "rt", encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    texts, labels = [], []
    for row in rows:
        if row.get("category") in (positive, negative):
            texts.append(row["text"].strip())
            labels.append(int(row["category"] == positive))
    if not texts:
        raise DataError(f"{path} holds no rows of category {positive!r} or {negative!r}")
    return texts, np.array(labels, dtype=np.int64)


def split_rows(count: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random split of row indices into train and test."""
    order = np.random.default_rng(seed).permutation(count)
    cut = int(round(count * (1 - test_fraction)))
    return np.sort(order[:cut]), np.sort(order[cut:])


def pad(sequences: list, length: int) -> np.ndarray:
    import keras

    return keras.utils.pad_sequences(sequences, maxlen=length, dtype="int64", padding="pre", truncating="pre",
                                     value=PAD)


def tokenize(
    train_texts: list[str], other_texts: dict[str, list[str]], vocab_size: int, length: int
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Token id sequences (int64, `length` wide) for the training texts and every other split; the vocabulary."""
    import keras

    if vocab_size < 3:
        raise DataError(f"vocab_size ({vocab_size}) must leave room for the padding and out-of-vocabulary ids")
    layer = keras.layers.TextVectorization(max_tokens=vocab_size, output_mode="int")
    layer.adapt(train_texts, batch_size=1024)
    tokens = {}
    for split, texts in {"train": train_texts, **other_texts}.items():
        ids = np.asarray(layer(texts))
        tokens[split] = pad([row[row != PAD] for row in ids], length)
    return tokens, [str(word) for word in layer.get_vocabulary()]
