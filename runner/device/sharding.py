"""A job's device mesh and the layout of its variables on it, under JAX: the runtime half of `accelerator.mesh`
and `model.sharding` (runner/spec/sharding.py checks both when the spec loads; docs/sharding.md).

Keras's own parts do the work (keras.io, "Distributed training with Keras 3"): a `DeviceMesh` of the job's devices
(sorted by process, then id, so that the first axis, the batch's, is split by host: each process feeds its own
rows of the global batch, as runner/data/pipeline.py shards by process), a `LayoutMap` of variable-path regexes,
and `ModelParallel(layout_map=..., batch_dim_name=<first axis>)`, set as Keras's distribution before the model is
built. `Layout.get_variable_layout` is Keras's own with two additions: `fsdp` picks each variable's layout from
its shape, and every layout is checked against the variable's shape when the variable is made, so a dimension the
mesh cannot divide is refused (exit 2) naming the variable, its shape and the axis, where JAX would raise its
IndivisibleError. `report(model)` measures what each device holds from the arrays' own shards.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from typing import Any

import keras
import numpy as np
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel, TensorLayout

from runner import SpecError
from runner.device import memory
from runner.spec.sharding import FSDP_MIN_ELEMENTS, mesh_text

REPLICATED = "(no rule: replicated)"
FSDP_WHOLE = f"fsdp: whole (under {FSDP_MIN_ELEMENTS:,} values)"


class Layout(ModelParallel):
    """ModelParallel whose variable layouts come from `rules` (regex -> axes, Keras's LayoutMap semantics: the
    one rule whose regex `re.search`es the path) or from `fsdp`, and are checked against each variable's shape."""

    def __init__(self, mesh: DeviceMesh, how: str, rules: dict[str, tuple], auto_shard_dataset: bool):
        layout_map = LayoutMap(mesh)
        for pattern, axes in rules.items():
            layout_map[pattern] = axes
        super().__init__(layout_map=layout_map, batch_dim_name=mesh.axis_names[0],
                         auto_shard_dataset=auto_shard_dataset)
        self.how, self.rules = how, dict(rules)
        self.rule_of: dict[str, str] = {}  # variable path -> the rule that laid it out

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        if getattr(variable, "_layout", None) is not None:  # an optimizer slot: its variable's layout
            return variable._layout
        shape = tuple(int(d) for d in variable.shape)
        rule, axes = self._axes(variable.path, shape)
        for dim, axis in enumerate(axes):
            if axis is None:
                continue
            size = self.device_mesh.shape[self.device_mesh.axis_names.index(axis)]
            if shape[dim] % size:
                raise SpecError(
                    f"model.sharding {rule}: variable {variable.path!r} of shape {list(shape)} cannot be split on "
                    f"its dimension {dim} ({shape[dim]}) over mesh axis {axis!r} ({size} devices): choose a mesh "
                    f"axis that divides {shape[dim]}, or a layout that leaves this dimension whole"
                )
        self.rule_of[variable.path] = rule
        return TensorLayout(list(axes), self.device_mesh)

    def _axes(self, path: str, shape: tuple[int, ...]) -> tuple[str, tuple]:
        if self.how == "fsdp":
            axes = fsdp_axes(shape, self.device_mesh.axis_names[-1], self.device_mesh.shape[-1])
            return ("fsdp" if any(axes) else FSDP_WHOLE), axes
        found = [p for p in self.rules if re.search(p, path)]
        if len(found) > 1:
            raise SpecError(f"model.sharding: variable {path!r} matches more than one rule ({found[0]!r} and "
                            f"{found[1]!r}): make the regexes exclusive")
        if not found:
            return REPLICATED, (None,) * len(shape)
        axes = self.rules[found[0]]
        if len(axes) != len(shape):
            raise SpecError(f"model.sharding {found[0]!r}: variable {path!r} has shape {list(shape)}, "
                            f"{len(shape)} dimension(s), but the rule names {len(axes)} axes {list(axes)}")
        return repr(found[0]), tuple(axes)

    def report(self, model: Any) -> dict[str, Any]:
        """The mesh, the layout with how many variables each rule laid out, and the bytes of parameters and
        optimizer state on the device holding most (from the arrays' shards), beside one whole copy's."""
        rules = Counter(self.rule_of.get(v.path, REPLICATED) for v in model.variables if len(v.shape))
        if getattr(model, "optimizer", None) is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # its slots, as the first step would make them
        params, params_whole = held(model.variables)
        slots = list(model.optimizer.variables) if getattr(model, "optimizer", None) is not None else []
        optimizer, optimizer_whole = held(slots)
        return {
            "mesh": dict(zip(self.device_mesh.axis_names, (int(s) for s in self.device_mesh.shape), strict=True)),
            "batch_axis": self.batch_dim_name,
            "layout": self.how,
            "variables_per_rule": dict(rules),
            "bytes_per_device": {"parameters": params, "optimizer": optimizer},
            "bytes_replicated": {"parameters": params_whole, "optimizer": optimizer_whole},
            "fraction_of_replicated": round((params + optimizer) / max(1, params_whole + optimizer_whole), 4),
            # runner/device/memory.py's estimate of the same model, as `runner validate --tpu-type` makes it.
            "estimate": self._estimate(model).to_dict(),
            "method": "the largest sum over this process's devices of jax.Array.addressable_shards' nbytes",
        }

    def gather(self, model: Any) -> None:
        """Every variable no process holds whole (a layout splitting it over the batch axis too, on several
        processes) replaced by a copy whole on every device, made by one collective on every process in the same
        order: model.keras reads whole values. After training only: the layout is not kept."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        whole = NamedSharding(self.device_mesh.backend_mesh, PartitionSpec())
        for variable in model.variables:
            value = variable.value
            if not value.is_fully_addressable and not held_whole_here(value):
                variable._value = jax.jit(lambda x: x, out_shardings=whole)(value)

    def _estimate(self, model: Any) -> memory.Estimate:
        count = sum(int(np.prod(v.shape)) for v in model.variables)
        trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        weight_bytes = max(1, round(held(model.variables)[1] / max(1, count)))  # bytes of a value, on average
        axis = 1 if self.how == "replicated" else int(self.device_mesh.shape[-1])
        return memory.estimate(count, trainable, weight_bytes, memory.slots_of(model.optimizer.name), axis,
                               method="runner/device/memory.py: the model's own counts, no activations")


def fsdp_axes(shape: tuple[int, ...], axis: str, size: int) -> tuple:
    """`fsdp`: a variable of at least FSDP_MIN_ELEMENTS values split on its largest dimension that `size`
    divides (the largest when none does, which the shape check then refuses by name); smaller ones whole."""
    elements = 1
    for d in shape:
        elements *= d
    if not shape or elements < FSDP_MIN_ELEMENTS or size == 1:
        return (None,) * len(shape)
    order = sorted(range(len(shape)), key=lambda i: -shape[i])
    dim = next((i for i in order if shape[i] % size == 0), order[0])
    return tuple(axis if i == dim else None for i in range(len(shape)))


def held(variables: list) -> tuple[int, int]:
    """(bytes on the local device holding most, bytes of one whole copy) of `variables`' arrays."""
    per_device: dict[Any, int] = defaultdict(int)
    whole = 0
    for variable in variables:
        value = variable.value
        whole += int(value.nbytes)
        for shard in value.addressable_shards:
            per_device[shard.device] += int(shard.data.nbytes)
    return max(per_device.values(), default=0), whole


