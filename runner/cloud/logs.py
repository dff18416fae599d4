"""A submitted job's output, read back from anywhere: its log, and its summary with restarts and cost.

Where a job's lines go (runner/cloud/tpu_startup.sh):
    Cloud Logging     the container's stdout and stderr, through docker's gcplogs log driver: an entry per line
                      in projects/P/logs/gcplogs-docker-driver, jsonPayload.container.name "/CONTAINER",
                      seconds after it was printed. The VM's service account writes them (logging.write).
    the bucket        RUN_DIR/logs/SUB/worker-N.log: the same lines and the startup script's own, copied every
                      30 s and once more at the end. It stays when the VM and Cloud Logging's retention are gone.

`follow` reads Cloud Logging when the job's container logs there (its started record says so) and the API
answers, else the bucket copy, and switches to the bucket copy if Cloud Logging stops answering. It follows
the job across restarts (a newer submission in job.json) and ends at the exit record of the submission it
follows, or when a watcher or `runner cancel` has had the last word.

Cloud Logging is read through its REST method entries:list with google-auth's AuthorizedSession (already
a dependency of google-cloud-tpu), not google-cloud-logging: one POST needs no new package. The endpoint
honours gcloud's CLOUDSDK_API_ENDPOINT_OVERRIDES_LOGGING, so tests point it at a local fake.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from runner import DataError, RunnerError, StorageError
from runner.cloud import record

LOGGING_API = "https://logging.googleapis.com"
DOCKER_LOG = "gcplogs-docker-driver"
_PAGE = 1000


def worker_log(run_dir: str, submission: str, worker: int = 0) -> str:
    path = record.log_path(run_dir, submission, worker)
    text = record.read_text(path)
    if text is None:
        raise DataError(
            f"no log at {path} yet: the TPU VM may still be queued or booting (`runner status NAME`); "
            "its first copy comes when the startup script starts"
        )
    return text


def newest_submission(run_dir: str) -> str:
    """The job's current submission (job.json), else the newest folder under RUN_DIR/logs/."""
    job = record.load_job(run_dir)
    if job is not None and record.current_submission(job):
        return record.current_submission(job)
    found = record.submissions_in(run_dir)
    if not found:
        raise DataError(f"no submission under {record.join(run_dir, 'logs')}: not a run folder of `runner submit`, "
                        "or its VM has not started yet")
    return found[-1]


# --- Cloud Logging -------------------------------------------------------------------------------


class CloudLogging:
    """entries:list for one container's lines, newest-seen first skipped (insertId), in timestamp order."""

    def __init__(self, project: str, session=None):
        self.project = project
        self.endpoint = (os.environ.get("CLOUDSDK_API_ENDPOINT_OVERRIDES_LOGGING") or LOGGING_API).rstrip("/")
        self._session = session
        self.seen: set[str] = set()
        self.since: str | None = None

    def session(self):
        if self._session is None:
            from google.auth.transport.requests import AuthorizedSession

            from runner.cloud.tpu_api import credentials

            self._session = AuthorizedSession(credentials())
        return self._session

    def new_lines(self, container: str, since: str) -> list[str]:
        """The container's lines not returned before. Raises StorageError when the API does not answer."""
        cursor = self.since or since
        query = (f'logName="projects/{self.project}/logs/{DOCKER_LOG}" AND jsonPayload.container.name="/{container}" '
                 f'AND timestamp>="{cursor}"')
        body: dict[str, Any] = {"resourceNames": [f"projects/{self.project}"], "filter": query,
                                "orderBy": "timestamp asc", "pageSize": _PAGE}
        lines = []
        while True:
            try:
                answer = self.session().post(f"{self.endpoint}/v2/entries:list", json=body, timeout=30)
            except Exception as exc:  # connection refused, DNS, timeout
                raise StorageError(f"Cloud Logging did not answer: {type(exc).__name__}: {exc}") from None
            if answer.status_code != 200:
                message = answer.text[:300].replace("\n", " ")
                raise StorageError(f"Cloud Logging refused entries:list for project {self.project}: "
                                   f"{answer.status_code} {message}")
            doc = answer.json()
            for entry in doc.get("entries", []):
                key = entry.get("insertId") or f"{entry.get('timestamp')}/{len(self.seen)}"
                if key in self.seen:
                    continue
                self.seen.add(key)
                self.since = max(self.since or "", entry.get("timestamp") or "")
                message = (entry.get("jsonPayload") or {}).get("message")
                if message is None:
                    message = entry.get("textPayload", "")
                lines.append(message if message.endswith("\n") else message + "\n")
            token = doc.get("nextPageToken")
            if not token:
                return lines
            body["pageToken"] = token


