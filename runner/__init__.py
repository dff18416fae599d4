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

# oneDNN's CPU kernels: TensorFlow turns them on by default only on CPUs with AVX-512 (VNNI, BF16) or AMX. On an
# AVX2-only CPU its Eigen kernels trained the MNIST CNN with twice the CPU time (page faults of freshly mapped
# buffers, 37% of it in the kernel): benchmarks/RESULTS.md, docs/performance.md. `TF_ENABLE_ONEDNN_OPTS=0` keeps
# TensorFlow's own choice.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
