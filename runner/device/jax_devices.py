"""The devices of a job that computes with JAX: the backend seam's JAX side of runner/device/strategy.py.

JAX finds its own devices: on a Cloud TPU VM `jax.devices()` initialises libtpu (the `jax[tpu]` extra installs
it), on the CPU it lists `accelerator.cpu_devices` host devices (JAX_NUM_CPU_DEVICES, set before JAX loaded:
runner/device/backend.py). Several devices train data-parallel through Keras's own
`keras.distribution.DataParallel` (variables replicated, the batch split on its first axis), set as Keras's
global distribution so that `fit`, `evaluate` and `predict` all use it. TensorFlow stays on the host for
tf.data: it is told to see no GPU. Every step that can wait on a device is bounded by `accelerator.timeout_s`;
on a slice the listing comes after the join, which has its own bound (`accelerator.join_timeout_s`,
runner/device/processes.py): the hosts arrive here together, and a late host is not charged to the TPU.
Beside the devices, the JAX engine's model checks (`check_traceable`, `calls_tensorflow`): runner/device/engine.py
`Jax.check_model` and `build_hint` call them, and the engine module stays free of their tracing code.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

import tensorflow as tf

from runner import AcceleratorError
from runner.device import host, processes, tpus
from runner.device.accelerator import Accelerator
from runner.device.bounded import Bounded
from runner.spec.types import AcceleratorSpec, ModelSpec

log = logging.getLogger(__name__)


def _devices(platform: str, timeout_s: float) -> list:
    import jax

    def listed() -> list:
        try:
            return jax.devices(platform)
        except RuntimeError:  # "Unknown backend" / "Backend 'tpu' failed to initialize": none of that kind here
            return []

    try:
        return Bounded(f"jax.devices({platform!r})", listed).result(timeout_s)
    except TimeoutError:
        joined = processes.joined()
        slice_note = (
            f" On a slice every host starts its TPU together once all joined (this is process {joined.index} of "
            f"{joined.count}): a host that stopped after the join holds the others; see every worker's log."
            if joined.several else ""
        )
        raise AcceleratorError(
            f"JAX did not list its {platform} devices within accelerator.timeout_s ({timeout_s:g} s): on a TPU VM "
            f"check that no other process holds the TPU ({host.LIBTPU_LOCKFILE}; `runner doctor` tells) and that "
            f"the container runs with --privileged --net=host.{slice_note}"
        ) from None


def resolve(spec: AcceleratorSpec, environ: Mapping[str, str], model: ModelSpec | None = None) -> Accelerator:
    """The devices for `spec` under JAX: a TPU when asked or indicated, else GPUs (`auto`, `gpu`), else the CPU.
    `model`: the job's model, whose `sharding` is laid out over `spec.mesh` (none: data-parallel)."""
    tf.config.set_visible_devices([], "GPU")  # tf.data only: the accelerator is JAX's
    if spec.kind in ("auto", "tpu"):
        target = host.tpu_target(spec.tpu, environ)
        tpus = _devices("tpu", spec.timeout_s) if target is not None or spec.kind == "tpu" else []
        if tpus:
            return _accelerator("tpu", tpus, spec, model)
        if spec.kind == "tpu":
            raise AcceleratorError(
                "accelerator.kind is 'tpu' but JAX finds no TPU: run on a Cloud TPU VM (or a GKE TPU node) with "
                "the TPU image (jax[tpu] and its libtpu: docs/image.md), its container started with --privileged "
                "--net=host; `runner doctor` checks each of these"
            )
        if target is not None:
            log.warning("no TPU, falling back: %s is indicated but JAX lists no TPU device", target)
    if spec.kind in ("auto", "gpu"):
        gpus = _devices("gpu", spec.timeout_s)
        if gpus:
            return _accelerator("gpu", gpus, spec, model)
        if spec.kind == "gpu":
            raise AcceleratorError(
                "accelerator.kind is 'gpu' but JAX sees no GPU: install jax[cuda12] in the image and run the "
                "container with --gpus all, or use accelerator.backend: tensorflow"
            )
    cpus = _devices("cpu", spec.timeout_s)
    local = [d for d in cpus if d.process_index == processes.joined().index]
    if len(local) != spec.cpu_devices:
        raise AcceleratorError(
            f"accelerator.cpu_devices is {spec.cpu_devices} but JAX lists {len(local)} CPU device(s): JAX was "
            "loaded before the runner set JAX_NUM_CPU_DEVICES; start the job with `runner run`"
        )
    return _accelerator("cpu", cpus, spec, model)


