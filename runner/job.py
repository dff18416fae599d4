"""run_job(spec): the one top-to-bottom story of a job, from a validated spec to a summary."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import tensorflow as tf

from runner import PROCESS_START, data, models, observe, schema, storage, train, userimport
from runner.errors import DataError, Preempted, RunnerError, SpecError
from runner.outputs import RunFolder
from runner.preemption import PreemptionNotice
from runner.spec import JobSpec
from runner.strategy import Accelerator, cluster_from_env, resolve_accelerator
from runner.timing import EpochRecord, Phases, build_summary

log = logging.getLogger(__name__)
keras = tf.keras


@dataclasses.dataclass
class JobResult:
    summary: dict
    error: RunnerError | None = None
    already_complete: bool = False


def per_replica_batch(spec: JobSpec, accelerator: Accelerator) -> int:
    batch, replicas = spec.data.global_batch_size, accelerator.replicas
    if batch % replicas:
        raise SpecError(
            f"data.global_batch_size ({batch}) must be divisible by the number of replicas ({replicas}); "
            f"try {max(replicas, batch // replicas * replicas)}"
        )
    per_replica = batch // replicas
    if accelerator.kind == "tpu" and per_replica % 8:
        log.warning("per-replica batch %d is not a multiple of 8: TPU cores pad it (128 per core is best)", per_replica)
    return per_replica


def _epoch_line(total_epochs: int) -> Callable[[EpochRecord], None]:
    def report(record: EpochRecord) -> None:
        metrics = " ".join(f"{k} {v:.4f}" for k, v in record.metrics.items())
        loss = "" if record.loss is None else f" loss {record.loss:.4f}"
        log.info(
            "epoch %d/%d: %.2f s, %d steps, %.0f examples/s,%s %s",
            record.epoch, total_epochs, record.seconds, record.steps, record.examples_per_sec, loss, metrics,
        )

    return report


def run_job(
    spec: JobSpec, *, spec_loaded_at: float | None = None, verbose: int = 0, early_notice: float | None = None
) -> JobResult:
    """Trains (or resumes) the job; always returns a summary, with the error that ended the job if any.

    `early_notice`: when a SIGTERM arrived before the job could install its handler (while TensorFlow was
    importing; see runner/preemption.py): the job then stops as preempted before training, having saved nothing.
    """
    if spec.kind == "matmul_bench":
        from runner import matmul

        return JobResult(*matmul.run_bench(spec, spec_loaded_at=spec_loaded_at))
    phases = Phases(start=PROCESS_START)
    entered = time.monotonic()
    phases.add("startup", (spec_loaded_at or entered) - PROCESS_START)
    phases.add("import", entered - (spec_loaded_at or entered))  # TensorFlow loads after the spec is checked
    run = RunFolder(spec.run_dir)
    try:
        run.check_spec(spec)
    except RunnerError as exc:
        return JobResult(build_summary(status="failed", job=spec.name, accelerator=None, phases=phases, epochs=[],
                                       global_batch=spec.data.global_batch_size, metrics={}, error=str(exc)), exc)
    done = run.completed_summary(spec.train.epochs)
    if done is not None:
        log.info("job %r is already complete (%s/summary.json); nothing to do", spec.name, run.path)
        return JobResult(done, already_complete=True)
    worker_index = cluster_from_env(os.environ)[1]
    if worker_index == 0:
        run.record_spec(spec)
    attempt = run.next_attempt()
    phases.add("run_folder", time.monotonic() - entered)

    accelerator: Accelerator | None = None
    clock, input_method = None, "not measured: the job stopped before its input pipeline was built"
    scalars = observe.ScalarLog(run.file("tensorboard")) if spec.output.tensorboard and worker_index == 0 else None
    profiler = observe.ProfileWindow(run.file("profile"), spec.profile.start_step, spec.profile.steps) if spec.profile else None
    epoch_line = _epoch_line(spec.train.epochs)
    recorder = train.Recorder(
        spec.data.global_batch_size,
        lambda record: (epoch_line(record), scalars and scalars.epoch(record)),
        checkpoint_clock=lambda: phases.seconds.get("checkpoint", 0.0),
        input_clock=lambda: clock.seconds() if clock else None,
    )
    metrics: dict[str, float] = {}
    status, error = "failed", None
    extra: dict = {"attempt": attempt, "run_dir": run.path, "train_epochs": spec.train.epochs}
    notice = PreemptionNotice(spec.checkpoint.grace_s)
    try:
        notice.install()  # a SIGTERM from here on is a preemption notice: see runner/train.py
        if early_notice is not None:
            notice.notify(early_notice)
        _stop_if_noticed(notice, "while the job was starting")
        with phases.phase("strategy"):
            accelerator = resolve_accelerator(spec.accelerator)
        per_replica_batch(spec, accelerator)
        if spec.train.mixed_precision != "float32":
            keras.mixed_precision.set_global_policy(f"mixed_{spec.train.mixed_precision}")
        keras.utils.set_random_seed(spec.train.seed)

        with phases.phase("data_init"):
            train_shards = data.find_shards(spec.data.train)
            schema.check_declared(spec.data.features, train_shards)
            preprocess = (
                userimport.load_callable(spec.data.preprocess, "data.preprocess", ("features",))
                if spec.data.preprocess else None
            )
            steps_per_epoch = spec.train.steps_per_epoch or data.steps_in(
                train_shards, spec.data.global_batch_size, "data.train"
            )
            train_ds = data.make_dataset(
                train_shards, spec.data.global_batch_size, spec.data.inputs, spec.data.label,
                training=True, shuffle_buffer=spec.data.shuffle_buffer, seed=spec.train.seed, preprocess=preprocess,
                workers=accelerator.workers, autotune=spec.data.autotune,
            )
            clock, input_method = observe.input_clock_for(accelerator)
            if clock is not None:
                train_ds = clock.wrap(train_ds)
            eval_shards = data.find_shards(spec.data.eval) if spec.data.eval else None
            if eval_shards is not None:
                schema.check_declared(spec.data.features, eval_shards)
                eval_steps = data.steps_in(eval_shards, spec.data.global_batch_size, "data.eval")
                eval_ds = data.make_dataset(
                    eval_shards, spec.data.global_batch_size, spec.data.inputs, spec.data.label, training=False,
                    preprocess=preprocess, workers=accelerator.workers, autotune=spec.data.autotune,
                )
            validation = _validation_data(spec, eval_shards, preprocess, accelerator.workers) if spec.train.validate_every_epoch else None
        plan = train.Plan(steps_per_epoch, spec.train.epochs)
        extra["steps_per_epoch"] = steps_per_epoch
        extra["steps_per_execution"] = models.steps_per_execution(spec, accelerator.kind)

        with phases.phase("build"), accelerator.strategy.scope():
            model = models.build_model(spec, train_shards.features)
            models.compile_model(model, spec, accelerator.kind)
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
            manager = run.checkpoint_manager(checkpoint, spec.checkpoint.keep, worker_index)

        with phases.phase("restore"):
            latest = run.latest_checkpoint()
            if latest:
                checkpoint.restore(latest).expect_partial()
                plan.start_step = int(model.optimizer.iterations.numpy())
                log.info("resuming %r from %s (step %d of %d)", spec.name, latest, plan.start_step, plan.total_steps)
        extra["resumed_from_step"] = plan.start_step

        def save(step: int) -> None:
            began = time.monotonic()
            manager.save(checkpoint_number=step)
            phases.add("checkpoint", time.monotonic() - began)

        _stop_if_noticed(notice, "before training began")
        with notice:
            checkpointer = train.Checkpointer(save, spec.checkpoint.every_steps, notice)
            began, saved_before = time.monotonic(), phases.seconds.get("checkpoint", 0.0)
            try:
                plateau = train.plateau_callbacks(
                    spec.train.early_stopping_patience, spec.train.reduce_lr_patience, spec.train.reduce_lr_factor
                )
                watchers = [*plateau, *([profiler] if profiler else [])]
                train.fit(model, train_ds, plan, recorder, checkpointer, watchers, verbose=verbose, validation=validation)
            except tf.errors.DataLossError as exc:
                raise _name_corrupt_shard(spec, exc) from None
            except tf.errors.InvalidArgumentError as exc:
                if not _from_input(exc):
                    raise
                raise _input_misfit(spec, exc, "data.train") from None
            finally:
                if profiler:
                    profiler.close()
                    extra["profile"] = profiler.to_dict()
                saved = phases.seconds.get("checkpoint", 0.0) - saved_before
                phases.add("train", time.monotonic() - began - saved - recorder.validation_s)
                phases.add("eval", recorder.validation_s)
        if checkpointer.preempted or notice.received.is_set():
            extra["preemption"] = {"grace_s": spec.checkpoint.grace_s, "saved_after_notice_s": checkpointer.saved_after_notice_s}
            raise Preempted(
                f"preemption notice received: saved step {int(model.optimizer.iterations.numpy())} to "
                f"{run.checkpoints}; run the same job again to continue"
            )
        extra["final_step"] = int(model.optimizer.iterations.numpy())
        stopped = [c.stopped_epoch + 1 for c in plateau if getattr(c, "stopped_epoch", 0)]
        if stopped:
            extra["stopped_early_after_epoch"] = stopped[0]
        if spec.train.reduce_lr_patience is not None:
            extra["final_learning_rate"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))

        if eval_shards is not None:
            with phases.phase("eval"):
                try:
                    results = model.evaluate(eval_ds, steps=eval_steps, return_dict=True, verbose=verbose)
                except tf.errors.DataLossError as exc:
                    raise _name_corrupt_shard(spec, exc, pattern=spec.data.eval) from None
                except tf.errors.InvalidArgumentError as exc:
                    if not _from_input(exc):
                        raise
                    raise _input_misfit(spec, exc, "data.eval") from None
            metrics = {k: float(v) for k, v in results.items()}
            metrics["examples"] = eval_steps * spec.data.global_batch_size
            log.info("eval: %s", ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            if scalars and recorder.epochs:
                scalars.evaluation(metrics, recorder.epochs[-1].epoch)
        with phases.phase("export"):
            serve_examples = data.example_inputs(train_shards.features, spec.data.inputs, preprocess)
            extra["model"] = run.save_model(model, accelerator.worker_index, serve_examples)
        status = "succeeded"
    except Preempted as exc:
        status, error = "preempted", exc
    except RunnerError as exc:
        error = exc
    except Exception as exc:  # the summary must still be written; the CLI prints the traceback in --debug
        log.debug("job failed", exc_info=True)
        paths = (spec.data.train, spec.data.eval, spec.output.dir)
        error = storage.storage_error(exc, paths, spec.storage.timeout_s) or RunnerError(
            f"training failed: {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
    summary = build_summary(
        status=status,
        job=spec.name,
        accelerator=None if accelerator is None else accelerator.to_dict(),
        phases=phases,
        epochs=recorder.epochs,
        global_batch=spec.data.global_batch_size,
        metrics=metrics,
        error=None if error is None else str(error),
        extra=extra,
        input_wait_method=input_method,
    )
    if scalars:
        scalars.close()
        summary["tensorboard"] = scalars.folder
    if accelerator is None or accelerator.is_chief:
        try:
            run.write_summary(summary, attempt)
        except tf.errors.OpError as exc:  # the outage that ended the job may still be on: stdout has the summary
            log.error("could not write the summary to %s: %s", run.path, exc.message.splitlines()[0])
    notice.remove()
    return JobResult(summary, error)


def _stop_if_noticed(notice: PreemptionNotice, when: str) -> None:
    if notice.received.is_set():
        raise Preempted(f"preemption notice received {when}: nothing new was trained or saved; run the same job again")


def _validation_data(spec: JobSpec, eval_shards: data.Shards | None, preprocess, workers: int = 1) -> tuple[tf.data.Dataset, int]:
    """The per-epoch validation batches: data.validation, else the eval shards (spec.py checks one is set)."""
    key = "data.validation" if spec.data.validation else "data.eval"
    shards = data.find_shards(spec.data.validation) if spec.data.validation else eval_shards
    if spec.data.validation:
        schema.check_declared(spec.data.features, shards)
    dataset = data.make_dataset(
        shards, spec.data.global_batch_size, spec.data.inputs, spec.data.label, training=False, preprocess=preprocess,
        workers=workers, autotune=spec.data.autotune,
    )
    return dataset, data.steps_in(shards, spec.data.global_batch_size, key)


def _from_input(exc: tf.errors.OpError) -> bool:
    """Whether a training or evaluation error came out of the input pipeline (Keras tags the iterator's op)."""
    return "IteratorGetNext" in exc.message


def _input_misfit(spec: JobSpec, exc: tf.errors.OpError, key: str) -> DataError:
    """A batch the pipeline could not decode: a record that does not fit data.features, or data.preprocess."""
    pattern = spec.data.train if key == "data.train" else spec.data.eval
    changed = data.corrupt_shards(pattern)
    # TensorFlow's line ends "...transformation with iterator: Iterator::Root::ParallelMapV2: <the reason>."
    lines = [line.strip() for line in exc.message.splitlines() if line.strip() and not line.strip().startswith("[[")]
    reason = next((line for line in lines if "transformation with iterator" in line), lines[-1] if lines else "")
    reason = reason.rsplit(": ", 1)[-1]
    where = f"shards that differ from their manifest: {'; '.join(changed)}" if changed else f"a shard matching {pattern!r}"
    return DataError(
        f"{key}: a batch could not be decoded ({reason}) in {where}; a record does not fit data.features, or "
        "data.preprocess failed on it: run `runner manifest` again for your own records (it names the record) "
        "or `runner prepare` for a built-in dataset; the run stopped, checkpoints kept"
    )


def _name_corrupt_shard(spec: JobSpec, exc: tf.errors.DataLossError, pattern: str | None = None) -> DataError:
    pattern = pattern or spec.data.train
    bad = data.corrupt_shards(pattern)
    where = "; ".join(bad) if bad else f"a shard matching {pattern!r} (all match the manifest: re-run `runner prepare`)"
    # Keras wraps the reader's error in "Graph execution error:" and a stack: keep the line about the record.
    lines = exc.message.splitlines()
    detail = next((line.strip() for line in lines if "record" in line.lower()), lines[0] if lines else "")
    return DataError(f"corrupt training data in {where}: {detail}; the run stopped, checkpoints kept")
