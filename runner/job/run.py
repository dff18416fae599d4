"""run_job(spec): the one top-to-bottom story of a job, from a validated spec to a summary.

check the data -> open the run folder -> device and precision -> inputs -> model (restored) -> train ->
evaluate -> judge -> export, and the summary written whatever happened (runner/rundir/attempt.py). The matmul
benchmark is a job of another kind: run_job hands it to runner/job/matmul.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import time
from typing import Any

import keras
import tensorflow as tf

from runner import DataError, Diverged, Interrupted, LearnedNothing, Preempted, RunnerError, SpecError, TimeLimitReached
from runner.data import faults, integrity, pipeline
from runner.device import engine, host, peak, precision, processes
from runner.device.strategy import per_replica_batch, resolve_accelerator
from runner.job import fingerprint
from runner.job.inputs import Inputs, make_inputs
from runner.rundir import joining, stalled
from runner.rundir.attempt import Attempt, JobResult, error_of
from runner.rundir.summary import Epoch, Summary
from runner.rundir.timing import EpochRecord
from runner.spec.types import JobSpec
from runner.train import build, fit, flops, hub, limits, loop, observe, progress, store, verdict
from runner.train.preemption import EarlyNotice, PreemptionNotice
from runner.train.saver import Saver

log = logging.getLogger(__name__)

__all__ = ["JobResult", "run_job"]


def run_job(
    spec: JobSpec, *, spec_loaded_at: float | None = None, verbose: int = 0, early_notice: EarlyNotice | None = None,
    progress_every: float | None = progress.DEFAULT_EVERY_S,
) -> JobResult:
    """Trains (or resumes) the job; always returns a summary, with the error that ended the job if any.

    `progress_every`: seconds between progress lines when stderr is not a terminal (runner/train/progress.py).
    `early_notice`: a SIGTERM or SIGINT that arrived while TensorFlow was importing (runner/train/preemption.py):
    the job then stops as preempted or interrupted before training, having saved nothing.
    """
    if spec.kind == "matmul_bench":
        from runner.job import matmul

        return matmul.run_bench(spec, spec_loaded_at=spec_loaded_at, early_notice=early_notice)
    attempt = Attempt.begin(spec, spec_loaded_at)
    # From here to the summary, a job that makes no progress for train.stall_timeout ends with exit 124: a hang
    # before training (the data, the TPU start, a restore) or after it bills as much as one inside it.
    stall = limits.StallGuard(spec.train.stall_timeout, lambda said: attempt.worker_index == 0 and stalled.mark(
        attempt.run.path, said, attempt.number)) if spec.train.stall_timeout else None
    if stall:
        attempt.phases.watch = stall.beat
        stall.start()
    try:
        return _run(spec, attempt, stall, verbose, early_notice, progress_every)
    finally:
        if stall:
            stall.stop()


def _run(spec: JobSpec, attempt: Attempt, stall: limits.StallGuard | None, verbose: int,
         early_notice: EarlyNotice | None, progress_every: float | None) -> JobResult:
    try:
        with attempt.phases.phase("data_init"):  # before the run folder is touched: bad data leaves it as it was
            data = integrity.check_job_data(spec)
        attempt.facts.data_verify = data.record
        _join(attempt)  # several processes: they form one job before the run folder is opened
        done = _open(attempt)
    except RunnerError as exc:  # nothing was written: the data or the run folder is refused or unreachable
        return JobResult(attempt.summary("failed", exc, global_batch=spec.data.global_batch_size), exc)
    if done is not None:
        train = data.shards["data.train"]
        changed = store.changed_since_complete(spec, attempt.run, train.features, train.manifest, done)
        if changed is not None:  # not "already complete": the model it would answer with is no longer this one
            return JobResult(attempt.summary("failed", changed, global_batch=spec.data.global_batch_size), changed)
        log.info("job %r is already complete (%s/summary.json); nothing to do", spec.name, attempt.run.path)
        return JobResult(done, already_complete=True)

    job = _Job(spec, attempt)
    notice = PreemptionNotice(spec.checkpoint.grace_s, shared=processes.joined().several)
    status, error, training = "failed", None, False
    try:
        notice.install()  # a SIGTERM or SIGINT from here on is a notice: see runner/train/preemption.py
        if early_notice is not None:
            early_notice.pass_to(notice)
        _stop_if_noticed(notice, "while the job was starting")
        job.start(data.shards)  # the device, the precision, the seed and the input pipelines
        model, saver, plan = _build_and_restore(spec, attempt, job.inputs, job.precision)
        if attempt.accelerator.layout is not None:  # what each device holds, measured from the arrays' shards
            attempt.facts.sharding = attempt.accelerator.layout.report(model)
        # Every model's labels, the user's own included, against its output width and loss: before any step.
        integrity.check_labels_fit(spec, data.shards, build.label_expectation(model, model.loss, spec.model.name))
        job.inputs.encode_labels(build.label_classes(spec.train, job.inputs.train.features.get(spec.data.label), model))
        if attempt.accelerator.kind != "tpu":  # one eager batch on the host; a TPU model is checked when compiled
            build.check_first_batch(model, model.loss, job.inputs.train_ds)
        _stop_if_noticed(notice, "before training began")
        training = True
        _train(spec, attempt, model, saver, job.inputs, plan, job.recorder, notice, verbose, progress_every, stall)
        job.metrics = _evaluate(spec, attempt, model, job.inputs, verbose, stall)
        warnings = verdict.warnings_of(job.epochs(), job.metrics, verdict.classes_of_output(model.output_shape))
        _export(spec, attempt, model, job.inputs)
        status = _judge(spec, attempt, warnings)
    except Preempted as exc:
        status, error = "preempted", exc
    except Interrupted as exc:
        status, error = "interrupted", exc
    except TimeLimitReached as exc:
        status, error = "time_limit", exc
    except LearnedNothing as exc:
        status, error = "learned_nothing", exc
    except Exception as exc:  # the summary must still be written; the CLI prints the traceback in --debug
        error = processes.lost_peer(exc) or error_of(exc, spec)
        if isinstance(error, (SpecError, DataError)) and not training:
            attempt.run.refuse_start()  # refused at start: nothing written, a folder it made removed
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
        self._earlier: list[dict] | None = None
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

    def start(self, shards: dict[str, pipeline.Shards]) -> None:
        spec, attempt = self.spec, self.attempt
        with attempt.phases.phase("strategy"):
            attempt.accelerator = resolve_accelerator(spec.accelerator, model=spec.model)
        attempt.facts.compile_cache = attempt.accelerator.engine.use_compile_cache(attempt.run.file("jax_cache"))
        per_replica_batch(spec.data.global_batch_size, attempt.accelerator)
        self.precision = precision.choose(spec.train.mixed_precision, spec.model.name, attempt.accelerator.kind)
        self.precision.apply()  # logged once final: the model may still change it (build.build_compiled)
        keras.utils.set_random_seed(spec.train.seed)
        with attempt.phases.phase("data_init"):
            self.inputs = make_inputs(spec, shards, attempt.accelerator, attempt.facts)

    def _earlier_epochs(self) -> list[dict]:
        if self._earlier is None:
            try:
                self._earlier = [Epoch.model_validate(r).model_dump(exclude_unset=True)  # declared records only
                                 for r in self.attempt.run.epochs_before(self.attempt.number)]
            except (tf.errors.OpError, ValueError) as exc:  # the summary still comes, with this attempt's epochs
                log.warning("could not read the earlier attempts' epochs from %s: %s", self.attempt.run.path, exc)
                self._earlier = []
        return self._earlier

    def _peak(self) -> tuple[float | None, str] | None:
        """The device's peak TFLOP/s in the job's precision, for MFU; None when nothing trained. A CPU's is
        measured once per host and dtype (its own timed phase), then read from its cache."""
        accelerator = self.attempt.accelerator
        if not self.recorder.epochs or accelerator is None or self.attempt.model_flops is None:
            return None
        detail = peak.device_detail(accelerator.kind, accelerator.tpu)
        cpu_devices = accelerator.replicas if accelerator.kind == "cpu" else 1
        with self.attempt.phases.phase("peak"):
            return peak.peak_tflops(accelerator.kind, detail, self.precision.policy, cpu_devices=cpu_devices)

    def epochs(self) -> list[EpochRecord]:
        """The job's epochs so far: every earlier attempt's, then this one's."""
        known = {f.name for f in dataclasses.fields(EpochRecord)}
        earlier = [EpochRecord(**{k: v for k, v in r.items() if k in known}) for r in self._earlier_epochs()]
        return earlier + self.recorder.epochs

    def _newest_checkpoint(self) -> str | None:
        try:
            return self.attempt.run.latest_checkpoint()
        except (tf.errors.OpError, OSError, ValueError) as exc:  # the summary still comes, without it
            log.warning("could not find the newest checkpoint in %s: %s", self.attempt.run.checkpoints, exc)
            return None

    def finish(self, status: str, error: RunnerError | None) -> dict:
        """The summary, written to the run folder by the chief (runner/rundir/attempt.py) and returned."""
        facts = self.attempt.facts
        if self.scalars:
            if self.metrics and self.recorder.epochs:
                self.scalars.evaluation(self.metrics, self.recorder.epochs[-1].epoch)
            self.scalars.close()
            facts.tensorboard = self.scalars.folder
        not_built = "not measured: the job stopped before its input pipeline was built"
        peak = self._peak()
        summary = self.attempt.summary(
            status, error, epochs=self.recorder.epochs, metrics=self.metrics,
            global_batch=self.spec.data.global_batch_size,
            input_wait_method=self.inputs.input_method if self.inputs else not_built,
        )
        # The summary's epochs span the job: every earlier attempt's, then this one's (timing: this one's only).
        mine = [{**record.model_dump(), "attempt": self.attempt.number} for record in summary.epochs]
        summary.epochs = self._earlier_epochs() + mine
        if self.precision is not None and summary.accelerator is not None:
            summary.accelerator.precision = self.precision.to_dict()  # what the job computed in, and why
            summary.accelerator.onednn = precision.onednn_enabled()
        if peak is not None:
            (flops_per_example, method), (value, source) = self.attempt.model_flops, peak
            per_s = summary.timing.examples_per_sec
            block = flops.throughput_block(flops_per_example, method, per_s, self.attempt.accelerator.replicas,
                                           value, source)
            if self.spec.model.hub and self.inputs:  # a language model's tokens/s and FLOPs per token
                hub.add_token_throughput({"throughput": block, "timing": {"examples_per_sec": per_s}},
                                         self.inputs.train.features)
            summary.throughput = block
        if status != "succeeded" and self.attempt.number:  # what the same command would continue from
            summary.newest_checkpoint = self._newest_checkpoint()
        several = processes.joined().several
        if several:
            _per_process(summary, status, self.attempt.number)
        summary = self.attempt.finish(summary)  # as written: checked against runner/rundir/summary.py
        if several:  # every process ends once process 0 has written (JAX's exit barrier waits only minutes)
            processes.finished(f"finished/{self.attempt.number}", 60.0 if status == "failed" else 3600.0)
        return summary


