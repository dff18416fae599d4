"""A small CNN for the image folder: `model.name: models:cnn` (the spec's folder is its code folder)."""

from __future__ import annotations

import tensorflow as tf

keras = tf.keras


def cnn(params, features, inputs):
    """features["image"].shape is the manifest's [height, width, channels]; pixels arrive as float32 0..255."""
    (name,) = inputs
    image = keras.Input(shape=features[name].shape, name=name)
    x = keras.layers.Rescaling(1 / 255)(image)
    x = keras.layers.Conv2D(params.get("filters", 8), 3, activation="relu")(x)
    x = keras.layers.GlobalMaxPooling2D()(x)
    out = keras.layers.Dense(params.get("classes", 2), activation="softmax", dtype="float32")(x)
    return keras.Model(image, out, name="lines_cnn")
