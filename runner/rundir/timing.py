"""Named phases on a monotonic clock, and the JSON summary every run writes (even a failed one).

The first epoch includes tracing and XLA compilation, so it is reported on its own and kept out of
step time and throughput; those come from the later ("steady") epochs. The phases are measured one by
one and add up to `total_s`; what falls between them is reported as `unaccounted_s`, never hidden.
Field by field: the typed summary runner/rundir/summary.py (which generates runner/rundir/summary.schema.json)
and docs/summary.md. This module imports no TensorFlow: `runner report` uses it to read summaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from runner.rundir.summary import SCHEMA_VERSION, STATUSES, Recorded, Summary

__all__ = ["PHASES", "SCHEMA_VERSION", "STATUSES", "EpochRecord", "Phases", "Recorded", "Summary", "build_summary",
           "completion"]

# Phases in the order a job passes through them; `total_s` is their sum plus `unaccounted_s`.
# "strategy" is accelerator init (resolving the device, building the tf.distribute strategy);
# "import" is loading TensorFlow after the spec is checked.
PHASES = (
    "startup", "import", "run_folder", "strategy", "data_init", "build", "restore", "train", "checkpoint", "eval",
    "export", "peak",
)


class Phases:
    """Accumulates wall seconds per named phase; a phase may be entered many times (checkpoint saves)."""

    def __init__(self, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.seconds: dict[str, float] = {}
        # Told of every phase that begins or ends ("build began"): the stall guard counts that as progress.
        self.watch: Callable[[str], None] | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        if self.watch:
            self.watch(f"{name} began")
        try:
            yield
        finally:
            self.add(name, time.monotonic() - began)
            if self.watch:
                self.watch(f"{name} ended")

    def add(self, name: str, seconds: float) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start


@dataclasses.dataclass
class EpochRecord:
    epoch: int  # 1-based, across resumed runs
    seconds: float  # wall time of the epoch, checkpoint saves made inside it excluded
    steps: int
    examples_per_sec: float
    loss: float | None
    metrics: dict[str, float]
    first_step_s: float | None = None  # the first device execution of this process (compile), if in this epoch
    checkpoint_s: float = 0.0  # checkpoint saves made inside the epoch (every_steps), kept out of `seconds`
    input_wait_s: float | None = None  # time the training loop was blocked on the input pipeline
    partial: bool = False  # stopped before its last step (a notice, a limit): its step count is not the epoch's
    attempt: int | None = None  # the attempt that trained it (the summary's epochs span every attempt)


def steady_timing(epochs: list[EpochRecord], global_batch: int | None) -> dict[str, float | None]:
    """First epoch (with compile) apart; step time and throughput from the steady epochs only."""
    if not epochs:
        return {"first_epoch_s": None, "steady_epoch_s": None, "step_time_ms": None, "examples_per_sec": None}
    first, later = epochs[0], [e for e in epochs[1:] if not e.partial]  # a cut-short epoch is not a steady one
    full = [e for e in later if e.steps == first.steps] or later
    if full:
        step_s = statistics.median(e.seconds / e.steps for e in full)
        steady_epoch = statistics.median(e.seconds for e in full)
    elif first.first_step_s is not None and first.steps > 1:
        # One epoch only: its steps after the compiling first execution are the steady part.
        steady_epoch = None
        step_s = (first.seconds - first.first_step_s) / max(first.steps - 1, 1)
    else:
        steady_epoch, step_s = None, None
    return {
        "first_epoch_s": round(first.seconds, 4),
        "steady_epoch_s": None if steady_epoch is None else round(steady_epoch, 4),
        "step_time_ms": None if step_s is None else round(step_s * 1e3, 3),
        "examples_per_sec": None if not step_s or not global_batch else round(global_batch / step_s, 1),
    }


def input_wait(epochs: list[EpochRecord], train_s: float, method: str) -> dict[str, Any]:
    """Total and share of training time the loop waited on input; None when it was not measured."""
    waits = [e.input_wait_s for e in epochs if e.input_wait_s is not None]
    if not waits or len(waits) < len(epochs):
        return {"input_wait_s": None, "input_wait_fraction": None, "input_wait_method": method}
    total = sum(waits)
    return {
        "input_wait_s": round(total, 4),
        "input_wait_fraction": round(total / train_s, 4) if train_s > 0 else None,
        "input_wait_method": method,
    }


def productive_seconds(epochs: list[EpochRecord], step_time_ms: float | None) -> float:
    """Time spent running training steps: the epochs (saves and validation already out) less what the
    first device execution took beyond a steady step (its tracing and compilation). Measured, so it
    never exceeds the training time even when later epochs run slower than the first."""
    first_step = next((e.first_step_s for e in epochs if e.first_step_s is not None), None)
    compile_excess = 0.0 if first_step is None else max(0.0, first_step - (step_time_ms or 0.0) / 1e3)
    return max(0.0, sum(e.seconds for e in epochs) - compile_excess)


def build_summary(
    *,
    status: str,
    job: str,
    accelerator: dict[str, Any] | None,
    phases: Phases,
    epochs: list[EpochRecord],
    global_batch: int | None,
    metrics: dict[str, float],
    error: str | None = None,
    extra: dict[str, Any] | None = None,
    input_wait_method: str = "not measured",
) -> Summary:
    """The summary through its model (runner/rundir/summary.py): pydantic.ValidationError names a key of
    `accelerator` or `extra` (the attempt's facts) that the model does not declare."""
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}; known: {', '.join(STATUSES)}")
    total = phases.elapsed()
    timing: dict[str, Any] = {f"{name}_s": round(phases.seconds.get(name, 0.0), 4) for name in PHASES}
    timing["unaccounted_s"] = round(total - sum(phases.seconds.values()), 4)
    timing["total_s"] = round(total, 4)
    timing.update(steady_timing(epochs, global_batch))
    train = phases.seconds.get("train", 0.0)
    # train_s split: the compiling first epoch, the rest; and what fit spent outside every epoch.
    timing["steady_train_s"] = None if not epochs else round(max(0.0, train - epochs[0].seconds), 4)
    timing["fit_overhead_s"] = None if not epochs else round(max(0.0, train - sum(e.seconds for e in epochs)), 4)
    first_step = next((e.first_step_s for e in epochs if e.first_step_s is not None), None)
    timing["first_step_s"] = None if first_step is None else round(first_step, 4)
    timing.update(input_wait(epochs, train, input_wait_method))
    productive = productive_seconds(epochs, timing["step_time_ms"])
    timing["productive_s"] = round(productive, 4)
    timing["goodput"] = round(productive / total, 4) if total > 0 and productive else None
    summary = {
        "schema_version": SCHEMA_VERSION,
        "status": status,
        "job": job,
        "accelerator": accelerator,
        "global_batch_size": global_batch,
        "timing": timing,
        "epochs": [dataclasses.asdict(e) for e in epochs],
        "metrics": metrics,
    }
    if error:
        summary["error"] = error
    if extra:
        summary.update(extra)
    return Summary.model_validate(summary)


def completion(summary: dict[str, Any] | None, epochs: int) -> str:
    """What a run folder's summary.json says of a job asked to train `epochs` epochs (runner/rundir/outputs.py,
    resume precedence 3): "complete" when it succeeded after exactly that many, "shrunk" when it succeeded
    after more (refused: a job never shrinks), else "open" (no summary, not succeeded, or fewer epochs:
    the job continues). No TensorFlow: `runner sweep` skips finished variants with it."""
    recorded = Recorded.of(summary)
    if recorded is None or not recorded.succeeded:
        return "open"
    trained = recorded.train_epochs or 0
    if trained > epochs:
        return "shrunk"
    return "complete" if trained == epochs else "open"
