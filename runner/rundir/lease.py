"""One run per run folder: a lease file, `<run folder>/lease.json`, taken before the run writes anything.

Two runs of one job name started together would both train and mix their checkpoints, summary and model;
the lease lets exactly one of them in. The other stops at once with exit 2, having written nothing, and
says who holds the folder and since when.

    local folder   the lease is made whole in a private file, then hard-linked to `lease.json` (an exclusive
                   create: the link fails when the name exists, on every POSIX filesystem and NFS);
                   renewing touches its mtime.
    gs://          an object created with `if_generation_match=0` (GCS's create-if-absent) through
                   google-cloud-storage; renewing rewrites it with `if_generation_match=<its generation>`,
                   so a run that lost its lease finds out at its next renewal instead of overwriting it.

The holder renews the lease every HEARTBEAT_S seconds from a background thread and deletes it when the run
ends, whatever its status. A lease is stale, and the next run takes it over (logging whose it was), when:
  - its holder ran on this machine (same hostname, boot and PID namespace) and that process is gone
    (kill -9, a crash); a live holder on this machine keeps its lease however long it has been silent;
  - its holder ran elsewhere and it has not been renewed for its `expiry_s` (EXPIRY_S): a VM that was
    killed stops renewing, so its lease lapses by itself. Age is measured on the storage's clock (the
    object's `updated` time on GCS, the file's mtime locally).
Taking over is itself exclusive (a conditional rewrite on GCS; a rename that only one taker wins locally),
so of several runs finding the same stale lease one gets it. Whoever finds its lease taken (renewal fails)
marks it lost: the run folder refuses the run's further saves (runner/rundir/outputs.py).
This module imports neither TensorFlow nor, until a gs:// lease is taken, google-cloud-storage.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from typing import Any

from runner import EXIT_USAGE, RunnerError, StorageError
from runner.data import storage

log = logging.getLogger(__name__)

LEASE = "lease.json"
HEARTBEAT_S = 30.0
# Four missed renewals: long enough for a slow bucket, short enough that a killed VM's run folder frees itself.
EXPIRY_S = 120.0
_ROUNDS = 5  # create / find stale / take over, retried when another run changes the lease in between


class LeaseHeld(RunnerError):
    """Another run holds the run folder's lease."""

    exit_code = EXIT_USAGE


# --- who is running ---------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return None


def _machine() -> dict[str, str | None]:
    """What makes two PIDs comparable: the same host, the same boot, the same PID namespace (a container
    on the same VM has its own PIDs)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": namespace}


def _process_start(pid: int) -> str | None:
    """The start time of a live process in clock ticks since boot (tells a reused PID apart); None when the
    process is gone or a zombie."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state is field 3, starttime field 22
    return None if not fields or fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int, started: str | None) -> bool:
    if os.path.isdir("/proc/self"):
        return (now := _process_start(pid)) is not None and (started is None or now == started)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def owner_doc(job: str, heartbeat_s: float = HEARTBEAT_S, expiry_s: float = EXPIRY_S) -> dict[str, Any]:
    now = time.time()
    return {
        "run_id": uuid.uuid4().hex,
        "job": job,
        **_machine(),
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "started_at": _utc(now),
        "started_unix": round(now, 3),
        "heartbeat_s": heartbeat_s,
        "expiry_s": expiry_s,
    }


def stale_reason(holder: dict[str, Any], age_s: float) -> str | None:
    """Why the lease `holder` wrote, last renewed `age_s` ago, no longer holds; None while it holds."""
    here = _machine()
    same_machine = all(holder.get(key) == here[key] for key in here) and here["boot_id"] is not None
    pid = holder.get("pid")
    if same_machine and isinstance(pid, int):
        if _alive(pid, holder.get("pid_start")):
            return None
        return f"its process (pid {pid} on this host) is gone"
    expiry = holder.get("expiry_s", EXPIRY_S)
    if not isinstance(expiry, (int, float)) or expiry <= 0:
        expiry = EXPIRY_S
    if age_s > expiry:
        return f"it was last renewed {_ago(age_s)}, past its expiry of {expiry:g} s"
    return None


def describe(holder: dict[str, Any], age_s: float | None = None) -> str:
    who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
    since = holder.get("started_at", "an unknown time")
    if isinstance(holder.get("started_unix"), (int, float)):
        since += f" ({_ago(time.time() - holder['started_unix'])})"
    renewed = "" if age_s is None else f", last renewed {_ago(age_s)}"
    return f"{who}, running since {since}{renewed} (run id {holder.get('run_id', '?')})"


# --- where the lease lives ----------------------------------------------------------------------


class _Found:
    def __init__(self, doc: dict[str, Any], age_s: float, token: Any):
        self.doc, self.age_s, self.token = doc, age_s, token


