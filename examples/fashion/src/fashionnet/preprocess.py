"""Preprocessing the runner applies in its tf.data map: `data.preprocess: fashionnet.preprocess:standardize`."""

from __future__ import annotations

import tensorflow as tf

# Pixel mean and standard deviation of the Fashion-MNIST training images (0..255 scale).
MEAN, STD = 72.94, 90.02


def standardize(batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """Gets a decoded batch (image: float32 [batch, 28, 28, 1] in 0..255, label: int64 [batch]); returns it."""
    return {**batch, "image": (batch["image"] - MEAN) / STD}
