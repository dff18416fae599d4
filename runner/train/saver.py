"""Checkpoint saves that do not stall training: TensorFlow's asynchronous checkpointing
(`tf.train.CheckpointOptions(enable_async=True)` through the run folder's CheckpointManager).

A save copies the weights, optimizer state and step into host memory (the training loop waits for that
copy only) and a background thread writes the copy; the CheckpointManager's index names the checkpoint
only once its files are written (runner/rundir/outputs.py, precedence 6), so a write cut short is never chosen.
Each save first waits for the write before it, and `wait()` waits for the last one and raises its error:
the job calls it when training ends, whatever ended it (the last epoch, a preemption notice within
`checkpoint.grace_s`, an error), before the summary and the export. Weights are checked finite before the
copy (runner/train/fit.py), so the copy written is the one checked.

Keras 3 variables can be copied this way only once per copy (their `_copy_trackable_to_cpu` makes a new
variable each time, which TensorFlow's copy function refuses from the second save on), so each save gets
a fresh copy: TensorFlow's helper is dropped once its write is done. A save that cannot be made in the
background (a variable type TensorFlow cannot copy) is made synchronously from then on, with a warning.
Multi-worker saves stay synchronous: every worker takes part in each save (collective ops).
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any

import tensorflow as tf

from runner import StorageError

log = logging.getLogger(__name__)


class Saver:
    """Saves `checkpoint` through `manager` at a step, in the background when `asynchronous`."""

    def __init__(self, manager: tf.train.CheckpointManager, checkpoint: tf.train.Checkpoint, asynchronous: bool):
        self._manager, self._checkpoint = manager, checkpoint
        self.asynchronous = asynchronous
        self.why_sync = None if asynchronous else "multi-worker saves are collective"
        self.saves = 0
        self.blocked_s = 0.0  # the training loop waiting on saves: the copy, and waits for writes
        self.write_s = 0.0  # background writes, from the save's start to its files written
        self._pending: tuple[str, float] | None = None  # (path, started) of the write in flight
        self._written: dict[str, float] = {}

    def save(self, step: int) -> str | None:
        """Saves at `step`; returns the checkpoint's path. Asynchronous: returns once the copy is made."""
        began = time.monotonic()
        try:
            self.wait()
            if self.asynchronous:
                options = tf.train.CheckpointOptions(enable_async=True, experimental_write_callbacks=[self._written_at])
                try:
                    path = self._manager.save(checkpoint_number=step, options=options)
                    self._pending = (path, began)
                    return path
                except (tf.errors.OpError, StorageError):
                    raise
                except Exception as exc:  # noqa: BLE001 - TensorFlow could not copy a variable: save synchronously
                    self._drop_helper(join=False)
                    self.asynchronous = False
                    self.why_sync = f"the background save could not start ({type(exc).__name__}: {exc})"
                    log.warning("checkpoints are saved synchronously from now on: %s", self.why_sync)
            path = self._manager.save(checkpoint_number=step)
            self.write_s += time.monotonic() - began
            return path
        finally:
            self.saves += 1
            self.blocked_s += time.monotonic() - began

    def _written_at(self, path: str) -> None:  # runs in TensorFlow's writer thread once the files are written
        self._written[path] = time.monotonic()

    def wait(self) -> None:
        """Waits for the write in flight, if any; raises its error (a storage fault), or StorageError when
        its checkpoint did not reach the index."""
        if self._pending is None:
            return
        path, began = self._pending
        self._pending = None
        self._drop_helper(join=True)
        if path in self._written:
            self.write_s += self._written.pop(path) - began
        if self._manager.latest_checkpoint != path:
            raise StorageError(
                f"the checkpoint {path} was not written (the index names {self._manager.latest_checkpoint}): "
                "check that the run folder's storage is writable and reachable, then run the job again"
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

    def _drop_helper(self, join: bool) -> None:
        """Ends TensorFlow's async helper of this checkpoint (its thread and host copy); with `join`, after
        its write is done, raising the write's error. The next save makes a fresh one."""
        helper = getattr(self._checkpoint, "_async_checkpointer_impl", None)
        if helper is None:
            return
        self._checkpoint._async_checkpointer_impl = None
        atexit.unregister(helper._join_async_save_thread)
        if join:
            helper._join_async_save_thread()  # the write done, then its error (if any) raised here

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": "async" if self.asynchronous else "sync",
            **({"why_sync": self.why_sync} if self.why_sync else {}),
            "saves": self.saves,
            "blocked_s": round(self.blocked_s, 4),
            "write_s": round(self.write_s, 4),
        }
