"""The run folders under an `output.dir` (local or gs://), read without TensorFlow: `runner runs`.

Each run folder's row comes from its summary.json (runner/rundir/summary.schema.json), its files (size, newest
change) and its lease, read and judged by runner/rundir/lease.py itself: a lease that still holds makes the
row `running`, whatever the last summary says. Removing a run folder takes its lease first, the way a run
does, so a run that holds it is never removed and no run can start in it while it is being removed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import posixpath
import shutil
from typing import Any

from runner import DataError, StorageError
from runner.data import storage
from runner.rundir import lease as leases
from runner.rundir import stalled
from runner.rundir.summary import Recorded

log = logging.getLogger(__name__)

# What makes a folder a run folder (runner/rundir/outputs.py writes them).
_MARKERS = ("summary.json", leases.LEASE, "spec.json", "checkpoints")
SUMMARY = "summary.json"


@dataclasses.dataclass
class Run:
    """One run folder as `runner runs` shows it."""

    name: str
    path: str
    status: str  # the summary's; `stalled` (its mark), `running` (a live lease) or `no summary` over it
    epochs_done: int | None
    epochs_asked: int | None
    best: dict[str, Any] | None  # {"metric", "value", "from": "eval" | "epoch N"}
    precision: str | None
    device: str | None
    updated: str | None  # the newest file's time, UTC ISO 8601
    bytes: int
    holder: str | None = None  # who holds the lease, while one holds

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _utc(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def best_metric(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The evaluation's accuracy (else its first metric, else its loss); without one, the best epoch's."""
    said = Recorded.of(summary) or Recorded()
    evaluated = said.evaluated
    if evaluated:
        name = "accuracy" if "accuracy" in evaluated else next((k for k in evaluated if k != "loss"), "loss")
        return {"metric": name, "value": evaluated[name], "from": "eval"}
    best = None
    for epoch in said.epochs:
        for name in ("val_accuracy", "accuracy"):
            if name in epoch.metrics and (best is None or epoch.metrics[name] > best["value"]):
                best = {"metric": name, "value": epoch.metrics[name], "from": f"epoch {epoch.epoch}"}
                break
    if best is None:
        losses = [e for e in said.epochs if e.loss is not None]
        if losses:
            low = min(losses, key=lambda e: e.loss)
            best = {"metric": "loss", "value": low.loss, "from": f"epoch {low.epoch}"}
    return best


def _epochs_done(summary: dict[str, Any]) -> int | None:
    """Epochs trained over every attempt: the final step over the steps per epoch (the epochs list holds only
    the latest attempt's)."""
    recorded = Recorded.of(summary) or Recorded()
    step, per_epoch = recorded.final_step, recorded.steps_per_epoch
    if step is not None and (per_epoch or 0) > 0:
        return int(step // per_epoch)
    numbers = [e.epoch for e in recorded.epochs if e.epoch is not None]
    if numbers:
        return int(max(numbers))
    return recorded.train_epochs if recorded.succeeded else None


def _row(name: str, path: str, summary: dict[str, Any] | None, size: int, newest: float | None,
         held: tuple[dict[str, Any], float] | None, stalled: bool = False) -> Run:
    summary = summary or {}
    recorded = Recorded.of(summary) or Recorded()
    accelerator = recorded.accelerator
    device = None
    if accelerator.kind:
        replicas = accelerator.replicas or 1
        device = accelerator.kind + (f" x{replicas}" if replicas > 1 else "")
    # A stalled attempt writes no summary, only its guard's mark (runner/rundir/stalled.py): the summary is older.
    status = "stalled" if stalled else recorded.status or "no summary"
    holder = None
    if held is not None:
        status, holder = "running", leases.describe(*held)
    return Run(
        name=name, path=path, status=status, epochs_done=_epochs_done(summary),
        epochs_asked=recorded.train_epochs, best=best_metric(summary),
        precision=accelerator.precision.policy, device=device, updated=_utc(newest),
        bytes=size, holder=holder,
    )


def _live(found: Any) -> tuple[dict[str, Any], float] | None:
    """(holder, age) when the lease read holds (lease.stale_reason says it does), else None."""
    if found is None or leases.stale_reason(found.doc, found.age_s) is not None:
        return None
    return found.doc, found.age_s


# --- local folders ----------------------------------------------------------------------------------


def _local_runs(folder: str) -> list[Run]:
    if not os.path.isdir(folder):
        raise DataError(f"{folder} is not a folder: name the output.dir that holds your run folders")
    runs = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path) or not any(os.path.exists(os.path.join(path, m)) for m in _MARKERS):
            continue
        size, newest = 0, None
        for root, _, files in os.walk(path):
            for file in files:
                try:
                    stat = os.stat(os.path.join(root, file))
                except FileNotFoundError:
                    continue  # removed while listed (a checkpoint rotated away)
                size += stat.st_size
                newest = stat.st_mtime if newest is None else max(newest, stat.st_mtime)
        runs.append(_row(name, path, _read_local(os.path.join(path, SUMMARY)), size, newest,
                         _live(leases._LocalLease(path).read()), os.path.exists(os.path.join(path, stalled.NAME))))
    return runs