class _LocalLease:
    def __init__(self, folder: str):
        self.path = os.path.join(folder, LEASE)

    def create(self, doc: dict[str, Any]) -> Any:
        private = f"{self.path}.{doc['run_id']}"
        with open(private, "x", encoding="utf-8") as handle:
            handle.write(json.dumps(doc, indent=2) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(private, self.path)
            return True
        except FileExistsError:
            return None
        except OSError as exc:  # a filesystem without hard links: an exclusive create instead
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            return self._create_exclusive(doc)
        finally:
            os.unlink(private)

    def _create_exclusive(self, doc: dict[str, Any]) -> Any:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(doc, indent=2) + "\n")
        return True

    def read(self) -> _Found | None:
        for _ in range(20):
            try:
                with open(self.path, encoding="utf-8") as handle:
                    mtime = os.fstat(handle.fileno()).st_mtime
                    text = handle.read()
            except FileNotFoundError:
                return None
            try:
                return _Found(json.loads(text), time.time() - mtime, None)
            except json.JSONDecodeError:
                time.sleep(0.05)  # an exclusive create still writing (filesystems without links)
        return _Found({}, time.time() - mtime, None)

    def take_over(self, stale: _Found, doc: dict[str, Any]) -> Any:
        """Moves the stale lease aside under a name of our own; only one taker's rename finds it."""
        aside = f"{self.path}.stale-{doc['run_id']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return None
        try:
            with open(aside, encoding="utf-8") as handle:
                moved = json.loads(handle.read() or "{}")
        except (OSError, json.JSONDecodeError):
            moved = {}
        if moved.get("run_id") != stale.doc.get("run_id"):
            # Another taker was quicker and this is its fresh lease: put it back.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                log.error("%s: a lease of %s was displaced while taking over a stale one", self.path, describe(moved))
        os.unlink(aside)
        return self.create(doc) if moved.get("run_id") == stale.doc.get("run_id") else None

    def renew(self, doc: dict[str, Any], token: Any) -> Any:
        found = self.read()
        if found is None or found.doc.get("run_id") != doc["run_id"]:
            return None
        os.utime(self.path)
        return True

    def delete(self, doc: dict[str, Any], token: Any) -> None:
        found = self.read()
        if found is not None and found.doc.get("run_id") == doc["run_id"]:
            os.unlink(self.path)


class _GcsLease:
    """The lease object; `token` is its generation."""

    def __init__(self, folder: str, timeout_s: float):
        from google.api_core.retry import Retry

        bucket, prefix = storage.split_gcs(folder)
        self.url = f"{folder.rstrip('/')}/{LEASE}"
        self.timeout_s = timeout_s
        self.blob_name = posixpath.join(prefix, LEASE) if prefix else LEASE
        self.bucket = storage.make_client().bucket(bucket)
        self.retry = Retry(predicate=storage.is_transient, initial=0.5, maximum=8.0, multiplier=2.0, timeout=timeout_s)
        self.request_timeout = (min(10.0, timeout_s), min(30.0, timeout_s))

    def _put(self, doc: dict[str, Any], generation: int, retry: Any = None) -> Any:
        from google.api_core import exceptions

        blob = self.bucket.blob(self.blob_name)
        try:
            blob.upload_from_string(
                json.dumps(doc, indent=2) + "\n", content_type="application/json", if_generation_match=generation,
                retry=retry or self.retry, timeout=self.request_timeout,
            )
        except exceptions.PreconditionFailed:
            return None
        return blob.generation

    def create(self, doc: dict[str, Any]) -> Any:
        return self._put(doc, 0)

    def read(self) -> _Found | None:
        from google.api_core import exceptions

        for _ in range(_ROUNDS):
            blob = self.bucket.get_blob(self.blob_name, retry=self.retry, timeout=self.request_timeout)
            if blob is None:
                return None
            try:
                text = blob.download_as_bytes(
                    if_generation_match=blob.generation, retry=self.retry, timeout=self.request_timeout
                )
            except (exceptions.PreconditionFailed, exceptions.NotFound):
                continue  # rewritten or deleted between the two requests
            try:
                doc = json.loads(text)
            except json.JSONDecodeError:
                doc = {}
            updated = blob.updated.timestamp() if blob.updated else time.time()
            return _Found(doc if isinstance(doc, dict) else {}, time.time() - updated, blob.generation)
        raise StorageError(f"{self.url} kept changing while it was read; run the job again")

    def take_over(self, stale: _Found, doc: dict[str, Any]) -> Any:
        return self._put(doc, stale.token)

    def renew(self, doc: dict[str, Any], token: Any) -> Any:
        from google.api_core.retry import Retry

        # A renewal is retried for a heartbeat at most: the next one tries again.
        retry = Retry(predicate=storage.is_transient, initial=1.0, maximum=8.0,
                      timeout=min(doc["heartbeat_s"], self.timeout_s))
        return self._put({**doc, "renewed_at": _utc(time.time())}, token, retry)

    def delete(self, doc: dict[str, Any], token: Any) -> None:
        from google.api_core import exceptions
        from google.api_core.retry import Retry

        try:
            self.bucket.blob(self.blob_name).delete(
                if_generation_match=token, retry=Retry(predicate=storage.is_transient, timeout=10.0),
                timeout=(5.0, 10.0),
            )
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            log.warning("%s is no longer this run's lease: left in place", self.url)


