"""The run folder's checkpoint store for the format the engine keeps (`Engine.checkpoint_format`): opened, restored,
saved through the one saver, and a finished job's weights compared with its model. Behind the one `Store`
interface (runner/rundir/checkpoints.py) are TensorFlow's (runner/train/tf_store.py) and Orbax's
(runner/rundir/orbax_store.py); whichever it is, the learning rate stays the spec's (build.py `keeping_rate`).
"""

from __future__ import annotations

from typing import Any

from runner import SpecError
from runner.device import engine, precision
from runner.rundir import matching, reported
from runner.rundir.checkpoints import Store
from runner.rundir.outputs import RunFolder
from runner.rundir.recorded import Recorded
from runner.spec.types import JobSpec
from runner.train import build, match
from runner.train.tf_store import TensorFlowStore


def open_store(run: RunFolder, model: Any, keep: int) -> Store:
    """`model`'s checkpoints in `run`'s checkpoints/, in the active engine's format, keeping the newest `keep`.
    Under JAX every process of a job takes part in Orbax's saves and restores."""
    if engine.active().checkpoint_format == "orbax":
        return run.orbax_store(model, keep)
    return TensorFlowStore(run, model, keep)


def restore(store: Store, model: Any, path: str, element_spec: Any = None) -> int:
    """Restores the checkpoint at `path` into `model` (and its optimizer) through `store`, all or nothing; returns
    its step. `element_spec`: a batch's shapes, to build a model that makes its variables only when first called.
    A model that no longer matches the checkpoint is refused (SpecError) naming each variable that differs
    (runner/rundir/matching.py), before anything is assigned."""
    match.make_every_variable(model, element_spec)
    return build.keeping_rate(model.optimizer, lambda: store.restore(path))


def restore_once(run: RunFolder, model: Any, path: str) -> int:
    """restore() through a store opened for it alone (evaluate and predict, which save nothing)."""
    store = open_store(run, model, 1)
    try:
        return restore(store, model, path)
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
    policy = (Recorded.of(done) or Recorded()).accelerator.precision.policy or "float32"
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
        match.make_every_variable(model)
        store = open_store(run, model, 1)
        try:
            store.check(weights.path, complete=True)
        finally:
            store.close()
    except SpecError as exc:
        return exc
    return None
