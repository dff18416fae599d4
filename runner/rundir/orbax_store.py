"""Checkpoints of a job that computes with JAX: Orbax's CheckpointManager in `<run>/checkpoints/ckpt_<step>/`, the
Orbax implementation of the checkpoint store's `Store` (runner/rundir/checkpoints.py; TensorFlow's is
runner/train/tf_store.py, and runner/train/saver.py is the one saver over either).

A checkpoint holds every variable of the model (weights, seed generators) and of its optimizer (slots, the
step, the learning rate), as Orbax's `StandardSave` of the arrays, beside a JSON list of each variable's path,
shape and dtype. Variables are keyed by their position, not by Keras's automatic names (`sequential_1`,
`adam`), which differ between two models built in one process. A restore is all or nothing: the JSON list and
the same list made from the model now are matched both ways, every variable by position, shape and dtype
(runner/rundir/matching.py), and a difference stops it naming each variable, before anything is assigned.

Saves are asynchronous (Orbax's default): `save` returns once the arrays are copied off the device, a
background thread writes them, and Orbax makes a step visible only when it is whole (a local step folder is
renamed from `ckpt_<step>.orbax-checkpoint-tmp-*`; on gs:// a `commit_success.txt` is written last), so a
save cut short by a kill is never restored. Orbax removes such temporary folders itself when it opens the
folder again. Each save first waits for the one before it; `wait()` waits for the last and raises its error.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from typing import Any

import numpy as np

from runner import StorageError
from runner.rundir import matching
from runner.rundir.checkpoints import PREFIX, name_of
from runner.rundir.checkpoints import step_of as _step_of

log = logging.getLogger(__name__)
NAME = "orbax"


def step_of(path: str) -> int | None:
    """The step of an Orbax checkpoint's folder (`ckpt_<step>`), None for any other name."""
    return _step_of(path, NAME)


def latest_in(directory: str) -> str | None:
    """The newest whole checkpoint in `directory` (Orbax's own test of a finished step), None when none is."""
    from orbax.checkpoint.path import step as steps

    try:
        found = [step_of(str(path)) for path in steps.checkpoint_steps_paths(directory)]
    except FileNotFoundError:
        return None
    found = [step for step in found if step is not None]
    return posixpath.join(directory.rstrip("/"), name_of(max(found), NAME)) if found else None


def _leftovers(directory: str) -> list[str]:
    """What the CheckpointManager is about to remove (`cleanup_tmp_directories`, on process 0 only): Orbax's own
    list of the step folders never made whole, by name; [] elsewhere or when it cannot tell."""
    import asyncio

    import jax
    from orbax.checkpoint._src.path import temporary_paths

    if jax.process_index() != 0:
        return []
    try:
        found = asyncio.run(temporary_paths.all_temporary_paths(directory))
        return sorted(posixpath.basename(str(path.get()).rstrip("/")) for path in found)
    except Exception as exc:  # noqa: BLE001 - naming them is a courtesy: Orbax removes them regardless
        log.debug("could not list the leftovers in %s: %s", directory, exc)
        return []


def _variables(model: Any) -> dict[str, list]:
    optimizer = model.optimizer
    if not optimizer.built:  # a restore before the first step: the slots must exist to receive their values
        optimizer.build(model.trainable_variables)
    return {"model": list(model.variables), "optimizer": list(optimizer.variables)}


def _layout(variables: dict[str, list]) -> dict[str, list[list]]:
    return {
        part: [[v.path, list(v.shape), str(v.dtype)] for v in found] for part, found in variables.items()
    }


