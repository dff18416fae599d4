"""The one place that chooses a device and builds the tf.distribute strategy; everything else is handed it.

Order for `accelerator.kind: auto`:
  1. a TPU, if one is indicated: `accelerator.tpu`, else $TPU_NAME, else $COLAB_TPU_ADDR (grpc://),
     else `local` when TPU device files exist (/dev/accel*, /dev/vfio). No indication: no TPU attempt,
     so a CPU-only run does not wait for a TPU that is not there;
  2. GPUs: MirroredStrategy over every visible GPU (several hosts: JAX's runtime, runner/device/processes.py);
  3. the CPU (MirroredStrategy over `accelerator.cpu_devices` logical devices when more than one).
`kind: tpu|gpu|cpu` asks for exactly that and fails (exit 3) when it is not there.
A TPU's device API (PJRT or stream executor, per generation) is set before TensorFlow loads: runner/device/tpu_env.py.
Every TPU step runs under `accelerator.timeout_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import tensorflow as tf

from runner import AcceleratorError, SpecError
from runner.device import backend, host
from runner.device.accelerator import Accelerator
from runner.device.bounded import Bounded
from runner.device.tpu_env import applied_tpu_env, apply_tpu_env
from runner.spec.types import AcceleratorSpec

log = logging.getLogger(__name__)


def per_replica_batch(global_batch: int, accelerator: Accelerator) -> int:
    """The global batch split evenly across the replicas; refused when it does not divide."""
    replicas = accelerator.replicas
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


def tpu_target(spec: AcceleratorSpec, environ: dict[str, str] | None = None) -> str | None:
    """The TPU to try, from the spec or the environment (runner/device/host.py); None when nothing points at a TPU."""
    return host.tpu_target(spec.tpu, environ)


def _bounded(what: str, seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() within `seconds`. A thread, not a process: the TPU system must be initialised in this process."""
    try:
        return Bounded(what, fn).result(seconds)
    except TimeoutError:
        raise TimeoutError(f"{what} did not finish within accelerator.timeout_s ({seconds:g} s)") from None


def _probe_grpc(target: str, seconds: float) -> None:
    """A remote TPU that does not answer makes experimental_connect_to_cluster hang forever: knock first."""
    address = urlparse(target)
    try:
        with socket.create_connection((address.hostname, address.port or 8470), timeout=min(seconds, 5.0)):
            pass
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address.hostname}:{address.port or 8470} ({exc})") from None


def _tpu_hints(target: str) -> str:
    hints = [
        "the TPU runtime version matches the TensorFlow in the image (tensorflow-tpu and its pinned libtpu)",
        "the container runs with --privileged --net=host so /dev/accel* and the TPU driver are visible",
    ]
    if target == "local" and os.path.exists(host.LIBTPU_LOCKFILE):
        hints.append(f"a stale {host.LIBTPU_LOCKFILE} left by a killed run "
                     "(`runner doctor` tells whether a process holds it)")
    if target.startswith("grpc://"):
        hints.append("the address and port of the TPU node, and that this machine can reach it")
    return "; ".join(hints)


def _cause(exc: BaseException) -> str:
    """The line of a TensorFlow error that says what went wrong, not "Graph execution error:" and the node."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    boilerplate = ("Graph execution error", "Detected at node", "<stack traces unavailable>", "[[")
    telling = [line for line in lines if not line.startswith(boilerplate)]
    return (telling or lines or [""])[0]


def connect_tpu(target: str, timeout_s: float) -> Accelerator:
    # The device API was chosen before TensorFlow loaded (`runner run`); a caller that skipped that gets the
    # choice recorded here, and a problem if TensorFlow loaded too early for it.
    runtime = applied_tpu_env() or apply_tpu_env(target)
    steps = [f"device API: {runtime.describe()}"]
    if runtime.problem:
        raise AcceleratorError(
            f"could not start the TPU {target!r} (device API {runtime.describe()}): {runtime.problem}"
        )
    try:
        if target.startswith("grpc://"):
            steps.append(f"probe {target}")
            _probe_grpc(target, timeout_s)
        steps.append("TPUClusterResolver")
        resolver = _bounded(
            "TPUClusterResolver", timeout_s, lambda: tf.distribute.cluster_resolver.TPUClusterResolver(tpu=target)
        )
        if target != "local":
            steps.append("experimental_connect_to_cluster")
            _bounded("connect_to_cluster", timeout_s, lambda: tf.config.experimental_connect_to_cluster(resolver))
        steps.append("initialize_tpu_system")
        topology = _bounded("initialize_tpu_system", timeout_s,
                            lambda: tf.tpu.experimental.initialize_tpu_system(resolver))
        strategy = tf.distribute.TPUStrategy(resolver)
    except Exception as exc:  # each TF version raises its own types here; all mean "no usable TPU"
        raise AcceleratorError(
            f"could not start the TPU {target!r} at step {steps[-1] if steps else '?'} "
            f"({type(exc).__name__}: {_cause(exc)}); "
            f"tried: {' -> '.join(steps)}. Check: {_tpu_hints(target)}"
        ) from exc
    workers = getattr(topology, "num_tasks", 1)
    cores = strategy.num_replicas_in_sync
    detail = f"{target}: {cores} cores, {workers} worker(s), mesh {list(getattr(topology, 'mesh_shape', []))}"
    return Accelerator(strategy, "tpu", cores, workers=workers, detail=detail, tpu_runtime=runtime)


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


def resolve_accelerator(spec: AcceleratorSpec, environ: dict[str, str] | None = None) -> Accelerator:
    """Builds the strategy for the spec (the order is in the module docstring); logs the choice once."""
    environ = dict(os.environ if environ is None else environ)
    started = time.monotonic()
    chosen = backend.active()
    if chosen.name == "jax":
        from runner.device import jax_devices  # JAX is imported only where the job computes with it

        accelerator = dataclasses.replace(jax_devices.resolve(spec, environ), backend=chosen)
    else:
        accelerator = dataclasses.replace(_resolve(spec, environ), backend=chosen)
    if accelerator.kind != "tpu" and applied_tpu_env() is not None:
        # Fell back from a TPU: the summary still says which device API the TPU was tried with.
        accelerator = dataclasses.replace(accelerator, tpu_runtime=applied_tpu_env())
    log.info(
        "accelerator: %s x%d (%s) on %s (%s) in %.2f s", accelerator.kind, accelerator.replicas, accelerator.detail,
        chosen.name, chosen.reason, time.monotonic() - started,
    )
    return accelerator


def _resolve(spec: AcceleratorSpec, environ: dict[str, str]) -> Accelerator:
    if spec.kind in ("auto", "tpu"):
        target = tpu_target(spec, environ)
        if target is not None:
            try:
                return connect_tpu(target, spec.timeout_s)
            except AcceleratorError as exc:
                # A TPU step that hung leaves its thread inside TensorFlow: the CPU would wait on it too.
                if spec.kind == "tpu" or isinstance(exc.__cause__, TimeoutError):
                    raise
                log.warning("no TPU, falling back: %s", exc)
        elif spec.kind == "tpu":
            raise AcceleratorError(
                "accelerator.kind is 'tpu' but nothing names a TPU: set accelerator.tpu (local, a TPU name or "
                "grpc://host:8470), or TPU_NAME / COLAB_TPU_ADDR, or run on a TPU VM"
            )
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
