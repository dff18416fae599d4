"""Loading a job spec from YAML: `load_spec` reads the file, applies `--set` overrides and validates the
whole of it against runner/spec/types.py's JobSpec before TensorFlow is imported; every error names the file, the
line and the dotted key (or the `--set` it came from). This module must never import TensorFlow.

Loading is bounded, whatever the input: a file over MAX_BYTES is not read, a `--set` over MAX_OVERRIDE_CHARS
is not parsed, and the YAML itself is parsed within runner/spec/yaml_lines.py's bounds (depth, values counted through
aliases, one document, plain keys).

A `--set` value is YAML (`train.epochs=3` is a number, `data.eval=null` is null), but only when YAML reads the
whole text as one value: text YAML would read otherwise (`name=--- x`, a document marker, reads as `x`;
`name=x # y` drops the comment) is refused with the quoting that keeps it as written.

`preflight` is what `runner validate` adds: the checks that read the disk but import nothing (user modules
found inside the spec's code roots, the attribute read from their source, the data's manifest against the
batch size).
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import os
import re
import stat
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from runner import SpecError
from runner.spec.datacheck import check_data, default_pattern
from runner.spec.keras import NAME_TAG, SERIALIZED_TAG
from runner.spec.types import JobSpec
from runner.spec.usercode import check_defined, find_code
from runner.spec.yaml_lines import INT_KEYED, MAX_BYTES, MAX_DEPTH, key_lines, parse_yaml, shown

MAX_OVERRIDES = 256
MAX_OVERRIDE_CHARS = 64 << 10
# Problems listed in one error: a spec with thousands of bad keys gets the first ones and a count.
MAX_PROBLEMS = 20
_KEY = r"[A-Za-z_][A-Za-z0-9_]*"


def _read(path: Path) -> str:
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise SpecError("is a folder; pass the path of a job spec such as jobs/mnist_cnn.yaml", file=path)
        if not stat.S_ISREG(info.st_mode):
            raise SpecError("is not a regular file (a pipe or a device); pass a job spec file", file=path)
        if info.st_size > MAX_BYTES:
            raise SpecError(f"is {info.st_size:,} bytes; a job spec is at most {MAX_BYTES:,} (1 MiB)", file=path)
        with path.open("rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        folder = path.parent.absolute()
        names = sorted(p.name for p in folder.glob("*.y*ml")) if folder.is_dir() else []
        near = difflib.get_close_matches(path.name, names, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise SpecError(f"no such file in {folder}{hint}; pass the path of a job spec such as jobs/mnist_cnn.yaml",
                        file=path) from None
    except PermissionError:
        raise SpecError("cannot be read (permission denied)", file=path) from None
    except OSError as exc:
        raise SpecError(f"cannot be read ({exc.strerror or exc})", file=path) from None
    if len(raw) > MAX_BYTES:
        raise SpecError(f"is over {MAX_BYTES:,} bytes; a job spec is at most 1 MiB", file=path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecError(f"byte {exc.start} is not UTF-8 text; a job spec is a UTF-8 YAML file",
                        file=path, line=line) from None


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` -> (dotted key, YAML-typed value), within the same bounds as a spec file."""
    if len(text) > MAX_OVERRIDE_CHARS:
        raise SpecError(f"--set {shown(text)}: {len(text):,} characters; a --set is at most {MAX_OVERRIDE_CHARS:,}")
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(rf"{_KEY}(\.{_KEY})*", key):
        raise SpecError(f"--set {shown(text)} must look like key.sub=value (for example train.epochs=3)")
    if key.count(".") >= MAX_DEPTH:
        raise SpecError(f"--set {shown(text)}: the key is nested more than {MAX_DEPTH} levels deep")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(f"--set {shown(text)}: the value holds bytes that are not UTF-8 text") from None
    if not raw.strip():
        return key, ""
    try:
        value, node = parse_yaml(raw, int_keys=key.rsplit(".", 1)[-1] in INT_KEYED)
    except SpecError as exc:
        raise SpecError(f"--set {shown(text)}: the value is not usable YAML ({exc.message})") from None
    _check_read_whole(raw, value, node, text)
    return key, value


def _check_read_whole(raw: str, value: Any, node: Any, text: str) -> None:
    """Refuses a --set value YAML reads as something other than what is written: a value that does not span the
    text (a document marker or directive before it, a comment or marker after it), or plain text that YAML
    folds (several lines). Quoted text is taken as written."""
    start, end = len(raw) - len(raw.lstrip()), len(raw.rstrip())
    spans = node is not None and node.start_mark.index == start and node.end_mark.index == end
    plain_text = node is not None and isinstance(value, str) and getattr(node, "style", None) in (None, "")
    if spans and not (plain_text and value != raw.strip()):
        return
    read = "nothing" if node is None else shown(value) if isinstance(value, str) else shown(repr(value))
    written = raw.strip()
    how = f"--set '{text.partition('=')[0].strip()}=\"{written}\"'" if not re.search(r"[\"'\\\n]", written) else (
        "YAML's double quotes around the value")
    raise SpecError(
        f"--set {shown(text)}: YAML reads this value as {read}, not as written; to mean the text, use {how}"
    )