def _join(attempt: Attempt) -> None:
    """Under JAX, the job's processes joined (runner/device/processes.py); one process has nothing to join."""
    spec = attempt.spec.accelerator
    if not engine.active().joins_processes:
        return
    on_tpu = spec.kind in ("auto", "tpu") and host.tpu_target(spec.tpu) is not None
    asked = processes.asked(os.environ, on_tpu)
    if not asked.several:
        return
    bound = processes.join_bound(asked, spec.join_timeout_s)
    roll = joining.Roll(attempt.run.path, asked.index, bound, attempt.spec.storage.timeout_s)
    with attempt.phases.phase("strategy"):
        joined = processes.join(asked, bound, spec.heartbeat_s, roll, waiting=attempt.phases.watch)
        attempt.worker_index, attempt.facts.processes = joined.index, joined.to_dict()
        # One job: a process given another spec, code or image ends every process (exit 2) before any step.
        processes.agree("job", fingerprint.of_job(attempt.spec), bound)


# What each process of a job of several reports of itself in process 0's summary.
_PER_PROCESS = ("examples_per_sec", "step_time_ms", "input_wait_s", "input_wait_fraction", "total_s")


def _per_process(summary: Summary, status: str, number: int) -> None:
    """Process 0's summary gets every process's own figures, and names the one that waited longest for input
    (all step together, so the others waited on it). A job that failed does not wait for processes that are gone."""
    mine = {"process": processes.joined().index, **{k: getattr(summary.timing, k) for k in _PER_PROCESS}}
    found = processes.gather(f"figures/{number}", mine, 0.5 if status == "failed" else 30.0)
    if found is None:
        return
    gone = {"missing": "it said nothing: see its log"}
    per = [f if f is not None else {"process": i, **gone} for i, f in enumerate(found)]
    waits = [(f.get("input_wait_s"), f["process"]) for f in per if f.get("input_wait_s") is not None]
    block = summary.processes.model_dump(exclude_unset=True) if summary.processes else {}
    summary.processes = {**block, "per_process": per, **({"slowest_input": max(waits)[1]} if waits else {})}


