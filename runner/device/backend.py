"""Which engine Keras computes with, decided once before Keras is imported: the backend seam's first half.

`accelerator.backend`:
  - `jax`: Keras 3 on JAX. The engine Google supports on Cloud TPUs today (`pip install "jax[tpu]"`, one
    process per host; TensorFlow has no TPU runtime after 2.18 and none on TPU7x: docs/tpu.md cites both).
  - `tensorflow`: Keras 3 on TensorFlow (with oneDNN on the CPU).
  - `auto`: JAX when the job names a device mesh (`accelerator.mesh`), runs as several processes
    (runner/device/processes.py) or points at a TPU
    (`accelerator.kind: tpu`, or a TPU named by the spec, $TPU_NAME, $COLAB_TPU_ADDR or this host's TPU device
    files); TensorFlow otherwise. On the CPU TensorFlow is measured
    several times faster than XLA (benchmarks/RESULTS.md, "Backends"); on a GPU it is kept until measured
    otherwise (no GPU is reachable where this was measured).
Under either backend the input pipeline is tf.data on the host: under JAX, TensorFlow never touches an
accelerator (the TPU image carries tensorflow-cpu). Keras reads KERAS_BACKEND once, when it is first imported,
so `apply` runs before anything imports Keras or TensorFlow (runner/job/startup.py); a Keras already imported
with another backend is refused rather than silently used.

This module must never import TensorFlow, JAX or Keras.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, MutableMapping

from runner import AcceleratorError
from runner.device import host, processes
from runner.spec.types import AcceleratorSpec

BACKENDS = ("tensorflow", "jax")

# The figure `auto`'s CPU choice rests on (benchmarks/backends.py; benchmarks/RESULTS.md, "Backends").
CPU_REASON = ("auto on a cpu: TensorFlow, measured faster than JAX for the MNIST CNN (6.7x on a 2-core AMD EPYC: "
              "benchmarks/RESULTS.md, backends); a figure of that model on that machine, not of this model on this "
              "host: accelerator.backend: jax runs it to compare")


@dataclasses.dataclass(frozen=True)
class Backend:
    """The engine a job computes with, and why."""

    name: str  # tensorflow | jax
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason}


def choose(spec: AcceleratorSpec, environ: MutableMapping[str, str] | None = None) -> Backend:
    """The backend for `spec` (the order is in the module docstring)."""
    environ = os.environ if environ is None else environ
    several = processes.asked(environ)
    if several.several and spec.backend == "tensorflow":
        raise AcceleratorError(
            f"accelerator.backend is tensorflow but {processes.COUNT} asks for {several.count} processes: a job of "
            "several processes runs on JAX's multi-process runtime; set accelerator.backend: jax (or auto)"
        )
    if spec.backend != "auto":
        return Backend(spec.backend, f"accelerator.backend: {spec.backend}, as the spec asks"
                       + (" (on a CPU, TensorFlow was measured faster: benchmarks/RESULTS.md, backends)"
                          if spec.backend == "jax" and spec.kind == "cpu" else ""))
    if several.several:
        return Backend("jax", f"auto with {several.count} processes: JAX's multi-process runtime")
    if spec.mesh != "auto":
        return Backend("jax", "auto with accelerator.mesh: Keras's ModelParallel lays variables out on JAX")
    if spec.kind == "tpu":
        return Backend("jax", "auto on a TPU: Keras 3 on JAX, the engine Cloud TPUs run today")
    target = host.tpu_target(spec.tpu, environ) if spec.kind == "auto" else None
    if target is not None:
        return Backend("jax", f"auto: a TPU is indicated ({target}): Keras 3 on JAX, the engine Cloud TPUs run today")
    if spec.kind == "gpu":
        return Backend("tensorflow", "auto on a gpu: TensorFlow (JAX on GPUs is not measured here)")
    return Backend("tensorflow", CPU_REASON)


def environment(backend: Backend, spec: AcceleratorSpec | None, environ: Mapping[str, str]) -> dict[str, str]:
    """What `apply` sets, reading nothing but its arguments (runner/job/startup.py plans with it): KERAS_BACKEND;
    under JAX on the CPU the number of host devices (`accelerator.cpu_devices`) and the CPU platform, unless
    `environ` sets them already. `spec` None: a command that runs no job (KERAS_BACKEND alone)."""
    env = {"KERAS_BACKEND": backend.name}
    if backend.name != "jax" or spec is None:
        return env
    if spec.kind in ("auto", "cpu") and spec.cpu_devices > 1:
        env["JAX_NUM_CPU_DEVICES"] = environ.get("JAX_NUM_CPU_DEVICES", str(spec.cpu_devices))
    if spec.kind == "cpu":
        env["JAX_PLATFORMS"] = environ.get("JAX_PLATFORMS", "cpu")
    return env


def apply(backend: Backend, spec: AcceleratorSpec, environ: MutableMapping[str, str] | None = None) -> None:
    """Sets what Keras and JAX read when they load (`environment`); refuses a Keras already loaded with another
    backend."""
    global _applied
    environ = os.environ if environ is None else environ
    loaded = sys.modules.get("keras")
    if loaded is not None:
        current = loaded.backend.backend()
        if current != backend.name:
            raise AcceleratorError(
                f"Keras was imported with the {current} backend before the job chose {backend.name} "
                f"({backend.reason}): set KERAS_BACKEND={backend.name} before starting Python, or "
                f"accelerator.backend: {current}"
            )
    environ.update(environment(backend, spec, environ))
    _applied = backend


_applied: Backend | None = None


def active(environ: MutableMapping[str, str] | None = None) -> Backend:
    """The backend this process computes with: as `apply` set it, else as KERAS_BACKEND says (a library
    caller that skipped `apply`; Keras's own default is TensorFlow)."""
    if _applied is not None:
        return _applied
    return from_environment(os.environ if environ is None else environ)


def from_environment(environ: Mapping[str, str]) -> Backend:
    """The backend KERAS_BACKEND names in `environ`, else Keras's own default (TensorFlow)."""
    name = environ.get("KERAS_BACKEND", "tensorflow")
    why = f"KERAS_BACKEND={name} in the environment" if "KERAS_BACKEND" in environ else "Keras's default"
    return Backend(name, why)
