"""What a job runs on, as the rest of the job sees it: the device kind, how many replicas and workers, the
engine that computes, and the scope its variables are made in (`scope()`: the TensorFlow engine's tf.distribute
strategy; under JAX none, its devices are Keras's distribution: runner/device/jax_devices.py). Built by
runner/device/strategy.py `resolve_accelerator`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from typing import Any

import tensorflow as tf

from runner.device import backend, host


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """What the job runs on: handed to data, training and the summary."""

    # The TensorFlow engine's tf.distribute strategy; None under JAX (Keras's distribution places the variables).
    strategy: tf.distribute.Strategy | None
    kind: str  # tpu | gpu | cpu
    replicas: int
    workers: int = 1
    worker_index: int = 0
    detail: str = ""
    # The engine that computes (runner/device/engine.py `Engine`, set by strategy.py `resolve_accelerator`): every
    # module asks it what differs between engines. Not imported here: each engine builds its Accelerators.
    engine: Any = None
    tpu: dict[str, str | None] | None = None  # on a TPU: runner/device/tpus.py `device_facts`
    # Under JAX with accelerator.mesh: the ModelParallel laying the variables out (runner/device/sharding.py).
    layout: Any = None

    def scope(self) -> contextlib.AbstractContextManager:
        """Where the model's variables are made (build, restore): the strategy's scope, else nothing to enter."""
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def whole_for_export(self, model: Any) -> None:
        """A sharded model's variables that no process holds whole gathered onto every device (a collective every
        process makes), so that model.keras can read them; nothing for a model without accelerator.mesh."""
        if self.layout is not None:
            self.layout.gather(model)

    @property
    def batch_shards(self) -> int:
        """How many ways the global batch is split: the mesh's first axis, else every replica."""
        return int(self.layout.device_mesh.shape[0]) if self.layout is not None else self.replicas

    @property
    def backend(self) -> backend.Backend:
        """The engine's name and reason, as the summary records them (`accelerator.backend`)."""
        return self.engine.backend if self.engine is not None else backend.Backend("tensorflow", "Keras's default")

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "backend": self.backend.to_dict(),
            "replicas": self.replicas,
            "workers": self.workers,
            "detail": self.detail,
            "tensorflow": tf.__version__,
            "keras": f"keras {_version('keras')}",  # the form runner report compares across runs
            **(self.engine.versions() if self.engine is not None else {}),
            # Input pipelines ran up to 1.38x faster on tcmalloc: runs compared side by side should agree on it.
            "allocator": host.allocator_in_use()[0],
            **({"tpu": self.tpu} if self.tpu else {}),
        }


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


