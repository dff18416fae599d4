"""runner: a containerised batch job runner for TensorFlow/Keras on Cloud TPU."""

import time

# The start of the clock every summary's `startup_s` is measured from (the interpreter's own start-up,
# tens of milliseconds, comes before it and is not counted).
PROCESS_START = time.monotonic()

__version__ = "0.1.0"
