"""What `runner submit` says about the batch and the shards for the chosen TPU type, before anything is sent.

The batch per device: `data.global_batch_size` over the slice's devices (its chips x the devices JAX makes of a
chip: runner/device/tpus.json). The job itself refuses a batch its devices do not divide
(runner/device/strategy.py `per_replica_batch`), which on a TPU VM happens after the slice has booted and
billed: `submit` refuses it first. A batch per device that is not a multiple of 8 is padded by the TPU cores,
128 per core being best (docs/accelerators.md, "Batch size"): a warning with the numbers.

The shards per host (a slice of several hosts, one JAX process each): runner/data/pipeline.py `host_share`
gives each host of a training split shards i, i+n, ... when there are at least as many shards as hosts, else
every host reads every shard in one order and keeps every n-th record (evaluation always divides by record).
So no host is ever left without records by too few shards, but it reads n times the bytes it trains on: a
warning, with docs/multihost.md's rule (at least one shard per host, a multiple of the hosts best). A host
whose shards hold no record at all (empty shards in the manifest) would train on nothing while the others wait
for it in every step: refused. The shard counts are the manifest's (`splits.*.shards`, each with its records),
read from the bucket only where `submit` reads remote files (not in a dry run without --preflight).
Imports no TensorFlow.
"""

from __future__ import annotations

import fnmatch
import posixpath
from typing import Any

from runner import RunnerError
from runner.cloud import record
from runner.device.tpus import TpuType
from runner.spec.types import JobSpec

BATCH_RULE = 'docs/accelerators.md, "Batch size"'
SHARD_RULE = 'docs/multihost.md, "Data"; docs/tpu.md, "Shards per slice"'
MULTIPLE, BEST = 8, 128


def devices_of(tpu: TpuType) -> tuple[int, int | None]:
    """(the devices JAX makes of the slice, of each chip); (chips, None) where the table has no figure."""
    peak = tpu.facts.peak
    per_chip = peak[1] if peak else None
    return tpu.chips * (per_chip or 1), per_chip


def _unit(per_chip: int | None) -> str:
    return "chip" if per_chip in (1, None) else f"device ({per_chip} per chip)"


def _mesh(spec: JobSpec) -> dict[str, int] | None:
    """accelerator.mesh when it names its axes (the first carries the batch), None for auto (every device)."""
    mesh = getattr(spec.accelerator, "mesh", "auto")
    return mesh if isinstance(mesh, dict) and mesh else None


