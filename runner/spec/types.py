"""The job spec: a frozen, typed description of one training job.

Defaults are declared once, here; a YAML file under `jobs/` holds only what differs.
`runner.specfile.load_spec` validates the whole file (and any `--set` overrides) before
TensorFlow is imported, and every error names the file, the line and the dotted key.
Every field has the range the runner can actually run with: integers are strict (`true` is not 1),
numbers are finite, and a value that passes here does not overflow or fail to convert later.
Paths are relative to the spec file (runner/spec/paths.py). This module must never import TensorFlow.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, StrictBool, StrictInt, ValidationInfo
from pydantic import field_validator, model_validator

from runner.spec.paths import has_control_character, refuse_glob_characters, resolve_path
from runner.spec.usercode import IDENTIFIER, CodeRoots, check_import_path, is_import_path

# The built-in models (runner/models.py's MODELS, which imports TensorFlow): `model.name` without a colon.
MODEL_NAMES = ("mnist_cnn", "cifar10_cnn", "imdb_lstm", "weather_rnn")

# Counts TensorFlow holds in int32 (shapes, steps per execution, TPU loop counters).
INT32_MAX = 2**31 - 1
# Seconds a timer, a join or a retry loop can wait: Python's timers overflow near 2**31 ms and the gs:// retry
# schedule (runner/data/storage.py) near 32,800 s; an hour is more than any of them needs.
MAX_WAIT_S = 3600.0


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a number, not true/false")
    return value


def _integer(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not true/false")
    return value


# An int, never a bool or a float such as 3.0 (pydantic strict), with a message that says why.
Integer = Annotated[StrictInt, BeforeValidator(_integer)]
# A finite float that is never a bool (pydantic's lax float reads `true` as 1.0; allow_inf_nan is off below).
Number = Annotated[float, BeforeValidator(_not_a_bool)]
Name = Annotated[str, Field(min_length=1, max_length=256)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --- sections ----------------------------------------------------------------------------------------


class AcceleratorSpec(_Strict):
    kind: Literal["auto", "tpu", "gpu", "cpu"] = "auto"
    # A TPU VM is "local"; a named TPU is its name; a remote TPU node is "grpc://host:8470".
    # Unset: TPU_NAME, then COLAB_TPU_ADDR, then "local" when /dev/accel* or /dev/vfio exist.
    tpu: Name | None = None
    # Bound on every TPU step (resolve, connect, initialise); a TPU that is not there must not stall a CPU run.
    timeout_s: Number = Field(60.0, gt=0, le=MAX_WAIT_S)
    # Split the host CPU into this many logical devices (MirroredStrategy over them): tests and dry runs.
    cpu_devices: Integer = Field(1, ge=1, le=64)

    @field_validator("tpu")
    @classmethod
    def _tpu_is_one_line(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or has_control_character(value)):
            raise ValueError(f"{value!r} is not a TPU name: write local, a TPU's name, or grpc://HOST:8470")
        return value


class FeatureSpec(_Strict):
    """One feature of the tf.train.Example records, as the model receives it (see docs/own-model.md)."""

    # uint8 pixels arrive as float32 0..255 (models rescale themselves); string stays tf.string.
    dtype: Literal["uint8", "int64", "float32", "string"]
    shape: tuple[Integer, ...] = Field((), max_length=8)
    # A list of any length, padded with zeros (or "") or cut to shape[0]: TPUs need static shapes.
    var_len: StrictBool = False
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
        elements = 1
        for size in self.shape:
            elements *= size
        if elements > INT32_MAX:
            raise ValueError(f"shape {list(self.shape)} holds {elements:,} values per example; at most {INT32_MAX:,}")
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


def _auto_or_bool(value: Any) -> bool | str:
    if value == "auto" or isinstance(value, bool):
        return value
    raise ValueError(f"{value!r} is none of auto, true, false")


class DataSpec(_Strict):
    # Glob of TFRecord shards, local or gs://. The folder holds the manifest.json written by `runner prepare`
    # (built-in datasets) or `runner manifest` (your own TFRecords).
    train: str = Field("data/mnist/train-*.tfrecord", validate_default=True)
    eval: str | None = Field("data/mnist/test-*.tfrecord", validate_default=True)
    # Shards checked after every epoch when train.validate_every_epoch is set. Unset: the eval shards.
    validation: str | None = None
    global_batch_size: Integer = Field(1024, ge=1, le=INT32_MAX)
    shuffle_buffer: Integer = Field(10_000, ge=0, le=INT32_MAX)
    # tf.data's autotuner (a background thread re-tuning parallelism and buffers). Off: every AUTOTUNE
    # parallelism is the machine's core count. On, tearing down an input iterator waits out the tuner's
    # current sleep (up to 60 s), so model.fit returns late (runner/data/pipeline.py).
    autotune: StrictBool = False
    # Hold the training split in host memory, decoded, instead of streaming it from the shards every epoch
    # (runner/data/in_memory.py). auto: held when one worker trains on a CPU or GPUs and it takes at most 1 GiB
    # decoded (and an eighth of the memory); true: held, or the job is refused; false: streamed.
    in_memory: Annotated[Literal["auto"] | bool, PlainValidator(_auto_or_bool)] = "auto"
    # Before training, every shard the job reads is checked against its manifest (docs/data.md): size (stat:
    # present, the listed size), sha256 (also reads and hashes every byte), or off.
    # A bare `off` in YAML (and --set) reads as false: it means off.
    verify: Annotated[Literal["size", "sha256", "off"], BeforeValidator(lambda v: "off" if v is False else v)] = "size"
    # Features fed to the model, in order; the label feature.
    inputs: tuple[Name, ...] = Field(("image",), max_length=256)
    label: Name = "label"
    # Your own TFRecords: the schema of each feature. `runner manifest` writes it into manifest.json and
    # `runner run` refuses to train when the manifest says otherwise. Unset: the manifest's schema is used.
    features: dict[Name, FeatureSpec] | None = Field(None, max_length=1024)
    # `package.module:function` called on every decoded batch (a dict of tensors) before the model sees it.
    preprocess: str | None = None

    @field_validator("train", "eval", "validation")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_path(value, ("data", info.field_name), info.context, glob=True)

    @field_validator("inputs")
    @classmethod
    def _inputs_once(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("no inputs: name the features the model reads, e.g. [image]")
        twice = sorted({n for n in value if value.count(n) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice; name each input once")
        return value

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


def _check_json(value: Any, where: str) -> None:
    """Text keys, finite numbers, text, booleans, null, lists and mappings of them (what JSON can record)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: the key {key!r} is not text")
            _check_json(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: use a finite number")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{where} is a {type(value).__name__} ({value!r:.40}): use text, a number, true/false, a list or a mapping")


