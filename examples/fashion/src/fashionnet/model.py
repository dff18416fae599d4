"""The model: a build function the runner imports by the path `fashionnet.model:build`."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

# tf.keras is Keras 3, the Keras the runner trains with.
keras = tf.keras

# The defaults are the documentation; a job spec's `model.params` holds only what differs.
DEFAULTS: dict[str, Any] = {"filters": 32, "dense": 128, "dropout": 0.25, "classes": 10}


def build(params: dict[str, Any], features: dict[str, Any], inputs: tuple[str, ...]) -> keras.Model:
    """An uncompiled CNN for the single image input; the runner compiles it from the spec's `train` block.

    `features` maps each feature name to its schema (`.dtype`, `.shape`); `inputs` are `data.inputs`.
    """
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown model.params {unknown}; known: {sorted(DEFAULTS)}")
    p = {**DEFAULTS, **params}
    (name,) = inputs
    image = keras.Input(shape=features[name].shape, name=name)
    x = image
    for scale in (1, 2):
        x = keras.layers.Conv2D(p["filters"] * scale, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(p["dropout"])(x)
    x = keras.layers.Dense(p["dense"], activation="relu")(x)
    # float32 output: under mixed precision a bfloat16 softmax loses the small probabilities.
    out = keras.layers.Dense(p["classes"], activation="softmax", dtype="float32")(x)
    return keras.Model(image, out, name="fashionnet")
