"""A summary as its readers read it: typed and lenient (`Recorded`).

The writers build the summary through the strict model (runner/rundir/summary.py `Summary`), which refuses a summary
of an older runner. Its readers (the resume rules, `runner runs`, `runner report`, `runner sweep`, the closing line,
the reported weights, `runner status`, the relaunch watcher, `runner submit`'s estimate of the epochs left) read
through this model instead: a key missing, null or of another type reads as unknown (None, an empty part or list),
other keys are ignored, so a summary of schema_version 1 or 2, or a part of one, still reads and never crashes a
report. Every field here is a key the generated schema declares at the same path (tests/test_summary.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

Number = int | float  # as written: an int stays an int (the report prints 3 as 3, not 3.00); a bool is neither


class Lenient(BaseModel):
    """A part read leniently: a value of another type is not read as this one (strict), and reads as unknown."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="wrap")
    @classmethod
    def _unknown_if_unreadable(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        try:
            return handler(value)
        except ValidationError:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)


def _numbers(value: Any) -> Any:
    """A name -> number mapping with the values that are not numbers left out (unknown)."""
    if not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class PrecisionRead(Lenient):
    policy: str | None = None
    reason: str | None = None


class AcceleratorRead(Lenient):
    kind: str | None = None
    replicas: int | None = None
    detail: str | None = None
    tensorflow: str | None = None
    keras: str | None = None
    allocator: str | None = None
    precision: PrecisionRead = Field(default_factory=PrecisionRead)


class TimingRead(Lenient):
    train_s: Number | None = None
    total_s: Number | None = None
    first_epoch_s: Number | None = None
    steady_epoch_s: Number | None = None
    step_time_ms: Number | None = None
    examples_per_sec: Number | None = None
    goodput: Number | None = None
    input_wait_fraction: Number | None = None


class EpochRead(Lenient):
    epoch: int | None = None
    steps: int | None = None
    loss: Number | None = None
    metrics: dict[str, Number] = Field(default_factory=dict)
    attempt: int | None = None

    @field_validator("metrics", mode="before")
    @classmethod
    def _metric_values(cls, value: Any) -> Any:
        return _numbers(value)


class TrainInputRead(Lenient):
    mode: str | None = None


class CheckpointSavesRead(Lenient):
    saves: int | None = None


class ProcessesRead(Lenient):
    count: int | None = None
    index: int | None = None


class ThroughputRead(Lenient):
    mfu: Number | None = None
    why_null: str | None = None


class TflopsRead(Lenient):
    warm: Number | None = None


class Recorded(Lenient):
    """A summary's facts as its readers read them (module docstring); `Recorded.of` reads a dict."""

    schema_version: int | None = None
    status: str | None = None
    job: str | None = None
    kind: str | None = None
    attempt: int | None = None
    run_dir: str | None = None
    accelerator: AcceleratorRead = Field(default_factory=AcceleratorRead)
    global_batch_size: int | None = None
    timing: TimingRead | None = None  # None: not a summary (report refuses it); `times` reads it either way
    epochs: list[EpochRead] = Field(default_factory=list)
    metrics: dict[str, Number] = Field(default_factory=dict)
    error: str | None = None
    train_epochs: int | None = None
    train_input: TrainInputRead = Field(default_factory=TrainInputRead)
    steps_per_epoch: int | None = None
    resumed_from_step: int | None = None
    final_step: int | None = None
    stopped_early_after_epoch: int | None = None
    checkpoint_saves: CheckpointSavesRead | None = None  # None: the attempt recorded no saves (it stopped before)
    model: str | None = None
    processes: ProcessesRead = Field(default_factory=ProcessesRead)
    tflops: TflopsRead = Field(default_factory=TflopsRead)
    throughput: ThroughputRead = Field(default_factory=ThroughputRead)
    newest_checkpoint: str | None = None

    @field_validator("metrics", mode="before")
    @classmethod
    def _metric_values(cls, value: Any) -> Any:
        return _numbers(value)

    @field_validator("epochs", mode="before")
    @classmethod
    def _records(cls, value: Any) -> Any:
        """An epoch record that is not an object is left out; the others read."""
        return [record for record in value if isinstance(record, dict)] if isinstance(value, list) else value

    @classmethod
    def of(cls, summary: Any) -> Recorded | None:
        """The reading of `summary`; None when it is not an object at all."""
        return cls.model_validate(summary) if isinstance(summary, dict) else None

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"

    @property
    def times(self) -> TimingRead:
        return self.timing or TimingRead()

    @property
    def evaluated(self) -> dict[str, Number]:
        """The evaluation's metrics by name, the count of records evaluated left out."""
        return {name: value for name, value in self.metrics.items() if name != "examples"}