def _set_dotted(doc: dict, dotted: str, value: Any, text: str) -> None:
    parts = dotted.split(".")
    node = doc
    for index, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(f"--set {shown(text)}: {'.'.join(parts[: index + 1])!r} is not a mapping")
        node = child
    node[parts[-1]] = value


# --- validation ----------------------------------------------------------------------------------------


def _allowed_keys(path: tuple) -> list[str]:
    annotation: Any = JobSpec
    for part in path:
        if isinstance(part, int):
            continue  # an item of a list: its model is found inside the list's annotation
        if (values := _mapping_of_models(annotation)) is not None:
            annotation = values  # the mapping's own key (e.g. a feature name under data.features)
            continue
        model = _model_in(annotation)
        field = model.model_fields.get(part) if model else None
        if field is None:
            return []
        annotation = field.annotation
    model = _model_in(annotation)
    return sorted(model.model_fields) if model else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model inside an annotation: `ProfileSpec | None`, `tuple[Metric, ...]`, Annotated unions of a name and
    a serialized Keras object."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        if (found := _model_in(argument)) is not None:
            return found
    return None


def _mapping_of_models(annotation: Any) -> type[BaseModel] | None:
    """The model of `dict[str, Model]` (or `dict[str, Model] | None`), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is dict:
            value = typing.get_args(candidate)[1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                return value
    return None


def _describe(error: dict, listed: set[tuple]) -> tuple[tuple, str]:
    """(dotted key path, message) of one pydantic error; `listed` holds the sections whose allowed keys an
    earlier message already listed (listed once, not once per unknown key)."""
    # The tags of a name-or-serialized-object field (runner/spec/keras.py) are no keys of the spec.
    path = tuple(part for part in error["loc"] if part not in (NAME_TAG, SERIALIZED_TAG))
    if error["type"] == "extra_forbidden":
        parent, unknown = path[:-1], str(path[-1])
        allowed = _allowed_keys(parent)
        close = difflib.get_close_matches(unknown, allowed, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        listing = "" if parent in listed else f" (allowed here: {', '.join(allowed)})"
        listed.add(parent)
        return path, f"unknown key {shown(unknown)}{hint}{listing}"
    message = error["msg"].removeprefix("Value error, ")
    # Pydantic's own messages do not quote the value; the spec's validators (value_error) do.
    if "input" in error and error["type"] not in ("model_type", "value_error") and not isinstance(error["input"], dict):
        message += f" (got {_shown_value(error['input'])})"
    return path, message


def _shown_value(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:76] + "..."


def _line_for(lines: dict[tuple, int], key_path: tuple) -> int | None:
    for end in range(len(key_path), 0, -1):
        if key_path[:end] in lines:
            return lines[key_path[:end]]
    return None


@dataclasses.dataclass(frozen=True)
class Source:
    """Where each key of a loaded spec came from, to name it in an error: the file's line or the `--set`."""

    path: Path
    lines: dict[tuple, int]
    overridden: dict[tuple, str]
    doc: dict = dataclasses.field(default_factory=dict)  # the values as written, before validation

    def written(self, key_path: tuple) -> Any:
        """The value at `key_path` as the file or a --set wrote it (None when the default applies)."""
        node: Any = self.doc
        for part in key_path:
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def holds(self, key_path: tuple) -> bool:
        return key_path in self.lines or any(key_path[: len(p)] == p for p in self.overridden)

    def where(self, key_path: tuple) -> str:
        texts = [o for p, o in self.overridden.items() if key_path[: len(p)] == p or p[: len(key_path)] == key_path]
        if texts:
            return f"--set {shown(texts[-1])}"
        line = _line_for(self.lines, key_path)
        if line:
            return f"{self.path}:{line}"
        # A key missing beside one a --set gave (`--set train.schedule.config.x=1`: schedule's class_name).
        parent = key_path[:-1]
        texts = [o for p, o in self.overridden.items() if parent and p[: len(parent)] == parent]
        return f"--set {shown(texts[-1])}" if texts else str(self.path)


