"""Cloud TPU hardware facts: one table (runner/device/tpus.json), one parser of an accelerator type.

Each generation's row holds what is known of it, every fact with a key of the table's `sources`: how the type
counts (chips, or TensorCores at two per chip), chips per host, the multi-host slices it is submitted as (and the
chips of their VMs), the bf16 peak per chip and the devices JAX makes of a chip, the TPU VM software version for
JAX, GKE's and Vertex AI's machine types, the zones that offer it, and, where a generation has none, why
there is no list price. Per-region prices are the table's `prices`
(runner/cloud/pricing.py reads them). `runner submit`, the engines, the MFU peak (runner/device/peak.py) and
the doctor read these rows; no other module names a generation.

A type is GENERATION-SIZE as the Cloud TPU API and xpk spell it (v5litepod-8, v6e-8, v5p-8, tpu7x-8); the
names people also type (v5e-8, trillium-8, ironwood-8) are the rows' `aliases`. Imports neither TensorFlow
nor JAX: `runner validate` and `runner submit` run without them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from runner import SpecError

TABLE = Path(__file__).with_name("tpus.json")
BACKENDS = ("jax",)  # a TPU computes with JAX only: TensorFlow's TPU path is retired (docs/tpu.md)
_TYPE = re.compile(r"([a-z0-9]+)-(\d+)")


@lru_cache(maxsize=2)
def table(path: Path = TABLE) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def source(key: str) -> str:
    """The text of one of the table's sources (a key the rows name)."""
    return table()["sources"][key]


@dataclasses.dataclass(frozen=True)
class Generation:
    """One row of the table; `row` is the JSON as written, the properties its parts."""

    row: dict[str, Any]

    @property
    def name(self) -> str:
        return self.row["name"]

    @property
    def chips_per_host(self) -> int:
        return self.row["chips_per_host"]

    def chips(self, size: int) -> int:
        """The chips of GENERATION-SIZE: the size counts chips (v5e, v6e) or TensorCores, two per chip."""
        return size if self.row["counts"] == "chips" else size // 2

    def valid(self, size: int) -> bool:
        sizes = self.row["sizes"]
        return size in sizes if sizes is not None else size >= 8 and size % 8 == 0

    def sizes_text(self) -> str:
        sizes = self.row["sizes"]
        return "multiples of 8" if sizes is None else ", ".join(map(str, sizes))

    def single_host_types(self) -> list[str]:
        sizes = self.row["sizes"] or range(8, 8 * self.chips_per_host + 1, 8)
        return [f"{self.name}-{s}" for s in sizes if self.chips(s) <= self.chips_per_host]

    def multi_host_types(self) -> list[str]:
        """The slices of more than one host the table gives with a source (`multi_host`), smallest first."""
        return list((self.row.get("multi_host") or {}).get("types", []))

    def hosts(self, chips: int) -> int:
        """The hosts (TPU VMs, one JAX process each) of a slice of `chips`: one when it fits on one host, else
        chips / the chips of a multi-host slice's VM (4 on v5e and v6e, whose single host holds 8)."""
        if chips <= self.chips_per_host:
            return 1
        per_vm = (self.row.get("multi_host") or {}).get("chips_per_vm", self.chips_per_host)
        return max(1, math.ceil(chips / per_vm))

    @property
    def multi_host_source(self) -> str | None:
        found = self.row.get("multi_host")
        return source(found["source"]) if found else None

    def runtime(self, backend: str = "jax") -> tuple[str | None, str]:
        """(the TPU VM software version for `backend`, its source), or (None, why there is none)."""
        found = self.row["runtime"][backend]
        if found is None:
            return None, f"{self.row['no_runtime'][backend]} ({source(self.row['no_runtime_source'])})"
        return found["version"], source(found["source"])

    @property
    def peak(self) -> tuple[float, int, str] | None:
        """(bf16 TFLOP/s per chip, devices JAX makes of a chip, source), or None when the table has none."""
        peak = self.row["peak"]
        if peak is None:
            return None
        return peak["bf16_tflops_per_chip"], peak["devices_per_chip"], source(peak["source"])

    @property
    def hbm(self) -> tuple[int, str] | None:
        """(bytes of HBM per chip, as its source says it), or None when the table has no figure."""
        hbm = self.row.get("hbm")
        if hbm is None:
            return None
        unit = 10**9 if hbm["unit"] == "GB" else 2**30
        return hbm["per_chip"] * unit, f"{hbm['per_chip']} {hbm['unit']} per chip ({source(hbm['source'])})"

    @property
    def zones(self) -> tuple[str, ...]:
        return tuple(self.row["zones"])

    @property
    def zones_source(self) -> str:
        return f"{source(self.row['zones_source'])}; read {table()['zones_read']}"

    @property
    def no_price(self) -> str | None:
        """Why this generation has no list price anywhere (TPU7x), or None."""
        return self.row.get("no_price")

    def refusal(self, target: str) -> str | None:
        """Why `target` (tpu_vm, gke, vertex) cannot run this generation at all, with the source; None when it can."""
        part = self.row.get(target) or {}
        return f"{part['refused']} ({source(part['source'])})" if part.get("refused") else None


