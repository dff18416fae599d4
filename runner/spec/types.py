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
import os
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    PlainValidator,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from runner.models import MODEL_NAMES, params_problem
from runner.spec import base
from runner.spec import hub as hub_spec
from runner.spec.base import INT32_MAX, MAX_WAIT_S, MIN_WAIT_S, Integer, Name, Strict, bounded, invisible_character
from runner.spec.code import CodeSpec
from runner.spec.paths import refuse_glob_characters, resolve_path, sibling_split
from runner.spec.sharding import check_layout, check_mesh, mesh_problem
from runner.spec.train import CheckpointSpec, TrainSpec
from runner.spec.usercode import (
    CodeRoots,
    check_import_path,
    is_import_path,
    system_folder_problem,
)

# --- sections ----------------------------------------------------------------------------------------


class AcceleratorSpec(Strict):
    kind: Literal["auto", "tpu", "gpu", "cpu"] = "auto"
    # The engine Keras computes with: auto is JAX on a TPU and TensorFlow elsewhere (runner/device/backend.py).
    backend: Literal["auto", "tensorflow", "jax"] = "auto"
    # A TPU VM is "local"; a named TPU is its name; a remote TPU node is "grpc://host:8470".
    # Unset: TPU_NAME, then COLAB_TPU_ADDR, then "local" when /dev/accel* or /dev/vfio exist.
    tpu: Name | None = None
    # Bound on every TPU step (resolve, connect, initialise, list its devices); a TPU that is not there must not
    # stall a CPU run.
    timeout_s: bounded(MIN_WAIT_S, MAX_WAIT_S, " s") = 60.0
    # A job of several processes: how long each waits for all to join (runner/device/processes.py). The workers
    # of a slice reach the join minutes apart (each pulls the image and checks its host alone): 900 s, three
    # times JAX's own default; never under JAX's 300 s on a TPU slice (docs/multihost.md says why).
    join_timeout_s: bounded(1.0, MAX_WAIT_S, " s") = 900.0
    # A job of several processes (runner/device/processes.py): a host silent this long ends every process
    # (exit 3); JAX's heartbeat timeout, whose own default is 100 s.
    heartbeat_s: bounded(2.0, MAX_WAIT_S, " s") = 100.0
    # Split the host CPU into this many logical devices (MirroredStrategy over them): tests and dry runs.
    cpu_devices: Integer = Field(1, ge=1, le=64)
    # auto: every device on one data axis; else {axis: size, ...}, the first axis the batch's (runner/spec/sharding.py).
    mesh: Annotated[Any, PlainValidator(check_mesh)] = "auto"

    @field_validator("tpu")
    @classmethod
    def _tpu_is_one_line(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or invisible_character(value)):
            raise ValueError(f"{value!r} is not a TPU name: write local, a TPU's name, or grpc://HOST:8470")
        return value

    @model_validator(mode="after")
    def _tpu_runs_jax(self) -> AcceleratorSpec:
        if self.kind == "tpu" and self.backend == "tensorflow":
            raise ValueError(
                "kind tpu with backend tensorflow: TensorFlow's TPU engine is retired (no TPU runtime after 2.18, "
                "none on TPU7x; the TPU image carries JAX: docs/tpu.md); set backend: jax (or auto)"
            )
        return self


class FeatureSpec(Strict):
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
    def _consistent(self) -> FeatureSpec:
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


class DataSpec(Strict):
    # Glob of TFRecord shards, local or gs://. The folder holds the manifest.json written by `runner prepare`
    # (built-in datasets) or `runner manifest` (your own TFRecords).
    train: str = Field("data/mnist/train-*.tfrecord", validate_default=True)
    # Shards evaluated once training ends: the figures the summary reports. Unset: the split named test beside
    # data.train (test-*.tfrecord in its folder, as `runner prepare` names shards) when the manifest there lists
    # one, else none; never another dataset's. null: no evaluation.
    eval: str | None = None
    # Shards evaluated every train.validation_every epochs; early stopping and learning-rate cuts select on them.
    # Unset: the split named validation beside data.train when the manifest there lists one, else the eval
    # shards for watching only: a job that selects on val_loss is refused rather than select on data.eval.
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

    @model_validator(mode="after")
    def _eval_beside_train(self) -> DataSpec:
        # Derived from the resolved data.train, so the test split is the one beside whatever folder it names.
        if "eval" not in self.model_fields_set:
            object.__setattr__(self, "eval", sibling_split(self.train, "test"))
        return self

    @property
    def eval_is_derived(self) -> bool:
        """data.eval was not given: it names the test split beside data.train, which may not exist."""
        return "eval" not in self.model_fields_set

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
    def _columns_are_declared(self) -> DataSpec:
        if self.features is not None:
            for key, name in [*(("data.inputs", n) for n in self.inputs), ("data.label", self.label)]:
                if name not in self.features:
                    raise ValueError(
                        f"{key} names {name!r}, which data.features does not declare "
                        f"(declared: {', '.join(self.features) or 'nothing'})"
                    )
        return self


