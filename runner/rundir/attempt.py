"""One attempt at a job: its run folder, its number, its timed phases, and the summary it always writes.

A job (runner/job/run.py) and the matmul benchmark (runner/job/matmul.py) both end through `Attempt.finish`, in a
`finally`-like epilogue: whatever stopped the attempt, its summary is built, written by the chief, and
returned for stdout.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import tensorflow as tf
from pydantic import ValidationError

from runner import PROCESS_START, RunnerError
from runner.data import storage
from runner.device.accelerator import Accelerator
from runner.rundir.outputs import RunFolder
from runner.rundir.summary import Summary
from runner.rundir.timing import EpochRecord, Phases, build_summary
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class JobResult:
    summary: dict  # as written and printed: a Summary given is turned into its JSON form
    error: RunnerError | None = None
    already_complete: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.summary, Summary):
            self.summary = self.summary.to_json()


@dataclasses.dataclass
class Facts:
    """What an attempt learns as it goes, each a key of summary.json (runner/rundir/summary.py `Summary`, which
    refuses a key it does not declare); None: not reached, and left out of the summary."""

    kind: str | None = None
    attempt: int | None = None
    run_dir: str | None = None
    train_epochs: int | None = None
    data_verify: dict | None = None
    train_input: dict | None = None
    splits: dict | None = None
    steps_per_epoch: int | None = None
    steps_per_execution: int | None = None
    resumed_from_step: int | None = None
    final_step: int | None = None
    stopped_early_after_epoch: int | None = None
    final_learning_rate: float | None = None
    checkpoint_saves: dict | None = None
    profile: dict | None = None
    interruption: dict | None = None
    preemption: dict | None = None
    time_limit: dict | None = None
    warnings: list | None = None
    model: Any = None
    tensorboard: str | None = None
    processes: dict | None = None  # the job's processes and how they divided the data (runner/device/processes.py)
    compile_cache: str | None = None  # JAX's persistent compilation cache (runner/device/jax_devices.py)
    sharding: dict | None = None  # the mesh, the layout and the bytes per device (runner/device/sharding.py)
    # The matmul benchmark's results, at the summary's top level.
    bench: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        found = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "bench"}
        return {**{k: v for k, v in found.items() if v is not None}, **(self.bench or {})}


@dataclasses.dataclass
class Attempt:
    spec: JobSpec
    run: RunFolder
    phases: Phases
    number: int = 0  # 0 until the run folder gives it one
    worker_index: int = 0  # this process's place among the job's processes (runner/device/processes.py); 0 writes
    accelerator: Accelerator | None = None
    facts: Facts = dataclasses.field(default_factory=Facts)
    # (FLOPs per training example, how counted): runner/train/flops.py, once the model is built.
    model_flops: tuple[float | None, str] | None = None

    @classmethod
    def begin(cls, spec: JobSpec, spec_loaded_at: float | None) -> Attempt:
        """Starts the clock's phases: the process start-up, then TensorFlow's import after the spec was checked."""
        phases = Phases(start=PROCESS_START)
        entered = time.monotonic()
        phases.add("startup", (spec_loaded_at or entered) - PROCESS_START)
        phases.add("import", entered - (spec_loaded_at or entered))
        return cls(spec, RunFolder(spec.run_dir), phases)

    def summary(
        self,
        status: str,
        error: RunnerError | None,
        *,
        epochs: list[EpochRecord] = (),
        metrics: dict[str, Any] | None = None,
        global_batch: int | None = None,
        input_wait_method: str = "not measured",
    ) -> Summary:
        return build_summary(
            status=status,
            job=self.spec.name,
            accelerator=None if self.accelerator is None else self.accelerator.to_dict(),
            phases=self.phases,
            epochs=list(epochs),
            global_batch=global_batch,
            metrics=metrics or {},
            error=None if error is None else str(error),
            extra=self.facts.to_dict(),
            input_wait_method=input_wait_method,
        )

    def finish(self, summary: Summary, *, keep_succeeded: bool = True) -> dict[str, Any]:
        """Writes the summary (the chief only): attempts/<n>.json and summary.json, checked again against its
        model (a key set since it was built is declared too). With `keep_succeeded`, a summary that did not succeed
        never replaces a succeeded one (runner/rundir/outputs.py). Then the run folder's lease is released,
        whatever the status. Returns the summary as written, for stdout."""
        try:
            summary = Summary.checked(summary.to_json())
        except ValidationError as exc:  # a defect of the runner's reporting: the summary is still written
            log.error("the summary breaks its declaration (runner/rundir/summary.py), written as it is: %s",
                      " ".join(str(exc).split())[:500])
            summary = summary.to_json()
        try:
            if self.worker_index == 0:
                self.run.write_summary(summary, self.number, keep_succeeded=keep_succeeded)
        except tf.errors.OpError as exc:  # the outage that ended the job may still be on: stdout has the summary
            log.error("could not write the summary to %s: %s", self.run.path, exc.message.splitlines()[0])
        finally:
            self.run.close()
            if self.run.remove_if_refused():
                summary.pop("run_dir", None)  # the closing line must not send the user to a folder that is gone
        return summary


def error_of(exc: Exception, spec: JobSpec, what: str = "training") -> RunnerError:
    """A RunnerError for any exception that ended an attempt: a storage fault (exit 3) naming the bucket, else
    the exception's own text (exit 1). The original stays as __cause__ for `--debug`."""
    if isinstance(exc, RunnerError):
        return exc
    log.debug("%s failed", what, exc_info=True)
    paths = (spec.data.train, spec.data.eval, spec.output.dir)
    error = storage.storage_error(exc, paths, spec.storage.timeout_s) or RunnerError(
        f"{what} failed: {type(exc).__name__}: {exc}"
    )
    error.__cause__ = exc
    return error
