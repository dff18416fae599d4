"""Who has begun to join: one marker per process in `<run>/joining/process-<i>.json`, written when the process
begins to join the others (runner/device/processes.py `join`), read by those that wait, so that they name the
processes still missing instead of only counting the seconds. On a slice the workers reach the join minutes
apart (each pulls the image and checks its host alone): the markers tell a worker that is late from one that
never started.

A marker holds the host, the PID and the wall-clock time it was written; one older than the join's bound is
an earlier launch's and counts for nothing. A marker that says `failed` (process 0's coordinator port in use)
ends the processes that read it, naming why. Process 0 removes the folder once every process joined (and a
local run folder left empty by that); a
process that could not join removes its own marker (a failed one stays, for the others to read), and a local
run folder that held nothing else is removed with it: a job that never formed leaves no run folder.

Markers are advice: a storage that cannot be written or read leaves the join to its bound, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import time
from typing import Any

import tensorflow as tf

from runner.data import storage
from runner.device.bounded import Bounded

log = logging.getLogger(__name__)

FOLDER = "joining"
# Clocks of hosts differ: a marker this much older than the bound still counts.
SKEW_S = 60.0


class Roll:
    """The markers of one job's processes in `run_path`; `bound_s`: the join's bound (accelerator.join_timeout_s),
    `io_s`: the longest one read or write may take (storage.timeout_s, at most 30 s)."""

    def __init__(self, run_path: str, index: int, bound_s: float, io_s: float = 30.0):
        self.run_path, self.index, self.bound_s, self.io_s = run_path.rstrip("/"), index, bound_s, min(io_s, 30.0)
        self.folder = posixpath.join(self.run_path, FOLDER)
        self._made_run_folder = False

    def _marker(self, index: int) -> str:
        return posixpath.join(self.folder, f"process-{index}.json")

    def _bounded(self, what: str, fn: Any) -> Any:
        try:
            return Bounded(what, fn).result(self.io_s)
        except (TimeoutError, tf.errors.OpError, OSError, ValueError) as exc:
            log.warning("joining: could not %s (%s): the processes still missing are not named",
                        what, " ".join(str(exc).split())[:200])
            return None

    def mark(self, failed: str | None = None) -> None:
        """Writes this process's marker: it begins to join (or, with `failed`, it could not, and why)."""
        doc = {"process": self.index, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}
        if failed:
            doc["failed"] = failed

        def write() -> None:
            if not storage.is_gcs(self.run_path) and not tf.io.gfile.exists(self.run_path):
                self._made_run_folder = True
            tf.io.gfile.makedirs(self.folder)
            partial = self._marker(self.index) + f".{os.getpid()}.partial"
            with tf.io.gfile.GFile(partial, "w") as handle:
                handle.write(json.dumps(doc))
            tf.io.gfile.rename(partial, self._marker(self.index), overwrite=True)

        self._bounded(f"write {self._marker(self.index)}", write)

    def present(self) -> dict[int, dict] | None:
        """The processes that began to join within the bound, by index (their markers); None when unreadable."""

        def read() -> dict[int, dict]:
            found: dict[int, dict] = {}
            if not tf.io.gfile.isdir(self.folder):
                return found
            oldest = time.time() - self.bound_s - SKEW_S
            for name in tf.io.gfile.listdir(self.folder):
                if not (name.startswith("process-") and name.endswith(".json")):
                    continue
                try:
                    with tf.io.gfile.GFile(posixpath.join(self.folder, name)) as handle:
                        doc = json.loads(handle.read())
                except (tf.errors.OpError, ValueError):  # removed meanwhile, or half-written on a bucket
                    continue
                if isinstance(doc, dict) and isinstance(doc.get("process"), int) and doc.get("at", 0) >= oldest:
                    found[doc["process"]] = doc
            return found

        return self._bounded(f"list {self.folder}", read)

    def clear(self, everyone: bool = False) -> None:
        """Removes this process's marker (a failed one stays), or with `everyone` the whole folder; then a local
        run folder this process made, if nothing else is in it."""

        def remove() -> None:
            if everyone:
                if tf.io.gfile.isdir(self.folder):
                    tf.io.gfile.rmtree(self.folder)
                if not storage.is_gcs(self.run_path):
                    try:
                        os.rmdir(self.run_path)  # empty: made for the markers (the job's first write remakes it)
                    except OSError:
                        pass
                return
            mine = self._marker(self.index)
            if tf.io.gfile.exists(mine):
                with tf.io.gfile.GFile(mine) as handle:
                    failed = "failed" in json.loads(handle.read() or "{}")
                if failed:
                    return
                tf.io.gfile.remove(mine)
            if storage.is_gcs(self.run_path):
                return
            for folder in (self.folder, self.run_path) if self._made_run_folder else (self.folder,):
                try:
                    os.rmdir(folder)
                except OSError:  # not empty (another process's marker, the job's files), or gone
                    pass

        self._bounded(f"remove the markers in {self.folder}", remove)