def _open(attempt: Attempt) -> dict | None:
    """Opens the run folder (its lease taken by process 0, the others opening it once it did) and gives the
    attempt its number; returns the summary of a job that is already complete (nothing to do), else None. A
    refusal on process 0 ends every process with its exit code. Resume rules: runner/rundir/outputs.py."""
    spec, run, facts = attempt.spec, attempt.run, attempt.facts
    entered = time.monotonic()
    several, chief, wait = processes.joined().several, attempt.worker_index == 0, spec.accelerator.timeout_s
    if several and not chief:
        said = processes.hear(f"open/{run.path}", wait + spec.storage.timeout_s)
        if said.startswith("refused"):
            code, _, message = said.removeprefix("refused ").partition(" ")
            raise _refused_on_chief(int(code), message)
    try:
        done = run.open(spec, attempt.worker_index)
    except RunnerError as exc:
        if several and chief:
            processes.tell(f"open/{run.path}", f"refused {exc.exit_code} {exc}")
        raise
    if several and chief:
        processes.tell(f"open/{run.path}", "done" if done is not None else "open")
    if done is not None:
        return done
    attempt.number = run.attempt
    facts.attempt, facts.run_dir, facts.train_epochs = attempt.number, run.path, spec.train.epochs
    attempt.phases.add("run_folder", time.monotonic() - entered)
    return None