class OrbaxStore:
    """Saves and restores one Keras model's state (and its optimizer's) in `directory`: a `Store`."""

    name = NAME
    asynchronous = True  # Orbax's own background writes, on every backend
    why_sync = None

    def __init__(self, directory: str, model: Any, keep: int, before_save: Callable[[], None] | None = None):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = directory.rstrip("/")
        self._model = model
        self._before_save = before_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, step_prefix=PREFIX, enable_async_checkpointing=True, create=True,
            cleanup_tmp_directories=True,  # the leftovers of a save cut short (resume precedence 4)
        )
        leftovers = _leftovers(self.directory)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        if leftovers:  # named as TensorFlow's are (runner/rundir/outputs.py remove_leftovers)
            log.info("removed %d leftover(s) of a checkpoint save that was cut short from %s: %s", len(leftovers),
                     self.directory, ", ".join(leftovers))

    def path(self, step: int) -> str:
        return posixpath.join(self.directory, name_of(step, NAME))

    def latest(self) -> str | None:
        step = self._manager.latest_step()
        return None if step is None else self.path(step)

    def save(self, step: int) -> str:
        """Starts the save of `step`; returns once the arrays are copied off the device."""
        if self._before_save is not None:
            self._before_save()
        variables = _variables(self._model)
        state = {part: {f"{i:05d}": v.value for i, v in enumerate(found)} for part, found in variables.items()}
        args = self._ocp.args.Composite(
            state=self._ocp.args.StandardSave(state),
            layout=self._ocp.args.JsonSave({"step": step, **_layout(variables)}),
        )
        try:
            self._manager.save(step, args=args, force=True)
        except OSError as exc:
            raise StorageError(f"could not save the checkpoint {self.path(step)}: {exc}") from exc
        return self.path(step)

    def wait(self) -> None:
        """Waits for the save in flight; raises StorageError when it failed. When it ended is not known (None)."""
        try:
            self._manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001 - Orbax's writer raises what the storage raised
            raise StorageError(
                f"the checkpoint write to {self.directory} failed ({type(exc).__name__}: {exc}): check that the run "
                "folder's storage is writable and reachable, then run the job again"
            ) from exc

    def restore(self, path: str) -> int:
        """Restores the checkpoint at `path` into the model and its optimizer, all or nothing; returns its step.
        The layout the save recorded and the model's, made now by the same function, are matched both ways by
        path and shape first (runner/rundir/matching.py): an edited model is refused (SpecError, exit 2) naming
        each difference, before anything is assigned."""
        step = step_of(path)
        variables = _variables(self._model)
        saved, pairs = self.check(path)
        ocp = self._ocp
        # Restored as host arrays of the saved layout, then assigned: the variables keep the placement a fresh
        # model's have, so the train step compiled (and cached in jax_cache/) for a fresh start is the one a
        # resume finds.
        target = {}
        for part, found in variables.items():
            paired = {then: now for now, then in pairs[part]}
            target[part] = {
                f"{i:05d}": _target(found[paired[i]].value) if i in paired else _zeros(shape, dtype)
                for i, (_, shape, dtype) in enumerate(saved.get(part, []))
            }
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        for part, found in variables.items():
            for now, then in pairs[part]:
                found[now].assign(restored["state"][part][f"{then:05d}"])
        return int(np.asarray(self._model.optimizer.iterations.value))

    def check(self, path: str, complete: bool = False) -> tuple[dict[str, list], dict[str, list[tuple[int, int]]]]:
        """(the layout saved at `path`, the pairs to assign); SpecError when the model no longer matches it.
        `complete`: the job is finished, and the refusal says so."""
        ocp = self._ocp
        saved = self._manager.restore(step_of(path), args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
        return saved, _matched(saved, _layout(_variables(self._model)), path, complete)

    def close(self) -> None:
        self._manager.close()


def _target(value: Any) -> Any:
    """What a variable's saved value is restored as: a host array, or, for an array no process holds whole (a
    layout that splits a variable over the batch axis too, as Gemma's embedding is, on several processes:
    runner/device/sharding.py), its shape, type and sharding, so that each process reads only its own shards."""
    import jax

    from runner.device.sharding import held_whole_here

    if getattr(value, "is_fully_addressable", True) or held_whole_here(value):
        return np.asarray(value)
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)


def _zeros(shape: list, dtype: str) -> np.ndarray:
    """A placeholder for a saved value nothing takes (a setting the model no longer keeps in a variable)."""
    try:
        return np.zeros(tuple(shape), np.dtype(dtype))
    except TypeError:
        import ml_dtypes

        return np.zeros(tuple(shape), getattr(ml_dtypes, dtype))


def _is_setting(part: str, entry: list) -> bool:
    """A variable that holds a spec setting, not something learned (runner/rundir/matching.py)."""
    return part == "optimizer" and str(entry[0]).rsplit("/", 1)[-1] == "learning_rate"


def _held(part: str, entries: list[list]) -> tuple[dict[str, matching.Held], list[int]]:
    """The learned variables of one part, keyed `part/N` by their position among them, and each one's index in
    `entries`."""
    kept = [i for i, entry in enumerate(entries) if not _is_setting(part, entry)]
    held = {
        f"{part}/{n:05d}": matching.Held(f"{part}/{n:05d}", tuple(int(d) for d in entries[i][1]), str(entries[i][2]),
                                         str(entries[i][0]))
        for n, i in enumerate(kept)
    }
    return held, kept


def _matched(saved: dict[str, list], now: dict[str, list], path: str,
             complete: bool = False) -> dict[str, list[tuple[int, int]]]:
    """(index in the model, index in the checkpoint) of every variable to assign, per part; SpecError when the
    two layouts differ in any learned variable."""
    before, after, pairs = {}, {}, {}
    for part in ("model", "optimizer"):
        old, old_index = _held(part, saved.get(part, []))
        new, new_index = _held(part, now[part])
        before.update(old)
        after.update(new)
        pairs[part] = list(zip(new_index, old_index, strict=False))  # equal lengths once matched
    matching.check(path, before, after, complete=complete)
    return pairs
