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

Only single-host types are submitted: `refuse_multi_host` says why and what works (docs/tpu.md has the sources).

The TPU VM software ("runtime version") of each generation is taken from a Google source for TensorFlow, and
each row of RUNTIMES says which (docs/tpu.md shows the same table). A row is a *recipe* when its source creates
that generation with that runtime and runs TensorFlow on it; every other combination, the default of a
generation without a recipe (v6e) included, is **unverified**: `runner submit` says so and needs
`--allow-unverified`. The image's own TensorFlow is judged apart (IMAGE_RECIPES): a runtime recipe ran
TensorFlow 2.18 on the VM, not the image's 2.19.1. The image brings its own TensorFlow and libtpu, so the VM
needs only the OS, the TPU driver and Docker. Nothing here ran on a TPU. This module imports no cloud client
and no TensorFlow.
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
    source: str  # Google's page for the generation (chips per host, sizes)

    @property
    def runtime_version(self) -> str:
        """The default TPU VM software: the generation's first row in RUNTIMES."""
        return RUNTIMES[self.name][0].version

    def chips(self, size: int) -> int:
        return size if self.counts == "chips" else size // 2

    def valid(self, size: int) -> bool:
        return size in self.sizes if self.sizes is not None else size >= 8 and size % 8 == 0

    def sizes_text(self) -> str:
        return "multiples of 8" if self.sizes is None else ", ".join(map(str, self.sizes))


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v6e", "chips", 8, (1, 4, 8, 16, 32, 64, 128, 256), "https://cloud.google.com/tpu/docs/v6e"),
        Generation("v5litepod", "chips", 8, (1, 4, 8, 16, 32, 64, 128, 256), "https://cloud.google.com/tpu/docs/v5e"),
        Generation("v5p", "cores", 4, None, "https://cloud.google.com/tpu/docs/v5p"),
        Generation("v4", "cores", 4, None, "https://cloud.google.com/tpu/docs/v4"),
        Generation("v3", "cores", 4, (8, 32, 64, 128, 256, 512, 1024, 2048), "https://cloud.google.com/tpu/docs/v3"),
        Generation("v2", "cores", 4, (8, 32, 128, 256, 512), "https://cloud.google.com/tpu/docs/v2"),
    )
}
# Names people type for a generation, mapped to the name the Cloud TPU API uses.
ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "trillium": "v6e"}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A TPU VM software version for one generation, where a Google source names it for TensorFlow."""

    version: str
    source: str
    recipe: bool  # the source creates this generation with this version and runs TensorFlow on it


# Google's TensorFlow 2.18 release test, main branch: it creates each TPU on the runtime below, installs
# tensorflow-tpu 2.18.0 on the VM and trains ResNet. (This image brings 2.19.1 in a container instead.)
_TF_RELEASE_TEST = ("Google's TensorFlow 2.18 release test: GoogleCloudPlatform/ml-auto-solutions "
                    "dags/solutions_team/solutionsteam_tf_release_supported.py (main, 7eda193b, 2026-08-21), "
                    "tf_resnet_{test} on {runtime}")
# Google's "TPU software versions" page: "TPU v6e, v5e, and v5p support TensorFlow 2.15.0 and newer" with
# tpu-vm-tf-x.y.z[-pod]-pjrt; 2.18.0 is the newest TensorFlow in its table. It shows no run.
_RUNTIMES_PAGE = ("Google's \"TPU software versions\" page (https://cloud.google.com/tpu/docs/supported-tpu-versions, "
                  "copy updated 2025-08-11): v6e, v5e and v5p support TensorFlow 2.15.0 and newer as "
                  "tpu-vm-tf-x.y.z-pjrt; newest listed 2.18.0. It names the version; it shows no run")
RUNTIMES: dict[str, tuple[Runtime, ...]] = {
    # v6e: the runtimes page and Vertex AI's TPU training page ("Starting with TPU v6e, TensorFlow is no
    # longer supported") disagree, and no Google test on the main branch runs TensorFlow on v6e (a v6e-4 test
    # on v2-alpha-tpuv6e was added on a branch, ml-auto-solutions 12936e9e, 2025-10-15, and not merged).
    "v6e": (
        Runtime("tpu-vm-tf-2.18.0-pjrt", _RUNTIMES_PAGE, recipe=False),
        Runtime(
            "v2-alpha-tpuv6e",
            "ml-auto-solutions commit 12936e9e (2025-10-15, a branch not merged into main): "
            "tf_resnet_v6e_4 on v2-alpha-tpuv6e",
            recipe=False,
        ),
    ),
    "v5litepod": (
        Runtime(
            "v2-alpha-tpuv5-lite", _TF_RELEASE_TEST.format(test="v5e_4", runtime="v2-alpha-tpuv5-lite"), recipe=True
        ),
        Runtime("tpu-vm-tf-2.18.0-pjrt", _RUNTIMES_PAGE, recipe=False),
    ),
    "v5p": (
        Runtime("v2-alpha-tpuv5", _TF_RELEASE_TEST.format(test="v5p_8", runtime="v2-alpha-tpuv5"), recipe=True),
        Runtime("tpu-vm-tf-2.18.0-pjrt", _RUNTIMES_PAGE, recipe=False),
    ),
    "v4": (Runtime("v2-alpha-tpuv5", _TF_RELEASE_TEST.format(test="v4_8", runtime="v2-alpha-tpuv5"), recipe=True),),
    "v3": (Runtime("v2-alpha-tpuv5", _TF_RELEASE_TEST.format(test="v3_8", runtime="v2-alpha-tpuv5"), recipe=True),),
    "v2": (Runtime("v2-alpha-tpuv5", _TF_RELEASE_TEST.format(test="v2_8", runtime="v2-alpha-tpuv5"), recipe=True),),
}


# The TPU image's TensorFlow (Dockerfile tf-tpu stage, requirements-tpu.lock; tests check the pin) on each
# generation: a recipe where a source runs that tensorflow-tpu on that generation. Google's release test above
# runs tensorflow-tpu 2.18.0 on the VM; the one source that runs 2.19.1 is Keras's TensorFlow TPU example, for
# v5p and v6e (v6e stays unverified: Google's pages disagree on it). So this axis is apart from the runtime's:
# v5e, v4, v3 and v2 have a runtime recipe (for 2.18) and none for the image's 2.19.1.
IMAGE_TENSORFLOW = "2.19.1"
_KERAS_TF_EXAMPLE = (
    "Keras's \"DistributedEmbedding using TPU SparseCore and TensorFlow\" "
    "(https://keras.io/keras_rs/examples/distributed_embedding_tf, 2025-09-02): `pip install "
    "tensorflow-tpu==2.19.1`, PJRT, Keras 3 fit under TPUStrategy; \"It needs to be run on TPU v5p or v6e\""
)
IMAGE_RECIPES: dict[str, str] = {"v5p": _KERAS_TF_EXAMPLE}
# Keras's example names v6e too, but Google's own pages disagree on TensorFlow there (RUNTIMES' v6e note): the
# image on v6e is unverified on every target, GKE's and Vertex AI's hosts included.
_V6E = ("Keras's TensorFlow TPU example names v5p or v6e, but Vertex AI's TPU training page says \"Starting with "
        "TPU v6e, TensorFlow is no longer supported\" and no Google test runs TensorFlow on v6e")


def image_unverified_reason(tpu: TpuType) -> str | None:
    """Why the runner's TPU image (tensorflow-tpu IMAGE_TENSORFLOW) on this generation is unverified, or None
    when a recipe runs that TensorFlow there."""
    if tpu.generation in IMAGE_RECIPES:
        return None
    with_recipe = ", ".join(g for g in GENERATIONS if g in IMAGE_RECIPES)
    why = _V6E if tpu.generation == "v6e" else (
        f"no recipe runs tensorflow-tpu {IMAGE_TENSORFLOW} on {tpu.generation} (the one that runs it, Keras's "
        "TensorFlow TPU example, names v5p or v6e; Google's release test runs TensorFlow 2.18 there)")
    return (
        f"the runner's TPU image (tensorflow-tpu {IMAGE_TENSORFLOW}, Keras 3) on {tpu.generation} is unverified: "
        f"{why}; generations with a recipe for the image: {with_recipe} ({DOCS})"
    )


def runtime_of(tpu: TpuType, runtime_version: str | None = None) -> tuple[str, Runtime | None]:
    """The runtime version to create `tpu` with (the generation's default unless given) and its row in
    RUNTIMES, or None when no Google source names it for TensorFlow on that generation."""
    version = runtime_version or GENERATIONS[tpu.generation].runtime_version
    return version, next((r for r in RUNTIMES[tpu.generation] if r.version == version), None)


def unverified_reason(tpu: TpuType, runtime_version: str | None = None, *, vm: bool = True) -> str | None:
    """Why the job on this type is unverified, or None when recipes cover it: the runner's image on the
    generation and, when `vm` (a TPU VM created with this runtime: --on tpu-vm, skypilot), TensorFlow on that
    runtime. GKE and Vertex AI choose the host's software themselves: only the image is judged there."""
    reasons = [runtime_unverified_reason(tpu, runtime_version) if vm else None, image_unverified_reason(tpu)]
    found = [reason for reason in reasons if reason]
    return "; and ".join(found) if found else None


def runtime_unverified_reason(tpu: TpuType, runtime_version: str | None = None) -> str | None:
    """Why TensorFlow on this type and runtime is unverified (no recipe ran it), or None when a recipe did."""
    version, row = runtime_of(tpu, runtime_version)
    if row is not None and row.recipe:
        return None
    recipes = [r.version for r in RUNTIMES[tpu.generation] if r.recipe]
    named = (
        f"named by {row.source}, but no recipe runs TensorFlow on it"
        if row
        else "no Google source names it for TensorFlow"
    )
    return (
        f"{tpu.name} on runtime {version} is unverified: {named}; "
        + (
            f"the {tpu.generation} runtime with a recipe is {', '.join(recipes)}"
            if recipes
            else f"no {tpu.generation} runtime has one"
        )
        + f" ({DOCS})"
    )


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