def batch_problems(spec: JobSpec, tpu: TpuType) -> list[str]:
    """A global batch the slice's devices do not divide, or a mesh of another size than the slice: the job would
    refuse either on the VM, after the boot."""
    if spec.kind != "train":
        return []
    batch = spec.data.global_batch_size
    devices, per_chip = devices_of(tpu)
    if (mesh := _mesh(spec)) is not None:
        total = 1
        for size in mesh.values():
            total *= size
        if per_chip is None or total == devices:
            return []
        shown = "{" + ", ".join(f"{name}: {size}" for name, size in mesh.items()) + "}"
        return [f"accelerator.mesh {shown} holds {total} devices, but {tpu.name} has {devices} ({tpu.chips} chips x "
                f"{per_chip}): make its sizes multiply to {devices}"]
    if batch % devices == 0:
        return []
    lower, upper = max(devices, batch // devices * devices), (batch // devices + 1) * devices
    return [f"data.global_batch_size ({batch}) must be divisible by the {devices} devices of {tpu.name} (one batch "
            f"per {_unit(per_chip)}): the job refuses it on the TPU VM, after the slice has booted; set it to {lower} "
            f"or {upper}"]


def batch_line(spec: JobSpec, tpu: TpuType) -> str | None:
    """The batch per device and per host on this slice, a warning when it is not a multiple of 8."""
    if spec.kind != "train":
        return None
    batch = spec.data.global_batch_size
    devices, per_chip = devices_of(tpu)
    hosts = f", {batch // tpu.hosts} per host on each of its {tpu.hosts} hosts" if tpu.hosts > 1 else ""
    if (mesh := _mesh(spec)) is not None:
        axis, size = next(iter(mesh.items()))
        return (f"batch: data.global_batch_size {batch} on {tpu.name} is {batch // size} per shard of "
                f"accelerator.mesh's batch axis {axis!r} ({size}){hosts}")
    if batch % devices:
        return None  # batch_problems refuses it
    each, unit = batch // devices, _unit(per_chip)
    said = f"data.global_batch_size {batch} on {tpu.name} is {each} per {unit}{hosts}"
    best = f"--set data.global_batch_size={BEST * devices} ({BEST} x {devices})"
    if each % MULTIPLE:
        return (f"warning: batch: {said}: the TPU cores pad a batch per {unit.split(' ')[0]} that is not a multiple "
                f"of {MULTIPLE}, and {BEST} is best ({BATCH_RULE}); e.g. {best}")
    if each < BEST:
        return f"batch: {said} (a multiple of {MULTIPLE}; {BEST} is best: {BATCH_RULE}; e.g. {best})"
    return f"batch: {said} ({BATCH_RULE}: a multiple of {MULTIPLE}, {BEST} best)"


def train_shards(pattern: str, manifest: dict[str, Any]) -> list[int]:
    """The records of each shard the pattern names, in the order runner/data/pipeline.py reads them (sorted)."""
    name = posixpath.basename(pattern)
    entries = {e["file"]: int(e["records"]) for info in manifest["splits"].values() for e in info["shards"]}
    return [entries[f] for f in sorted(entries) if fnmatch.fnmatchcase(f, name)]


def shard_advice(spec: JobSpec, tpu: TpuType, remote: bool) -> tuple[list[str], list[str]]:
    """(lines to say, problems that stop the submission) about data.train's shards on a slice of several hosts."""
    hosts, pattern = tpu.hosts, spec.data.train if spec.kind == "train" else None
    if hosts == 1 or not pattern:
        return [], []
    manifest_path = posixpath.join(posixpath.dirname(pattern), "manifest.json")
    if not remote:
        return [f"shards: not counted (a dry run reads nothing remote; with --preflight it reads {manifest_path} "
                f"to count data.train's shards for the {hosts} hosts: {SHARD_RULE})"], []
    try:
        manifest = record.read_json(manifest_path, patient=False)
        records = None if manifest is None else train_shards(pattern, manifest)
    except RunnerError as error:
        return [f"shards: not counted ({error})"], []
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        return [f"shards: not counted ({manifest_path} is not a manifest: {type(error).__name__}: {error})"], []
    if not records:
        what = "is not there" if manifest is None else f"lists no shard that {posixpath.basename(pattern)!r} names"
        return [f"shards: not counted: {manifest_path} {what} (the job stops on the VM without it)"], []
    shards, good = len(records), max(hosts, -(-len(records) // hosts) * hosts)
    prepare = f"`runner prepare DATASET --shards {good}` writes {good}"
    if shards < hosts:
        return [f"warning: shards: data.train has {shards} shard{'s' if shards > 1 else ''} for the {hosts} hosts "
                f"of {tpu.name}: every host reads all of them and keeps one record in {hosts}, reading {hosts}x "
                f"what it trains on; at least one shard per host, a multiple of {hosts} best ({SHARD_RULE}): "
                f"{prepare}"], []
    per_host = [records[i::hosts] for i in range(hosts)]
    empty = [i for i, mine in enumerate(per_host) if sum(mine) == 0]
    if empty:
        return [], [f"data.train's {shards} shards in {manifest_path} leave host{'s' if len(empty) > 1 else ''} "
                    f"{', '.join(map(str, empty))} of {tpu.name} no record (host i reads shards i, i+{hosts}, ...: "
                    "runner/data/pipeline.py), so it would train on nothing while the others wait for it every "
                    f"step; write the split again without empty shards ({SHARD_RULE})"]
    counts = sorted({len(mine) for mine in per_host})
    held = f"{min(map(sum, per_host)):,}-{max(map(sum, per_host)):,} records a host"
    if len(counts) > 1:
        return [f"warning: shards: data.train's {shards} shards give the {hosts} hosts of {tpu.name} "
                f"{counts[0]} or {counts[-1]} each ({held}); a multiple of {hosts} gives each the same "
                f"({SHARD_RULE}): {prepare}"], []
    return [f"shards: data.train's {shards} shards give each of the {hosts} hosts of {tpu.name} {counts[0]} "
            f"({held}; {SHARD_RULE})"], []
