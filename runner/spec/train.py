"""The spec's `train:` and `checkpoint:` sections: how a job trains and how often it saves. No TensorFlow."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, StrictBool, field_validator, model_validator

from runner.spec.base import INT32_MAX, MAX_WAIT_S, Integer, Number, Strict
from runner.spec.usercode import check_import_path, is_import_path


def _auto_or_steps(value: Any) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT32_MAX):
        return value
    raise ValueError(f"{value!r} is neither 'auto' nor a whole number of steps from 1 to {INT32_MAX:,}")


def _loss_or_metric(value: str, what: str) -> str:
    if not value.strip():
        raise ValueError(f"an empty {what} name: write a Keras name such as 'accuracy' or `package.module:function`")
    if is_import_path(value):
        return check_import_path(value)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError(f"{value!r} is not a Keras {what} name (letters, digits and '_'), nor `package.module:function`")
    return value


class TrainSpec(Strict):
    epochs: Integer = Field(12, ge=1, le=1_000_000)
    # Unset: derived from the manifest (records // global_batch_size).
    steps_per_epoch: Integer | None = Field(None, ge=1, le=INT32_MAX)
    # Steps run on the device per host round trip. auto: 32 on a TPU (where each round trip costs
    # milliseconds), 1 on CPU/GPU (measured no faster here: see benchmarks/RESULTS.md).
    steps_per_execution: Annotated[int | Literal["auto"], PlainValidator(_auto_or_steps)] = "auto"
    optimizer: Literal["adam", "sgd", "rmsprop", "adamw"] = "adam"
    learning_rate: Number = Field(1e-3, gt=0)
    # auto: bfloat16 where the device computes it natively (TPUs, GPUs from compute capability 8.0, CPUs with
    # AVX512_BF16 or AMX), float32 elsewhere (runner/device/precision.py). The output layer stays float32 either way.
    mixed_precision: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Keras names, or your own `package.module:function` taking (y_true, y_pred).
    loss: str = Field("sparse_categorical_crossentropy", max_length=256)
    metrics: tuple[Annotated[str, Field(max_length=256)], ...] = Field(("accuracy",), max_length=64)
    # NumPy, Python and TensorFlow are seeded with it (keras.utils.set_random_seed): 0 to 2**32 - 1.
    seed: Integer = Field(0, ge=0, le=2**32 - 1)
    # Evaluate on data.validation (unset: data.eval) after every epoch; val_* metrics join each epoch's record.
    validate_every_epoch: StrictBool = False
    # Stop once val_loss has not improved for this many epochs and keep the best epoch's weights. Needs
    # validate_every_epoch. After a resume the count starts again from the resumed epoch.
    early_stopping_patience: Integer | None = Field(None, ge=1, le=1_000_000)
    # Multiply the learning rate by reduce_lr_factor once val_loss has not improved for this many epochs.
    reduce_lr_patience: Integer | None = Field(None, ge=1, le=1_000_000)
    reduce_lr_factor: Number = Field(0.5, gt=0, lt=1)

    @model_validator(mode="after")
    def _plateau_needs_validation(self) -> TrainSpec:
        for key in ("early_stopping_patience", "reduce_lr_patience"):
            value = getattr(self, key)
            if value is not None and not self.validate_every_epoch:
                raise ValueError(f"train.{key} ({value}) watches val_loss: also set train.validate_every_epoch: true")
        return self

    @field_validator("loss")
    @classmethod
    def _loss_form(cls, value: str) -> str:
        return _loss_or_metric(value, "loss")

    @field_validator("metrics")
    @classmethod
    def _metrics_form(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(_loss_or_metric(m, "metric") for m in value)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice; name each metric once")
        return names


class CheckpointSpec(Strict):
    # Unset: one checkpoint per epoch. Set: also every K steps (must divide steps_per_execution evenly).
    every_steps: Integer | None = Field(None, ge=1, le=INT32_MAX)
    keep: Integer = Field(3, ge=1, le=10_000)
    # Seconds a preemption notice (SIGTERM) or Ctrl-C leaves for the final save.
    grace_s: Number = Field(30.0, gt=0, le=MAX_WAIT_S)
