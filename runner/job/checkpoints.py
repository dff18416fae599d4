"""The run folder's checkpoints for the backend the job computes with: one restore and one saver for the
job's story (run) and for evaluate/predict (predict). Under TensorFlow, tf.train.CheckpointManager and the
background Saver (runner/train/saver.py); under JAX, Orbax (runner/rundir/orbax_store.py). Either way the
learning rate stays the spec's (runner/train/build.py `keeping_rate`).
"""

from __future__ import annotations

from typing import Any

from runner.rundir.orbax_store import OrbaxSaver, OrbaxStore
from runner.rundir.outputs import RunFolder
from runner.train import build
from runner.train.saver import Saver


def restore(run: RunFolder, model: Any, checkpoint: Any, path: str, keep: int = 1) -> int:
    """Restores the checkpoint at `path` into `model` (and its optimizer); returns its step. `checkpoint`:
    TensorFlow's checkpoint object from build_compiled, None under JAX."""
    if checkpoint is not None:
        return build.restore(checkpoint, path)
    store = run.orbax_store(model, keep)
    try:
        return build.keeping_rate(model.optimizer, lambda: store.restore(path))
    finally:
        store.close()


def saver(run: RunFolder, model: Any, checkpoint: Any, keep: int) -> Any:
    """The saver that writes the job's checkpoints into the run folder, in the background. Under JAX every process
    of a job takes part in Orbax's saves."""
    if checkpoint is None:
        return OrbaxSaver(run.orbax_store(model, keep))
    return Saver(run.checkpoint_manager(checkpoint, keep), checkpoint, asynchronous=True)


__all__ = ["OrbaxStore", "restore", "saver"]
