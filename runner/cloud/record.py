"""What a submitted job keeps in its run folder, and where a job name leads on this machine.

    RUN_DIR/job.json                          the job: where it runs, what to create again after a
                                              preemption (the flags and the spec as submitted), every
                                              submission (id, times) and every restart (time, cause, step
                                              reached, time lost); written by `runner submit` and the watcher
    RUN_DIR/logs/SUB/worker-N.log             the container's output and the startup script's lines,
                                              copied by the startup script every 30 s and at the end
    RUN_DIR/logs/SUB/worker-N.started.json    written when the job's container starts (time, log driver)
    RUN_DIR/logs/SUB/worker-N.exit.json       the job's exit code, or why the startup script ran nothing
    RUN_DIR/logs/SUB/cancelled.json           `runner cancel` was here: a watcher stops instead of restarting
    RUN_DIR/summary.json, checkpoints/        written by the job itself (runner/rundir/outputs.py); the newest
                                              whole step of either format: runner/rundir/checkpoints.py

SUB is the submission id (time of submission and 4 random hex digits). Each submission writes only under
its own folder, so an old exit record can never answer for a new submission.

RUN_DIR is a gs:// folder (google-cloud-storage: TensorFlow is not imported) or a local one.
The local pointer, $RUNNER_STATE_DIR/jobs/NAME.json (default ~/.local/state/runner), remembers a
job's project, zone and run folder, so `runner logs NAME` works after the queued resource is gone.
"""

from __future__ import annotations

import datetime
import json
import os
import posixpath
import re
import secrets
from pathlib import Path
from typing import Any

from runner import StorageError
from runner.data import storage
from runner.rundir import checkpoints, stalled
from runner.rundir.recorded import Recorded

JOB_FILE = "job.json"


# --- reading and writing a run folder -----------------------------------------------------------


def read_text(path: str, patient: bool = True) -> str | None:
    """The file's text, or None when it does not exist (yet). Not patient: one try of at most 10 s (the
    client's default retries a bucket that does not answer for about two minutes)."""
    if not storage.is_gcs(path):
        file = Path(path)
        return file.read_text() if file.is_file() else None
    from google.api_core import exceptions as api

    bucket, name = storage.split_gcs(path)
    try:
        blob = storage.make_client().bucket(bucket).blob(name)
        return blob.download_as_text(timeout=60) if patient else blob.download_as_text(timeout=10, retry=None)
    except api.NotFound:
        return None
    except api.GoogleAPICallError as exc:
        raise StorageError(f"cannot read {path}: {exc.code} {exc.message}") from None
    except StorageError as exc:  # no credentials: said once, not wrapped again
        raise StorageError(f"cannot read {path}: {exc}") from None
    except Exception as exc:  # connection refused, DNS, timeouts: the bucket cannot be reached
        raise StorageError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def write_text(path: str, text: str) -> None:
    if not storage.is_gcs(path):
        file = Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(file.name + ".partial")
        partial.write_text(text)
        partial.replace(file)
        return
    from google.api_core import exceptions as api

    bucket, name = storage.split_gcs(path)
    try:
        storage.make_client().bucket(bucket).blob(name).upload_from_string(
            text, content_type="application/json" if name.endswith(".json") else "text/plain", timeout=60)
    except api.GoogleAPICallError as exc:
        raise StorageError(f"cannot write {path}: {exc.code} {exc.message}") from None
    except Exception as exc:
        raise StorageError(f"cannot write {path}: {type(exc).__name__}: {exc}") from None


def read_json(path: str, patient: bool = True) -> dict[str, Any] | None:
    text = read_text(path, patient)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise StorageError(f"{path} is not JSON: a partial copy, or not written by runner") from None


# --- paths ---------------------------------------------------------------------------------------


def join(run_dir: str, *parts: str) -> str:
    return posixpath.join(run_dir.rstrip("/"), *parts)


def submission_dir(run_dir: str, submission: str) -> str:
    return join(run_dir, "logs", submission)


def log_path(run_dir: str, submission: str, worker: int | str = 0) -> str:
    return join(run_dir, "logs", submission, f"worker-{worker}.log")


def exit_path(run_dir: str, submission: str, worker: int | str = 0) -> str:
    return join(run_dir, "logs", submission, f"worker-{worker}.exit.json")


def started_path(run_dir: str, submission: str, worker: int | str = 0) -> str:
    return join(run_dir, "logs", submission, f"worker-{worker}.started.json")


def cancelled_path(run_dir: str, submission: str) -> str:
    return join(run_dir, "logs", submission, "cancelled.json")


