"""The one place that chooses a device and builds the strategy; everything else is handed it. The job's engine
(runner/device/engine.py) lists its devices: TensorFlow's in runner/device/tf_devices.py, JAX's in jax_devices.py.

Order for `accelerator.kind: auto`:
  1. a TPU, if one is indicated (`accelerator.tpu`, $TPU_NAME, $COLAB_TPU_ADDR, or TPU device files:
     runner/device/host.py): the job computes with JAX (runner/device/backend.py), whose TPU devices
     runner/device/jax_devices.py lists. No indication: no TPU attempt;
  2. GPUs: MirroredStrategy over every visible GPU (several hosts: JAX's runtime, runner/device/processes.py);
  3. the CPU (MirroredStrategy over `accelerator.cpu_devices` logical devices when more than one).
`kind: tpu|gpu|cpu` asks for exactly that and fails (exit 3) when it is not there.
A TPU is JAX's (runner/device/jax_devices.py): TensorFlow computes on GPUs or the CPU and never touches a TPU
(its TPU runtimes stop at 2.18 and the images carry tensorflow-cpu: docs/tpu.md), so a TensorFlow job
(`accelerator.backend: tensorflow`) on a machine with a TPU runs on the CPU and says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from runner import SpecError
from runner.device import engine
from runner.device.accelerator import Accelerator
from runner.spec.types import AcceleratorSpec, ModelSpec

log = logging.getLogger(__name__)


def per_replica_batch(global_batch: int, accelerator: Accelerator) -> int:
    """The global batch split evenly across the replicas; refused when it does not divide."""
    replicas = accelerator.batch_shards
    if global_batch % replicas:
        raise SpecError(
            f"data.global_batch_size ({global_batch}) must be divisible by the number of replicas ({replicas}): "
            f"set it to {max(replicas, global_batch // replicas * replicas)} or "
            f"{(global_batch // replicas + 1) * replicas}"
        )
    per_replica = global_batch // replicas
    if accelerator.kind == "tpu" and per_replica % 8:
        log.warning("per-replica batch %d is not a multiple of 8: TPU cores pad it (128 per core is best)", per_replica)
    return per_replica


def resolve_accelerator(spec: AcceleratorSpec, environ: dict[str, str] | None = None,
                        model: ModelSpec | None = None) -> Accelerator:
    """Builds the strategy for the spec (the order is in the module docstring); logs the choice once. `model`:
    the job's model, laid out over `accelerator.mesh` under JAX (runner/device/sharding.py)."""
    environ = dict(os.environ if environ is None else environ)
    started = time.monotonic()
    chosen = engine.active()  # the engine `set_before_keras` set: it lists its own devices
    accelerator = dataclasses.replace(chosen.resolve(spec, environ, model), engine=chosen)
    log.info(
        "accelerator: %s x%d (%s) on %s (%s) in %.2f s", accelerator.kind, accelerator.replicas, accelerator.detail,
        chosen.name, chosen.reason, time.monotonic() - started,
    )
    return accelerator
