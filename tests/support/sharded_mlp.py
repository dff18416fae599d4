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


class Hold(keras.callbacks.Callback):
    """At the end of step HOLD_AT_STEP (environment) creates the file HOLD_FILE and waits, at most 120 s, until the
    test removes it: a signal sent meanwhile lands at a known step."""

    def on_train_batch_end(self, batch, logs=None):
        import os
        import time

        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        if str(step) == os.environ.get("HOLD_AT_STEP"):
            held = os.environ["HOLD_FILE"]
            open(held, "w").close()
            deadline = time.monotonic() + 120
            while os.path.exists(held) and time.monotonic() < deadline:
                time.sleep(0.02)
