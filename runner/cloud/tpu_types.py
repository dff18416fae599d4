"""What `runner submit` accepts of a TPU type, zone and software version; the facts are runner/device/tpus.py's.

  - Single-host slices only: `refuse_multi_host` says why and which types work.
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

from runner import SpecError
from runner.device.tpus import TpuType, generations, parse_tpu_type, single_host_types

__all__ = ["DOCS", "TpuType", "check_zone_offers", "parse_tpu_type", "refuse_multi_host", "refuse_on",
           "runtime_of", "single_host_type", "single_host_types", "unverified_reason", "where_problems"]

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


def refuse_multi_host(tpu_type: str) -> None:
    """Raises SpecError (exit 2) for a type that spans more than one host, saying what works and why.

    A multi-host slice runs the same program on every host, which must join one JAX process group
    (`jax.distributed.initialize`, all hosts started together and restarted together after any host fails:
    JAX's multi_process and fault_tolerance docs). The runner starts one container on one host and its job
    and checkpoint code assume one process, so it refuses rather than start a slice that would hang.
    """
    tpu = parse_tpu_type(tpu_type)
    if tpu.single_host:
        return
    per_host = generations()[tpu.generation].chips_per_host
    on_vm = [name for name in single_host_types() if not parse_tpu_type(name).facts.refusal("tpu_vm")]
    gke_only = [name for name in single_host_types() if name not in on_vm]
    raise SpecError(
        f"--tpu-type {tpu.name} is a multi-host slice ({tpu.chips} chips on {tpu.hosts} hosts of {per_host}), which "
        "this runner does not support yet: every host must run the job as one JAX process group "
        "(jax.distributed.initialize, started and restarted together), and the runner starts and checkpoints one "
        f"process on one host. Single-host types work: {', '.join(on_vm)}; {', '.join(gke_only)} with --on gke "
        f"(see {DOCS})"
    )


def single_host_type(text: str) -> TpuType:
    """`parse_tpu_type`, after `refuse_multi_host`: what `runner submit` accepts."""
    refuse_multi_host(text)
    return parse_tpu_type(text)
