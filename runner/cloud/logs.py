"""What a submitted job leaves in its run folder, read back from anywhere: logs, exit records, summary + cost.

    RUN_DIR/summary.json                 written by the job itself (runner/outputs.py)
    RUN_DIR/logs/worker-N.log            the container's stdout and stderr, copied every 30 s by the
                                         startup script (runner/cloud/tpu_startup.sh) and once more at the end
    RUN_DIR/logs/worker-N.exit.json      the container's exit code, the script's start and end times, the TPU
                                         type and the price per chip-hour it was submitted at

RUN_DIR is a gs:// folder (google-cloud-storage, so TensorFlow is not imported) or a local one.
The cost estimate covers worker 0's time from the start of its startup script to the end of the job: it
leaves out the minutes the TPU API takes to provision and delete the VM.
"""

from __future__ import annotations

import datetime
import json
import posixpath
import time
from pathlib import Path
from typing import Any, Callable

from runner import storage
from runner.cloud import pricing
from runner.errors import DataError, StorageError


def read_text(path: str) -> str | None:
    """The file's text, or None when it does not exist (yet)."""
    if not storage.is_gcs(path):
        file = Path(path)
        return file.read_text() if file.is_file() else None
    from google.api_core import exceptions as api

    bucket, name = storage.split_gcs(path)
    try:
        return storage.make_client().bucket(bucket).blob(name).download_as_text(timeout=60)
    except api.NotFound:
        return None
    except api.GoogleAPICallError as exc:
        raise StorageError(f"cannot read {path}: {exc.code} {exc.message}") from None


def log_path(run_dir: str, worker: int) -> str:
    return posixpath.join(run_dir.rstrip("/"), "logs", f"worker-{worker}.log")


def exit_record(run_dir: str, worker: int = 0) -> dict[str, Any] | None:
    text = read_text(posixpath.join(run_dir.rstrip("/"), "logs", f"worker-{worker}.exit.json"))
    return None if text is None else json.loads(text)


def worker_log(run_dir: str, worker: int = 0) -> str:
    text = read_text(log_path(run_dir, worker))
    if text is None:
        raise DataError(
            f"no log at {log_path(run_dir, worker)} yet: the TPU VM may still be queued or booting "
            "(`runner status NAME --zone ZONE`), or the run folder is not a submitted job's"
        )
    return text


def follow(run_dir: str, worker: int, emit: Callable[[str], None], interval_s: float = 15.0,
           timeout_s: float | None = None) -> dict[str, Any]:
    """Emits the log as it grows until the worker's exit record appears; returns that record."""
    shown = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        record = exit_record(run_dir, worker)  # read first: the final log copy precedes the record
        text = read_text(log_path(run_dir, worker)) or ""
        if len(text) > shown:
            emit(text[shown:])
            shown = len(text)
        if record is not None:
            return record
        if deadline is not None and time.monotonic() > deadline:
            raise DataError(f"worker {worker} of {run_dir} had not finished after {timeout_s:g}s of --follow")
        time.sleep(interval_s)


def _seconds_between(start: str, end: str) -> float:
    parse = lambda text: datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def cost_of(record: dict[str, Any]) -> dict[str, Any]:
    """The estimate for one exit record, at the price per chip-hour the job was submitted at."""
    hours = max(_seconds_between(record["started_at"], record["finished_at"]), 0.0) / 3600
    cost = pricing.estimate(record["accelerator_type"], hours, spot=bool(record.get("spot")))
    price = record.get("usd_per_chip_hour")
    if price is not None and price != cost["usd_per_chip_hour"]:
        cost["usd_per_chip_hour"] = price
        cost["usd"] = round(cost["chips"] * hours * price, 4)
    cost["measured"] = "worker 0, from its startup script's start to the job's end"
    return cost


def summary_with_cost(run_dir: str) -> dict[str, Any]:
    """The job's summary.json, with `cost` from worker 0's exit record (None when there is none)."""
    path = posixpath.join(run_dir.rstrip("/"), "summary.json")
    text = read_text(path)
    if text is None:
        raise DataError(f"no summary at {path} yet: the job has not finished (follow it: `runner logs {run_dir} --follow`)")
    summary = json.loads(text)
    record = exit_record(run_dir, 0)
    summary["cost"] = None if record is None else cost_of(record)
    if record is None:
        summary["cost_note"] = f"no {run_dir}/logs/worker-0.exit.json: not a submitted job, or still running"
    return summary
