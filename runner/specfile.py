"""Loading a job spec from YAML: `load_spec` reads the file, applies `--set` overrides and validates the
whole of it against runner/spec.py's JobSpec before TensorFlow is imported; every error names the file, the
line and the dotted key (or the `--set` it came from). This module must never import TensorFlow.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from runner.errors import SpecError
from runner.spec import JobSpec



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
    parts = iter(path)
    for part in parts:
        field = model.model_fields.get(part) if model else None
        annotation = field.annotation if field else None
        # A section may be optional (`profile: ProfileSpec | None`): its model is the union's model member.
        model = next(
            (c for c in (annotation, *typing.get_args(annotation)) if isinstance(c, type) and issubclass(c, BaseModel)),
            None,
        )
        if model is None and (values := _mapping_of_models(annotation)) is not None:
            model = values
            next(parts, None)  # the mapping's own key (e.g. a feature name under data.features)
    return sorted(model.model_fields) if model else []


def _mapping_of_models(annotation: Any) -> type[BaseModel] | None:
    """The model of `dict[str, Model]` (or `dict[str, Model] | None`), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is dict:
            value = typing.get_args(candidate)[1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                return value
    return None


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
