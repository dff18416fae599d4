"""What a TPU costs: list prices per chip-hour by generation and region, on demand and Spot apart.

The prices are the `prices` of the TPU table (runner/device/tpus.json): every row names its source and the date it
was read, and says whether the figure was found in that source (`confirmed`). A generation the table marks
`no_price` (TPU7x) has no list price anywhere, and every answer for it says so. A price is looked up by TPU type
and region; a region the table has no row for has no price (v4, for one, is sold in us-central2 only), and the
answer says so instead of borrowing another region's figure. An estimate is chips x hours x the price per
chip-hour, with everything needed to redo the sum. The hours are the caller's: Google bills while the TPU exists,
so they should run from the queued resource's creation to its deletion. No cloud client, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from runner.device import tpus
from runner.device.tpus import TpuType, parse_tpu_type  # noqa: F401  (re-exported for callers)

TABLE = tpus.TABLE
_ZONE = re.compile(r"([a-z]+-[a-z]+\d+)-[a-z0-9]+")


@lru_cache(maxsize=4)
def price_table(path: Path = TABLE) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def region_of(zone_or_region: str) -> str:
    """us-central2-b -> us-central2; a region comes back as it is."""
    match = _ZONE.fullmatch(zone_or_region.strip())
    return match.group(1) if match else zone_or_region.strip()


@dataclasses.dataclass(frozen=True)
class Price:
    """One generation's price per chip-hour in one region, on demand or Spot, and where it comes from."""

    generation: str
    region: str
    spot: bool
    usd: float | None  # per chip-hour; None: no price known for this generation, region and kind
    confirmed: bool = False
    source: str | None = None
    date: str | None = None
    note: str = ""  # said wherever the price is shown: unconfirmed, or why there is none

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def price_per_chip_hour(tpu_type: str, region: str, spot: bool = False, table: Path = TABLE) -> Price:
    """The list price of one chip-hour of `tpu_type` (e.g. v5litepod-8) in `region` (a zone is accepted)."""
    tpu = parse_tpu_type(tpu_type)
    generation = tpu.generation
    region = region_of(region)
    doc = price_table(table)
    kind = "Spot" if spot else "on-demand"
    if tpu.facts.no_price:
        return Price(generation, region, spot, None, note=tpu.facts.no_price)
    rows = [r for r in doc["prices"] if r["generation"] == generation]
    row = next((r for r in rows if r["region"] == region), None)
    if row is None:
        known = ", ".join(sorted(r["region"] for r in rows)) or "none"
        note = f"no {kind} price for {generation} in {region} in {Path(table).name} (priced regions: {known})"
        return Price(generation, region, spot, None, note=note)
    usd = row["spot"] if spot else row["on_demand"]
    source = doc["sources"].get(row["source"], row["source"])
    if usd is None:
        note = f"the source gives no {kind} price for {generation} in {region}"
        return Price(generation, region, spot, None, source=source, date=row["date"], note=note)
    note = "" if row["confirmed"] else (
        f"unconfirmed: ${usd} per chip-hour for {generation} {kind} in {region} was not found in its source"
    )
    if spot and not note:
        note = "Spot prices change often; this is the list price on the date shown"
    return Price(generation, region, spot, float(usd), bool(row["confirmed"]), source, row["date"], note)


def estimate(tpu_type: str, hours: float, region: str, spot: bool = False, table: Path = TABLE) -> dict[str, Any]:
    """The cost of `hours` of a TPU type: chips x hours x the price per chip-hour, or `usd: null` with
    the reason when no price is known."""
    tpu = parse_tpu_type(tpu_type)
    price = price_per_chip_hour(tpu.name, region, spot, table)
    usd = None if price.usd is None else round(tpu.chips * hours * price.usd, 4)
    return {
        "accelerator_type": tpu.name,
        "chips": tpu.chips,
        "hours": round(hours, 4),
        "region": price.region,
        "spot": spot,
        "usd_per_chip_hour": price.usd,
        "usd": usd,
        "price": {"confirmed": price.confirmed, "source": price.source, "date": price.date, "note": price.note},
    }
