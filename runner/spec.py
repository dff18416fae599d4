"""The job spec: a frozen, typed description of one training job.

Defaults are declared once, here; a YAML file under `jobs/` holds only what differs.
`load_spec` validates the whole file (and any `--set` overrides) before TensorFlow is
imported, and every error names the file, the line and the dotted key.
This module must never import TensorFlow.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runner.errors import SpecError


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


class DataSpec(_Strict):
    # Glob of TFRecord shards, local or gs://. The folder holds the manifest.json written by `runner prepare`.
    train: str = "data/mnist/train-*.tfrecord"
    eval: str | None = "data/mnist/test-*.tfrecord"
    global_batch_size: int = Field(1024, ge=1)
    shuffle_buffer: int = Field(10_000, ge=0)
    # Features fed to the model, in order; the label feature.
    inputs: tuple[str, ...] = ("image",)
    label: str = "label"


class ModelSpec(_Strict):
    name: str = "mnist_cnn"
    params: dict[str, Any] = Field(default_factory=dict)


class TrainSpec(_Strict):
    epochs: int = Field(12, ge=1)
    # Unset: derived from the manifest (records // global_batch_size).
    steps_per_epoch: int | None = Field(None, ge=1)
    # Steps run on the device per host round trip; measured on this model: see benchmarks/RESULTS.md.
    steps_per_execution: int = Field(1, ge=1)
    optimizer: Literal["adam", "sgd", "rmsprop", "adamw"] = "adam"
    learning_rate: float = Field(1e-3, gt=0)
    # bfloat16 is the TPU's native type; the output layer stays float32 either way.
    mixed_precision: Literal["float32", "bfloat16", "float16"] = "float32"
    loss: str = "sparse_categorical_crossentropy"
    metrics: tuple[str, ...] = ("accuracy",)
    seed: int = 0


class CheckpointSpec(_Strict):
    # Unset: one checkpoint per epoch. Set: also every K steps (must divide steps_per_execution evenly).
    every_steps: int | None = Field(None, ge=1)
    keep: int = Field(3, ge=1)
    # Seconds a preemption notice (SIGTERM) leaves for the final save.
    grace_s: float = Field(30.0, gt=0)


class OutputSpec(_Strict):
    # The run folder is <dir>/<job name>; local path or gs://.
    dir: str = "runs"


class JobSpec(_Strict):
    name: str = "mnist_cnn"
    accelerator: AcceleratorSpec = AcceleratorSpec()
    data: DataSpec = DataSpec()
    model: ModelSpec = ModelSpec()
    train: TrainSpec = TrainSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    output: OutputSpec = OutputSpec()

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
        if every is not None and every % spe:
            raise ValueError(
                f"checkpoint.every_steps ({every}) must be a multiple of train.steps_per_execution ({spe}): "
                "checkpoints can only be taken between device executions"
            )
        return self

    @property
    def run_dir(self) -> str:
        return f"{self.output.dir.rstrip('/')}/{self.name}"

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())


# --- loading -----------------------------------------------------------------------------------


class _LineLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys and remembers the line of every dotted key."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise SpecError(f"duplicate key {key!r} (first at line {seen[key]})", line=line)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _key_lines(node: yaml.Node, prefix: tuple = ()) -> dict[tuple, int]:
    """Maps each dotted key path (as a tuple) to its 1-based line in the YAML source."""
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = prefix + (index,)
            lines[path] = item.start_mark.line + 1
            lines.update(_key_lines(item, path))
    return lines


def _allowed_keys(path: tuple) -> list[str]:
    model: type[BaseModel] | None = JobSpec
    for part in path:
        field = model.model_fields.get(part) if model else None
        annotation = field.annotation if field else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return sorted(model.model_fields) if model else []


def _describe(error: dict) -> tuple[tuple, str]:
    path = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        parent, unknown = path[:-1], str(path[-1])
        allowed = _allowed_keys(parent)
        close = difflib.get_close_matches(unknown, allowed, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return path, f"unknown key {unknown!r}{hint} (allowed here: {', '.join(allowed)})"
    message = error["msg"].removeprefix("Value error, ")
    if "input" in error and error["type"] != "model_type" and not isinstance(error["input"], dict):
        message += f" (got {error['input']!r})"
    return path, message


def _set_dotted(doc: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = doc
    for index, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(f"cannot set {dotted!r}: {'.'.join(parts[: index + 1])!r} is not a mapping")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` -> (dotted key, YAML-typed value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or not re.fullmatch(r"[A-Za-z_][\w.]*", key.strip()):
        raise SpecError(f"--set {text!r} must look like key.sub=value (for example train.epochs=3)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError(f"--set {text!r}: the value is not valid YAML ({exc.problem})") from None
    return key.strip(), value


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Reads, checks and returns the job spec at `path` with `--set key=value` overrides applied."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError("no such file; pass the path of a job spec such as jobs/mnist_cnn.yaml", file=path) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read as a YAML text file ({exc.__class__.__name__})", file=path) from None
    try:
        node = yaml.compose(text, Loader=_LineLoader)
        doc = yaml.load(text, Loader=_LineLoader)
    except SpecError as exc:
        raise exc.at(path) from None
    except yaml.YAMLError as exc:
        mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        if context is not None and getattr(exc, "context", None):
            problem += f" ({exc.context} that starts at line {context.line + 1})"
        raise SpecError(f"not valid YAML: {problem}", file=path, line=mark.line + 1 if mark else None) from None
    if doc is None:
        raise SpecError("the file is empty; a job spec is a mapping such as `name: my_job`", file=path)
    if not isinstance(doc, dict):
        raise SpecError(f"a job spec must be a mapping of keys, not a {type(doc).__name__}", file=path, line=1)
    lines = _key_lines(node)
    overridden: dict[tuple, str] = {}
    for text_override in overrides:
        key, value = parse_override(text_override)
        _set_dotted(doc, key, value)
        overridden[tuple(key.split("."))] = text_override
    try:
        return JobSpec.model_validate(doc)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key_path, message = _describe(error)
            dotted = ".".join(str(part) for part in key_path) or "(top level)"
            source = next((f"--set {o}" for p, o in overridden.items() if key_path[: len(p)] == p), None)
            line = _line_for(lines, key_path)
            where = source or (f"{path}:{line}" if line else str(path))
            problems.append(f"{where}: {dotted}: {message}")
        raise SpecError("\n".join(problems)) from None


def _line_for(lines: dict[tuple, int], key_path: tuple) -> int | None:
    for end in range(len(key_path), 0, -1):
        if key_path[:end] in lines:
            return lines[key_path[:end]]
    return None
