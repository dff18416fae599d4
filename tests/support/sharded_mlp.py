"""A small MLP for sharding tests: 784 -> 256 -> 256 -> 10 on MNIST images. Its two big kernels (200,704 and
65,536 values) are over runner/spec/sharding.py's FSDP_MIN_ELEMENTS, every width divisible by 4 and 8;
`params.hidden` changes the widths (an odd width makes a layout the mesh cannot divide)."""

import keras


def build(params, features, inputs):
    hidden = int(params.get("hidden", 256))
    x = keras.Input((28, 28, 1))
    y = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))
    y = keras.layers.Dense(hidden, activation="relu", name="wide")(y)
    y = keras.layers.Dense(hidden, activation="relu", name="middle")(y)
    return keras.Model(x, keras.layers.Dense(10, activation="softmax", name="out")(y))
