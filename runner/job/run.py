"""run_job(spec): the one top-to-bottom story of a job, from a validated spec to a summary.

open the attempt (run folder) -> device -> inputs -> model (restored) -> fit -> evaluate -> export,
and the summary written whatever happened (runner/rundir/attempt.py). Each step is a function below.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import time

import tensorflow as tf

from runner import Diverged, Interrupted, Preempted, RunnerError
from runner.data import in_memory, integrity, pipeline
from runner.device import host, precision
from runner.device.strategy import Accelerator, per_replica_batch, resolve_accelerator
from runner.rundir.attempt import Attempt, JobResult, error_of
from runner.rundir.timing import EpochRecord
from runner.spec import usercode
from runner.spec.types import JobSpec
from runner.train import build, fit, observe, progress
from runner.train.preemption import EarlyNotice, PreemptionNotice
from runner.train.saver import Saver

log = logging.getLogger(__name__)
keras = tf.keras

__all__ = ["JobResult", "run_job"]


def run_job(
    spec: JobSpec, *, spec_loaded_at: float | None = None, verbose: int = 0, early_notice: EarlyNotice | None = None,
    progress_every: float | None = progress.DEFAULT_EVERY_S,
) -> JobResult:
    """Trains (or resumes) the job; always returns a summary, with the error that ended the job if any.

    `progress_every`: seconds between progress lines when stderr is not a terminal (runner/train/progress.py).
    `early_notice`: a SIGTERM or SIGINT that arrived while TensorFlow was importing (runner/train/preemption.py): the
    job then stops as preempted or interrupted before training, having saved nothing.
    """
    if spec.kind == "matmul_bench":
        from runner.job import matmul

        return matmul.run_bench(spec, spec_loaded_at=spec_loaded_at)
    attempt = Attempt.begin(spec, spec_loaded_at)
    try:
        with attempt.phases.phase("data_init"):  # before the run folder is touched: bad data leaves it as it was
            attempt.extra["data_verify"] = integrity.check_job_data(spec)
        done = _open(attempt)
    except RunnerError as exc:  # nothing was written: the data or the run folder is refused or unreachable
        return JobResult(attempt.summary("failed", exc, global_batch=spec.data.global_batch_size), exc)
    if done is not None:
        log.info("job %r is already complete (%s/summary.json); nothing to do", spec.name, attempt.run.path)
        return JobResult(done, already_complete=True)

    job = _Job(spec, attempt)
    notice = PreemptionNotice(spec.checkpoint.grace_s)
    status, error = "failed", None
    try:
        notice.install()  # a SIGTERM or SIGINT from here on is a notice: see runner/train/preemption.py
        if early_notice is not None:
            early_notice.pass_to(notice)
        _stop_if_noticed(notice, "while the job was starting")
        job.start()  # the device, the precision, the seed and the input pipelines
        model, checkpoint, plan = _build_and_restore(spec, attempt, job.inputs, job.precision)
        _stop_if_noticed(notice, "before training began")
        _train(spec, attempt, model, checkpoint, job.inputs, plan, job.recorder, notice, verbose, progress_every)
        job.metrics = _evaluate(spec, attempt, model, job.inputs, verbose)
        _export(spec, attempt, model, job.inputs)
        status = "succeeded"
    except Preempted as exc:
        status, error = "preempted", exc
    except Interrupted as exc:
        status, error = "interrupted", exc
    except Exception as exc:  # the summary must still be written; the CLI prints the traceback in --debug
        error = error_of(exc, spec)
    finally:  # whatever stopped the job, its summary is written and the signal handlers put back
        summary = job.finish(status, error)
        notice.remove()
    return JobResult(summary, error)


class _Job:
    """What one attempt builds as it goes (device, precision, inputs, metrics), and the summary of whatever it
    got to."""

    def __init__(self, spec: JobSpec, attempt: Attempt):
        self.spec, self.attempt = spec, attempt
        self.inputs: Inputs | None = None
        self.precision: precision.Precision | None = None
        self.metrics: dict = {}
        chief = attempt.worker_index == 0
        self.scalars = observe.ScalarLog(attempt.run.file("tensorboard")) if spec.output.tensorboard and chief else None
        self._epoch_line = observe.epoch_line(spec.train.epochs)
        self.recorder = fit.Recorder(
            spec.data.global_batch_size, self._epoch_done,
            checkpoint_clock=lambda: attempt.phases.seconds.get("checkpoint", 0.0),
            input_clock=lambda: self.inputs.clock.seconds() if self.inputs and self.inputs.clock else None,
        )

    def _epoch_done(self, record: EpochRecord) -> None:
        self._epoch_line(record)
        if self.scalars:
            self.scalars.epoch(record)

    def start(self) -> None:
        spec, attempt = self.spec, self.attempt
        with attempt.phases.phase("strategy"):
            attempt.accelerator = resolve_accelerator(spec.accelerator)
        per_replica_batch(spec.data.global_batch_size, attempt.accelerator)
        self.precision = precision.choose(spec.train.mixed_precision, spec.model.name, attempt.accelerator.kind)
        self.precision.apply()
        keras.utils.set_random_seed(spec.train.seed)
        with attempt.phases.phase("data_init"):
            self.inputs = _inputs(spec, attempt.accelerator, attempt.extra)

    def finish(self, status: str, error: RunnerError | None) -> dict:
        """The summary, written to the run folder by the chief (runner/rundir/attempt.py) and returned."""
        summary = self.attempt.summary(
            status, error, epochs=self.recorder.epochs, metrics=self.metrics, global_batch=self.spec.data.global_batch_size,
            input_wait_method=self.inputs.input_method if self.inputs else "not measured: the job stopped before its input pipeline was built",
        )
        if self.precision is not None and summary.get("accelerator") is not None:
            summary["accelerator"]["precision"] = self.precision.to_dict()  # what the job computed in, and why
            summary["accelerator"]["onednn"] = precision.onednn_enabled()
        if self.scalars:
            if self.metrics and self.recorder.epochs:
                self.scalars.evaluation(self.metrics, self.recorder.epochs[-1].epoch)
            self.scalars.close()
            summary["tensorboard"] = self.scalars.folder
        self.attempt.finish(summary)
        return summary


def _open(attempt: Attempt) -> dict | None:
    """Opens the run folder (its lease taken by the chief) and gives the attempt its number; returns the
    summary of a job that is already complete (nothing to do), else None. Resume rules: runner/rundir/outputs.py."""
    spec, run = attempt.spec, attempt.run
    entered = time.monotonic()
    attempt.worker_index = host.cluster_from_env(os.environ)[1]
    done = run.open(spec, attempt.worker_index)
    if done is not None:
        return done
    attempt.number = run.attempt
    attempt.extra.update(attempt=attempt.number, run_dir=run.path, train_epochs=spec.train.epochs)
    attempt.phases.add("run_folder", time.monotonic() - entered)
    return None


@dataclasses.dataclass
class Evaluation:
    """Weighted batches holding every record of a split once, the last batch padded (runner/data/pipeline.py)."""

    dataset: tf.data.Dataset
    steps: int
    records: int


@dataclasses.dataclass
class Inputs:
    """The job's input pipelines, built once: training batches, and the evaluation and per-epoch validation
    batches when the spec asks for them."""

    train: pipeline.Shards
    train_ds: tf.data.Dataset
    steps_per_epoch: int
    eval: Evaluation | None
    validation: Evaluation | None
    preprocess: object
    clock: observe.InputClock | None
    input_method: str


def _inputs(spec: JobSpec, accelerator: Accelerator, extra: dict) -> Inputs:
    """The pipelines; `extra` (the summary's) gets train_input as soon as it is chosen, so a load that fails
    is reported with it."""
    batch, workers, d = spec.data.global_batch_size, accelerator.workers, spec.data
    preprocess = usercode.load_callable(d.preprocess, "data.preprocess", ("features",), spec.code_roots) if d.preprocess else None

    def evaluation(pattern: str, key: str) -> Evaluation:
        shards = pipeline.find_shards(pattern)
        pipeline.check_declared(d.features, shards)
        steps = pipeline.eval_steps(shards, batch, key)
        dataset = pipeline.make_dataset(
            shards, batch, d.inputs, d.label, training=False, preprocess=preprocess, workers=workers,
            autotune=d.autotune, weighted=True,
        )
        return Evaluation(dataset, steps, shards.records)

    train_shards = pipeline.find_shards(d.train)
    pipeline.check_declared(d.features, train_shards)
    steps_per_epoch = spec.train.steps_per_epoch or pipeline.steps_in(train_shards, batch, "data.train")
    held = in_memory.choose(d.in_memory, train_shards, (*d.inputs, d.label), accelerator.kind, workers, host.memory_bytes(),
                            batch)
    extra["train_input"] = held.to_dict()
    if held.held:
        log.info("loading data.train into memory: %d records (%s)", train_shards.records, held.why)
        loaded = in_memory.load(train_shards, (*d.inputs, d.label), "data.train")
        held = dataclasses.replace(held, load_s=round(loaded.seconds, 3))
        extra["train_input"] = held.to_dict()
        log.info("data.train held in memory: %d records loaded in %.1f s", loaded.records, loaded.seconds)
        train_ds = in_memory.make_dataset(
            loaded, train_shards.features, batch, d.inputs, d.label, shuffle=d.shuffle_buffer > 1,
            seed=spec.train.seed, preprocess=preprocess,
        )
    else:
        train_ds = pipeline.make_dataset(
            train_shards, batch, d.inputs, d.label, training=True, shuffle_buffer=d.shuffle_buffer,
            seed=spec.train.seed, preprocess=preprocess, workers=workers, autotune=d.autotune,
        )
    clock, input_method = observe.input_clock_for(accelerator)
    if clock is not None:
        train_ds = clock.wrap(train_ds)
    eval_ = evaluation(d.eval, "data.eval") if d.eval else None
    validation = None
    if spec.train.validate_every_epoch:  # data.validation, else the eval shards (spec.py checks one is set)
        validation = evaluation(d.validation, "data.validation") if d.validation else eval_
    return Inputs(train_shards, train_ds, steps_per_epoch, eval_, validation, preprocess, clock, input_method)


def _build_and_restore(
    spec: JobSpec, attempt: Attempt, inputs: Inputs, chosen: precision.Precision
) -> tuple[keras.Model, tf.train.Checkpoint, fit.Plan]:
    """The model built under the strategy, restored from the newest complete checkpoint if there is one."""
    accelerator = attempt.accelerator
    attempt.run.check_checkpoints(spec, inputs.train, inputs.steps_per_epoch)  # what they mean must not change
    plan = fit.Plan(inputs.steps_per_epoch, spec.train.epochs)
    attempt.extra["steps_per_epoch"] = inputs.steps_per_epoch
    attempt.extra["steps_per_execution"] = build.steps_per_execution(spec, accelerator.kind)
    with attempt.phases.phase("build"):
        model, checkpoint = build.build_compiled(spec, inputs.train.features, accelerator, chosen)
    with attempt.phases.phase("restore"):
        latest = attempt.run.latest_checkpoint()
        if latest:
            plan.start_step = build.restore(checkpoint, latest)
            log.info("resuming %r from %s (step %d of %d)", spec.name, latest, plan.start_step, plan.total_steps)
    attempt.extra["resumed_from_step"] = plan.start_step
    return model, checkpoint, plan


def _train(
    spec: JobSpec, attempt: Attempt, model: keras.Model, checkpoint: tf.train.Checkpoint, inputs: Inputs,
    plan: fit.Plan, recorder: fit.Recorder, notice: PreemptionNotice, verbose: int, progress_every: float | None,
) -> None:
    """fit from the plan's start step, saving every checkpoint interval; raises Preempted after a notice."""
    phases, extra = attempt.phases, attempt.extra
    manager = attempt.run.checkpoint_manager(checkpoint, spec.checkpoint.keep, attempt.accelerator.worker_index)
    # In the background on one worker (runner/train/saver.py): training waits only for the copy of the weights.
    saver = Saver(manager, checkpoint, asynchronous=attempt.accelerator.workers == 1)

    def save(step: int) -> None:
        with phases.phase("checkpoint"):
            saver.save(step)

    profiler = observe.ProfileWindow(attempt.run.file("profile"), spec.profile.start_step, spec.profile.steps) if spec.profile else None
    plateau = fit.plateau_callbacks(spec.train.early_stopping_patience, spec.train.reduce_lr_patience, spec.train.reduce_lr_factor)
    checkpointer = fit.Checkpointer(save, spec.checkpoint.every_steps, notice)
    shown = progress.for_training(
        steps_per_epoch=plan.steps_per_epoch, epochs=plan.epochs, start_step=plan.start_step,
        global_batch=spec.data.global_batch_size, every_s=progress_every,
    )
    began, saved_before = time.monotonic(), phases.seconds.get("checkpoint", 0.0)
    with notice:
        try:
            watchers = [*plateau, *([profiler] if profiler else []), shown]
            validation = (inputs.validation.dataset, inputs.validation.steps) if inputs.validation else None
            fit.fit(model, inputs.train_ds, plan, recorder, checkpointer, watchers, verbose=verbose, validation=validation)
            with phases.phase("checkpoint"):
                saver.wait()  # the last checkpoint written (within the grace after a notice) before summary and export
            if checkpointer.saved_after_notice_s is not None:
                checkpointer.saved_after_notice_s = notice.seconds_since()
        except tf.errors.OpError as exc:
            raise pipeline.input_error(exc, spec.data.train, "data.train") or exc from None
        except Diverged as exc:
            with phases.phase("checkpoint"):
                saver.wait_after_error()  # the newest complete checkpoint is then the one named
            raise _diverged(exc, spec, attempt) from None
        finally:
            if saver.pending:  # training stopped by an error: the write in flight still completes (or is logged)
                with phases.phase("checkpoint"):
                    saver.wait_after_error()
            extra["checkpoint_saves"] = saver.to_dict()
            shown.close()
            if profiler:
                profiler.close()
                extra["profile"] = profiler.to_dict()
            saved = phases.seconds.get("checkpoint", 0.0) - saved_before
            phases.add("train", time.monotonic() - began - saved - recorder.validation_s)
            phases.add("eval", recorder.validation_s)
    step = int(model.optimizer.iterations.numpy())
    if notice.interrupted:
        extra["interruption"] = {"grace_s": spec.checkpoint.grace_s, "saved_after_notice_s": checkpointer.saved_after_notice_s}
        raise Interrupted(f"interrupted: saved step {step}; run the same job again to continue")
    if checkpointer.preempted or notice.received.is_set():
        extra["preemption"] = {"grace_s": spec.checkpoint.grace_s, "saved_after_notice_s": checkpointer.saved_after_notice_s}
        raise Preempted(f"preemption notice received: saved step {step} to {attempt.run.checkpoints}; run the same job again to continue")
    extra["final_step"] = step
    stopped = [c.stopped_epoch + 1 for c in plateau if getattr(c, "stopped_epoch", 0)]
    if stopped:
        extra["stopped_early_after_epoch"] = stopped[0]
    if spec.train.reduce_lr_patience is not None:
        extra["final_learning_rate"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


def _evaluate(spec: JobSpec, attempt: Attempt, model: keras.Model, inputs: Inputs, verbose: int) -> dict:
    """Metrics on every record of data.eval after training ({} when the spec names no eval shards)."""
    if inputs.eval is None:
        return {}
    with attempt.phases.phase("eval"):
        try:
            results = model.evaluate(inputs.eval.dataset, steps=inputs.eval.steps, return_dict=True, verbose=verbose)
        except tf.errors.OpError as exc:
            raise pipeline.input_error(exc, spec.data.eval, "data.eval") or exc from None
    metrics = {k: float(v) for k, v in results.items()}
    metrics["examples"] = inputs.eval.records
    log.info("eval: %s", ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
    return metrics


def _export(spec: JobSpec, attempt: Attempt, model: keras.Model, inputs: Inputs) -> None:
    """The trained model for serving, with example inputs (runner/rundir/serving.py); written by the chief."""
    with attempt.phases.phase("export"):
        serve_examples = pipeline.example_inputs(inputs.train.features, spec.data.inputs, inputs.preprocess)
        attempt.extra["model"] = attempt.run.save_model(model, attempt.accelerator.worker_index, serve_examples)


def _diverged(exc: Diverged, spec: JobSpec, attempt: Attempt) -> Diverged:
    """The divergence with what it left behind and what to change."""
    latest = attempt.run.latest_checkpoint()
    look = "Lower train.learning_rate, or look for NaN or inf in the data, data.preprocess or train.loss"
    if latest is None:
        kept, again = "no checkpoint of it was saved", f"{look}, and run the job again"
    else:
        kept = f"none of it was saved: the newest checkpoint, {posixpath.basename(latest)}, holds the last finite weights"
        # The learning rate is part of what the checkpoints mean (runner/rundir/outputs.py): a new one starts anew.
        again = f"{look}; a lower learning rate starts over under a new job name (`--set name={spec.name}-2`)"
    return Diverged(f"{exc} (train.learning_rate {spec.train.learning_rate:g}); {kept}, and no model was exported. {again}")


def _stop_if_noticed(notice: PreemptionNotice, when: str) -> None:
    if notice.interrupted:
        raise Interrupted(f"interrupted {when}: nothing new was trained or saved; run the same job again")
    if notice.received.is_set():
        raise Preempted(f"preemption notice received {when}: nothing new was trained or saved; run the same job again")