class ModelSpec(_Strict):
    # A built-in model (MODEL_NAMES, runner/models.py) or your own build function as `package.module:function`
    # in your code (see `code`).
    name: str = "mnist_cnn"
    # Handed to the build function as they are: JSON-like values (text keys, finite numbers).
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _params_are_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_json(value, "params")
        return value

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
        if value not in MODEL_NAMES:
            close = difflib.get_close_matches(value, MODEL_NAMES, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown built-in model {value!r}{hint} (built in: {', '.join(MODEL_NAMES)}; "
                "your own: `package.module:function`)"
            )
        return value


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


class TrainSpec(_Strict):
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
    def _plateau_needs_validation(self) -> "TrainSpec":
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


class CheckpointSpec(_Strict):
    # Unset: one checkpoint per epoch. Set: also every K steps (must divide steps_per_execution evenly).
    every_steps: Integer | None = Field(None, ge=1, le=INT32_MAX)
    keep: Integer = Field(3, ge=1, le=10_000)
    # Seconds a preemption notice (SIGTERM) or Ctrl-C leaves for the final save.
    grace_s: Number = Field(30.0, gt=0, le=MAX_WAIT_S)


class StorageSpec(_Strict):
    # An unanswered gs:// operation (outage, 503s, dropped connections) is retried with backoff for about
    # this long, then the job stops with exit 3 naming the bucket. See runner/data/storage.py.
    timeout_s: Number = Field(300.0, gt=0, le=MAX_WAIT_S)


class MatmulSpec(_Strict):
    """`kind: matmul_bench`: an N x N matrix multiplied `chain` times in one compiled call, on every replica."""

    # 32768 x 32768 is 4 GiB per float32 matrix: the most one accelerator's memory holds three of.
    size: Integer = Field(4096, ge=1, le=32_768)
    chain: Integer = Field(4, ge=1, le=1000)
    # Timed calls after the first (cold) one; the warm figure is their median.
    iterations: Integer = Field(5, ge=1, le=10_000)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class OutputSpec(_Strict):
    # The run folder is <dir>/<job name>; local path or gs://. No glob characters: checkpoints are found by
    # pattern, so a folder named `runs[1]` would never be resumed.
    dir: str = Field("runs", validate_default=True)
    # TensorBoard scalars per epoch (loss, metrics, examples/s, input wait) in <run folder>/tensorboard.
    tensorboard: StrictBool = True

    @field_validator("dir")
    @classmethod
    def _resolve(cls, value: str, info: ValidationInfo) -> str:
        return refuse_glob_characters(resolve_path(value, ("output", "dir"), info.context))


class ProfileSpec(_Strict):
    # Global steps start_step .. start_step + steps - 1 (1-based) are traced into <run folder>/profile.
    # Step 1 compiles: start later to see steady steps.
    start_step: Integer = Field(10, ge=1, le=INT32_MAX)
    steps: Integer = Field(5, ge=1, le=1000)


class CodeSpec(_Strict):
    """Where the spec's import paths (`package.module:function`) may point: a job spec names code, so it must
    be trusted like a Python script, and it reaches only the code it declares here (docs/specs.md)."""

    # The folder holding your own modules. Unset: the spec file's folder.
    folder: str | None = Field(None, validate_default=True)
    # Installed packages (pip install, PYTHONPATH) the spec may also name, by top-level name: [fashionnet].
    packages: tuple[Annotated[str, Field(pattern=rf"^{IDENTIFIER}$", max_length=128)], ...] = Field((), max_length=64)

    @field_validator("folder")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return (info.context or {}).get("base")
        path = resolve_path(value, ("code", "folder"), info.context)
        if path.startswith("gs://"):
            raise ValueError(f"{path!r}: code is imported from a local folder, not from a bucket")
        return path

    @field_validator("packages")
    @classmethod
    def _packages_are_yours(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if name in sys.stdlib_module_names or name == "runner":
                owner = "the runner itself" if name == "runner" else "Python's standard library"
                raise ValueError(f"{name!r} is {owner}, not a package of yours; list only your own packages")
        return value


class JobSpec(_Strict):
    name: str = "mnist_cnn"
    # train: fit a model on data; matmul_bench: time matrix multiplications (TFLOPS) and train nothing.
    kind: Literal["train", "matmul_bench"] = "train"
    accelerator: AcceleratorSpec = Field(default_factory=dict, validate_default=True)
    data: DataSpec = Field(default_factory=dict, validate_default=True)
    model: ModelSpec = Field(default_factory=dict, validate_default=True)
    train: TrainSpec = Field(default_factory=dict, validate_default=True)
    checkpoint: CheckpointSpec = Field(default_factory=dict, validate_default=True)
    output: OutputSpec = Field(default_factory=dict, validate_default=True)
    matmul: MatmulSpec = Field(default_factory=dict, validate_default=True)
    storage: StorageSpec = Field(default_factory=dict, validate_default=True)
    code: CodeSpec = Field(default_factory=dict, validate_default=True)
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
            unused = [k for k in ("data", "model", "train", "checkpoint", "code") if k in self.model_fields_set]
            if unused:
                raise ValueError(f"kind matmul_bench trains nothing: remove {', '.join(unused)}")
        if self.train.validate_every_epoch and not (self.data.validation or self.data.eval):
            raise ValueError("train.validate_every_epoch needs data to validate on: set data.validation or data.eval")
        return self

    @property
    def run_dir(self) -> str:
        return f"{self.output.dir.rstrip('/')}/{self.name}"

    @property
    def import_paths(self) -> dict[str, str]:
        """Every `package.module:function` the spec names, by the key that names it."""
        named = {"model.name": self.model.name, "data.preprocess": self.data.preprocess or "", "train.loss": self.train.loss}
        named.update({f"train.metrics[{i}]": m for i, m in enumerate(self.train.metrics)})
        return {key: value for key, value in named.items() if is_import_path(value)}

    @property
    def code_roots(self) -> CodeRoots:
        """Where import paths may point (runner/spec/usercode.py); without a spec file, the current directory."""
        return CodeRoots(self.code.folder or os.getcwd(), self.code.packages)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())
