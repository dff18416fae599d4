"""`accelerator.mesh` and `model.sharding`: how a job's devices are arranged and how its variables are laid out on
them, checked when the spec loads (no TensorFlow, no JAX). runner/device/sharding.py builds Keras's
`DeviceMesh`, `LayoutMap` and `ModelParallel` from them (docs/sharding.md).

- `accelerator.mesh`: `auto` (every device on one data axis: Keras's DataParallel, variables replicated) or a
  mapping of axis names to sizes, e.g. `{batch: 2, model: 4}`. The FIRST axis carries the batch (each device
  row of it a share of the global batch; several processes feed their own rows), the LAST axis is the one `fsdp`
  shards over. The sizes multiply to the job's device count.
- `model.sharding`: `replicated` (every variable whole on every device), `fsdp` (each variable of at least
  FSDP_MIN_ELEMENTS values split on its largest dimension the last axis divides; smaller ones replicated), `hub`
  (a KerasHub backbone's own `get_layout_map(mesh)`), or a mapping of variable-path regexes to one mesh axis
  name (or null) per dimension, as Keras's `LayoutMap` takes them.
"""

from __future__ import annotations

import re
from typing import Any

from runner.spec.usercode import IDENTIFIER

# fsdp: a variable holding fewer values than this stays whole on every device. 16,384 values are 64 KiB in
# float32: biases, norms and small kernels cost less to keep than to gather before every use.
FSDP_MIN_ELEMENTS = 16_384
LAYOUTS = ("replicated", "fsdp", "hub")
MAX_AXES = 4


def check_mesh(value: Any) -> str | dict[str, int]:
    """`auto`, or {axis name: size} with identifiers for names and sizes of at least 1."""
    if value == "auto":
        return value
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{value!r} is not a mesh: write auto, or axis names and sizes such as {{batch: 2, model: 4}}")
    if len(value) > MAX_AXES:
        raise ValueError(f"{len(value)} axes: a mesh has at most {MAX_AXES}")
    for name, size in value.items():
        if not isinstance(name, str) or not re.fullmatch(IDENTIFIER, name):
            raise ValueError(f"axis name {name!r}: use a name of letters, digits and '_' (e.g. batch, model)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"axis {name!r} has size {size!r}: a size is a whole number of devices, at least 1")
    return dict(value)


def check_layout(value: Any) -> str | dict[str, tuple[str | None, ...]]:
    """`replicated`, `fsdp`, `hub`, or {regex: [axis or null, ...]}."""
    if isinstance(value, str):
        if value not in LAYOUTS:
            raise ValueError(f"{value!r} is none of {', '.join(LAYOUTS)}, nor a mapping of variable-path regexes to "
                             "axes such as {'dense.*kernel': [null, model]}")
        return value
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{value!r} is not a layout: write replicated, fsdp, hub, or regexes of variable paths "
                         "mapped to axes such as {'dense.*kernel': [null, model]}")
    rules: dict[str, tuple[str | None, ...]] = {}
    for pattern, axes in value.items():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None
        if not isinstance(axes, (list, tuple)) or not all(a is None or isinstance(a, str) for a in axes):
            raise ValueError(f"{pattern!r}: {axes!r} is not a list of one mesh axis name (or null) per dimension")
        rules[pattern] = tuple(axes)
    return rules


def mesh_problem(accelerator: Any, layout: Any, global_batch: int, hub: str | None) -> str | None:
    """What is wrong between the mesh, the layout, the batch and the device count, else None. The count is known
    here on the CPU only, per process (the processes are counted once they join): elsewhere, and exactly,
    once the devices are listed (runner/device/sharding.py)."""
    mesh = accelerator.mesh
    devices = accelerator.cpu_devices if accelerator.kind == "cpu" else None
    if layout == "hub" and not hub:
        return "model.sharding hub takes the layout of a KerasHub backbone: set model.hub to its preset"
    if mesh != "auto" and accelerator.backend == "tensorflow":
        return ("accelerator.mesh shards over devices through Keras's ModelParallel, which runs on JAX: set "
                "accelerator.backend: jax (or auto), or accelerator.mesh: auto")
    if mesh == "auto":
        if layout != "replicated":
            return (f"model.sharding {_text(layout)} needs accelerator.mesh naming its axes, e.g. "
                    "{batch: 2, model: 4} (the first axis carries the batch, the last holds the shards)")
        return None
    names = list(mesh)
    sizes = list(mesh.values())
    total = 1
    for size in sizes:
        total *= size
    if devices is not None and total % devices:  # a job of several processes has `devices` on each
        return (f"accelerator.mesh {_mesh_text(mesh)} holds {total} devices, which is no whole number of processes "
                f"of accelerator.cpu_devices ({devices}) each: make the sizes multiply to {devices} (one process) "
                f"or to {devices} times the processes")
    if global_batch % sizes[0]:
        return (f"data.global_batch_size ({global_batch}) must be divisible by accelerator.mesh's batch axis "
                f"{names[0]!r} ({sizes[0]}), its first axis")
    if isinstance(layout, dict):
        for pattern, axes in layout.items():
            unknown = [a for a in axes if a is not None and a not in mesh]
            if unknown:
                return (f"model.sharding {pattern!r} names axis {unknown[0]!r}, which accelerator.mesh does not "
                        f"have (its axes: {', '.join(names)})")
            twice = sorted({a for a in axes if a is not None and axes.count(a) > 1})
            if twice:
                return f"model.sharding {pattern!r} names axis {twice[0]!r} twice: an axis shards one dimension"
    return None


def _mesh_text(mesh: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.items()) + "}"


def _text(layout: Any) -> str:
    return layout if isinstance(layout, str) else "(a map of regexes)"


def mesh_text(mesh: str | dict[str, int]) -> str:
    return mesh if isinstance(mesh, str) else _mesh_text(mesh)
