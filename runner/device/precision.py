"""`train.mixed_precision`: what a job computes in, and why (the summary's `accelerator.precision`).

`auto` (the default) computes in bfloat16 where the device does so natively and in float32 elsewhere:
every TPU; GPUs of compute capability 8.0 or more; CPUs with AVX512_BF16 or AMX (their flags in
/proc/cpuinfo, read by runner/device/host.py; $RUNNER_CPU_BF16=1 or 0 makes a CPU act as one with them or
without). Variables stay float32 either way, and so does every model's output layer (runner/models.py).
Under `auto`, a model whose output layer would compute in bfloat16 (an own model without `dtype="float32"`
on it) trains in float32, starting from the weights it would have had in float32 at once, and so does a
built-in model listed in runner/models.py's table as kept in float32 on the device (bfloat16 measured to
cost it accuracy, or to be slower there).
`float32`, `bfloat16` and `float16` are taken as asked.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import keras
import numpy as np
import tensorflow as tf

from runner import models
from runner.device import host

log = logging.getLogger(__name__)



@dataclasses.dataclass
class Precision:
    """The policy a job computes in (float32 | bfloat16 | float16), why, and whether `auto` chose it."""

    policy: str
    reason: str
    auto: bool = False

    def to_dict(self) -> dict[str, str]:
        return {"policy": self.policy, "reason": self.reason}

    def apply(self) -> None:
        """Sets Keras's global policy: layers built from now on compute in it (variables stay float32)."""
        keras.mixed_precision.set_global_policy("float32" if self.policy == "float32" else f"mixed_{self.policy}")

    def fall_back(self, reason: str) -> None:
        """`auto` chose bfloat16 but the model cannot have it: float32, with the reason."""
        self.policy, self.reason = "float32", reason
        self.apply()


def random_state() -> tuple:
    """The state the unseeded initializers of a model about to be built draw from (Keras takes their seeds from
    Python's `random`; user code may use NumPy's), for set_random_state()."""
    return random.getstate(), np.random.get_state()


def set_random_state(state: tuple) -> None:
    """Puts back random_state()'s: a model built again in float32 after `auto` fell back starts from the weights
    it would have had where `auto` chose float32 at once (a CPU without a bf16 flag), not from the next draws."""
    random.setstate(state[0])
    np.random.set_state(state[1])


def _gpus() -> list[tuple[str, tuple[int, int] | None]]:
    found = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        found.append((details.get("device_name", gpu.name), details.get("compute_capability")))
    return found


def decide(
    asked: str, model_name: str, kind: str, cpuinfo: str | None = None,
    gpus: list[tuple[str, tuple[int, int] | None]] = (),
    float32_models: dict[tuple[str, str], str] | None = None, cpu_bf16: bool | None = None,
) -> Precision:
    """The precision for `train.mixed_precision` (`asked`) on a device of `kind` (tpu, gpu, cpu), from the
    host's facts as given: the /proc/cpuinfo text, the GPUs' (name, compute capability), the built-in
    models kept in float32 under auto, by (model, kind) (default: runner/models.py's table), and
    $RUNNER_CPU_BF16 as host.cpu_bf16_override() reads it (not None: it decides for a CPU, not the flags)."""
    if asked != "auto":
        return Precision(asked, f"train.mixed_precision: {asked}")
    policy, reason = host.native_precision(kind, cpuinfo, gpus, cpu_bf16)
    if float32_models is None:
        why = models.float32_under_auto(model_name, kind)
    else:
        why = float32_models.get((model_name, kind))
    if policy == "bfloat16" and why:
        policy, reason = "float32", f"{reason}, but model {model_name!r}: {why}: float32"
    return Precision(policy, reason, auto=True)


def choose(asked: str, model_name: str, kind: str) -> Precision:
    """decide() with this host's facts: its CPU flags for a CPU job (or $RUNNER_CPU_BF16 in their place), its
    GPUs' compute capability for a GPU one."""
    override = host.cpu_bf16_override() if kind == "cpu" and asked == "auto" else None
    cpuinfo = host.read_cpuinfo() if kind == "cpu" and asked == "auto" and override is None else None
    gpus = _gpus() if kind == "gpu" and asked == "auto" else []
    return decide(asked, model_name, kind, cpuinfo, gpus, cpu_bf16=override)


def output_layers(model: keras.Model) -> list[str]:
    """The names of the layers that compute the model's outputs, in order."""
    return [getattr(getattr(getattr(t, "_keras_history", None), "operation", None), "name", "?") for t in model.outputs]


def output_not_float32(model: keras.Model) -> str | None:
    """Why the model's output is not float32 (the layer computing it in another type), None when it is."""
    for tensor in model.outputs:
        dtype = getattr(tensor.dtype, "name", tensor.dtype)
        if dtype != "float32":
            layer = getattr(getattr(tensor, "_keras_history", None), "operation", None)
            named = f"its output layer {layer.name!r}" if layer is not None else "its output"
            return f"{named} computes in {dtype} (give that layer dtype='float32' to train the rest in bfloat16)"
    return None


def onednn_enabled() -> bool | None:
    """Whether TensorFlow runs its oneDNN CPU kernels (runner/__init__.py turns them on unless
    TF_ENABLE_ONEDNN_OPTS says otherwise); None when this TensorFlow cannot tell."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    return bool(_pywrap_util_port.IsMklEnabled())
