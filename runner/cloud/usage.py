"""What a job's TPU has cost so far, from the Cloud TPU API's own timestamps.

Google bills a TPU while its node exists, not while the job runs. Each submission of a job is one window:

    start   the node's createTime (the queued resource's createTime when the node was never seen: a request
            that waited in the queue bills nothing, so that fallback is an upper bound)
    end     the end time of the queued resource's delete operation (from the API), else the first time a
            watcher found it gone, else now (it still exists)

cost = chips x hours x the price per chip-hour of the TPU's generation in the zone's region, Spot or on
demand as submitted (runner/cloud/pricing.py: each price with its source and date, unconfirmed ones said so;
no price for that region: `usd` is null and `price.note` says why).
"""

from __future__ import annotations

import datetime
from typing import Any

from runner.cloud import pricing, record


def window_hours(window: dict[str, Any], now: datetime.datetime | None = None) -> tuple[float, str]:
    """Hours one submission's node existed, and which timestamps measured them."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    start = record.parse_time(window.get("node_created_at"))
    start_basis = "node createTime"
    if start is None:
        start, start_basis = record.parse_time(window.get("created_at")), "queued resource createTime (upper bound)"
    if start is None:
        return 0.0, "never created"
    end = record.parse_time(window.get("deleted_at"))
    end_basis = "delete operation endTime"
    if end is None and window.get("gone_at"):
        end, end_basis = record.parse_time(window["gone_at"]), "first seen gone"
    if end is None:
        end, end_basis = now, "still exists"
    return max((end - start).total_seconds(), 0.0) / 3600, f"{start_basis} to {end_basis}"


def job_cost(job: dict[str, Any], now: datetime.datetime | None = None) -> dict[str, Any]:
    """The cost of every submission of a job (job.json's `submissions`) and their sum."""
    tpu_type, zone, spot = job["request"]["tpu_type"], job["zone"], bool(job["request"].get("spot"))
    chips = pricing.parse_tpu_type(tpu_type).chips
    price = pricing.price_per_chip_hour(tpu_type, zone, spot)
    windows = []
    for window in job.get("submissions", []):
        hours, measured = window_hours(window, now)
        usd = None if price.usd is None else round(chips * hours * price.usd, 4)
        windows.append({"submission": window["id"], "hours": round(hours, 4), "usd": usd, "measured": measured})
    return {
        "accelerator_type": tpu_type,
        "chips": chips,
        "region": price.region,
        "spot": spot,
        "usd_per_chip_hour": price.usd,
        "hours": round(sum(w["hours"] for w in windows), 4),
        "usd": None if price.usd is None else round(sum(w["usd"] for w in windows), 4),
        "price": {"confirmed": price.confirmed, "source": price.source, "date": price.date, "note": price.note},
        "submissions": windows,
    }
