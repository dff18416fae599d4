"""TPU prices (runner/cloud/pricing.py, the `prices` of runner/device/tpus.json): per generation and region, on
demand and Spot apart, each row with its source and date; a region without a row has no price, and says so; TPU7x
has no list price anywhere, and says so."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from runner import SpecError
from runner.cloud import pricing
from runner.device.tpus import generations

TABLE = json.loads(pricing.TABLE.read_text())
GENERATIONS = generations()


def test_every_row_names_its_source_and_the_date_it_was_read() -> None:
    assert TABLE["prices"], "the table has rows"
    for row in TABLE["prices"]:
        where = f"{row['generation']} {row['region']}"
        assert row["generation"] in GENERATIONS, where
        assert row["source"] in TABLE["sources"] and TABLE["sources"][row["source"]], where
        datetime.date.fromisoformat(row["date"])
        assert isinstance(row["confirmed"], bool) and row["read_from"], where
        assert row["on_demand"] > 0, where
        assert row["spot"] is None or 0 < row["spot"] < row["on_demand"], f"{where}: Spot costs less than on demand"
    pairs = [(row["generation"], row["region"]) for row in TABLE["prices"]]
    assert len(pairs) == len(set(pairs)), "one row per generation and region"


def test_each_generation_has_a_price_somewhere_but_tpu7x_which_says_it_has_none() -> None:
    priced = {row["generation"] for row in TABLE["prices"]}
    assert priced == {name for name, g in GENERATIONS.items() if not g.no_price}
    assert [name for name, g in GENERATIONS.items() if g.no_price] == ["tpu7x"]
    for zone in ("us-central1-c", "europe-west4-a"):
        for spot in (False, True):
            price = pricing.price_per_chip_hour("tpu7x-8", zone, spot=spot)
            assert price.usd is None and price.note.startswith("no list price: "), price
    cost = pricing.estimate("tpu7x-8", 1.0, "us-central1-c")
    assert cost["usd"] is None and cost["chips"] == 4 and "no list price" in cost["price"]["note"]


def test_v4_is_priced_in_us_central2_only_and_elsewhere_has_no_price() -> None:
    assert {row["region"] for row in TABLE["prices"] if row["generation"] == "v4"} == {"us-central2"}
    v4 = pricing.price_per_chip_hour("v4-8", "us-central2-b")
    assert (v4.usd, v4.region, v4.confirmed, v4.note) == (3.22, "us-central2", True, "")
    elsewhere = pricing.price_per_chip_hour("v4-8", "us-central1-a")
    assert elsewhere.usd is None
    assert elsewhere.note == "no on-demand price for v4 in us-central1 in tpus.json (priced regions: us-central2)"


def test_v6e_is_priced_per_region_and_spot_apart() -> None:
    central = pricing.price_per_chip_hour("v6e-8", "us-central1-b")
    europe = pricing.price_per_chip_hour("v6e-8", "europe-west4-a")
    assert (central.usd, europe.usd) == (2.70, 2.97)
    spot = pricing.price_per_chip_hour("v6e-8", "us-central1-b", spot=True)
    assert spot.spot and spot.usd == 0.54421 and spot.usd < central.usd
    assert "Spot prices change often" in spot.note
    assert pricing.price_per_chip_hour("v6e-8", "us-east5-a", spot=True).usd == 1.215  # Spot differs by region


def test_a_missing_spot_price_is_said_not_borrowed() -> None:
    missing = pricing.price_per_chip_hour("v3-8", "us-east1-d", spot=True)
    assert missing.usd is None and missing.note == "the source gives no Spot price for v3 in us-east1"
    assert pricing.price_per_chip_hour("v3-8", "us-east1-d").usd == 2.0


def test_an_estimate_is_chips_times_hours_times_the_price() -> None:
    cost = pricing.estimate("v5p-8", 2.5, "us-east5-a", spot=True)
    assert (cost["chips"], cost["usd_per_chip_hour"], cost["usd"]) == (4, 1.68, 16.8)
    assert cost["price"]["confirmed"] and cost["price"]["date"] and cost["price"]["source"].startswith("SkyPilot")
    nothing = pricing.estimate("v4-8", 1.0, "europe-west4")
    assert nothing["usd"] is None and "priced regions: us-central2" in nothing["price"]["note"]


def test_an_unconfirmed_row_says_so_wherever_its_price_shows(tmp_path: Path) -> None:
    doc = {
        "about": "test table",
        "sources": {"hearsay": "a figure nobody here found in a source"},
        "prices": [{"generation": "v5litepod", "region": "us-west4", "on_demand": 1.25, "spot": 0.5,
                    "confirmed": False, "source": "hearsay", "read_from": "-", "date": "2026-11-23"}],
    }
    table = tmp_path / "tpus.json"
    table.write_text(json.dumps(doc))
    cost = pricing.estimate("v5litepod-4", 2.0, "us-west4-a", table=table)
    assert cost["usd"] == 10.0
    assert cost["price"]["confirmed"] is False
    assert cost["price"]["note"] == (
        "unconfirmed: $1.25 per chip-hour for v5litepod on-demand in us-west4 was not found in its source"
    )


def test_zones_and_regions() -> None:
    assert pricing.region_of("us-central2-b") == "us-central2"
    assert pricing.region_of("europe-west4") == "europe-west4"
    with pytest.raises(SpecError, match="did you mean v5p-8"):
        pricing.price_per_chip_hour("v5x-8", "us-central1")
