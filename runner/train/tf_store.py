"""TensorFlow's implementation of the checkpoint store's `Store` (runner/rundir/checkpoints.py): tf.train.Checkpoint
of the model and its optimizer through the run folder's CheckpointManager (runner/rundir/outputs.py), `ckpt-<step>`
files beside the index `checkpoint`; Orbax's is runner/rundir/orbax_store.py.

A save copies the weights, optimizer state and step into host memory (the training loop waits for that copy only,
`tf.train.CheckpointOptions(enable_async=True)`) and a background thread writes the copy; the CheckpointManager's
index names the checkpoint only once its files are written (precedence 6 of outputs.py), so a write cut short is
never chosen, and it removes the oldest beyond `keep`. Weights are checked finite before the copy
(runner/train/fit.py), so the copy written is the one checked.

Keras 3 variables can be copied this way only once per copy (their `_copy_trackable_to_cpu` makes a new variable
each time, which TensorFlow's copy function refuses from the second save on), so each save gets a fresh copy:
TensorFlow's helper is dropped once its write is done. A save that cannot be made in the background (a variable
type TensorFlow cannot copy) is made synchronously from then on, with a warning.
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any

import tensorflow as tf

from runner import StorageError
from runner.rundir.outputs import RunFolder
from runner.train import match

log = logging.getLogger(__name__)


class TensorFlowStore:
    """`model`'s checkpoints in `run`'s checkpoints/, keeping the newest `keep`; saved in the background when
    `asynchronous`."""

    name = "tensorflow"

    def __init__(self, run: RunFolder, model: Any, keep: int, asynchronous: bool = True):
        scope = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
        with scope.scope():  # its save counter beside the model's variables
            self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        self._manager = run.checkpoint_manager(self._checkpoint, keep)
        self._model = model
        self.asynchronous = asynchronous
        self.why_sync: str | None = None if asynchronous else "asked to save synchronously"
        self._written: dict[str, float] = {}
        self._pending: str | None = None

    def latest(self) -> str | None:
        return self._manager.latest_checkpoint

    def save(self, step: int) -> str:
        """Starts the save of `step`; returns once the state is copied to host memory (the write done, when
        synchronous)."""
        if self.asynchronous:
            options = tf.train.CheckpointOptions(enable_async=True, experimental_write_callbacks=[self._written_at])
            try:
                self._pending = self._manager.save(checkpoint_number=step, options=options)
                return self._pending
            except (tf.errors.OpError, StorageError):
                raise
            except Exception as exc:  # noqa: BLE001 - TensorFlow could not copy a variable: save synchronously
                self._drop_helper(join=False)
                self.asynchronous = False
                self.why_sync = f"the background save could not start ({type(exc).__name__}: {exc})"
                log.warning("checkpoints are saved synchronously from now on: %s", self.why_sync)
        return self._manager.save(checkpoint_number=step)

    def _written_at(self, path: str) -> None:  # runs in TensorFlow's writer thread once the files are written
        self._written[path] = time.monotonic()

    def wait(self) -> float | None:
        """Waits for the write in flight, raising its error (a storage fault); returns when it ended."""
        path, self._pending = self._pending, None
        self._drop_helper(join=True)
        return None if path is None else self._written.pop(path, None)

    def restore(self, path: str) -> int:
        """All or nothing (runner/train/match.py); returns the step restored."""
        match.restore_tensorflow(self._checkpoint, path)
        return int(self._model.optimizer.iterations.numpy())

    def check(self, path: str, complete: bool = False) -> None:
        """SpecError when the model no longer matches the checkpoint at `path`; nothing is read into it."""
        match.restore_tensorflow(self._checkpoint, path, read=False, complete=complete)

    def close(self) -> None:
        self._drop_helper(join=True)

    def _drop_helper(self, join: bool) -> None:
        """Ends TensorFlow's async helper of this checkpoint (its thread and host copy); with `join`, after its
        write is done, raising the write's error. The next save makes a fresh one."""
        helper = getattr(self._checkpoint, "_async_checkpointer_impl", None)
        if helper is None:
            return
        self._checkpoint._async_checkpointer_impl = None
        atexit.unregister(helper._join_async_save_thread)
        if join:
            helper._join_async_save_thread()  # the write done, then its error (if any) raised here