# --- following a job --------------------------------------------------------------------------


def follow(run_dir: str, emit: Callable[[str], None], *, worker: int = 0, submission: str | None = None,
           interval_s: float = 5.0, timeout_s: float | None = None, source: str = "auto",
           note: Callable[[str], None] = lambda line: None, cloud: CloudLogging | None = None) -> dict[str, Any]:
    """Emits the job's lines as they come until it ends; returns the exit record (or the watcher's outcome).

    source: auto (Cloud Logging when the container logs there, else the bucket), bucket, or cloud-logging.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    job = record.load_job(run_dir)
    current = submission or newest_submission(run_dir)
    mode: str | None = "bucket" if source == "bucket" else None
    shown = 0
    waiting_said = False
    while True:
        exit_found = record.exit_record(run_dir, current, worker)
        started = record.started_record(run_dir, current, worker)
        if mode is None and started is not None:
            if started.get("log_driver") == "gcplogs" and job is not None:
                mode = "cloud"
                cloud = cloud or CloudLogging(job["project"])
            elif source == "cloud-logging":
                raise DataError(f"submission {current} does not log to Cloud Logging (log driver "
                                f"{started.get('log_driver')}); read the bucket copy (--source bucket)")
            else:
                mode = "bucket"
        if mode == "cloud":
            try:
                for line in cloud.new_lines(started["container"], started["started_at"]):
                    emit(line)
            except StorageError as error:
                if source == "cloud-logging":
                    raise
                note(f"{error}; following the bucket copy instead")
                mode = "bucket"
        if mode != "cloud":
            text = record.read_text(record.log_path(run_dir, current, worker)) or ""
            if len(text) > shown:
                emit(text[shown:])
                shown = len(text)
        if exit_found is not None:
            if mode == "cloud":
                time.sleep(min(interval_s, 3.0))  # Cloud Logging may hold the last lines for a moment
                for line in cloud.new_lines(started["container"], started["started_at"]):
                    emit(line)
                emit(f"{exit_found.get('reason') or 'the job exited with code ' + str(exit_found.get('exit_code'))}\n")
            job = record.load_job(run_dir) or job
            if submission is None and job is not None:
                newer = _newer(job, current)
                if newer and not job.get("outcome"):
                    current, mode, shown, waiting_said = _switch(job, current, newer, source, note)
                    continue
            return exit_found
        job = record.load_job(run_dir) or job
        if submission is None and job is not None:
            if job.get("outcome") and _newer(job, current) is None:
                outcome = job["outcome"]
                note(f"the job is over: {outcome['outcome']} ({outcome['reason']})")
                return {"exit_code": outcome["exit_code"], "reason": outcome["reason"], "outcome": outcome["outcome"]}
            newer = _newer(job, current)
            if newer:
                current, mode, shown, waiting_said = _switch(job, current, newer, source, note)
                continue
        if record.read_text(record.cancelled_path(run_dir, current)) is not None:
            note(f"submission {current} was cancelled (runner cancel)")
            return {"exit_code": 130, "reason": "cancelled", "outcome": "cancelled"}
        if started is None and not waiting_said:
            note(f"waiting for submission {current} to start its job (the TPU may be queued or booting)")
            waiting_said = True
        if deadline is not None and time.monotonic() > deadline:
            raise DataError(f"submission {current} of {run_dir} had not finished after {timeout_s:g}s of --follow")
        time.sleep(interval_s)


def _newer(job: dict[str, Any] | None, current: str) -> str | None:
    ids = [w["id"] for w in (job or {}).get("submissions", [])]
    return ids[-1] if ids and current in ids and ids[-1] != current else None


def _switch(job: dict[str, Any], current: str, newer: str, source: str, note: Callable[[str], None]):
    cause = next((r["cause"] for r in job.get("restarts", []) if r.get("to") == newer), "resubmitted")
    note(f"submission {current} was replaced by {newer}: {cause}")
    return newer, ("bucket" if source == "bucket" else None), 0, False


# --- the summary ---------------------------------------------------------------------------------


def summary_with_cost(run_dir: str) -> dict[str, Any]:
    """The job's summary.json with the watcher's outcome, its restarts and the cost of every submission."""
    from runner.cloud import recovery

    job = record.load_job(run_dir)
    if job is None:
        raise DataError(
            f"no job record at {record.join(run_dir, record.JOB_FILE)}: not a run folder of `runner submit`"
        )
    try:
        found = record.summary(run_dir)
    except RunnerError:
        found = None
    if found is None:
        raise DataError(
            f"no summary at {record.join(run_dir, 'summary.json')} yet: the job has not finished "
            f"(follow it: `runner logs {job['name']} --follow`)"
        )
    return recovery.final_summary(job)