def held_whole_here(value: Any) -> bool:
    """This process's shards of `value` cover all of it (a copy per process, as a batch axis split by process
    leaves a variable laid out on the model axis alone)."""
    sharding = value.sharding
    if sharding.is_fully_replicated:
        return True
    # From the sharding alone: `value.addressable_shards` raises for some arrays spread over several processes
    # (jax 0.10.2: "An argument array had 2 shard(s)"), which a resume of a data-parallel job met.
    indices = {tuple((s.start, s.stop) for s in index)
               for index in sharding.addressable_devices_indices_map(value.shape).values()}
    covered = sum(int(np.prod([(stop if stop is not None else size) - (start or 0)
                               for (start, stop), size in zip(index, value.shape, strict=True)]))
                  for index in indices)
    return covered >= int(np.prod(value.shape))


def distribution(mesh: dict[str, int], layout: Any, hub: str | None, devices: list, processes: int
                 ) -> tuple[Layout, str]:
    """The job's ModelParallel over `devices` (every device of every process) and its line for the log."""
    total = 1
    for size in mesh.values():
        total *= size
    if total != len(devices):
        raise SpecError(f"accelerator.mesh {mesh_text(mesh)} holds {total} devices but the job has {len(devices)} "
                        f"({devices[0].platform} devices over {processes} process(es)): make the sizes multiply "
                        f"to {len(devices)}")
    batch_axis, rows = next(iter(mesh.items()))
    if processes > 1 and rows % processes:
        raise SpecError(f"accelerator.mesh {mesh_text(mesh)}: its batch axis {batch_axis!r} ({rows}) must be a "
                        f"multiple of the job's {processes} processes: each process feeds its own rows of the batch")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    device_mesh = DeviceMesh(tuple(mesh.values()), list(mesh), np.array(ordered).reshape(tuple(mesh.values())))
    if layout == "hub":
        how, rules = f"hub ({hub})", hub_rules(hub, device_mesh)
    elif layout in ("fsdp", "replicated"):
        how, rules = layout, {}
    else:
        how, rules = "rules", dict(layout)
    chosen = Layout(device_mesh, "fsdp" if layout == "fsdp" else how, rules, auto_shard_dataset=processes == 1)
    keras.distribution.set_distribution(chosen)
    return chosen, f"ModelParallel over mesh {mesh_text(mesh)}, layout {how}"


def hub_rules(preset: str, mesh: DeviceMesh) -> dict[str, tuple]:
    """The layout a KerasHub backbone gives itself (`get_layout_map(mesh)`), its class read from the preset's
    config.json; keras_hub is imported only here."""
    try:
        import keras_hub
        from keras_hub.src.utils.preset_utils import CONFIG_FILE, load_json
    except ImportError as exc:
        raise SpecError(f"model.sharding hub needs keras-hub installed ({exc})") from None
    config = load_json(preset, CONFIG_FILE)
    name = config.get("class_name") if isinstance(config, dict) else None
    backbone = getattr(keras_hub.models, name or "", None)
    if backbone is None or not hasattr(backbone, "get_layout_map"):
        raise SpecError(f"model.sharding hub: the preset {preset!r} names backbone {name!r} in its config.json, "
                        "which gives no layout of its own (get_layout_map); write model.sharding as regex rules")
    try:
        found = backbone.get_layout_map(mesh)
    except ValueError as exc:  # e.g. a mesh without the axes the backbone lays out on
        raise SpecError(f"model.sharding hub: {name}.get_layout_map refused accelerator.mesh "
                        f"{json.dumps(dict(zip(mesh.axis_names, mesh.shape, strict=True)))}: {exc}") from None
    return {pattern: tuple(found[pattern].axes) for pattern in found}
