"""Model FLOPs and this host's peak for runner_vs_keras.py, in a child process (the benchmark's own process
loads no TensorFlow): the MNIST Basic CNN counted by runner/train/flops.py, the CPU's peak per dtype by
runner/device/peak.py (measured once per host and cached). Prints one JSON line. Not a benchmark on its own.

    python benchmarks/_mfu.py --batch 1024 [--cache-dir DIR]
"""

import argparse
import json

from _common import REPO  # noqa: F401  (puts the repository on sys.path)

from runner import models
from runner.data.schema import Feature
from runner.device import peak
from runner.train import flops

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=1024)
parser.add_argument("--cache-dir", default=None)
args = parser.parse_args()

model = models.build("mnist_cnn", {}, {"image": Feature(shape=(28, 28, 1), dtype="float32")}, ("image",))
per_example, method = flops.count(model, args.batch)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
peaks = {p: peak.peak_tflops("cpu", None, p, cache_dir=args.cache_dir) for p in ("bfloat16", "float32")}
print(json.dumps({
    "flops_per_example": per_example, "flops_method": method, "step_flops_per_example": flops.step_flops(model, 64),
    "peaks": {p: {"tflops": v, "source": s} for p, (v, s) in peaks.items()}, "cpu": peak.cpu_model(),
}))
