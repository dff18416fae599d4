"""The one checkpoint saver of the training loop, over either format's store (a `Store` of
runner/rundir/checkpoints.py: TensorFlow's runner/train/tf_store.py or Orbax's runner/rundir/orbax_store.py), so
that saves do not stall training.

A save returns once the store has copied the state off the device, and the write goes on in the background. Each
save first waits for the write before it, and `wait()` waits for the last one and raises its error, or
StorageError when its checkpoint did not become the store's newest whole one: the job calls it when training
ends, whatever ended it (the last epoch, a preemption notice within `checkpoint.grace_s`, an error), before the
summary and the export. The seconds the loop was blocked and the seconds the writes took go to the summary
(`checkpoint_saves`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from runner import StorageError
from runner.rundir.checkpoints import Store

log = logging.getLogger(__name__)


class Saver:
    """Saves `store`'s model at a step, in the background when the store can."""

    def __init__(self, store: Store):
        self.store = store
        self.saves = 0
        self.blocked_s = 0.0  # the training loop waiting on saves: the copy, and waits for writes
        self.write_s = 0.0  # writes, from the save's start to its files written
        self._pending: tuple[str, float] | None = None  # (path, started) of the write in flight

    @property
    def asynchronous(self) -> bool:
        return self.store.asynchronous

    def save(self, step: int) -> str:
        """Saves at `step`; returns the checkpoint's path. Asynchronous: returns once the copy is made."""
        began = time.monotonic()
        try:
            self.wait()
            path = self.store.save(step)
            if self.store.asynchronous:
                self._pending = (path, began)
            else:
                self.write_s += time.monotonic() - began
            return path
        finally:
            self.saves += 1
            self.blocked_s += time.monotonic() - began

    def wait(self) -> None:
        """Waits for the write in flight, if any; raises its error (a storage fault), or StorageError when its
        checkpoint is not the store's newest whole one."""
        if self._pending is None:
            return
        path, began = self._pending
        self._pending = None
        ended = self.store.wait()
        self.write_s += (ended if ended is not None else time.monotonic()) - began
        if (latest := self.store.latest()) != path:
            raise StorageError(
                f"the checkpoint {path} was not written (the newest is {latest}): check that the run folder's "
                "storage is writable and reachable, then run the job again"
            )

    @property
    def pending(self) -> bool:
        """A write is in flight (or done but not yet waited for)."""
        return self._pending is not None

    def wait_after_error(self) -> None:
        """wait() while another error ends training: the write completes, its own error is only logged."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the error already ending the job is the one to report
            log.error("the last checkpoint write failed too: %s", exc)

    def to_dict(self) -> dict[str, Any]:
        why_sync = self.store.why_sync
        return {
            "mode": "async" if self.store.asynchronous else "sync",
            **({"why_sync": why_sync} if why_sync else {}),
            **({"store": self.store.name} if self.store.name == "orbax" else {}),  # TensorFlow's: the default
            "saves": self.saves,
            "blocked_s": round(self.blocked_s, 4),
            "write_s": round(self.write_s, 4),
        }
