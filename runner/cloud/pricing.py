"""TPU types and what they cost: the accelerator behind `runner submit --tpu-type` and its cost estimate.

The price table lives in one file, runner/cloud/tpu_prices.json, with the date and source of its prices. An
estimate is chips x hours x the list price per chip-hour; `estimate` says which price it used, so a reader
can redo the sum. This module imports no cloud client and no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from runner.errors import SpecError

_TABLE = Path(__file__).with_name("tpu_prices.json")
# Names people type for a generation, mapped to the name the Cloud TPU API uses.
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "trillium": "v6e"}


@lru_cache(maxsize=1)
def price_table() -> dict[str, Any]:
    return json.loads(_TABLE.read_text())


@dataclasses.dataclass(frozen=True)
class TpuType:
    name: str  # as the API wants it, e.g. v5litepod-8
    generation: str
    chips: int
    runtime_version: str  # the default TPU VM software for this generation
    usd_per_chip_hour: float


def _sizes_text(sizes: Any) -> str:
    return sizes if isinstance(sizes, str) else ", ".join(map(str, sizes))


def parse_tpu_type(text: str) -> TpuType:
    """`v5litepod-8` -> TpuType; a wrong generation or size is refused with the accepted ones."""
    generations = price_table()["generations"]
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", text.strip().lower())
    if not match:
        raise SpecError(
            f"--tpu-type {text!r} must look like GENERATION-SIZE, e.g. v5litepod-8 or v6e-8 "
            f"(generations: {', '.join(generations)})"
        )
    generation, size = match.group(1), int(match.group(2))
    if generation not in generations:
        if generation in _ALIASES:
            raise SpecError(f"--tpu-type {text!r}: the Cloud TPU API calls it {_ALIASES[generation]}-{size}")
        close = difflib.get_close_matches(generation, list(generations), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}-{size}?" if close else ""
        raise SpecError(f"--tpu-type {text!r}: unknown TPU generation {generation!r}{hint} (known: {', '.join(generations)})")
    info = generations[generation]
    sizes = info["sizes"]
    valid = size >= 8 and size % 8 == 0 if isinstance(sizes, str) else size in sizes
    if not valid:
        raise SpecError(f"--tpu-type {text!r}: {generation} comes in sizes {_sizes_text(sizes)}, not {size}")
    chips = size if info["counts"] == "chips" else size // 2
    return TpuType(f"{generation}-{size}", generation, chips, info["runtime_version"], float(info["usd_per_chip_hour"]))


def estimate(tpu_type: str, hours: float, spot: bool = False) -> dict[str, Any]:
    """The cost of `hours` of a TPU type at the table's list price, with everything needed to check it."""
    tpu = parse_tpu_type(tpu_type)
    table = price_table()
    usd = tpu.chips * hours * tpu.usd_per_chip_hour
    return {
        "accelerator_type": tpu.name,
        "chips": tpu.chips,
        "hours": round(hours, 4),
        "usd_per_chip_hour": tpu.usd_per_chip_hour,
        "usd": round(usd, 4),
        "spot": spot,
        "basis": "on-demand list price" + (" (an upper bound: Spot VMs cost less)" if spot else ""),
        "price_table": {"date": table["date"], "source": table["source"]},
    }
