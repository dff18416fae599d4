"""Cloud TPU accelerator types: generation, size, chips, hosts, and which of them this project runs.

A type is GENERATION-SIZE as the Cloud TPU API spells it (v5litepod-8, v6e-8, v5p-8, v4-8). The number after
the dash counts chips (v5e, v6e) or TensorCores, two per chip (v2, v3, v4, v5p). The hosts of a slice are its
chips divided by the chips each TPU VM host carries; per Google's page for each generation:

    generation  counts  chips/host  single-host types            source
    v6e         chips   8           v6e-1, v6e-4, v6e-8          https://cloud.google.com/tpu/docs/v6e
    v5litepod   chips   8           v5litepod-1, -4, -8          https://cloud.google.com/tpu/docs/v5e
    v5p         cores   4           v5p-8                        https://cloud.google.com/tpu/docs/v5p
    v4          cores   4           v4-8                         https://cloud.google.com/tpu/docs/v4
    v3          cores   4           v3-8                         https://cloud.google.com/tpu/docs/v3
    v2          cores   4           v2-8                         https://cloud.google.com/tpu/docs/v2

Only single-host types run here: `refuse_multi_host` says why and what works (docs/tpu.md has the sources).
The runtime version of each generation is the one Google's "TPU software versions" page names for a framework
installed by the user (https://cloud.google.com/tpu/docs/runtimes): this image brings its own TensorFlow and
libtpu, so the VM needs only the OS, the TPU driver and Docker. This module imports no cloud client and no
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re

from runner import SpecError

DOCS = "docs/tpu.md"


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str  # as the Cloud TPU API spells it
    counts: str  # chips | cores: what the number after the dash counts
    chips_per_host: int
    sizes: tuple[int, ...] | None  # None: any multiple of 8
    runtime_version: str
    source: str

    def chips(self, size: int) -> int:
        return size if self.counts == "chips" else size // 2

    def valid(self, size: int) -> bool:
        return size in self.sizes if self.sizes is not None else size >= 8 and size % 8 == 0

    def sizes_text(self) -> str:
        return "multiples of 8" if self.sizes is None else ", ".join(map(str, self.sizes))


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v6e", "chips", 8, (1, 4, 8, 16, 32, 64, 128, 256), "v2-alpha-tpuv6e",
                   "https://cloud.google.com/tpu/docs/v6e"),
        Generation("v5litepod", "chips", 8, (1, 4, 8, 16, 32, 64, 128, 256), "v2-alpha-tpuv5-lite",
                   "https://cloud.google.com/tpu/docs/v5e"),
        Generation("v5p", "cores", 4, None, "v2-alpha-tpuv5", "https://cloud.google.com/tpu/docs/v5p"),
        Generation("v4", "cores", 4, None, "tpu-ubuntu2204-base", "https://cloud.google.com/tpu/docs/v4"),
        Generation("v3", "cores", 4, (8, 32, 64, 128, 256, 512, 1024, 2048), "tpu-ubuntu2204-base",
                   "https://cloud.google.com/tpu/docs/v3"),
        Generation("v2", "cores", 4, (8, 32, 128, 256, 512), "tpu-ubuntu2204-base",
                   "https://cloud.google.com/tpu/docs/v2"),
    )
}
# Names people type for a generation, mapped to the name the Cloud TPU API uses.
ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "trillium": "v6e"}


@dataclasses.dataclass(frozen=True)
class TpuType:
    name: str  # as the API wants it, e.g. v5litepod-8
    generation: str
    chips: int
    hosts: int
    runtime_version: str  # the default TPU VM software for this generation

    @property
    def single_host(self) -> bool:
        return self.hosts == 1


def parse_tpu_type(text: str) -> TpuType:
    """`v5litepod-8` -> TpuType; a wrong generation or size is refused with the accepted ones."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", text.strip().lower())
    if not match:
        raise SpecError(
            f"--tpu-type {text!r} must look like GENERATION-SIZE, e.g. v5litepod-8 or v6e-8 "
            f"(generations: {', '.join(GENERATIONS)})"
        )
    name, size = match.group(1), int(match.group(2))
    if name not in GENERATIONS:
        if name in ALIASES:
            raise SpecError(f"--tpu-type {text!r}: the Cloud TPU API calls it {ALIASES[name]}-{size}")
        close = difflib.get_close_matches(name, list(GENERATIONS), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}-{size}?" if close else ""
        raise SpecError(f"--tpu-type {text!r}: unknown TPU generation {name!r}{hint} (known: {', '.join(GENERATIONS)})")
    generation = GENERATIONS[name]
    if not generation.valid(size):
        raise SpecError(f"--tpu-type {text!r}: {name} comes in sizes {generation.sizes_text()}, not {size}")
    chips = generation.chips(size)
    hosts = max(1, math.ceil(chips / generation.chips_per_host))
    return TpuType(f"{name}-{size}", name, chips, hosts, generation.runtime_version)


def generation_of(accelerator_type: str) -> str | None:
    """The generation in an accelerator type as the API or the TPU VM's metadata names it (v5litepod-8 ->
    v5litepod, v5e-8 -> v5litepod); None when it names none this module knows."""
    name = accelerator_type.strip().lower().rsplit("-", 1)[0]
    name = ALIASES.get(name, name)
    return name if name in GENERATIONS else None


def single_host_types() -> list[str]:
    """Every type that fits on one TPU VM host, newest generation first."""
    found = []
    for generation in GENERATIONS.values():
        sizes = generation.sizes or tuple(range(8, 8 * generation.chips_per_host + 1, 8))
        found += [f"{generation.name}-{s}" for s in sizes if generation.chips(s) <= generation.chips_per_host]
    return found


def refuse_multi_host(tpu_type: str) -> None:
    """Raises SpecError (exit 2) for a type that spans more than one host, saying what works and why.

    TensorFlow on a multi-host slice runs one client on worker 0 that reaches every host's TPU through a TPU
    worker service; only the `tpu-vm-tf-*-pod*` runtimes run that service, and the client needs
    cloud-tpu-client (googleapiclient) to find the hosts. No Google or Keras document shows that from a
    container with tensorflow-tpu from PyPI, so it is refused here rather than guessed.
    """
    tpu = parse_tpu_type(tpu_type)
    if tpu.single_host:
        return
    per_host = GENERATIONS[tpu.generation].chips_per_host
    raise SpecError(
        f"--tpu-type {tpu.name} is a multi-host slice ({tpu.chips} chips on {tpu.hosts} hosts of {per_host}), "
        "which this runner does not support: TensorFlow on several hosts needs the tpu-vm-tf-*-pod runtimes' "
        "TPU worker service on every host and cloud-tpu-client on worker 0, and no documented recipe runs that "
        f"from this image. Single-host types work: {', '.join(single_host_types())} (see {DOCS})"
    )


def single_host_type(text: str) -> TpuType:
    """`parse_tpu_type`, after `refuse_multi_host`: what `runner submit` accepts."""
    refuse_multi_host(text)
    return parse_tpu_type(text)
