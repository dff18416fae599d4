"""The data a spec names, checked as `runner validate` checks it, with plain file reads and no TensorFlow: the
local shards against their manifest, and, for a pattern that matches nothing, the folder or file it was likely
meant to name (`runner run` says the same through `no_match_hint`). This module must never import TensorFlow.
"""

from __future__ import annotations

import difflib
import glob
import json
import os
from pathlib import Path

from runner.spec import hub as hub_spec
from runner.spec.columns import class_weight_problem, columns_problem, pixels_problem
from runner.spec.types import DataSpec, JobSpec
from runner.spec.yaml_lines import shown


def default_pattern(key: str, pattern: str) -> str:
    """The default of data.<key> as declared (relative), for a spec that leaves it unset."""
    default = DataSpec.model_fields[key].default
    return default if isinstance(default, str) else pattern


def _missing_folder(folder: str, pattern: str, written: str, spec_path: Path) -> str:
    """Nothing matches because the folder is missing: a close name when the nearest existing folder holds one
    (never a command that would prepare data under a typo), else how to write the data there."""
    base, missing = folder, []
    while not os.path.isdir(base) and os.path.dirname(base) != base:
        base, part = os.path.dirname(base), os.path.basename(base)
        missing.insert(0, part)
    held = sorted(e.name for e in os.scandir(base) if e.is_dir()) if os.path.isdir(base) else []
    close = difflib.get_close_matches(missing[0], held, n=1, cutoff=0.6) if missing else []
    if close:
        # Mend the pattern as the spec wrote it: the missing component at its place counted from the end.
        parts, wrong = written.split("/"), missing[0]
        place = len(parts) - (len(missing) + 1)
        if 0 <= place < len(parts) and parts[place] == wrong:
            mended = "/".join([*parts[:place], close[0], *parts[place + 1:]])
        else:
            mended = os.path.join(base, close[0], *missing[1:], os.path.basename(pattern))
        return (f"nothing matches {written!r}: {os.path.join(base, wrong)} does not exist; did you mean {mended!r}? "
                f"({base} holds {close[0]})")
    return (
        f"nothing matches {written!r}: {folder} does not exist. Write the data there first: "
        f"`runner prepare DATASET --out {folder}` for a built-in dataset, or your own TFRecords, then "
        f"`runner manifest {spec_path}`; or pass --no-data if the data comes later"
    )


def no_match_hint(pattern: str) -> str | None:
    """Why a local pattern matches nothing, with the name it was likely meant to have (as `validate` says it):
    a missing folder next to one of a close name, or a file name close to one the folder holds; None for gs://
    or when nothing close is found."""
    if pattern.startswith("gs://"):
        return None
    folder, name = os.path.dirname(pattern) or ".", os.path.basename(pattern)
    if not os.path.isdir(folder):
        said = _missing_folder(folder, pattern, pattern, Path("SPEC")).split(": ", 1)[1]  # after "nothing matches"
        return said if "did you mean" in said else f"{folder} does not exist"
    near = difflib.get_close_matches(name, sorted(os.listdir(folder)), n=1, cutoff=0.5)
    return f"did you mean {os.path.join(folder, near[0])!r}?" if near else None


def check_data(
    spec: JobSpec, key: str, pattern: str, written: str, spec_path: Path
) -> tuple[list[tuple[tuple, str]], str | None]:
    """The local shards of `data.<key>` against their manifest, as `runner run` will read them (no TensorFlow:
    plain file reads): (problems, each with the key it is about; a note on what was not checked).
    `written` is the pattern as the spec wrote it (quoted in messages). gs:// data is left to `runner run` and
    `runner doctor`."""
    folder, name = os.path.dirname(pattern) or ".", os.path.basename(pattern)

    def problem(message: str, about: tuple = ("data", key)) -> tuple[list[tuple[tuple, str]], None]:
        return [(about, f"data.{key}: {message}")], None

    if pattern.startswith("gs://"):
        return [], f"data in {folder} not checked: validate reads no bucket (`runner doctor SPEC` does)"
    if not os.path.isdir(folder):
        return problem(_missing_folder(folder, pattern, written, spec_path))
    files = sorted(glob.glob(pattern))
    manifest_path = os.path.join(folder, "manifest.json")
    if not files:
        held = sorted(os.listdir(folder))
        near = difflib.get_close_matches(name, held, n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        holds = ", ".join(held[:8]) + (", ..." if len(held) > 8 else "") if held else "nothing"
        return problem(f"no files match {name!r} in {folder}{hint} (it holds: {holds})")
    if not os.path.isfile(manifest_path):
        return problem(
            f"{folder} holds {len(files)} file(s) matching {name!r} but no manifest.json: for your own TFRecords, "
            f"declare data.features and run `runner manifest {spec_path}`; for a built-in dataset, "
            f"`runner prepare DATASET --out {folder}`"
        )
    try:
        with open(manifest_path, "rb") as handle:
            manifest = json.loads(handle.read(64 << 20))
        shards = {e["file"]: int(e["records"]) for split in manifest["splits"].values() for e in split["shards"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return problem(
            f"{manifest_path} cannot be read as a manifest ({type(exc).__name__}: {shown(str(exc))}); write it "
            f"again: `runner manifest {spec_path} --force` for your own TFRecords (data.features declared), "
            f"`runner prepare DATASET --out {folder}` for a built-in dataset"
        )
    columns = columns_problem(spec.data, manifest, manifest_path, spec.train.sample_weight) if key == "train" else None
    if columns:
        return problem(columns, about=("data", "inputs" if columns.startswith("data.inputs") else "label"))
    pixels = pixels_problem(spec.model, spec.data, manifest, manifest_path)
    if pixels:
        return problem(pixels, about=("model", "params"))
    tokens = hub_spec.records_problem(spec.model, manifest, manifest_path)
    if tokens:
        return problem(tokens, about=("model", "hub"))
    weights = class_weight_problem(spec.train.class_weight, manifest, manifest_path) if key == "train" else None
    if weights:
        return problem(weights, about=("train", "class_weight"))
    unlisted = [f for f in files if os.path.basename(f) not in shards]
    if unlisted:
        return problem(
            f"{unlisted[0]} matches {name!r} but {manifest_path} does not list it; narrow the pattern, or write the "
            f"manifest again: `runner manifest {spec_path} --force` for your own TFRecords (data.features "
            f"declared), `runner prepare DATASET --out {folder}` for a built-in dataset"
        )
    records = sum(shards[os.path.basename(f)] for f in files)
    batch = spec.data.global_batch_size
    if key == "train" and spec.train.steps_per_epoch is None and records < batch:
        return problem(
            f"{records:,} records in {pattern} make no full batch of data.global_batch_size ({batch:,}); set "
            f"data.global_batch_size to at most {records:,}, or add data",
            about=("data", "global_batch_size"),
        )
    return [], None
