"""What `runner submit` accepts of a TPU type, zone and software version; the facts are runner/device/tpus.py's.

  - Single-host slices, and the multi-host slices the table gives the hosts of (v5e, v6e and v5p at 16 and 32):
    `refuse_unknown_slice` refuses any other, saying why and which types work.
  - The zone must offer the type: `check_zone_offers` refuses any other with the zones that do, and the
    table's source for them and the date it was read.
  - The TPU VM is created with the software version Google's runtimes page names for JAX on the generation
    (the runner's TPU image runs Keras 3 on JAX; the VM needs only its OS, the TPU driver and Docker). A
    `--runtime-version` the table does not name for JAX there is **unverified**: `runner submit` says so
    and sends it only with `--allow-unverified`.
  - TPU7x has no Cloud TPU API and no TPU VM software: only `--on gke` takes it.

Nothing here ran on a TPU (docs/tpu.md). Imports no cloud client and no TensorFlow.
"""

from __future__ import annotations

import math

from runner import SpecError
from runner.device.tpus import TpuType, multi_host_types, parse_tpu_type, single_host_types

__all__ = ["DOCS", "TpuType", "check_zone_offers", "multi_host_types", "parse_tpu_type", "refuse_on",
           "refuse_unknown_slice", "runtime_of", "single_host_types", "slice_type", "unverified_reason",
           "where_problems"]

DOCS = "docs/tpu.md"
BACKEND = "jax"  # what the runner's TPU image runs (docs/image.md)


def runtime_of(tpu: TpuType) -> tuple[str | None, str]:
    """(the TPU VM software version for the image's backend on this type, its source), or (None, why not)."""
    return tpu.facts.runtime(BACKEND)


def unverified_reason(tpu: TpuType, runtime_version: str | None = None, *, vm: bool = True) -> str | None:
    """Why a TPU VM of this type on `runtime_version` is unverified (no source names that version for JAX on
    the generation), or None. `vm`: False where the engine chooses the host's software (GKE, Vertex AI)."""
    named, where = runtime_of(tpu)
    if not vm or runtime_version is None or runtime_version == named:
        return None
    return (f"{tpu.name} on runtime {runtime_version} is unverified: no source in this project's TPU table names it "
            f"for JAX on {tpu.generation}; the one named is {named} ({where}); drop --runtime-version to use it "
            f"({DOCS})")


def refuse_on(tpu: TpuType, target: str) -> None:
    """Raises SpecError (exit 2) when `target` (tpu_vm: --on tpu-vm and skypilot, which create TPU VMs; gke;
    vertex) cannot run the generation at all, with the reason and what can."""
    why = tpu.facts.refusal(target)
    if why:
        on = {"tpu_vm": "tpu-vm or skypilot", "gke": "gke", "vertex": "vertex"}[target]
        raise SpecError(f"--tpu-type {tpu.name} cannot run --on {on}: {why} ({DOCS})")


def check_zone_offers(tpu: TpuType, zone: str) -> None:
    """Raises SpecError (exit 2) when the table says `zone` does not offer the type's generation."""
    facts = tpu.facts
    if zone in facts.zones:
        return
    raise SpecError(f"--zone {zone} does not offer {tpu.name}: {tpu.generation}'s single-host types are offered in "
                    f"{', '.join(facts.zones)} (source: {facts.zones_source}); pick one of those, or check "
                    f"`gcloud compute tpus accelerator-types list --zone={zone}` if the table is out of date")


def where_problems(tpu: TpuType, zone: str | None, creates_vm: bool) -> list[str]:
    """What `runner submit` refuses about where the type would run: a zone that does not offer it, and a TPU VM
    of a generation that has none (`creates_vm`: --on tpu-vm and skypilot)."""
    checks = [lambda: check_zone_offers(tpu, zone)] if zone else []
    if creates_vm:
        checks.insert(0, lambda: refuse_on(tpu, "tpu_vm"))
    problems = []
    for check in checks:
        try:
            check()
        except SpecError as error:
            problems.append(str(error))
    return problems


def refuse_unknown_slice(tpu_type: str) -> None:
    """Raises SpecError (exit 2) for a multi-host type whose host count the table gives no source for, saying
    what works and why.

    A multi-host slice runs the same program on every host (TPU VM), all of which join one JAX process group
    (`jax.distributed.initialize`, started together and restarted together after any host fails: JAX's
    multi_process and fault_tolerance docs). The startup script starts that program on every worker; what it
    must know is how many workers there are, and the table says so, with a source, only for the types listed.
    The count its chips per VM would give for another type is shown, never used.
    """
    tpu = parse_tpu_type(tpu_type)
    if tpu.single_host or tpu.name in tpu.facts.multi_host_types():
        return
    on_vm = [name for name in single_host_types() if not parse_tpu_type(name).facts.refusal("tpu_vm")]
    gke_only = [name for name in single_host_types() if name not in on_vm]
    sourced = tpu.facts.multi_host_types()
    confirmed = (f"it has one only for {', '.join(sourced)}" if sourced
                 else f"it has none for any multi-host {tpu.generation} slice")
    raise SpecError(
        f"--tpu-type {tpu.name} is a multi-host slice of {tpu.chips} chips ({tpu.hosts} hosts of "
        f"{math.ceil(tpu.chips / tpu.hosts)} chips, if its VMs are as the TPU table's other {tpu.generation} VMs), "
        f"but the table has no source for its host count ({confirmed}): every host runs the job as one JAX process "
        "(jax.distributed.initialize), so the startup script must know how many there are, and the runner does not "
        f"guess it. Multi-host types work: {', '.join(multi_host_types())}. Single-host types work: "
        f"{', '.join(on_vm)}; {', '.join(gke_only)} with --on gke (see {DOCS})"
    )


def slice_type(text: str) -> TpuType:
    """`parse_tpu_type`, after `refuse_unknown_slice`: what `runner submit` accepts."""
    refuse_unknown_slice(text)
    return parse_tpu_type(text)