def _accelerator(kind: str, devices: list, spec: AcceleratorSpec, model: ModelSpec | None) -> Accelerator:
    """`devices`: every device of the job, on every process. Several processes each feed their own share of
    the global batch (runner/data/pipeline.py shards by process), so Keras must not shard the data again."""
    import keras

    joined = processes.joined()
    layout = None
    if spec.mesh != "auto" and model is not None:
        from runner.device import sharding

        layout, detail = sharding.distribution(spec.mesh, model.sharding, getattr(model, "hub", None), devices,
                                               joined.count)
        detail += f" of {len(devices)} {kind} devices ({devices[0].device_kind})"
    elif len(devices) > 1:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices, auto_shard_dataset=not joined.several)
        )
        detail = f"DataParallel over {len(devices)} {kind} devices ({devices[0].device_kind})"
    else:
        detail = f"one {kind} device ({devices[0].device_kind})"
    if joined.several:
        detail += f" in {joined.count} processes, this one process {joined.index}"
    return Accelerator(None, kind, len(devices), workers=joined.count,
                       worker_index=joined.index, detail=detail, layout=layout,
                       tpu=tpus.device_facts(devices[0].device_kind, os.environ) if kind == "tpu" else None)


def check_traceable(model, name: str) -> None:
    """SpecError (exit 2) before training when JAX cannot trace the model's forward pass: a model that calls
    TensorFlow (`tf.*`) inside `call` trains under TensorFlow only. Tracing is shapes only: nothing compiles."""
    import jax

    from runner import SpecError

    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # a subclassed model never called: its first step tells instead
        return
    if not inputs:
        return
    specs = [jax.ShapeDtypeStruct((2, *t.shape[1:]), t.dtype) for t in inputs]
    specs = specs[0] if len(specs) == 1 else specs
    trainable = [v.value for v in model.trainable_variables]
    other = [v.value for v in model.non_trainable_variables]
    try:
        jax.eval_shape(lambda t, o, x: model.stateless_call(t, o, x, training=True)[0], trainable, other, specs)
    except Exception as exc:  # whatever JAX met while tracing the user's code
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        why = calls_tensorflow(exc) or "fix the model's code, or train it with accelerator.backend: tensorflow"
        raise SpecError(
            f"model.name {name!r} cannot run under the jax backend ({type(exc).__name__}: {first}): {why}"
        ) from exc


def calls_tensorflow(exc: BaseException, module_name: str | None = None) -> str | None:
    """What to do when `exc` came from TensorFlow code run under the JAX backend, else None: a frame of the
    tensorflow package in its traceback or an earlier one of its chain (Keras trims its own), a TensorFlow tensor
    in its message, or the user's module (`module_name`, imported already) importing TensorFlow."""
    frames, seen = [], exc
    for _ in range(16):
        tb = seen.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            break
    module = sys.modules.get(module_name or "")
    imports_tf = module is not None and any(
        getattr(value, "__name__", "").split(".")[0] == "tensorflow" for value in vars(module).values()
    )
    if not imports_tf and not any("/tensorflow/" in f for f in frames) and "tf.Tensor" not in str(exc):
        return None
    return ("the model calls TensorFlow, which JAX cannot trace: write it with keras.ops and keras layers, or "
            "train it with accelerator.backend: tensorflow")
