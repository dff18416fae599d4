"""The weights a run folder reports, and a newer checkpoint an abandoned attempt left beside them.

A succeeded summary.json describes model.keras: the weights its `metrics` were measured on (after early
stopping put back the best epoch's). An attempt that went on towards more epochs and was left (interrupted,
preempted, failed) leaves newer checkpoints, while summary.json stays the finished job's (a summary that did
not succeed never replaces one that did) and `runner run` with the original epochs finds the job complete.
`runner evaluate` and `runner predict` answer with what was reported:

  1. `--checkpoint`: the checkpoint it names (checkpoints/ckpt-<step>, its name alone, or a .keras file).
  2. summary.json `succeeded`: model.keras, at the summary's final_step; if model.keras is gone, the
     checkpoint of that step.
  3. otherwise (a job still training, or stopped before it finished) the newest complete checkpoint.

A checkpoint newer than the step a succeeded summary reports is named (`abandoned_note`) whenever the job is
run, evaluated or predicted.
"""

from __future__ import annotations

import dataclasses
import posixpath

import tensorflow as tf

from runner import SpecError
from runner.device import engine
from runner.rundir import checkpoints
from runner.rundir.outputs import RunFolder
from runner.rundir.summary import Recorded


@dataclasses.dataclass(frozen=True)
class Weights:
    """Where the weights come from: a checkpoint prefix or a .keras file, and the step they were trained to."""

    path: str
    step: int | None
    keras_file: bool


step_of = checkpoints.step_of  # either format's name: runner/rundir/checkpoints.py


def _checkpoint(prefix: str) -> bool:
    """A whole checkpoint is at `prefix`: TensorFlow's (`<prefix>.index`) or Orbax's (a `ckpt_<step>/` folder)."""
    return tf.io.gfile.exists(prefix + ".index") or (checkpoints.step_of(prefix, "orbax") is not None
                                                     and tf.io.gfile.isdir(prefix))


def _format() -> str:
    return engine.active().checkpoint_format


def _newest(run: RunFolder) -> str | None:
    """The newest whole checkpoint of the format this engine restores, read as `runner status` reads it."""
    saved = checkpoints.newest(run.path, store=_format())
    return None if saved is None else saved.path


def _finished(run: RunFolder) -> Recorded | None:
    summary = Recorded.of(run.read_json("summary.json"))
    return summary if summary and summary.succeeded else None


def chosen_weights(run: RunFolder, job: str, asked: str | None = None) -> Weights:
    """The weights evaluate and predict restore (the module docstring's rules); SpecError (exit 2) naming what
    to run or pass when there are none."""
    if asked:
        return _asked(run, asked)
    summary = _finished(run)
    if summary is not None:
        step = summary.final_step
        if tf.io.gfile.exists(run.file("model.keras")):
            return Weights(run.file("model.keras"), step, True)
        prefix = posixpath.join(run.checkpoints, checkpoints.name_of(step, "tensorflow"))
        for candidate in (prefix, posixpath.join(run.checkpoints, checkpoints.name_of(step, "orbax"))):
            if _checkpoint(candidate):
                return Weights(candidate, step, False)
        raise SpecError(
            f"{run.file('summary.json')} reports job {job!r} finished at step {step}, but neither "
            f"{run.file('model.keras')} nor {prefix} is there: pass --checkpoint with one that is "
            f"(in {run.checkpoints}), or train again with `runner run --fresh`"
        )
    latest = _newest(run)
    if latest is None:
        run.check_backend()  # checkpoints of the other backend are invisible to this one: named, not "none"
        raise SpecError(f"{run.checkpoints} holds no checkpoint of job {job!r}: run `runner run` first")
    return Weights(latest, step_of(latest), False)


def _asked(run: RunFolder, asked: str) -> Weights:
    """--checkpoint: a .keras file, a checkpoint prefix, or a prefix's name inside the run's checkpoints/."""
    if asked.endswith(".keras"):
        if not tf.io.gfile.exists(asked):
            raise SpecError(f"--checkpoint {asked}: no such file")
        return Weights(asked, None, True)
    for prefix in (asked.rstrip("/"), posixpath.join(run.checkpoints, asked.rstrip("/"))):
        if _checkpoint(prefix):
            return Weights(prefix, step_of(prefix), False)
    names = sorted(posixpath.basename(p)[: -len(".index")] for p in tf.io.gfile.glob(f"{run.checkpoints}/*.index"))
    names += sorted(posixpath.basename(p.rstrip("/")) for p in tf.io.gfile.glob(f"{run.checkpoints}/ckpt_*")
                    if checkpoints.step_of(p, "orbax") is not None)
    raise SpecError(
        f"--checkpoint {asked}: no checkpoint there (no {asked}.index); {run.checkpoints} holds "
        f"{', '.join(names) or 'none'}: name one of them, or a .keras file"
    )


def abandoned_note(run: RunFolder) -> str | None:
    """A checkpoint newer than the step a succeeded summary.json reports, named with the attempt that left it
    and what each command does with it; None when there is none."""
    summary = _finished(run)
    step = summary.final_step if summary else None
    saved = None if step is None else checkpoints.newest(run.path, store=_format())
    if saved is None or saved.step <= step:
        return None
    latest, newer = saved.path, saved.step
    left = None
    for path in sorted(tf.io.gfile.glob(run.file("attempts/*.json")), reverse=True):
        attempt = Recorded.of(run.read_json(f"attempts/{posixpath.basename(path)}"))
        if attempt and not attempt.succeeded:
            left = attempt
            break
    by = "an attempt that did not finish"
    if left is not None:
        by = (f"attempt {left.attempt or '?'} (train.epochs {left.train_epochs or '?'}, "
              f"ended {left.status or '?'})")
    epochs = left.train_epochs if left else None
    again = f"; `runner run --set train.epochs={epochs}` continues it" if epochs else ""
    return (
        f"{latest} (step {newer}) is newer than the step {step} {run.file('summary.json')} reports: {by} left it. "
        f"evaluate and predict use {posixpath.basename(_reported(run, step))}, the weights the summary reports; "
        f"`--checkpoint {posixpath.basename(latest)}` uses the newer one{again}"
    )


def _reported(run: RunFolder, step: int) -> str:
    return run.file("model.keras") if tf.io.gfile.exists(run.file("model.keras")) else f"ckpt-{step}"
