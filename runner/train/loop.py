"""One attempt's training: `fit` from the plan's start step with the runner's callbacks, the checkpoint saves
waited for, and an Outcome returned that says how far it got and how it stopped.

Callback order (runner/train/fit.py): a non-finite loss stops first; the recorder times the epoch; the
checkpointer saves it (and acts on a notice); then the limits, the plateau callbacks, the profiler and the
progress display. Nothing here knows the run folder: the checkpoint manager and the profile folder are handed in.
"""

from __future__ import annotations

import dataclasses
import time

import keras
import tensorflow as tf

from runner import Diverged
from runner.data import faults
from runner.rundir.timing import Phases
from runner.spec.train import CheckpointSpec, TrainSpec
from runner.train import build, fit, limits, observe, progress
from runner.train.preemption import PreemptionNotice
from runner.train.saver import Saver


@dataclasses.dataclass
class Outcome:
    """How an attempt's training ended. `stopped`: None when it ran its plan (or early stopping ended it);
    "preempted" or "interrupted" after a notice, "time_limit" at train.max_duration; each after a save.
    `error`: Diverged, the input or storage fault, or any other error (a user callback's) that ended it; the saves
    were still waited for, and `final_step` and `checkpoint_saves` say what was kept."""

    final_step: int | None = None
    stopped: str | None = None
    saved_after_notice_s: float | None = None
    checkpoint_saves: dict | None = None
    profile: dict | None = None
    stopped_early_after_epoch: int | None = None
    final_learning_rate: float | None = None
    error: Exception | None = None


@dataclasses.dataclass
class Feed:
    """What training reads: the training batches, the validation (dataset, steps) if any and every how many
    epochs it runs (Keras fit's validation_freq), the training pattern (named when a read fails) and the class
    weights (Keras fit's class_weight)."""

    dataset: tf.data.Dataset
    validation: tuple[tf.data.Dataset, int] | None
    pattern: str
    class_weight: dict[int, float] | None = None
    validation_every: int = 1


def train(
    model: keras.Model, saver: Saver, feed: Feed, plan: fit.Plan, recorder: fit.Recorder, notice: PreemptionNotice,
    phases: Phases, *, settings: TrainSpec, saving: CheckpointSpec, global_batch: int,
    profiler: observe.ProfileWindow | None = None, verbose: int = 0, progress_every: float | None = None,
    callbacks: list[keras.callbacks.Callback] = (), stall: limits.StallGuard | None = None,
) -> Outcome:
    """Trains the plan; never raises for what ends training (see Outcome), so its bookkeeping always arrives.
    `callbacks`: the user's own (train.callbacks), run after every callback of the runner's. `stall`: the job's
    stall guard (train.stall_timeout), started and stopped by the job, which it watches beyond training."""

    def save(step: int) -> None:
        with phases.phase("checkpoint"):
            saver.save(step)

    outcome = Outcome()
    recorder.plan = plan
    plateau = fit.plateau_callbacks(
        settings.early_stopping_patience, settings.reduce_lr_patience, settings.reduce_lr_factor
    )
    checkpointer = fit.Checkpointer(save, saving.every_steps, notice)
    limit = limits.TimeLimit(settings.max_duration, notice) if settings.max_duration else None
    shown = progress.for_training(
        steps_per_epoch=plan.steps_per_epoch, epochs=plan.epochs, start_step=plan.start_step,
        global_batch=global_batch, every_s=progress_every,
    )
    guards = [watcher for watcher in (limit, stall) if watcher is not None]
    watchers = [*guards, *plateau, *([profiler] if profiler else []), shown, *callbacks]
    began, saved_before = time.monotonic(), phases.seconds.get("checkpoint", 0.0)
    with notice:
        try:
            fit.fit(
                model, feed.dataset, plan, recorder, checkpointer, watchers, verbose=verbose,
                validation=feed.validation, class_weight=feed.class_weight, validation_every=feed.validation_every,
            )
            with phases.phase("checkpoint"):
                saver.wait()  # the last checkpoint written (within the grace after a notice) before summary and export
            if checkpointer.saved_after_notice_s is not None:
                checkpointer.saved_after_notice_s = notice.seconds_since()
        except tf.errors.OpError as exc:
            outcome.error = faults.input_error(exc, feed.pattern, "data.train") or exc
        except Diverged as exc:
            with phases.phase("checkpoint"):
                saver.wait_after_error()  # the newest complete checkpoint is then the one named
            outcome.error = exc
        except Exception as exc:  # a user callback or the model's own code: what was saved before it still counts
            outcome.error = exc
        finally:
            if saver.pending:  # training stopped by an error: the write in flight still completes (or is logged)
                with phases.phase("checkpoint"):
                    saver.wait_after_error()
            outcome.checkpoint_saves = saver.to_dict()
            shown.close()
            if profiler:
                profiler.close()
                outcome.profile = profiler.to_dict()
            saved = phases.seconds.get("checkpoint", 0.0) - saved_before
            phases.add("train", time.monotonic() - began - saved - recorder.validation_s)
            phases.add("eval", recorder.validation_s)
    outcome.final_step = int(model.optimizer.iterations.numpy())
    if outcome.error is not None:
        return outcome
    outcome.saved_after_notice_s = checkpointer.saved_after_notice_s
    if notice.interrupted:
        outcome.stopped = "interrupted"
    elif limit is not None and limit.reached:
        outcome.stopped = "time_limit"
    elif checkpointer.preempted or notice.received.is_set():
        outcome.stopped = "preempted"
    stopped = [c.stopped_epoch + 1 for c in plateau if getattr(c, "stopped_epoch", 0)]
    outcome.stopped_early_after_epoch = stopped[0] if stopped else None
    if settings.reduce_lr_patience is not None:
        outcome.final_learning_rate = build.to_float(model.optimizer.learning_rate)
    return outcome
