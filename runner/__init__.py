"""runner: a containerised batch job runner for TensorFlow/Keras on Cloud TPU."""

import os
import time

# The start of the clock every summary's `startup_s` is measured from (the interpreter's own start-up,
# tens of milliseconds, comes before it and is not counted).
PROCESS_START = time.monotonic()

__version__ = "0.1.0"

# TensorFlow's C++ start-up notices (absl's InitializeLog warning, CPU feature and oneDNN lines) are noise to
# a user: hidden unless the environment asks for them. TensorFlow reads this once, when it loads, which is
# after this package; `--debug` sets it to 0 first (runner/cli/common.py).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