def new_submission_id(now: datetime.datetime | None = None) -> str:
    """`20260315-101500-7f3a`: sortable, and a valid label value (lowercase, digits, dashes, <= 63)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def submissions_in(run_dir: str) -> list[str]:
    """The submission ids with a folder under RUN_DIR/logs/, oldest first (the ids sort by time)."""
    logs = join(run_dir, "logs")
    if not storage.is_gcs(logs):
        folder = Path(logs)
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    bucket, prefix = storage.split_gcs(logs + "/")
    try:
        blobs = storage.make_client().list_blobs(bucket, prefix=prefix, delimiter="/", timeout=60)
        list(blobs)  # the prefixes are known once the pages are read
        return sorted(p[len(prefix):].rstrip("/") for p in blobs.prefixes)
    except Exception as exc:
        raise StorageError(f"cannot list {logs}: {type(exc).__name__}: {exc}") from None


def exit_record(run_dir: str, submission: str, worker: int | str = 0) -> dict[str, Any] | None:
    return read_json(exit_path(run_dir, submission, worker))


def slice_exit_record(run_dir: str, submission: str, hosts: int = 1, settled: bool = False) -> dict[str, Any] | None:
    """The exit record that speaks for the job of a slice of `hosts`: worker 0's (process 0 writes the run folder
    and ends last), else one written by a worker that could not learn its number; and, once no worker can still
    write (`settled`: the queued resource is gone or DELETING), another worker's, as when worker 0 was lost."""
    found = exit_record(run_dir, submission, 0) or exit_record(run_dir, submission, "unknown")
    for worker in range(1, hosts if settled else 1):
        found = found or exit_record(run_dir, submission, worker)
    return found


def started_record(run_dir: str, submission: str, worker: int | str = 0) -> dict[str, Any] | None:
    return read_json(started_path(run_dir, submission, worker))


# --- the job's own outputs -------------------------------------------------------------------------


def summary(run_dir: str, patient: bool = True) -> dict[str, Any] | None:
    return read_json(join(run_dir, "summary.json"), patient)


def stall_mark(run_dir: str, patient: bool = True) -> dict[str, Any] | None:
    """The mark a stalled job's guard left (runner/rundir/stalled.py): a stall, not a time limit, ended it."""
    return read_json(join(run_dir, stalled.NAME), patient)


def is_complete(found: dict[str, Any] | None, epochs: int | None) -> bool:
    """The rule runner/rundir/outputs.py uses: `succeeded` for at least the requested epochs (None: any success)."""
    said = Recorded.of(found)
    if not found or said is None or not said.succeeded:
        return False
    return epochs is None or (said.train_epochs or 0) >= epochs


def checkpoint_step(run_dir: str) -> int | None:
    """The step of the newest whole checkpoint, TensorFlow's or Orbax's (runner/rundir/checkpoints.py); None: none."""
    return checkpoints.latest_step(run_dir)


# --- job.json --------------------------------------------------------------------------------------


def load_job(run_dir: str) -> dict[str, Any] | None:
    return read_json(join(run_dir, JOB_FILE))


def save_job(job: dict[str, Any]) -> None:
    write_text(join(job["run_dir"], JOB_FILE), json.dumps(job, indent=2) + "\n")


def current_submission(job: dict[str, Any]) -> str | None:
    return job["submissions"][-1]["id"] if job.get("submissions") else None


# --- where a job name leads, on this machine ------------------------------------------------------


def _state_dir() -> Path:
    if os.environ.get("RUNNER_STATE_DIR"):
        return Path(os.environ["RUNNER_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "runner"


def remember(name: str, project: str, zone: str, run_dir: str) -> None:
    """Best effort: a job that cannot be remembered here is still found through its queued resource."""
    folder = _state_dir() / "jobs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        pointer = {"name": name, "project": project, "zone": zone, "run_dir": run_dir}
        (folder / f"{name}.json").write_text(json.dumps(pointer) + "\n")
    except OSError:
        pass


def recall(name: str) -> dict[str, str] | None:
    try:
        return json.loads((_state_dir() / "jobs" / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def remembered() -> list[dict[str, str]]:
    found = []
    for file in sorted((_state_dir() / "jobs").glob("*.json")):
        try:
            found.append(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return found


def now_text() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime.datetime | None:
    """RFC 3339 as the APIs and the startup script write it (Z or an offset, with or without fractions)."""
    if not text:
        return None
    text = text.strip().replace("Z", "+00:00")
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", text)
    if match:  # fromisoformat before 3.11 takes at most 6 fraction digits; the API sends up to 9
        text = match.group(1) + (match.group(2) or "")[:7] + match.group(3)
    try:
        parsed = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)