def _load(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> tuple[JobSpec, Source]:
    if path is None:  # no file: the defaults with the --set options (`runner doctor --set ...`)
        path, doc, node = Path("the defaults"), {}, None
    else:
        path = Path(path)
        try:
            doc, node = parse_yaml(_read(path))
        except SpecError as exc:
            raise exc.at(path) from None
    if doc is None:
        raise SpecError("the file is empty; a job spec is a mapping such as `name: my_job`", file=path)
    if not isinstance(doc, dict):
        raise SpecError(f"a job spec must be a mapping of keys, not a {type(doc).__name__}", file=path, line=1)
    if len(overrides) > MAX_OVERRIDES:
        raise SpecError(f"{len(overrides)} --set options; at most {MAX_OVERRIDES}")
    overridden: dict[tuple, str] = {}
    for text_override in overrides:
        key, value = parse_override(text_override)
        _set_dotted(doc, key, value, text_override)
        overridden[tuple(key.split("."))] = text_override
    source = Source(path, key_lines(node), overridden, doc)
    context = {"base": os.path.dirname(os.path.abspath(path)), "from_cli": frozenset(overridden)}
    try:
        return JobSpec.model_validate(doc, context=context), source
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        problems: list[str] = []
        listed: set[tuple] = set()
        for error in errors[:MAX_PROBLEMS]:
            key_path, message = _describe(error, listed)
            if len(message) > 600:
                message = message[:597] + "..."
            where = source.where(key_path)
            if not key_path or len(key_path) == 1 and error["type"] == "value_error" and _allowed_keys(key_path):
                # A check across keys: its line is that of the first key it names that the file or a --set holds.
                named = [tuple(k.split(".")) for k in re.findall(r"\b[a-z_]+\.[a-z_]+\b", message)]
                named += [(w,) for w in re.findall(r"\b[a-z_]+\b", message) if w in JobSpec.model_fields]
                where = source.where(next((k for k in named if source.holds(k)), key_path))
            dotted = ".".join(str(part) for part in key_path)
            problems.append(f"{where}: {dotted}: {message}" if dotted else f"{where}: {message}")
        if len(errors) > MAX_PROBLEMS:
            problems.append(f"... and {len(errors) - MAX_PROBLEMS} more problems")
        raise SpecError("\n".join(problems)) from None
    except (RecursionError, ValueError, TypeError) as exc:  # pydantic itself gave up on a value
        raise SpecError(f"cannot be checked ({type(exc).__name__}: {shown(str(exc))})", file=path) from None


def load_spec(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Reads, checks and returns the job spec at `path` (None: the defaults) with `--set key=value` applied."""
    return _load(path, overrides)[0]


# --- what `runner validate` adds ---------------------------------------------------------------------


@dataclasses.dataclass
class Preflight:
    """What validate found beyond the spec itself: problems (exit 2) and notes (what it could not check)."""

    spec: JobSpec
    problems: list[str]
    notes: list[str]
    code: dict[str, str]  # spec key -> the file its import path loads from


# The arguments `runner run` calls each spec key's function with (usercode.load_callable's callers).
CALLED_WITH = {"model.name": ("params", "features", "inputs"), "data.preprocess": ("features",),
               "train.loss": ("y_true", "y_pred"), "train.metrics": ("y_true", "y_pred")}


def preflight(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, data: bool = True) -> Preflight:
    """Loads the spec (SpecError as load_spec) and checks, importing nothing: every import path's module
    inside the spec's code roots and its attribute in the module's source, and (unless `data` is False: the
    data comes later) the local data against its manifest and the batch size."""
    spec, source = _load(path, overrides)
    problems: list[str] = []
    code: dict[str, str] = {}
    for key, import_path in spec.import_paths.items():
        key_path = tuple(re.sub(r"\[\d+\]$", "", key).split("."))
        try:
            found = find_code(import_path, key, spec.code_roots)
            keywords = dict(spec.model.params) if key == "model.name" else None  # keras.io's builders
            check_defined(found, key, CALLED_WITH.get(re.sub(r"\[\d+\]$", "", key)), keywords)
            code[key] = found.origin
        except SpecError as exc:
            problems.append(f"{source.where(key_path)}: {exc}")
    notes: list[str] = []
    batch, devices = spec.data.global_batch_size, spec.accelerator.cpu_devices
    if spec.kind == "train" and spec.accelerator.kind in ("auto", "cpu") and batch % devices:
        # `runner run` refuses it once the strategy is built (after TensorFlow loads); on a TPU or GPU the
        # CPU devices are not used, so only a spec that can end on the CPU is held to it here.
        lower, upper = max(devices, batch // devices * devices), (batch // devices + 1) * devices
        key = ("data", "global_batch_size")
        if not source.holds(key):
            key = ("accelerator", "cpu_devices")
        problems.append(
            f"{source.where(key)}: data.global_batch_size ({batch}) must be divisible by accelerator.cpu_devices "
            f"({devices}), the replicas on the CPU: set it to {lower} or {upper}"
        )
    if spec.kind == "train" and not data:
        notes.append("data not checked (--no-data): `runner validate` without it checks the data once it is there")
    elif spec.kind == "train":
        for key in ("train", "eval", "validation"):
            pattern = getattr(spec.data, key)
            if key == "eval" and spec.data.eval_is_derived and pattern and not glob.glob(pattern):
                continue  # unset: the test split beside data.train, or none when there is none (docs/specs.md)
            if pattern:
                written = source.written(("data", key))
                as_written = written if isinstance(written, str) else default_pattern(key, pattern)
                found, note = check_data(spec, key, pattern, as_written, Path(path))
                for about, problem in found:  # named where the key it is about was set, else at data.<key>
                    problems.append(f"{source.where(about if source.holds(about) else ('data', key))}: {problem}")
                if note and note not in notes:
                    notes.append(note)
    return Preflight(spec, problems, notes, code)
