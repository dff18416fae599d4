"""Paths in a job spec (docs/specs.md, "Paths"). A relative local path read from the spec file resolves
against the file's folder (as Compose and Kubernetes tools do); one given with `--set` against the current
directory, like any other command-line argument; `~` is expanded; `gs://BUCKET/...` is kept as written and
other schemes are refused. Without a spec file (a JobSpec built in code) paths stay as written.
This module imports no TensorFlow.

The context is what runner/spec/load.py hands to validation: {"base": the spec file's folder, "from_cli": the
dotted keys (as tuples) that `--set` gave}.
"""

from __future__ import annotations

import os
import re

from runner.spec.base import invisible_character

# Characters a glob reads as a pattern: checkpoints and shards are found by globbing the run folder.
GLOB_CHARACTERS = "[]*?"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def base_folder(key: tuple[str, ...], context: dict | None) -> str | None:
    """The folder a relative path under `key` resolves against: the current directory for `--set` values,
    the spec file's folder for the file's own (and for defaults); None without a spec file (stays relative)."""
    context = context or {}
    if any(key[:end] in context.get("from_cli", ()) for end in range(1, len(key) + 1)):
        return os.getcwd()
    return context.get("base")


def resolve_path(value: str, key: tuple[str, ...], context: dict | None, *, glob: bool = False) -> str:
    """A local path made absolute against its base folder (`~` expanded), or a gs:// path as written."""
    if not value.strip():
        raise ValueError("an empty path: name a folder (relative to the spec file) or gs://BUCKET/...")
    if _CONTROL.search(value):
        raise ValueError(f"{value!r} holds a control character (a newline, tab or NUL): remove it")
    if bad := invisible_character(value):  # the bidirectional and zero-width ones: a path that reads as another
        raise ValueError(f"{value!r} holds {bad}: remove it (paths are plain visible text)")
    scheme, sep, rest = value.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        if scheme != "gs":
            raise ValueError(f"{value!r}: {scheme}:// is not supported; use a local path or gs://BUCKET/...")
        if not re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*(/|$)", rest):
            raise ValueError(f"{value!r} names no bucket: write gs://BUCKET/path")
        return value
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return os.path.normpath(expanded)
    base = base_folder(key, context)
    if base is None:
        return value
    if glob and any(c in base for c in GLOB_CHARACTERS):
        raise ValueError(
            f"{value!r} is relative to {base}, whose name holds a glob character ({GLOB_CHARACTERS}): "
            "give an absolute path, or move the spec to a folder without them"
        )
    return os.path.normpath(os.path.join(base, expanded))


def sibling_split(train: str, split: str) -> str | None:
    """The glob of the split named `split` beside the shards `train` names, as `runner prepare` writes them
    (`<split>-NNNNN-of-NNNNN.tfrecord` in one folder); None when `train` already reads that name."""
    folder, slash, _ = train.rpartition("/")
    sibling = f"{folder}{slash}{split}-*.tfrecord"
    return None if sibling == train else sibling


def refuse_glob_characters(path: str) -> str:
    """The run folder, refused when a glob would read it as a pattern: a run there could never resume."""
    found = sorted({c for c in path if c in GLOB_CHARACTERS})
    if found:
        raise ValueError(
            f"{path!r} holds the glob character{'s' if len(found) > 1 else ''} {' '.join(found)}: checkpoints are "
            f"found by pattern, so a run there could never resume; choose a folder without {' '.join(GLOB_CHARACTERS)}"
        )
    return path


def has_control_character(text: str) -> bool:
    return _CONTROL.search(text) is not None
