"""The run folder's checkpoints for the backend the job computes with: one restore and one saver for the
job's story (run) and for evaluate/predict (predict). Under TensorFlow, tf.train.CheckpointManager and the
background Saver (runner/train/saver.py); under JAX, Orbax (runner/rundir/orbax_store.py). Either way the
learning rate stays the spec's (runner/train/build.py `keeping_rate`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from runner import SpecError
from runner.device import engine, precision
from runner.rundir import matching, reported
from runner.rundir.orbax_store import OrbaxSaver, OrbaxStore
from runner.rundir.outputs import RunFolder
from runner.spec.types import JobSpec
from runner.train import build, match
from runner.train.saver import Saver


def restore(run: RunFolder, model: Any, checkpoint: Any, path: str, keep: int = 1, element_spec: Any = None) -> int:
    """Restores the checkpoint at `path` into `model` (and its optimizer), all or nothing; returns its step.
    `checkpoint`: TensorFlow's checkpoint object from build_compiled, None under JAX. `element_spec`: a batch's
    shapes, to build a model that makes its variables only when first called. A model that no longer matches
    the checkpoint is refused (SpecError) naming each variable that differs (runner/rundir/matching.py)."""
    if checkpoint is not None:
        return build.restore(checkpoint, path, element_spec)
    match.make_every_variable(model, element_spec)
    store = run.orbax_store(model, keep)
    try:
        return build.keeping_rate(model.optimizer, lambda: store.restore(path))
    finally:
        store.close()


def changed_since_complete(
    spec: JobSpec, run: RunFolder, features: dict, manifest: dict, done: dict
) -> SpecError | None:
    """A finished job run again restores nothing, but its model must still be the one its weights were trained
    for: the SpecError saying the job is complete and what changed, or None. The weights are those evaluate and
    predict would use (model.keras of the finished job, else its checkpoint: runner/rundir/reported.py)."""
    try:
        weights = reported.chosen_weights(run, spec.name)
    except SpecError:
        return None  # nothing to compare with: run's own checks say what is missing
    policy = ((done.get("accelerator") or {}).get("precision") or {}).get("policy") or "float32"
    precision.Precision(policy, "the finished job's").apply()  # the optimizer it saved: a loss scale under float16
    model = build.build_model(spec, features, manifest)
    if not model.built:  # a model that makes its variables on its first call: no batch here to build it from
        return None
    try:
        if weights.keras_file:
            matching.check(weights.path, match.keras_file_saved(weights.path), match.keras_file_live(model),
                           store="model.keras", complete=True)
            return None
        build.compile_model(model, spec)
        if engine.active().checkpoint_format != "orbax":
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
            match.restore_tensorflow(checkpoint, weights.path, read=False, complete=True)
            return None
        match.make_every_variable(model)
        store = run.orbax_store(model, 1)
        try:
            store.check(weights.path, complete=True)
        finally:
            store.close()
    except SpecError as exc:
        return exc
    return None


def saver(run: RunFolder, model: Any, checkpoint: Any, keep: int) -> Any:
    """The saver that writes the job's checkpoints into the run folder, in the background. Under JAX every process
    of a job takes part in Orbax's saves."""
    if checkpoint is None:
        return OrbaxSaver(run.orbax_store(model, keep))
    return Saver(run.checkpoint_manager(checkpoint, keep), checkpoint, asynchronous=True)


__all__ = ["OrbaxStore", "changed_since_complete", "restore", "saver"]
