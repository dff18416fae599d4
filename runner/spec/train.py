"""The spec's `train:` and `checkpoint:` sections: how a job trains and how often it saves. No TensorFlow.

The optimizer, loss, metrics and learning-rate schedule are Keras's own names or serialized objects
(runner/spec/keras.py); which learning rate applies is settled here, once:
1. `train.schedule` set: the schedule sets the rate at every step (train.learning_rate and a `learning_rate` in
   the optimizer's config are refused beside it);
2. else a serialized optimizer whose config has `learning_rate`: that rate (train.learning_rate, if also given,
   must agree);
3. else train.learning_rate (default 0.001).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, StrictBool, field_validator, model_validator

from runner.spec import keras
from runner.spec.base import (
    INT32_MAX,
    LEARNING_RATE_RANGE,
    MAX_WAIT_S,
    MIN_WAIT_S,
    Integer,
    Name,
    Number,
    Strict,
    bounded,
)
from runner.spec.usercode import check_import_path, is_import_path


def _auto_or_steps(value: Any) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT32_MAX):
        return value
    raise ValueError(f"{value!r} is neither 'auto' nor a whole number of steps from 1 to {INT32_MAX:,}")


def _validation_every(value: Any) -> int | str:
    if value in ("auto", "never"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1_000_000:
        return "never" if value == 0 else value
    raise ValueError(f"{value!r} is none of auto, never, or a whole number of epochs from 0 (never) to 1,000,000")


# The momentum the name `sgd` has always meant here (Keras's own SGD default is 0.0); `{class_name: SGD}` is
# Keras's default, as written.
SGD_MOMENTUM = 0.9


# validation_every auto validates every epoch when the validation split holds at most this share of the records
# one epoch trains. A validation step is a forward pass only (about a third of a training step's work), so at
# this share validating costs a few percent of an epoch; the built-in jobs (10,000 eval records against 60,000
# trained, 17%) stay without it.
AUTO_VALIDATION_SHARE = 0.10


ClassId = Annotated[int, Field(ge=0, le=1_000_000)]


class TrainSpec(Strict):
    epochs: Integer = Field(12, ge=1, le=1_000_000)
    # Unset: derived from the manifest (records // global_batch_size).
    steps_per_epoch: Integer | None = Field(None, ge=1, le=INT32_MAX)
    # Steps run on the device per host round trip. auto: 32 on a TPU (where each round trip costs
    # milliseconds), 1 on CPU/GPU (measured no faster here: see benchmarks/RESULTS.md).
    steps_per_execution: Annotated[int | Literal["auto"], PlainValidator(_auto_or_steps)] = "auto"
    # A Keras optimizer name (adam, sgd, rmsprop, adamw, nadam, ...: `sgd` has momentum 0.9) at train.learning_rate,
    # or Keras's serialized form {class_name: AdamW, config: {learning_rate: 0.001, weight_decay: 0.01}}.
    optimizer: keras.Optimizer = "adam"
    learning_rate: bounded(*LEARNING_RATE_RANGE) = 1e-3
    # Keras's serialized learning-rate schedule, {class_name: CosineDecay, config: {initial_learning_rate: ...,
    # decay_steps: ...}}; it replaces the learning rate (see the module's docstring). Unset: a constant rate.
    schedule: keras.SerializedSchedule | None = None
    # auto: bfloat16 where the device computes it natively (TPUs, GPUs from compute capability 8.0, CPUs with
    # AVX512_BF16 or AMX), float32 elsewhere (runner/device/precision.py). The output layer stays float32 either way.
    mixed_precision: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Keras names or serialized objects ({class_name: SparseCategoricalCrossentropy, config: {from_logits: true}}),
    # or your own `package.module:function` taking (y_true, y_pred).
    loss: keras.Loss = "sparse_categorical_crossentropy"
    metrics: tuple[keras.Metric, ...] = Field(("accuracy",), max_length=64)
    # NumPy, Python and TensorFlow are seeded with it (keras.utils.set_random_seed): 0 to 2**32 - 1.
    seed: Integer = Field(0, ge=0, le=2**32 - 1)
    # Evaluate on data.validation (unset: data.eval) every N epochs (Keras fit's validation_freq); val_* metrics
    # join those epochs' records. auto: every epoch on data.validation (as Keras's validation_data), and on
    # data.eval when it holds at most AUTO_VALIDATION_SHARE of the records one epoch trains (runner/job/inputs.py),
    # else never; 0 or never: never. The older key
    # `validate_every_epoch: true|false` still reads as 1|never.
    validation_every: Annotated[int | Literal["auto", "never"], PlainValidator(_validation_every)] = "auto"
    # Stop once val_loss has not improved for this many epochs and keep the best epoch's weights. Needs
    # validation every epoch (validation_every 1, or auto: then on whatever the split's size). After a resume
    # the count starts again from the resumed epoch.
    early_stopping_patience: Integer | None = Field(None, ge=1, le=1_000_000)
    # Multiply the learning rate by reduce_lr_factor once val_loss has not improved for this many epochs.
    reduce_lr_patience: Integer | None = Field(None, ge=1, le=1_000_000)
    reduce_lr_factor: bounded(0.001, 0.999) = 0.5
    # Wall-clock limit in seconds from the process start: at it the job saves, stops with status time_limit and
    # exits 124 (runner/train/limits.py). Unset: none. `runner submit` sets it (--max-run-duration).
    max_duration: Number | None = Field(None, ge=1, le=366 * 86400)
    # Seconds without progress (no phase of the job begun or ended, no step finished: runner/train/limits.py) after
    # which the process exits 124 (the newest checkpoint kept). Unset: none.
    stall_timeout: Number | None = Field(None, ge=10, le=7 * 86400)
    # A finished run whose metric is at chance (or whose loss never fell below its first epoch's) ends as
    # learned_nothing, exit 4; true keeps such a run `succeeded` (with the warning in its summary).
    allow_chance: StrictBool = False
    # Keras fit's class_weight: {class id: weight}, or `balanced` (total / (classes x count) from the manifest's
    # label_counts, as scikit-learn's "balanced"). Unset: every class weighs 1.
    class_weight: dict[ClassId, bounded(1e-6, 1e6)] | Literal["balanced"] | None = None
    # A numeric scalar feature of the records (int64 or float32, shape [] or [1], finite, >= 0) handed to Keras as
    # sample weights, in training and in evaluation and validation alike (docs/specs.md); it is not a model input.
    sample_weight: Name | None = None
    # Your own Keras callbacks, `package.module:Class` (called with no arguments), run after the runner's own
    # (the finite-loss check, timing, checkpoints and preemption), so a callback of yours cannot break a save.
    callbacks: tuple[Annotated[str, Field(max_length=256)], ...] = Field((), max_length=32)

    @model_validator(mode="before")
    @classmethod
    def _older_validation_key(cls, doc: Any) -> Any:
        """`validate_every_epoch: true|false`, the key before validation_every, keeps its meaning: 1|never."""
        if not isinstance(doc, dict) or "validate_every_epoch" not in doc:
            return doc
        doc = dict(doc)
        old = doc.pop("validate_every_epoch")
        if "validation_every" in doc:
            raise ValueError(
                f"train.validate_every_epoch ({old!r}) and train.validation_every ({doc['validation_every']!r}) "
                "both set the validation cadence: keep train.validation_every only"
            )
        if not isinstance(old, bool):
            raise ValueError(
                f"train.validate_every_epoch is {old!r}: write true or false, or use its successor "
                "train.validation_every: N (epochs), auto or never"
            )
        doc["validation_every"] = 1 if old else "never"
        return doc

    @model_validator(mode="after")
    def _plateau_needs_validation(self) -> TrainSpec:
        for key in ("early_stopping_patience", "reduce_lr_patience"):
            value = getattr(self, key)
            if value is not None and self.validation_every not in (1, "auto"):
                raise ValueError(
                    f"train.{key} ({value}) watches val_loss after every epoch, but train.validation_every is "
                    f"{self.validation_every!r}: set train.validation_every: 1 (or leave it auto)"
                )
        return self

    @model_validator(mode="after")
    def _f_scores_need_one_hot_labels(self) -> TrainSpec:
        # Keras's F1Score and FBetaScore take 2D labels (keras/src/metrics/f_score_metrics.py: "FBetaScore expects
        # 2D inputs"); the runner's class ids are one per record, one-hot encoded only for CategoricalCrossentropy.
        # Run as written, each failed after the first epoch's steps, leaving a run folder.
        loss = self.loss.class_name if isinstance(self.loss, keras.Serialized) else self.loss
        for metric in self.metrics:
            name = metric.class_name if isinstance(metric, keras.Serialized) else metric
            average = metric.config.get("average") if isinstance(metric, keras.Serialized) else None
            if name in _F_SCORES and average not in ("micro", "macro", "weighted"):
                # Keras's default (average None) is one score per class: not one number a summary can hold.
                raise ValueError(
                    f"train.metrics: {name} gives one score per class unless it averages them: write "
                    f"{{class_name: {'F1Score' if name == 'f1_score' else name}, config: {{average: macro}}}} "
                    "(or micro, weighted)"
                )
            if name in _F_SCORES and loss not in ("categorical_crossentropy", "CategoricalCrossentropy"):
                raise ValueError(
                    f"train.metrics: {name} takes one-hot labels, and with train.loss {loss} the class ids reach "
                    "Keras one per record: set train.loss: categorical_crossentropy (the runner one-hot encodes the "
                    "class ids for it; for two classes end the model in a softmax of 2), or remove the metric"
                )
        return self

    @model_validator(mode="after")
    def _one_kind_of_weight(self) -> TrainSpec:
        # Keras 3 refuses both (keras/src/trainers/data_adapters/tf_dataset_adapter.py make_class_weight_map_fn:
        # "You cannot `class_weight` and `sample_weight` at the same time.").
        if self.sample_weight is not None and self.class_weight is not None:
            raise ValueError(
                f"train.sample_weight ({self.sample_weight!r}) and train.class_weight both weigh the records, and "
                "Keras takes one or the other: remove train.class_weight, or fold the class weights into the "
                "feature's values"
            )
        return self

    def validates(self) -> bool:
        """Whether per-epoch validation may run (auto decides from the record counts when the job starts)."""
        return self.validation_every != "never"

    def selects_on_validation(self) -> tuple[str, ...]:
        """The keys that act on val_loss (keep the best epoch's weights, cut the rate): they must see a
        validation split of their own, never data.eval (runner/data/splits.py)."""
        return tuple(f"train.{k}" for k in ("early_stopping_patience", "reduce_lr_patience") if getattr(self, k))

    def needs_validation(self) -> str | None:
        """The key that asks for validation whatever auto decides, if one does."""
        if isinstance(self.validation_every, int):
            return "train.validation_every"
        for key in ("early_stopping_patience", "reduce_lr_patience"):
            if getattr(self, key) is not None:
                return f"train.{key}"
        return None

    @model_validator(mode="after")
    def _one_learning_rate(self) -> TrainSpec:
        given = "learning_rate" in self.model_fields_set
        in_config = self.optimizer.config.get("learning_rate") if not isinstance(self.optimizer, str) else None
        if self.schedule is not None:
            if given:
                raise ValueError(
                    f"train.learning_rate ({self.learning_rate:g}) and train.schedule ({self.schedule.class_name}) "
                    "both set the learning rate: the schedule replaces it; remove train.learning_rate"
                )
            if in_config is not None:
                raise ValueError(
                    f"train.optimizer's config sets learning_rate ({in_config:g}) and train.schedule "
                    f"({self.schedule.class_name}) replaces it: remove learning_rate from the optimizer's config"
                )
            if self.reduce_lr_patience is not None:
                raise ValueError(
                    f"train.reduce_lr_patience ({self.reduce_lr_patience}) lowers a constant learning rate, but "
                    f"train.schedule ({self.schedule.class_name}) sets it at every step: use one of them"
                )
        elif given and in_config is not None and in_config != self.learning_rate:
            raise ValueError(
                f"train.learning_rate ({self.learning_rate:g}) and train.optimizer's config learning_rate "
                f"({in_config:g}) disagree: the optimizer's config wins; remove train.learning_rate"
            )
        return self

    @field_validator("callbacks")
    @classmethod
    def _callbacks_form(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not is_import_path(path):
                raise ValueError(f"{path!r}: name your callback class as `package.module:Class`")
            check_import_path(path)
        return value

    @field_validator("metrics")
    @classmethod
    def _metrics_once(cls, value: tuple[Any, ...]) -> tuple[Any, ...]:
        seen = [keras.identity(m) for m in value]
        twice = sorted({n for n in seen if seen.count(n) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice; name each metric once")
        return value

    def optimizer_for_keras(self) -> dict[str, Any]:
        """The optimizer in Keras's serialized form with its constant learning rate settled (see the module's
        docstring); with train.schedule, the caller puts the deserialized schedule in its place."""
        if isinstance(self.optimizer, str):
            config: dict[str, Any] = {"learning_rate": self.learning_rate}
            if self.optimizer.lower() == "sgd":
                config["momentum"] = SGD_MOMENTUM
            serialized = {"class_name": keras.optimizer_class(self.optimizer), "config": config}
        else:
            serialized = self.optimizer.to_keras()
            serialized["config"].setdefault("learning_rate", self.learning_rate)
        return serialized


_F_SCORES = ("f1_score", "F1Score", "FBetaScore")


# Optimizer settings whose variables a checkpoint must hold to mean what it says. use_ema keeps an average of every
# weight and puts it in the weights' place when training ends: switched on at a resume it starts from zeros, and a
# resumed run ended at a loss of ln(classes), a model at chance, exit 0. So the run folder pins it with the class.
# (A momentum or amsgrad switched on starts its buffers from zeros, as a new optimizer does: no harm, not pinned.)
_SLOT_SETTINGS = ("use_ema",)


def optimizer_identity(train: TrainSpec) -> str:
    """The optimizer's Keras class (`Adam`, `SGD`, `AdamW`) and the settings that add slots (`Adam+use_ema`):
    what a checkpoint's optimizer variables mean, so a run folder pins it; its learning rate, schedule and
    other settings may change between attempts."""
    serialized = train.optimizer_for_keras()  # a name's implied settings too (`sgd` has a momentum)
    extra = [key for key in _SLOT_SETTINGS if serialized["config"].get(key) not in (None, False, 0, 0.0)]
    return "+".join([serialized["class_name"], *extra])


class CheckpointSpec(Strict):
    # Unset: one checkpoint per epoch. Set: also every K steps (must divide steps_per_execution evenly).
    every_steps: Integer | None = Field(None, ge=1, le=INT32_MAX)
    keep: Integer = Field(3, ge=1, le=10_000)
    # Seconds a preemption notice (SIGTERM) or Ctrl-C leaves for the final save.
    grace_s: bounded(MIN_WAIT_S, MAX_WAIT_S, " s") = 30.0
