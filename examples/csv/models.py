"""A model of the CSV's columns: `model.name: models:tabular`. Each column is its own named input.

Numbers are scaled by the ranges `runner prepare` recorded (manifest.json, value_ranges), copied into
model.params; a category arrives as its id into the manifest's preprocessing.vocabularies and is one-hot encoded.
"""

from __future__ import annotations

import tensorflow as tf

keras = tf.keras


def tabular(params, features, inputs):
    given, encoded = {}, []
    for name in inputs:  # each column is a scalar per record: shape []
        category = name in params["categories"]
        given[name] = keras.Input(shape=(), name=name, dtype="int64" if category else "float32")
        column = keras.layers.Reshape((1,))(given[name])
        if category:
            encoded.append(keras.layers.CategoryEncoding(params["categories"][name], output_mode="one_hot")(column))
        else:
            low, high = params["ranges"][name]
            encoded.append(keras.layers.Rescaling(1 / (high - low), offset=-low / (high - low))(column))
    x = keras.layers.Concatenate()(encoded)
    x = keras.layers.Dense(16, activation="relu")(x)
    out = keras.layers.Dense(2, activation="softmax", dtype="float32")(x)
    return keras.Model(given, out, name="umbrella")
