"""The job spec: a frozen, typed description of one training job.

Defaults are declared once, here; a YAML file under `jobs/` holds only what differs.
`runner.specfile.load_spec` validates the whole file (and any `--set` overrides) before
TensorFlow is imported, and every error names the file, the line and the dotted key.
This module must never import TensorFlow.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from runner.userimport import check_import_path, is_import_path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AcceleratorSpec(_Strict):
    kind: Literal["auto", "tpu", "gpu", "cpu"] = "auto"
    # A TPU VM is "local"; a named TPU is its name; a remote TPU node is "grpc://host:8470".
    # Unset: TPU_NAME, then COLAB_TPU_ADDR, then "local" when /dev/accel* or /dev/vfio exist.
    tpu: str | None = None
    # Bound on every TPU step (resolve, connect, initialise); a TPU that is not there must not stall a CPU run.
    timeout_s: float = Field(60.0, gt=0)
    # Split the host CPU into this many logical devices (MirroredStrategy over them): tests and dry runs.
    cpu_devices: int = Field(1, ge=1, le=64)


class FeatureSpec(_Strict):
    """One feature of the tf.train.Example records, as the model receives it (see README "Your own model")."""

    # uint8 pixels arrive as float32 0..255 (models rescale themselves); string stays tf.string.
    dtype: Literal["uint8", "int64", "float32", "string"]
    shape: tuple[int, ...] = ()
    # A list of any length, padded with zeros (or "") or cut to shape[0]: TPUs need static shapes.
    var_len: bool = False
    # How stored bytes become the uint8 tensor: raw bytes, or a PNG/JPEG image of shape [height, width, channels].
    # Unset: raw for uint8, none for the others.
    decode: Literal["none", "raw", "png", "jpeg"] = "none"

    @model_validator(mode="before")
    @classmethod
    def _default_decode(cls, doc: Any) -> Any:
        if isinstance(doc, dict) and doc.get("decode") is None:
            doc = {**doc, "decode": "raw" if doc.get("dtype") == "uint8" else "none"}
        return doc

    @model_validator(mode="after")
    def _consistent(self) -> "FeatureSpec":
        if any(size < 1 for size in self.shape):
            raise ValueError(f"shape {list(self.shape)}: every dimension must be at least 1")
        if (self.dtype == "uint8") != (self.decode != "none"):
            raise ValueError(
                f"dtype {self.dtype} with decode {self.decode}: uint8 features are decoded from bytes "
                "(decode raw, png or jpeg); int64, float32 and string features use decode none"
            )
        if self.decode in ("png", "jpeg") and (len(self.shape) != 3 or self.shape[2] not in (1, 3, 4)):
            raise ValueError(f"decode {self.decode} needs shape [height, width, channels] with 1, 3 or 4 channels")
        if self.var_len and (self.decode != "none" or len(self.shape) != 1):
            raise ValueError(
                "var_len needs a one-dimensional int64, float32 or string feature with shape [max_length]"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "var_len": self.var_len, "decode": self.decode}


class DataSpec(_Strict):
    # Glob of TFRecord shards, local or gs://. The folder holds the manifest.json written by `runner prepare`.
    train: str = "data/mnist/train-*.tfrecord"
    eval: str | None = "data/mnist/test-*.tfrecord"
    # Shards checked after every epoch when train.validate_every_epoch is set. Unset: the eval shards.
    validation: str | None = None
    global_batch_size: int = Field(1024, ge=1)
    shuffle_buffer: int = Field(10_000, ge=0)
    # tf.data's autotuner (a background thread re-tuning parallelism and buffers). Off: every AUTOTUNE
    # parallelism is the machine's core count. On, tearing down an input iterator waits out the tuner's
    # current sleep (up to 60 s), so model.fit returns late (runner/data.py).
    autotune: bool = False
    # Checked before the run folder is touched (docs/data.md): size: every shard the manifest lists for
    # train/eval/validation is there with its listed size (one stat each); sha256: also reads every byte
    # and compares its hash (cost in the summary's data_verify); off: neither (the manifest is still checked).
    # A bare `off` in YAML (and --set) reads as false: it means off.
    verify: Annotated[Literal["size", "sha256", "off"], BeforeValidator(lambda v: "off" if v is False else v)] = "size"
    # Features fed to the model, in order; the label feature.
    inputs: tuple[str, ...] = ("image",)
    label: str = "label"
    # Your own TFRecords: the schema of each feature. `runner manifest` writes it into manifest.json and
    # `runner run` refuses to train when the manifest says otherwise. Unset: the manifest's schema is used.
    features: dict[str, FeatureSpec] | None = None
    # `package.module:function` called on every decoded batch (a dict of tensors) before the model sees it.
    preprocess: str | None = None

    @field_validator("preprocess")
    @classmethod
    def _preprocess_is_import_path(cls, value: str | None) -> str | None:
        return None if value is None else check_import_path(value)

    @model_validator(mode="after")
    def _columns_are_declared(self) -> "DataSpec":
        if self.features is not None:
            for key, name in [*(("data.inputs", n) for n in self.inputs), ("data.label", self.label)]:
                if name not in self.features:
                    raise ValueError(
                        f"{key} names {name!r}, which data.features does not declare "
                        f"(declared: {', '.join(self.features) or 'nothing'})"
                    )
        return self


class ModelSpec(_Strict):
    # A built-in model (runner/models.py) or your own build function as `package.module:function`.
    name: str = "mnist_cnn"
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _builtin_or_import_path(cls, value: str) -> str:
        if is_import_path(value):
            return check_import_path(value)
        if "." in value:
            module, _, function = value.rpartition(".")
            raise ValueError(
                f"{value!r} looks like an import path: separate module and function with a colon, "
                f"e.g. {module + ':' + function!r}"
            )
        return value


class TrainSpec(_Strict):
    epochs: int = Field(12, ge=1)
    # Unset: derived from the manifest (records // global_batch_size).
    steps_per_epoch: int | None = Field(None, ge=1)
    # Steps run on the device per host round trip. auto: 32 on a TPU (where each round trip costs
    # milliseconds), 1 on CPU/GPU (measured no faster here: see benchmarks/RESULTS.md).
    steps_per_execution: int | Literal["auto"] = "auto"
    optimizer: Literal["adam", "sgd", "rmsprop", "adamw"] = "adam"
    learning_rate: float = Field(1e-3, gt=0)
    # bfloat16 is the TPU's native type; the output layer stays float32 either way.
    mixed_precision: Literal["float32", "bfloat16", "float16"] = "float32"
    # Keras names, or your own `package.module:function` taking (y_true, y_pred).
    loss: str = "sparse_categorical_crossentropy"
    metrics: tuple[str, ...] = ("accuracy",)
    seed: int = 0
    # Evaluate on data.validation (unset: data.eval) after every epoch; val_* metrics join each epoch's record.
    validate_every_epoch: bool = False
    # Stop once val_loss has not improved for this many epochs and keep the best epoch's weights. Needs
    # validate_every_epoch. After a resume the count starts again from the resumed epoch.
    early_stopping_patience: int | None = Field(None, ge=1)
    # Multiply the learning rate by reduce_lr_factor once val_loss has not improved for this many epochs.
    reduce_lr_patience: int | None = Field(None, ge=1)
    reduce_lr_factor: float = Field(0.5, gt=0, lt=1)

    @model_validator(mode="after")
    def _plateau_needs_validation(self) -> "TrainSpec":
        for key in ("early_stopping_patience", "reduce_lr_patience"):
            value = getattr(self, key)
            if value is not None and not self.validate_every_epoch:
                raise ValueError(f"{key} ({value}) watches val_loss: also set validate_every_epoch: true")
        return self

    @field_validator("loss")
    @classmethod
    def _loss_form(cls, value: str) -> str:
        return check_import_path(value) if is_import_path(value) else value

    @field_validator("metrics")
    @classmethod
    def _metrics_form(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_import_path(m) if is_import_path(m) else m for m in value)


class CheckpointSpec(_Strict):
    # Unset: one checkpoint per epoch. Set: also every K steps (must divide steps_per_execution evenly).
    every_steps: int | None = Field(None, ge=1)
    keep: int = Field(3, ge=1)
    # Seconds a preemption notice (SIGTERM) leaves for the final save.
    grace_s: float = Field(30.0, gt=0)


class StorageSpec(_Strict):
    # An unanswered gs:// operation (outage, 503s, dropped connections) is retried with backoff for about
    # this long, then the job stops with exit 3 naming the bucket. See runner/storage.py.
    timeout_s: float = Field(300.0, gt=0)


class MatmulSpec(_Strict):
    """`kind: matmul_bench`: an N x N matrix multiplied `chain` times in one compiled call, on every replica."""

    size: int = Field(4096, ge=1)
    chain: int = Field(4, ge=1)
    # Timed calls after the first (cold) one; the warm figure is their median.
    iterations: int = Field(5, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class OutputSpec(_Strict):
    # The run folder is <dir>/<job name>; local path or gs://.
    dir: str = "runs"
    # TensorBoard scalars per epoch (loss, metrics, examples/s, input wait) in <run folder>/tensorboard.
    tensorboard: bool = True


class ProfileSpec(_Strict):
    # Global steps start_step .. start_step + steps - 1 (1-based) are traced into <run folder>/profile.
    # Step 1 compiles: start later to see steady steps.
    start_step: int = Field(10, ge=1)
    steps: int = Field(5, ge=1, le=1000)


class JobSpec(_Strict):
    name: str = "mnist_cnn"
    # train: fit a model on data; matmul_bench: time matrix multiplications (TFLOPS) and train nothing.
    kind: Literal["train", "matmul_bench"] = "train"
    accelerator: AcceleratorSpec = AcceleratorSpec()
    data: DataSpec = DataSpec()
    model: ModelSpec = ModelSpec()
    train: TrainSpec = TrainSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    output: OutputSpec = OutputSpec()
    matmul: MatmulSpec = MatmulSpec()
    storage: StorageSpec = StorageSpec()
    # Unset: no profiler trace.
    profile: ProfileSpec | None = None

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", value):
            raise ValueError(
                f"job name {value!r} must be 1-128 letters, digits, '_', '.' or '-' "
                "(it names the run folder and the checkpoints)"
            )
        return value

    @model_validator(mode="after")
    def _cadence_fits_execution(self) -> "JobSpec":
        every, spe = self.checkpoint.every_steps, self.train.steps_per_execution
        if spe != "auto" and spe < 1:
            raise ValueError(f"train.steps_per_execution ({spe}) must be 'auto' or a positive integer")
        if every is not None and spe != "auto" and every % spe:
            raise ValueError(
                f"checkpoint.every_steps ({every}) must be a multiple of train.steps_per_execution ({spe}): "
                "checkpoints can only be taken between device executions"
            )
        return self

    @model_validator(mode="after")
    def _sections_fit_kind(self) -> "JobSpec":
        if self.kind == "train" and "matmul" in self.model_fields_set:
            raise ValueError("matmul: is read only by kind: matmul_bench; remove it or set kind: matmul_bench")
        if self.kind == "matmul_bench":
            unused = [k for k in ("data", "model", "train", "checkpoint") if k in self.model_fields_set]
            if unused:
                raise ValueError(f"kind matmul_bench trains nothing: remove {', '.join(unused)}")
        if self.train.validate_every_epoch and not (self.data.validation or self.data.eval):
            raise ValueError("train.validate_every_epoch needs data to validate on: set data.validation or data.eval")
        return self

    @property
    def run_dir(self) -> str:
        return f"{self.output.dir.rstrip('/')}/{self.name}"

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())