# --- the lease ---------------------------------------------------------------------------------


class Lease:
    """A run's hold on its run folder; `take` it, then `release` it when the run ends."""

    def __init__(self, backend: Any, where: str, doc: dict[str, Any], token: Any):
        self._backend, self.where, self.doc, self._token = backend, where, doc, token
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._renew_until_released, name="run-folder-lease", daemon=True)
        self._thread.start()
        atexit.register(self.release)  # an exit that skips the run's own release (SystemExit, Ctrl-C)

    @classmethod
    def take(
        cls, folder: str, job: str, timeout_s: float = storage.DEFAULT_TIMEOUT_S,
        heartbeat_s: float = HEARTBEAT_S, expiry_s: float = EXPIRY_S,
    ) -> Lease:
        """Takes the lease of `folder`, or raises LeaseHeld naming the holder (StorageError when the folder
        cannot be written). `timeout_s` bounds the retries of one gs:// request (storage.timeout_s)."""
        is_gcs = storage.is_gcs(folder)
        where = f"{folder.rstrip('/')}/{LEASE}"
        try:
            backend = _GcsLease(folder, timeout_s) if is_gcs else _LocalLease(folder)
            doc = owner_doc(job, heartbeat_s, expiry_s)
            return cls._take(backend, where, doc, folder)
        except (RunnerError, KeyboardInterrupt):
            raise
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise StorageError(
                f"cannot write the run folder {folder} (its lease {exc.filename or where}): {reason}; make it "
                "writable or set output.dir to a folder this machine can write"
            ) from None
        except Exception as exc:  # noqa: BLE001 - google-cloud-storage's errors, named with the object
            raise StorageError(f"cannot take the lease {where}: {type(exc).__name__}: {str(exc)[:300]}") from None

    @classmethod
    def _take(cls, backend: Any, where: str, doc: dict[str, Any], folder: str) -> Lease:
        for _ in range(_ROUNDS):
            token = backend.create(doc)
            if token is not None:
                return cls(backend, where, doc, token)
            found = backend.read()
            if found is None:
                continue  # released in between: try again
            if found.doc.get("run_id") == doc["run_id"]:
                return cls(backend, where, doc, found.token)  # our create went through; its answer was lost
            reason = stale_reason(found.doc, found.age_s)
            if reason is None:
                raise LeaseHeld(
                    f"the run folder {folder} is in use by another run of job {found.doc.get('job', '?')!r}: "
                    f"{describe(found.doc, found.age_s)}. Wait for that run to end, or, if it is dead, delete "
                    f"{where} and run again (a lease from another host also lapses "
                    f"{found.doc.get('expiry_s', EXPIRY_S):g} s after its last renewal)"
                )
            log.warning("%s: taking over a stale lease (%s): %s", where, reason, describe(found.doc, found.age_s))
            token = backend.take_over(found, doc)
            if token is not None:
                return cls(backend, where, doc, token)
        raise LeaseHeld(f"{where} kept changing hands while this run tried to take it; run the job again")

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def _renew_until_released(self) -> None:
        interval = float(self.doc["heartbeat_s"])
        while not self._stop.wait(interval):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    token = self._backend.renew(self.doc, self._token)
                except Exception as exc:  # noqa: BLE001 - storage down: the next heartbeat tries again
                    log.warning("could not renew %s: %s: %s", self.where, type(exc).__name__, str(exc)[:200])
                    continue
                if token is None:
                    self._lost.set()
                    log.error("%s was taken over by another run: this run saves nothing more", self.where)
                    return
                self._token = token

    def release(self) -> None:
        """Stops renewing and deletes the lease (if it is still this run's); safe to call more than once."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.release)
        with self._lock:
            if self.lost:
                return
            try:
                self._backend.delete(self.doc, self._token)
            except Exception as exc:  # noqa: BLE001 - the run is over; the lease lapses by itself
                log.warning(
                    "could not delete %s (%s: %s): the next run takes it over once it is stale",
                    self.where, type(exc).__name__, str(exc)[:200],
                )
