"""Bytes per device before launch: what a job's model will hold on each chip of a TPU type, against the chip's HBM
(runner/device/tpus.json `hbm`), said by `runner validate --tpu-type` (docs/sharding.md). No TensorFlow, no JAX.

Per device, for P parameters of which T train, over a mesh whose last axis has M devices (1 when the layout is
`replicated`) and whose first axis splits the global batch B into b = B / batch-axis rows:
  - parameters: P x (bytes of the weights' dtype) / M;
  - optimizer slots: T x 4 bytes x slots / M (slots: adam, adamw, nadam, adamax, lion... 2; sgd, rmsprop,
    adagrad... 1), kept in float32, laid out as their variables (Keras gives a slot its variable's layout);
  - gradients: T x 4 bytes / M;
  - activations, a causal language model only (from its config: L layers, hidden h, a query heads, vocabulary V,
    sequence s): L x (34 s b h + 5 a s^2 b) bytes, the activations of a transformer layer kept for the backward
    pass in 16-bit without recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large
    Transformer Models", 2022, section 4.1), plus float32 logits, 4 s b V; not divided by M (a layout may split
    them, this estimate does not count on it).
LoRA (`model.lora_rank` r): T is 4 r h per layer (rank-r adapters on the query and value projections, each
r x (h + h)). A model's parameter count comes from a KerasHub preset's metadata.json (`parameter_count`, written
by save_to_preset); any other model is counted once built, and `runner run` measures its bytes per device (the
summary's `sharding`), with this estimate of the same model beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# Keras optimizers with two slots per variable (first and second moments); the others keep one.
TWO_SLOTS = ("adam", "adamw", "nadam", "adamax", "lion", "lamb")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "mixed_bfloat16": 4, "mixed_float16": 4}
WARN_FRACTION = 0.9  # more than this share of HBM: warned (XLA's own buffers and fragmentation need room)


@dataclasses.dataclass(frozen=True)
class Estimate:
    parameters: int
    trainable: int
    per_device: dict[str, int]  # parameters, optimizer, gradients, activations
    model_axis: int
    method: str

    @property
    def total(self) -> int:
        return sum(self.per_device.values())

    def to_dict(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "trainable": self.trainable, "bytes_per_device": self.per_device,
                "total_bytes_per_device": self.total, "model_axis": self.model_axis, "method": self.method}


def slots_of(optimizer: Any) -> int:
    if isinstance(optimizer, str):
        name = optimizer
    elif isinstance(optimizer, dict):
        name = optimizer.get("class_name", "")
    else:  # the spec's serialized form ({class_name, config}) as its model
        name = getattr(optimizer, "class_name", "")
    return 2 if str(name).lower() in TWO_SLOTS else 1


def estimate(parameters: int, trainable: int, weight_bytes: int, slots: int, model_axis: int,
             activations: int = 0, method: str = "") -> Estimate:
    per = {
        "parameters": parameters * weight_bytes // model_axis,
        "optimizer": trainable * 4 * slots // model_axis,
        "gradients": trainable * 4 // model_axis,
        "activations": activations,
    }
    return Estimate(parameters, trainable, per, model_axis, method)


def model_axis(spec: Any) -> int:
    mesh = spec.accelerator.mesh
    if mesh == "auto" or spec.model.sharding == "replicated":
        return 1
    return int(list(mesh.values())[-1])


def batch_rows(spec: Any, devices: int) -> int:
    mesh = spec.accelerator.mesh
    return int(next(iter(mesh.values()))) if mesh != "auto" else devices


def of_spec(spec: Any, devices: int) -> tuple[Estimate | None, str]:
    """The estimate for `spec` on `devices` devices, or None and why not."""
    preset = getattr(spec.model, "hub", None)
    if not preset:
        return None, ("not estimated before the model is built (only a KerasHub preset's size is known from its "
                      "files); `runner run` measures the bytes per device (the summary's sharding)")
    if not os.path.isdir(preset):
        return _named(preset, spec)
    try:
        with open(os.path.join(preset, "metadata.json")) as f:
            count = int(json.load(f)["parameter_count"])
        with open(os.path.join(preset, "config.json")) as f:
            config = json.load(f).get("config", {})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"not estimated: {preset}/metadata.json gives no parameter_count ({exc})"
    layers, hidden = int(config.get("num_layers", 0)), int(config.get("hidden_dim", 0))
    heads, vocabulary = int(config.get("num_query_heads", config.get("num_heads", 0))), int(
        config.get("vocabulary_size", 0))
    dtype = config.get("dtype")
    dtype = dtype.get("config", {}).get("name") if isinstance(dtype, dict) else dtype
    weight_bytes = DTYPE_BYTES.get(str(dtype), 4)
    rank = getattr(spec.model, "lora_rank", None)
    trainable = 4 * int(rank) * hidden * layers if rank else count
    sequence = _sequence_length(preset, spec)
    rows = max(1, spec.data.global_batch_size // batch_rows(spec, devices))
    activations = layers * (34 * sequence * rows * hidden + 5 * heads * sequence**2 * rows) + 4 * sequence * rows * \
        vocabulary
    method = (f"{count:,} parameters ({preset}/metadata.json), weights {dtype or 'float32'}, "
              f"{'LoRA rank ' + str(rank) if rank else 'every weight trained'}, {rows} sequences of {sequence} "
              "tokens per device (docs/sharding.md, memory estimate)")
    return estimate(count, trainable, weight_bytes, slots_of(spec.train.optimizer), model_axis(spec), activations,
                    method), ""


def _named(preset: str, spec: Any) -> tuple[Estimate | None, str]:
    """A preset known by name only (downloaded when the job loads it): its parameter count from the table KerasHub
    ships of its own presets (keras_hub/src/models/*/*_presets.py, read as text: nothing is imported), and a lower
    bound from it: the weights (in bfloat16, as KerasHub's Gemma and Llama presets are saved) and, without LoRA,
    the slots and gradients of every weight; the adapters and activations need the preset's config."""
    count, where = installed_preset_params(preset)
    if count is None:
        return None, f"not estimated: the preset {preset!r} is read only when the job loads it ({where})"
    rank = getattr(spec.model, "lora_rank", None)
    trainable = 0 if rank else count
    method = (f"at least: {count:,} parameters ({where}), weights in bfloat16, "
              + (f"LoRA rank {rank}'s adapters" if rank else "") + (" and " if rank else "")
              + "activations not counted (the preset's config.json is read when the job loads it)")
    return estimate(count, trainable, 2, slots_of(spec.train.optimizer), model_axis(spec), 0, method), ""


def _preset_table(name: str) -> tuple[str | None, str]:
    """(the keras_hub model folder whose preset table names `name`, None and why): read as text, nothing imported."""
    package = _keras_hub()
    if package is None:
        return None, "keras_hub is not installed here"
    models = os.path.join(package, "src", "models")
    for folder in sorted(os.listdir(models)) if os.path.isdir(models) else []:
        path = os.path.join(models, folder, f"{folder}_presets.py")
        if os.path.isfile(path) and f'"{name}"' in open(path, encoding="utf-8").read():
            return os.path.join(models, folder), ""
    return None, f"keras_hub names no preset {name!r}"


def installed_preset_params(name: str) -> tuple[int | None, str]:
    """(parameters, where they were read) of a KerasHub preset name from the preset tables of the installed
    keras_hub, parsed as Python literals; (None, why) when keras_hub is not installed or names no such preset."""
    import ast

    folder, why = _preset_table(name)
    if folder is None:
        return None, why
    family = os.path.basename(folder)
    for node in ast.walk(ast.parse(open(os.path.join(folder, f"{family}_presets.py"), encoding="utf-8").read())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                continue
            params = ((table.get(name) or {}).get("metadata") or {}).get("params")
            if isinstance(params, int):
                return params, f"keras_hub's preset table, {family}_presets.py"
    return None, f"keras_hub names no preset {name!r}"


def layout_problem(spec: Any) -> str | None:
    """What `model.sharding: hub` cannot lay out, told before launch from the installed keras_hub's files (read as
    text, nothing imported) and a preset's config.json on disk: a backbone with no `get_layout_map` (found from a
    named preset's model folder, or the module a preset folder's config.json names), and for Gemma's layout
    (attention heads over the model axis) head counts the model axis does not divide. Otherwise the job is refused
    as it builds the model: on a TPU VM, after the slice started billing. None when fine or not knowable here."""
    preset = getattr(spec.model, "hub", None)
    if spec.model.sharding != "hub" or not preset or "://" in preset:
        return None
    config: dict = {}
    if os.path.isdir(preset):
        try:
            with open(os.path.join(preset, "config.json")) as f:
                doc = json.load(f)
            module, config = str(doc["module"]), dict(doc.get("config") or {})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        package = _keras_hub()
        backbone = package and os.path.join(os.path.dirname(package), module.replace(".", os.sep) + ".py")
        what = f"the preset {preset}'s backbone ({module})"
    else:
        models, _ = _preset_table(preset)
        if models is None:
            return None
        family = os.path.basename(models)
        backbone = os.path.join(models, f"{family}_backbone.py")
        what = f"the preset {preset!r} is a {family} model, whose backbone"
    if not backbone or not os.path.isfile(backbone):
        return None
    text = open(backbone, encoding="utf-8").read()
    shown = os.path.relpath(backbone, os.path.dirname(_keras_hub() or backbone))
    if "def get_layout_map" not in text:
        return (f"model.sharding hub: {what} gives no layout of its own (no get_layout_map in the installed "
                f"{shown}): the job would be refused as it builds the model, after the slice started; use "
                "model.sharding: fsdp, regex rules, or replicated (with accelerator.mesh: auto)")
    axis = model_axis(spec)
    if os.path.basename(backbone) == "gemma_backbone.py" and axis > 1:
        for key in ("num_query_heads", "num_key_value_heads"):
            heads = config.get(key)
            if isinstance(heads, int) and heads % axis:
                return (f"model.sharding hub: {preset}/config.json has {key} {heads}, which mesh axis 'model' "
                        f"({axis} devices) cannot split (GemmaBackbone.get_layout_map lays attention heads over "
                        f"it): use a model axis that divides {heads}, or model.sharding: fsdp")
    return None


def _keras_hub() -> str | None:
    """The installed keras_hub package's folder (found, not imported), None without it."""
    import importlib.util

    found = importlib.util.find_spec("keras_hub")
    return list(found.submodule_search_locations)[0] if found and found.submodule_search_locations else None


def _sequence_length(preset: str, spec: Any) -> int:
    for source in (getattr(spec.model, "params", {}) or {},):
        if isinstance(source.get("sequence_length"), int):
            return source["sequence_length"]
    try:
        with open(os.path.join(preset, "preprocessor.json")) as f:
            return int(json.load(f)["config"]["sequence_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1024


def verdict(found: Estimate, hbm_bytes: int, hbm_text: str, spec: Any, devices: int) -> tuple[str, str]:
    """("fits" | "tight" | "too_big", the line that says so and, when it does not fit, which knob helps)."""
    share = found.total / hbm_bytes
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in found.per_device.items())
    line = f"memory per device: {_gib(found.total)} of {hbm_text} ({share:.0%}): {parts}; {found.method}"
    if share <= WARN_FRACTION:
        return "fits", line
    knobs = []
    if found.model_axis < devices:
        knobs.append(f"a bigger model axis (accelerator.mesh's last axis, now {found.model_axis}, with "
                     "model.sharding fsdp or hub) divides parameters, slots and gradients")
    if getattr(spec.model, "hub", None) and not getattr(spec.model, "lora_rank", None):
        knobs.append("model.lora_rank trains small adapters: no slots or gradients for the frozen weights")
    if found.per_device["activations"] > found.total / 4:
        knobs.append("a smaller data.global_batch_size (or a longer batch axis) cuts the activations")
    if found.per_device["parameters"] and found.parameters * 2 // found.model_axis < found.per_device["parameters"]:
        knobs.append("bfloat16 weights (the preset saved in bfloat16) halve the parameters")
    hint = "; ".join(knobs) or "a TPU type of more HBM per chip"
    return ("too_big" if share > 1 else "tight"), f"{line}. It {'does not fit' if share > 1 else 'is tight'}: {hint}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


def check_for_tpu(spec: Any, tpu_type: str) -> tuple[str, str]:
    """(verdict, the line to print) for `spec` on every device of `tpu_type` (SpecError for a type the table
    does not know). The mesh, when named, must hold the type's devices."""
    from runner import SpecError
    from runner.device import tpus

    parsed = tpus.parse_tpu_type(tpu_type)
    peak = parsed.facts.peak
    per_chip = peak[1] if peak else 1
    devices = parsed.chips * per_chip
    mesh = spec.accelerator.mesh
    if mesh != "auto":
        total = 1
        for size in mesh.values():
            total *= size
        if total != devices:
            raise SpecError(f"accelerator.mesh {mesh} holds {total} devices but {parsed.name} has {devices} "
                            f"({parsed.chips} chips, {per_chip} JAX device(s) each): make the sizes multiply to "
                            f"{devices}")
    problem = layout_problem(spec)
    if problem:
        raise SpecError(problem)
    found, why = of_spec(spec, devices)
    fits, line = _against_hbm(found, why, parsed, per_chip, spec, devices)
    shown = (f"auto: the batch over {devices} devices, each weight on every device" if mesh == "auto" else
             f"{', '.join(f'{k} {v}' for k, v in mesh.items())}, model.sharding {spec.model.sharding}")
    return fits, line.replace("memory per device:", f"memory per device (mesh {shown}):", 1)


def _against_hbm(found: Estimate | None, why: str, parsed: Any, per_chip: int, spec: Any,
                 devices: int) -> tuple[str, str]:
    if found is None:
        return "unknown", f"memory per device: {why}"
    hbm = parsed.facts.hbm
    if hbm is None:
        return "unknown", f"memory per device: {_gib(found.total)} ({found.method}); the TPU table has no HBM " \
                          f"figure for {parsed.generation}"
    return verdict(found, hbm[0] // per_chip, f"{parsed.name}'s {hbm[1]}" if per_chip == 1 else
                   f"{_gib(hbm[0] // per_chip)} (half of {hbm[1]})", spec, devices)