def _build_and_restore(
    spec: JobSpec, attempt: Attempt, inputs: Inputs, chosen: precision.Precision
) -> tuple[keras.Model, Any, fit.Plan]:
    """The model built under the strategy, restored from the newest complete checkpoint if there is one, and
    the saver that writes its checkpoints into the run folder."""
    accelerator, facts = attempt.accelerator, attempt.facts
    attempt.run.check_checkpoints(spec, inputs.train, inputs.steps_per_epoch)  # what they mean must not change
    plan = fit.Plan(inputs.steps_per_epoch, spec.train.epochs)
    facts.steps_per_epoch = inputs.steps_per_epoch
    facts.steps_per_execution = build.steps_per_execution(spec, accelerator.kind)
    with attempt.phases.phase("build"):
        model = build.build_compiled(spec, inputs.train.features, accelerator, chosen, inputs.train.manifest)
        per_replica = spec.data.global_batch_size // accelerator.replicas
        counted = hub.count(model, inputs.train.features) if spec.model.hub else None  # PaLM's analytic count
        attempt.model_flops = counted or flops.count(model, per_replica, accelerator.engine)  # milliseconds
    with attempt.phases.phase("restore"):
        checkpoints = store.open_store(attempt.run, model, spec.checkpoint.keep)
        latest = attempt.run.latest_checkpoint()
        if latest:
            plan.start_step = store.restore(checkpoints, model, latest, inputs.train_ds.element_spec)
            log.info("resuming %r from %s (step %d of %d)", spec.name, latest, plan.start_step, plan.total_steps)
    facts.resumed_from_step = plan.start_step
    return model, Saver(checkpoints), plan  # in the background: training waits only for the copy of the weights


def _train(
    spec: JobSpec, attempt: Attempt, model: keras.Model, saver: Any, inputs: Inputs, plan: fit.Plan,
    recorder: fit.Recorder, notice: PreemptionNotice, verbose: int, progress_every: float | None,
    stall: limits.StallGuard | None = None,
) -> None:
    """Trains the plan (runner/train/loop.py) and records how it ended; raises what stopped it."""
    profiler = None
    if spec.profile:
        profiler = observe.ProfileWindow(attempt.run.file("profile"), spec.profile.start_step, spec.profile.steps,
                                        engine=attempt.accelerator.engine)
    validation = (inputs.validation.dataset, inputs.validation.steps) if inputs.validation else None
    feed = loop.Feed(inputs.train_ds, validation, spec.data.train, inputs.class_weight, inputs.validation_every or 1)
    outcome = loop.train(
        model, saver, feed, plan, recorder, notice, attempt.phases, settings=spec.train, saving=spec.checkpoint,
        global_batch=spec.data.global_batch_size, profiler=profiler, verbose=verbose, progress_every=progress_every,
        callbacks=inputs.callbacks, stall=stall,
    )
    facts, step = attempt.facts, outcome.final_step
    facts.checkpoint_saves, facts.profile = outcome.checkpoint_saves, outcome.profile
    if outcome.error is not None and not isinstance(outcome.error, Diverged):
        facts.final_step = step  # what was trained and saved before the error still counts
    if isinstance(outcome.error, Diverged):
        raise _diverged(outcome.error, spec, attempt) from None
    if outcome.error is not None:
        raise outcome.error
    stop = {"grace_s": spec.checkpoint.grace_s, "saved_after_notice_s": outcome.saved_after_notice_s}
    if outcome.stopped == "interrupted":
        facts.interruption = stop
        raise Interrupted(f"interrupted: saved step {step}; run the same job again to continue")
    if outcome.stopped == "time_limit":
        facts.time_limit = {"max_duration_s": spec.train.max_duration, **stop}
        raise TimeLimitReached(
            f"train.max_duration ({spec.train.max_duration:g} s) reached: saved step {step} to "
            f"{attempt.run.checkpoints}; run the same job again (with a longer limit) to continue"
        )
    if outcome.stopped == "preempted":
        facts.preemption = stop
        raise Preempted(
            f"preemption notice received: saved step {step} to {attempt.run.checkpoints}; run the same job again "
            "to continue"
        )
    facts.final_step = step
    facts.stopped_early_after_epoch = outcome.stopped_early_after_epoch
    facts.final_learning_rate = outcome.final_learning_rate


