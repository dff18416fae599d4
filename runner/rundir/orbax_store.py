"""Checkpoints of a job that computes with JAX: Orbax's CheckpointManager in `<run>/checkpoints/ckpt_<step>/`,
the backend seam's JAX side of the checkpoint store (TensorFlow's is tf.train.CheckpointManager: outputs.py).

A checkpoint holds every variable of the model (weights, seed generators) and of its optimizer (slots, the
step, the learning rate), as Orbax's `StandardSave` of the arrays, beside a JSON list of each variable's path,
shape and dtype. Variables are keyed by their position, not by Keras's automatic names (`sequential_1`,
`adam`), which differ between two models built in one process; the JSON list lets a restore name the layer
whose shape or presence changed instead of failing inside Orbax.

Saves are asynchronous (Orbax's default): `save` returns once the arrays are copied off the device, a
background thread writes them, and Orbax makes a step visible only when it is whole (a local step folder is
renamed from `ckpt_<step>.orbax-checkpoint-tmp-*`; on gs:// a `commit_success.txt` is written last), so a
save cut short by a kill is never restored. Orbax removes such temporary folders itself when it opens the
folder again. Each save first waits for the one before it; `wait()` waits for the last and raises its error.
"""

from __future__ import annotations

import logging
import posixpath
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from runner import SpecError, StorageError

log = logging.getLogger(__name__)

PREFIX = "ckpt"
_STEP = re.compile(rf"{PREFIX}_(\d+)$")


def step_of(path: str) -> int | None:
    match = _STEP.search(path.rstrip("/"))
    return int(match.group(1)) if match else None


def latest_in(directory: str) -> str | None:
    """The newest whole checkpoint in `directory` (Orbax's own test of a finished step), None when none is."""
    from orbax.checkpoint.path import step as steps

    try:
        found = [step_of(str(path)) for path in steps.checkpoint_steps_paths(directory)]
    except FileNotFoundError:
        return None
    found = [step for step in found if step is not None]
    return posixpath.join(directory.rstrip("/"), f"{PREFIX}_{max(found)}") if found else None


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
    """Saves and restores one Keras model's state (and its optimizer's) in `directory`."""

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
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def path(self, step: int) -> str:
        return posixpath.join(self.directory, f"{PREFIX}_{step}")

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
        """Waits for the save in flight; raises StorageError when it failed or did not become the newest."""
        try:
            self._manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001 - Orbax's writer raises what the storage raised
            raise StorageError(
                f"the checkpoint write to {self.directory} failed ({type(exc).__name__}: {exc}): check that the run "
                "folder's storage is writable and reachable, then run the job again"
            ) from exc

    def restore(self, path: str) -> int:
        """Restores the checkpoint at `path` into the model and its optimizer; returns its step. A model whose
        variables differ from the checkpoint's (an edited model) is refused naming the first difference."""
        step = step_of(path)
        ocp = self._ocp
        variables = _variables(self._model)
        saved = self._manager.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
        _check_layout(saved, _layout(variables), path)
        # Restored as host arrays, then assigned: the variables keep the placement a fresh model's have, so the
        # train step compiled (and cached in jax_cache/) for a fresh start is the one a resume finds.
        target = {
            part: {f"{i:05d}": np.asarray(v.value) for i, v in enumerate(found)} for part, found in variables.items()
        }
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        for part, found in variables.items():
            for i, variable in enumerate(found):
                variable.assign(restored["state"][part][f"{i:05d}"])
        return int(np.asarray(self._model.optimizer.iterations.value))

    def close(self) -> None:
        self._manager.close()


def _check_layout(saved: dict[str, list], now: dict[str, list], path: str) -> None:
    for part in ("model", "optimizer"):
        before, after = saved.get(part, []), now[part]
        for index in range(max(len(before), len(after))):
            old = before[index] if index < len(before) else None
            new = after[index] if index < len(after) else None
            if old is not None and new is not None and list(old[1]) == list(new[1]) and old[2] == new[2]:
                continue
            what = "variable" if part == "model" else "optimizer variable"
            if old is None:
                change = f"the model has a {what} the checkpoint lacks: {new[0]} {tuple(new[1])}"
            elif new is None:
                change = f"the checkpoint has a {what} the model lacks: {old[0]} {tuple(old[1])}"
            else:
                change = (f"{what} {new[0]} is {tuple(new[1])} {new[2]} in the model and "
                          f"{tuple(old[1])} {old[2]} in the checkpoint ({old[0]})")
            raise SpecError(
                f"the model changed since {path} was saved: {change}. Start the job over with `runner run --fresh` "
                "(the run folder is moved aside, not deleted), or give the changed model a new job name "
                "(`--set name=...`)"
            )


class OrbaxSaver:
    """The training loop's saver over an OrbaxStore: the same face as runner/train/saver.py's Saver."""

    def __init__(self, store: OrbaxStore):
        self._store = store
        self.asynchronous = True
        self.why_sync = None
        self.saves = 0
        self.blocked_s = 0.0
        self.write_s = 0.0
        self._pending: tuple[str, float] | None = None

    def save(self, step: int) -> str:
        began = time.monotonic()
        try:
            self.wait()
            path = self._store.save(step)
            self._pending = (path, began)
            return path
        finally:
            self.saves += 1
            self.blocked_s += time.monotonic() - began

    def wait(self) -> None:
        if self._pending is None:
            return
        path, began = self._pending
        self._pending = None
        self._store.wait()
        self.write_s += time.monotonic() - began
        if self._store.latest() != path:
            raise StorageError(
                f"the checkpoint {path} was not written (the newest is {self._store.latest()}): check that the run "
                "folder's storage is writable and reachable, then run the job again"
            )

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def wait_after_error(self) -> None:
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the error already ending the job is the one to report
            log.error("the last checkpoint write failed too: %s", exc)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "async", "store": "orbax", "saves": self.saves, "blocked_s": round(self.blocked_s, 4),
                "write_s": round(self.write_s, 4)}
