"""The devices of a job that computes with TensorFlow: the TensorFlow side of runner/device/strategy.py (the JAX
side is runner/device/jax_devices.py), asked through runner/device/engine.py's `TensorFlow.resolve`.

GPUs: MirroredStrategy over every visible GPU; else the CPU (MirroredStrategy over `accelerator.cpu_devices`
logical devices when more than one). A TPU is JAX's: TensorFlow computes on GPUs or the CPU and never touches a
TPU (its TPU runtimes stop at 2.18 and the images carry tensorflow-cpu: docs/tpu.md), so a TensorFlow job
(`accelerator.backend: tensorflow`) on a machine with a TPU runs on the CPU and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import tensorflow as tf

from runner import AcceleratorError
from runner.device import host
from runner.device.accelerator import Accelerator
from runner.spec.types import AcceleratorSpec

log = logging.getLogger(__name__)


def _split_cpu(devices: int) -> None:
    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0])
    if current is None or len(current) != devices:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(devices)]
        )


def _mirrored(kind: str, devices: int) -> Accelerator:
    if devices > 1:
        strategy = tf.distribute.MirroredStrategy()
        return Accelerator(strategy, kind, strategy.num_replicas_in_sync,
                           detail=f"MirroredStrategy over {devices} {kind} devices")
    return Accelerator(tf.distribute.get_strategy(), kind, 1, detail=f"one {kind} device")


def resolve(spec: AcceleratorSpec, environ: Mapping[str, str]) -> Accelerator:
    """TensorFlow's devices: GPUs, else the CPU (`kind: tpu` with TensorFlow is refused when the spec loads)."""
    target = host.tpu_target(spec.tpu, environ) if spec.kind == "auto" else None
    if target is not None:
        log.warning("a TPU is indicated (%s), but accelerator.backend is tensorflow, which computes on GPUs or the "
                    "CPU only (TensorFlow's TPU path is retired: docs/tpu.md); set accelerator.backend: jax (or "
                    "auto) to train on the TPU", target)
    if spec.kind in ("auto", "gpu"):
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            return _mirrored("gpu", len(gpus))
        if spec.kind == "gpu":
            raise AcceleratorError(
                "accelerator.kind is 'gpu' but TensorFlow sees no GPU: check the image has a CUDA build of "
                "TensorFlow and the container runs with --gpus all"
            )
    if spec.cpu_devices > 1:
        _split_cpu(spec.cpu_devices)
    return _mirrored("cpu", spec.cpu_devices)