@lru_cache(maxsize=1)
def generations() -> dict[str, Generation]:
    """Every generation by the name the API uses, in the table's order (generally available ones newest first,
    then TPU7x, whose access goes through the account team)."""
    return {row["name"]: Generation(row) for row in table()["generations"]}


@lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    return {alias: g.name for g in generations().values() for alias in g.row["aliases"]}


def generation_name(accelerator_type: str) -> str:
    """The generation an accelerator type names, as the API spells it: `v5litepod-8`, `v5e-4` -> v5litepod,
    `tpu7x` -> tpu7x (as the API, the TPU VM's metadata, TPU_ACCELERATOR_TYPE or a summary writes it); a name
    the table does not know comes back as written, without its size."""
    name = accelerator_type.strip().lower()
    head, _, tail = name.rpartition("-")
    name = head if tail.isdigit() and head else name
    return _aliases().get(name, name)


def generation_of(accelerator_type: str) -> Generation | None:
    """The table's row for the generation an accelerator type names; None for one it does not know."""
    return generations().get(generation_name(accelerator_type))


# The generation each TPU device kind JAX reports is (`jax.devices()[0].device_kind`), as JAX itself reads it:
# jax/_src/pallas/mosaic/tpu_info.py `chip_version_from_device_kind` (jax 0.10.2). Not run on a TPU here.
_DEVICE_KINDS = {"TPU v2": "v2", "TPU v3": "v3", "TPU v4": "v4", "TPU v5 lite": "v5litepod", "TPU v5e": "v5litepod",
                 "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "tpu7x"}


def device_facts(device_kind: str, environ: dict[str, str] | os._Environ) -> dict[str, str | None]:
    """What a job on a TPU records of it (the summary's accelerator.tpu, which MFU's peak reads): the device kind
    JAX reports, its generation (None for a kind the table does not know), the accelerator type the submission
    asked for (RUNNER_TPU_TYPE, passed by the TPU VM's startup script; else TPU_ACCELERATOR_TYPE) and the TPU
    VM's software version (RUNNER_TPU_RUNTIME_VERSION)."""
    return {"device_kind": device_kind, "generation": _DEVICE_KINDS.get(device_kind),
            "accelerator_type": environ.get("RUNNER_TPU_TYPE") or environ.get("TPU_ACCELERATOR_TYPE") or None,
            "runtime_version": environ.get("RUNNER_TPU_RUNTIME_VERSION") or None}


@dataclasses.dataclass(frozen=True)
class TpuType:
    name: str  # as the API wants it, e.g. v5litepod-8
    generation: str
    chips: int
    hosts: int  # TPU VMs, each running the job as one JAX process (Google's tables call them VMs)

    @property
    def single_host(self) -> bool:
        return self.hosts == 1

    @property
    def facts(self) -> Generation:
        return generations()[self.generation]


def parse_tpu_type(text: str) -> TpuType:
    """`v5litepod-8` -> TpuType; a wrong generation or size is refused with the accepted ones."""
    known = ", ".join(generations())
    match = _TYPE.fullmatch(text.strip().lower())
    if not match:
        raise SpecError(f"--tpu-type {text!r} must look like GENERATION-SIZE, e.g. v5litepod-8 or v6e-8 "
                        f"(generations: {known})")
    name, size = match.group(1), int(match.group(2))
    if name not in generations():
        if name in _aliases():
            raise SpecError(f"--tpu-type {text!r}: the Cloud TPU API calls it {_aliases()[name]}-{size}")
        close = difflib.get_close_matches(name, list(generations()), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}-{size}?" if close else ""
        raise SpecError(f"--tpu-type {text!r}: unknown TPU generation {name!r}{hint} (known: {known})")
    generation = generations()[name]
    if not generation.valid(size):
        raise SpecError(f"--tpu-type {text!r}: {name} comes in sizes {generation.sizes_text()}, not {size}")
    chips = generation.chips(size)
    return TpuType(f"{name}-{size}", name, chips, generation.hosts(chips))


def single_host_types() -> list[str]:
    """Every type that fits on one host, in the table's order."""
    return [name for generation in generations().values() for name in generation.single_host_types()]


def multi_host_types() -> list[str]:
    """Every multi-host type the table gives the hosts of, in the table's order."""
    return [name for generation in generations().values() for name in generation.multi_host_types()]
