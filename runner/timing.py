"""Named phases on a monotonic clock, and the JSON summary every run writes (even a failed one).

The first epoch includes tracing and XLA compilation, so it is reported on its own and kept out of
step time and throughput; those come from the later ("steady") epochs. Field by field: README, "The summary".
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Iterator

SCHEMA_VERSION = 1

# Phases in the order a job passes through them; `total_s` covers them all plus what falls between.
PHASES = ("startup", "strategy", "data_init", "build", "restore", "train", "checkpoint", "eval", "export")


class Phases:
    """Accumulates wall seconds per named phase; a phase may be entered many times (checkpoint saves)."""

    def __init__(self, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - began)

    def add(self, name: str, seconds: float) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start


@dataclasses.dataclass
class EpochRecord:
    epoch: int  # 1-based, across resumed runs
    seconds: float
    steps: int
    examples_per_sec: float
    loss: float | None
    metrics: dict[str, float]
    first_step_s: float | None = None  # the first device execution of this process (compile), if in this epoch


def steady_timing(epochs: list[EpochRecord], global_batch: int) -> dict[str, float | None]:
    """First epoch (with compile) apart; step time and throughput from the steady epochs only."""
    if not epochs:
        return {"first_epoch_s": None, "steady_epoch_s": None, "step_time_ms": None, "examples_per_sec": None}
    first, later = epochs[0], epochs[1:]
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
        "examples_per_sec": None if not step_s else round(global_batch / step_s, 1),
    }


def build_summary(
    *,
    status: str,
    job: str,
    accelerator: dict[str, Any] | None,
    phases: Phases,
    epochs: list[EpochRecord],
    global_batch: int,
    metrics: dict[str, float],
    error: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    total = phases.elapsed()
    timing: dict[str, Any] = {f"{name}_s": round(phases.seconds.get(name, 0.0), 4) for name in PHASES}
    timing.update(steady_timing(epochs, global_batch))
    first_step = next((e.first_step_s for e in epochs if e.first_step_s is not None), None)
    timing["first_step_s"] = None if first_step is None else round(first_step, 4)
    # Productive time: training steps at their steady cost; compile, restores, saves and waits are not.
    steps = sum(e.steps for e in epochs)
    productive = steps * timing["step_time_ms"] / 1e3 if timing["step_time_ms"] else 0.0
    timing["productive_s"] = round(min(productive, total), 4)
    timing["goodput"] = round(productive / total, 4) if total > 0 and productive else None
    timing["total_s"] = round(total, 4)
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
    return summary