def _evaluate(spec: JobSpec, attempt: Attempt, model: keras.Model, inputs: Inputs, verbose: int,
              stall: limits.StallGuard | None = None) -> dict:
    """Metrics on every record of data.eval after training ({} when the spec names no eval shards)."""
    if inputs.eval is None:
        return {}
    with attempt.phases.phase("eval"):
        try:
            results = model.evaluate(inputs.eval.dataset, steps=inputs.eval.steps, return_dict=True, verbose=verbose,
                                     callbacks=[stall] if stall else None)
        except tf.errors.OpError as exc:
            raise faults.input_error(exc, spec.data.eval, "data.eval") or exc from None
    metrics = {k: float(v) for k, v in results.items()}
    metrics["examples"] = inputs.eval.records
    log.info("eval: %s", ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
    return metrics


def _judge(spec: JobSpec, attempt: Attempt, warnings: list[str]) -> str:
    """`succeeded`, unless the result is at chance (runner/train/verdict.py) and the spec does not allow it."""
    if not warnings:
        return "succeeded"
    attempt.facts.warnings = warnings
    for warning in warnings:
        log.warning("%s", warning)
    if spec.train.allow_chance:
        return "succeeded"
    raise LearnedNothing(
        "the run finished but learned nothing: " + "; ".join(warnings) + ". The model is saved; set "
        "train.allow_chance: true if a result at chance is expected"
    )


def _export(spec: JobSpec, attempt: Attempt, model: keras.Model, inputs: Inputs) -> None:
    """The trained model for serving, with example inputs (runner/rundir/serving.py); written by the chief."""
    with attempt.phases.phase("export"):
        attempt.accelerator.whole_for_export(model)
        serve_examples = (pipeline.example_inputs(inputs.train.features, spec.data.inputs, inputs.preprocess)
                          if spec.output.saved_model else None)
        attempt.facts.model = attempt.run.save_model(model, attempt.accelerator.worker_index, serve_examples,
                                                     saved_model=spec.output.saved_model)


def _diverged(exc: Diverged, spec: JobSpec, attempt: Attempt) -> Diverged:
    """The divergence with what it left behind and what to change."""
    latest = attempt.run.latest_checkpoint()
    look = "Lower train.learning_rate, or look for NaN or inf in the data, data.preprocess or train.loss"
    if latest is None:
        kept, again = "no checkpoint of it was saved", f"{look}, and run the job again"
    else:
        kept = (
            f"none of it was saved: the newest checkpoint, {posixpath.basename(latest)}, holds the last finite weights"
        )
        # A new learning rate is applied on resume (runner/rundir/pins.py): the same job continues with it.
        again = (
            f"{look}; run the same job again with the lower rate (`--set train.learning_rate=...`): it continues "
            "from that checkpoint"
        )
    return Diverged(
        f"{exc} (train.learning_rate {spec.train.learning_rate:g}); {kept}, and no model was exported. {again}"
    )


def _refused_on_chief(code: int, message: str) -> RunnerError:
    """Process 0's refusal to open the run folder, as this process ends with it (the same exit code)."""
    error = RunnerError(f"process 0 could not open the run folder: {message}")
    error.exit_code = code
    return error


def _stop_if_noticed(notice: PreemptionNotice, when: str) -> None:
    if notice.interrupted:
        raise Interrupted(f"interrupted {when}: nothing new was trained or saved; run the same job again")
    if notice.received.is_set():
        raise Preempted(f"preemption notice received {when}: nothing new was trained or saved; run the same job again")