def _read_local(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


# --- gs:// ------------------------------------------------------------------------------------------


def _gcs_runs(folder: str, timeout_s: float) -> list[Run]:
    from google.api_core import exceptions

    bucket_name, prefix = storage.split_gcs(folder)
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    client = storage.make_client()
    try:
        blobs = list(client.list_blobs(bucket_name, prefix=prefix, timeout=min(60.0, timeout_s)))
    except exceptions.NotFound:
        raise StorageError(f"bucket gs://{bucket_name} does not exist or this account cannot see it") from None
    except Exception as exc:  # noqa: BLE001 - google-cloud-storage's errors, named with the bucket
        raise StorageError(f"cannot list {folder}: {type(exc).__name__}: {str(exc)[:300]}") from None
    grouped: dict[str, list[Any]] = {}
    for blob in blobs:
        name, sep, rest = blob.name[len(prefix):].partition("/")
        if sep and rest:
            grouped.setdefault(name, []).append(blob)
    runs = []
    for name, members in sorted(grouped.items()):
        files = {blob.name[len(prefix) + len(name) + 1:]: blob for blob in members}
        if not any(m in files or any(f.startswith(m + "/") for f in files) for m in _MARKERS):
            continue
        summary = None
        if SUMMARY in files:
            try:
                summary = json.loads(files[SUMMARY].download_as_bytes(timeout=min(60.0, timeout_s)))
            except (json.JSONDecodeError, UnicodeDecodeError, exceptions.NotFound):
                summary = None
        updated = [blob.updated.timestamp() for blob in members if blob.updated]
        path = f"gs://{bucket_name}/{prefix}{name}"
        held = _live(leases._GcsLease(path, timeout_s).read()) if leases.LEASE in files else None
        runs.append(_row(name, path, summary if isinstance(summary, dict) else None,
                         sum(blob.size or 0 for blob in members), max(updated) if updated else None, held,
                         stalled.NAME in files))
    return runs


# --- the API ----------------------------------------------------------------------------------------


def list_runs(folder: str, timeout_s: float = storage.DEFAULT_TIMEOUT_S) -> list[Run]:
    """Every run folder directly under `folder`, the most recently changed first."""
    runs = _gcs_runs(folder, timeout_s) if storage.is_gcs(folder) else _local_runs(folder)
    return sorted(runs, key=lambda run: run.updated or "", reverse=True)


def run_path(folder: str, name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise DataError(f"{name!r} is not a run name: give the name of one run folder in {folder}")
    return posixpath.join(folder.rstrip("/"), name) if storage.is_gcs(folder) else os.path.join(folder, name)


def find_run(folder: str, name: str, timeout_s: float = storage.DEFAULT_TIMEOUT_S) -> Run:
    for run in list_runs(folder, timeout_s):
        if run.name == name:
            return run
    raise DataError(f"no run folder {name!r} in {folder}: `runner runs {folder}` lists them")


def remove_run(run: Run, timeout_s: float = storage.DEFAULT_TIMEOUT_S) -> int:
    """Removes a run folder; returns the bytes removed. Takes its lease first (lease.LeaseHeld, exit 2, while
    another run holds it); the lease goes last, released as a run releases it."""
    held = leases.Lease.take(run.path, "runner runs rm", timeout_s)
    try:
        if storage.is_gcs(run.path):
            bucket_name, prefix = storage.split_gcs(run.path)
            client = storage.make_client()
            for blob in client.list_blobs(bucket_name, prefix=prefix.rstrip("/") + "/"):
                if blob.name != f"{prefix.rstrip('/')}/{leases.LEASE}":
                    blob.delete(timeout=min(60.0, timeout_s))
        else:
            # The lease goes with the folder: releasing it afterwards finds nothing, so no run can slip in between.
            shutil.rmtree(run.path)
    finally:
        held.release()  # on gs:// this deletes the lease object, the folder's last
    return run.bytes