class ModelSpec(Strict):
    # A built-in model (MODEL_NAMES, runner/models.py) or your own build function as `package.module:function`
    # in your code (see `code`).
    name: str = "mnist_cnn"
    # Handed to the build function as they are: JSON-like values (text keys, finite numbers).
    params: dict[str, Any] = Field(default_factory=dict)
    # replicated, fsdp, hub, or {variable-path regex: [axis or null, ...]} over accelerator.mesh (docs/sharding.md).
    sharding: Annotated[Any, PlainValidator(check_layout)] = "replicated"
    # A KerasHub preset (name, kaggle:// or hf:// handle, folder): its CausalLM is the model (runner/spec/hub.py).
    hub: str | None = None
    # LoRA adapters of this rank on the hub backbone (backbone.enable_lora): only they train.
    lora_rank: Annotated[Any, PlainValidator(hub_spec.check_lora_rank)] = None

    @field_validator("hub")
    @classmethod
    def _hub_preset(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else hub_spec.check_preset(value, info.context)

    @field_validator("params")
    @classmethod
    def _params_are_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        base.check_json(value, "params")
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

    @field_validator("params")
    @classmethod
    def _builtin_params(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # A built-in model's params are known without TensorFlow: a typo is refused here, with its line. (`name`
        # is declared first, so it is validated first.)
        name = info.data.get("name")
        problem = params_problem(name, value) if name in MODEL_NAMES else None
        if problem:
            raise ValueError(problem)
        return value


class StorageSpec(Strict):
    # An unanswered gs:// operation (outage, 503s, dropped connections) is retried with backoff for about
    # this long, then the job stops with exit 3 naming the bucket. See runner/data/storage.py.
    timeout_s: bounded(MIN_WAIT_S, MAX_WAIT_S, " s") = 300.0


class MatmulSpec(Strict):
    """`kind: matmul_bench`: an N x N matrix multiplied `chain` times in one compiled call, on every replica."""

    # 32768 x 32768 is 4 GiB per float32 matrix: the most one accelerator's memory holds three of.
    size: Integer = Field(4096, ge=1, le=32_768)
    chain: Integer = Field(4, ge=1, le=1000)
    # Timed calls after the first (cold) one; the warm figure is their median.
    iterations: Integer = Field(5, ge=1, le=10_000)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class OutputSpec(Strict):
    # The run folder is <dir>/<job name>; local path or gs://. No glob characters: checkpoints are found by
    # pattern, so a folder named `runs[1]` would never be resumed.
    dir: str = Field("runs", validate_default=True)
    # TensorBoard scalars per epoch (loss, metrics, examples/s, input wait) in <run folder>/tensorboard.
    tensorboard: StrictBool = True
    # A SavedModel in <run folder>/saved_model beside model.keras, for TF Serving and TensorFlow without Keras;
    # false skips its export (about 2 s of a small job on a 2-core CPU).
    saved_model: StrictBool = True

    @field_validator("dir")
    @classmethod
    def _resolve(cls, value: str, info: ValidationInfo) -> str:
        return refuse_glob_characters(resolve_path(value, ("output", "dir"), info.context))


class ProfileSpec(Strict):
    # Global steps start_step .. start_step + steps - 1 (1-based) are traced into <run folder>/profile.
    # Step 1 compiles: start later to see steady steps.
    start_step: Integer = Field(10, ge=1, le=INT32_MAX)
    steps: Integer = Field(5, ge=1, le=1000)


class JobSpec(Strict):
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
            # A leading '.' hides the run folder from `ls`; a leading '-' reads as an option to runner and gsutil.
            first = value[:1] in "._-" and re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", value)
            rule = (f"must start with a letter or digit, not {value[0]!r} (try {value.lstrip('._-') or 'job'!r})"
                    if first else "must be 1-128 letters, digits, '_', '.' or '-', the first a letter or digit")
            raise ValueError(f"job name {value!r} {rule} (it names the run folder and the checkpoints)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _hub_defaults(cls, doc: Any) -> Any:
        return hub_spec.fill_defaults(doc)

    @model_validator(mode="after")
    def _hub_job_fits(self) -> JobSpec:
        if problem := hub_spec.job_problem(self):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _cadence_fits_execution(self) -> JobSpec:
        every, spe = self.checkpoint.every_steps, self.train.steps_per_execution
        if every is not None and spe != "auto" and every % spe:
            raise ValueError(
                f"checkpoint.every_steps ({every}) must be a multiple of train.steps_per_execution ({spe}): "
                "checkpoints can only be taken between device executions"
            )
        return self

    @model_validator(mode="after")
    def _mesh_fits(self) -> JobSpec:
        hub = getattr(self.model, "hub", None)
        if problem := mesh_problem(self.accelerator, self.model.sharding, self.data.global_batch_size, hub):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _sections_fit_kind(self) -> JobSpec:
        if self.kind == "train" and "matmul" in self.model_fields_set:
            raise ValueError("matmul: is read only by kind: matmul_bench; remove it or set kind: matmul_bench")
        if self.kind == "matmul_bench":
            unused = [k for k in ("data", "model", "train", "checkpoint", "code") if k in self.model_fields_set]
            if unused:
                raise ValueError(f"kind matmul_bench trains nothing: remove {', '.join(unused)}")
        asking = self.train.needs_validation()
        if asking and self.train.validates() and not (self.data.validation or self.data.eval):
            raise ValueError(f"{asking} needs data to validate on: set data.validation or data.eval")
        return self

    @model_validator(mode="after")
    def _sample_weight_is_a_record_feature(self) -> JobSpec:
        weight, d = self.train.sample_weight, self.data
        if weight is None:
            return self
        if weight == d.label or weight in d.inputs:
            role = "data.label" if weight == d.label else "one of data.inputs"
            raise ValueError(
                f"train.sample_weight names {weight!r}, which is {role}: a sample weight is a feature of its own "
                "(the model never sees it); name the feature that holds the weights"
            )
        if d.features is not None and weight not in d.features:
            raise ValueError(
                f"train.sample_weight names {weight!r}, which data.features does not declare "
                f"(declared: {', '.join(d.features)})"
            )
        return self

    @model_validator(mode="after")
    def _code_folder_is_yours(self) -> JobSpec:
        # An explicit code.folder is checked as it is read; the default (the spec's own folder) only once the
        # spec names code in it: a spec of built-ins may sit anywhere.
        folder = self.code.folder
        if "folder" not in self.code.model_fields_set and folder and self.import_paths:
            if problem := system_folder_problem(folder):
                key = next(iter(self.import_paths))
                raise ValueError(
                    f"{key} names code, and {problem} (code.folder unset: the spec's own folder); "
                    "set code.folder to the folder of your own modules"
                )
        return self

    @property
    def run_dir(self) -> str:
        return f"{self.output.dir.rstrip('/')}/{self.name}"

    @property
    def import_paths(self) -> dict[str, str]:
        """Every `package.module:function` the spec names, by the key that names it."""
        named = {"model.name": self.model.name, "data.preprocess": self.data.preprocess or ""}
        named["train.loss"] = self.train.loss
        named.update({f"train.metrics[{i}]": m for i, m in enumerate(self.train.metrics)})
        named.update({f"train.callbacks[{i}]": c for i, c in enumerate(self.train.callbacks)})
        return {key: value for key, value in named.items() if isinstance(value, str) and is_import_path(value)}

    @property
    def code_roots(self) -> CodeRoots:
        """Where import paths may point (runner/spec/usercode.py); without a spec file, the current directory."""
        return CodeRoots(self.code.folder or os.getcwd(), self.code.packages)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())
