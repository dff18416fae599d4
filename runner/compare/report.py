"""Compare runs: read their summaries (any schema version this runner knows), tabulate, plot.

A run is a run folder (holding summary.json) or a summary file, local or gs://. Each becomes one row:
device, replicas, batch, first epoch, steady epoch, step time, examples/s, goodput, accuracy, and the
speed-up of its throughput over a chosen baseline row. No TensorFlow: gs:// paths are read and written
with google-cloud-storage; the plot (runner/compare/plot.py) needs matplotlib, the `plot` extra.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import shutil
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runner import DataError
from runner.data import storage
from runner.rundir.timing import PHASES

READABLE_VERSIONS = (1, 2)


class SummaryError(DataError):
    """A path that holds no summary this runner can read; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Row:
    source: str
    job: str
    status: str
    schema_version: int
    device: str | None
    replicas: int | None
    batch: int | None
    first_epoch_s: float | None
    steady_epoch_s: float | None
    step_time_ms: float | None
    examples_per_sec: float | None
    goodput: float | None
    accuracy: float | None
    input_wait_fraction: float | None
    speedup: float | None = None
    software: tuple[tuple[str, str], ...] = ()  # (TensorFlow | Keras | malloc, version), as far as recorded
    train_input: str | None = None  # in_memory | streamed (summary train_input.mode); None when not recorded


# --- reading -----------------------------------------------------------------------------------


def read_text(path: str) -> str:
    """A local file, or a gs:// object read with google-cloud-storage: no TensorFlow, so a report (and a
    sweep's check for finished variants) starts in a second. FileNotFoundError when there is none."""
    if not storage.is_gcs(path):
        return Path(path).read_text()
    from google.api_core import exceptions as api_exceptions

    bucket, name = storage.split_gcs(path)
    try:
        return storage.make_client().bucket(bucket).blob(name).download_as_text(timeout=_GCS_TIMEOUT_S)
    except api_exceptions.NotFound:
        raise FileNotFoundError(path) from None
    except api_exceptions.GoogleAPICallError as exc:  # permission, network: say so instead of a traceback
        raise SummaryError(f"{path}: cannot read from the bucket: {exc.message or exc}") from None


_GCS_TIMEOUT_S = 60.0


def _is_dir(path: str) -> bool:
    if not storage.is_gcs(path):
        return Path(path).is_dir()
    bucket, name = storage.split_gcs(path)
    if not name:
        return True
    try:
        return bool(list(storage.make_client().list_blobs(bucket, prefix=name.rstrip("/") + "/", max_results=1)))
    except Exception:  # noqa: BLE001 - an unreadable bucket: reading the path says why
        return False


def summary_path(source: str) -> str:
    """A run folder's summary.json, or the file itself."""
    source = source.rstrip("/") or "/"
    return posixpath.join(source, "summary.json") if _is_dir(source) else source


def read_summary(source: str) -> dict[str, Any]:
    """The summary at `source` in the current form (schema_version 2), upgraded if older."""
    path = summary_path(source)
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise SummaryError(
            f"{path}: no such file; pass a run folder (holding summary.json) or a summary file"
        ) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise SummaryError(f"{path}: cannot be read as a summary ({type(exc).__name__})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        # A saved stdout of `runner run`: the summary is its last line.
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            doc = json.loads(lines[-1])
        except (json.JSONDecodeError, IndexError):
            raise SummaryError(
                f"{path}: not JSON; a summary is summary.json or the last stdout line of `runner run`"
            ) from None
    return upgrade(doc, path)


def upgrade(doc: Any, path: str) -> dict[str, Any]:
    """Brings a summary of an older schema_version to the current form; refuses versions it does not know."""
    if not isinstance(doc, dict) or "timing" not in doc or "status" not in doc:
        raise SummaryError(f"{path}: not a runner summary (no `status` and `timing`)")
    version = doc.get("schema_version")
    if version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and version > max(READABLE_VERSIONS)
        raise SummaryError(
            f"{path}: schema_version {version!r} cannot be read: this runner reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}" + ("; upgrade runner to read it" if newer else "")
        )
    if version == 1:
        doc = _from_v1(doc)
    return doc


def _from_v1(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 1 had no import/run-folder phases and no input wait; its epoch seconds included
    checkpoint saves made inside the epoch. What it did not record stays None, never guessed."""
    doc = json.loads(json.dumps(doc))
    timing = doc["timing"]
    for name in PHASES:
        timing.setdefault(f"{name}_s", None)
    phases = [timing[f"{n}_s"] for n in PHASES if timing[f"{n}_s"] is not None]
    total = timing.get("total_s")
    timing["unaccounted_s"] = None if total is None else round(total - sum(phases), 4)
    timing.update({"input_wait_s": None, "input_wait_fraction": None,
                   "input_wait_method": "not recorded (schema_version 1)"})
    train, first = timing.get("train_s"), timing.get("first_epoch_s")
    timing["steady_train_s"] = None if train is None or first is None else round(max(0.0, train - first), 4)
    timing["fit_overhead_s"] = None  # its epoch times held checkpoint saves: the difference would mislead
    for epoch in doc.get("epochs", []):
        epoch.setdefault("checkpoint_s", None)
        epoch.setdefault("input_wait_s", None)
    doc["read_from_schema_version"] = 1
    doc["schema_version"] = 2
    return doc


# --- rows --------------------------------------------------------------------------------------


def to_row(source: str, doc: dict[str, Any]) -> Row:
    timing, accelerator = doc["timing"], doc.get("accelerator") or {}
    metrics = doc.get("metrics") or {}
    return Row(
        source=source,
        job=doc.get("job", "?"),
        status=doc["status"],
        schema_version=doc.get("read_from_schema_version", doc["schema_version"]),
        device=accelerator.get("kind"),
        replicas=accelerator.get("replicas"),
        batch=doc.get("global_batch_size"),
        first_epoch_s=timing.get("first_epoch_s"),
        steady_epoch_s=timing.get("steady_epoch_s"),
        step_time_ms=timing.get("step_time_ms"),
        examples_per_sec=timing.get("examples_per_sec"),
        goodput=timing.get("goodput"),
        accuracy=metrics.get("accuracy"),
        input_wait_fraction=timing.get("input_wait_fraction"),
        software=tuple((name, accelerator[key]) for key, name in _SOFTWARE if accelerator.get(key)),
        train_input=(doc.get("train_input") or {}).get("mode"),
    )


_SOFTWARE = (("tensorflow", "TensorFlow"), ("keras", "Keras"), ("allocator", "malloc"))


def _software_text(row: Row) -> str:
    return ", ".join(value if name == "Keras" else f"{name} {value}" for name, value in row.software)  # "keras 3.15.1"


def _software_differs(rows: list[Row]) -> bool:
    """Whether two runs record different versions of the same thing (a summary without one is no evidence)."""
    seen: dict[str, set[str]] = {}
    for row in rows:
        for name, value in row.software:
            seen.setdefault(name, set()).add(value)
    return any(len(values) > 1 for values in seen.values())


def pick_baseline(rows: list[Row], baseline: str | None) -> Row:
    """The row named by `baseline`: a job name, a source as given, or a 1-based row number; else the first."""
    if baseline is None:
        return rows[0]
    for row in rows:
        if baseline in (row.job, row.source, row.source.rstrip("/")):
            return row
    if baseline.isdigit() and 1 <= int(baseline) <= len(rows):
        return rows[int(baseline) - 1]
    raise SummaryError(
        f"--baseline {baseline!r} names no run; use a job name ({', '.join(r.job for r in rows)}), "
        f"a path as given, or a row number 1-{len(rows)}"
    )


def with_speedup(rows: list[Row], baseline: Row) -> list[Row]:
    """Speed-up = examples/s over the baseline's (equal to the epoch-time ratio when epochs hold the same data)."""
    base = baseline.examples_per_sec
    return [
        dataclasses.replace(r, speedup=round(r.examples_per_sec / base, 2) if base and r.examples_per_sec else None)
        for r in rows
    ]


def load_rows(sources: Iterable[str], baseline: str | None = None) -> tuple[list[Row], list[str]]:
    """Rows for every readable source, and one problem line per source that could not be read."""
    rows, problems = [], []
    for source in sources:
        try:
            rows.append(to_row(source, read_summary(source)))
        except SummaryError as exc:
            problems.append(str(exc))
    if rows:
        rows = with_speedup(rows, pick_baseline(rows, baseline))
    return rows, problems


# --- rendering ---------------------------------------------------------------------------------

COLUMNS = (
    ("job", "run"), ("device", "device"), ("replicas", "replicas"), ("batch", "batch"),
    ("first_epoch_s", "first epoch s"), ("steady_epoch_s", "steady epoch s"), ("step_time_ms", "step ms"),
    ("examples_per_sec", "examples/s"), ("goodput", "goodput"), ("accuracy", "accuracy"),
    ("input_wait_fraction", "input wait"), ("speedup", "speed-up"),
)


def _cell(row: Row, field: str) -> str:
    value = getattr(row, field)
    if value is None:
        return "-"
    if field == "job" and row.status != "succeeded":
        return f"{value} ({row.status})"
    if field in ("goodput", "input_wait_fraction"):
        return f"{value:.0%}"
    if field == "accuracy":
        return f"{value:.4f}"
    if field == "speedup":
        return f"{value:.2f}x"
    if field == "examples_per_sec":
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.2f}" if value >= 1 else f"{value:.3f}"
    return str(value)


def table(rows: list[Row]) -> list[list[str]]:
    """Header row, then one row of text cells per run."""
    return [[title for _, title in COLUMNS], *([_cell(r, f) for f, _ in COLUMNS] for r in rows)]


def notes(rows: list[Row], baseline: Row) -> list[str]:
    lines = [f"speed-up: examples/s over {baseline.job}'s; "
             "first epoch includes compilation and is kept out of step time"]
    old = [r.job for r in rows if r.schema_version < 2]
    if old:
        lines.append(f"read from schema_version 1 (no input wait recorded): {', '.join(old)}")
    if _software_differs(rows):  # a speed-up then measures the software too (tcmalloc alone: up to 1.38x input)
        runs = "; ".join(f"{r.job}: {_software_text(r)}" for r in rows if r.software)
        lines.append(f"the runs differ in software, which the speed-up includes: {runs}")
    if len({r.train_input for r in rows if r.train_input}) > 1:  # a streamed split costs CPU a held one does not
        runs = "; ".join(f"{r.job}: {r.train_input.replace('_', ' ')}" for r in rows if r.train_input)
        lines.append(f"the runs fed training differently (data.in_memory), which the speed-up includes: {runs}")
    return lines


def markdown(rows: list[Row], baseline: Row) -> str:
    cells = table(rows)
    numeric = [i for i, (field, _) in enumerate(COLUMNS) if field not in ("job", "device")]
    rule = ["---:" if i in numeric else "---" for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(r) + " |" for r in (cells[0], rule, *cells[1:])]
    return "\n".join(lines + [""] + [f"_{n}_" for n in notes(rows, baseline)]) + "\n"


def terminal_width() -> int:
    """The width a table printed to stdout may take: $COLUMNS, else the terminal's, else (a pipe, a file)
    wide enough that nothing wraps."""
    return shutil.get_terminal_size(fallback=(_UNWRAPPED, 24)).columns


_UNWRAPPED = 200


def _common_prefix(jobs: list[str]) -> str:
    """The part every job name shares, up to a `-` (sweep variants: `mnist_cnn-global_batch_size-`)."""
    if len(jobs) < 2:
        return ""
    prefix = os.path.commonprefix(jobs)
    prefix = prefix[: prefix.rfind("-") + 1]
    return prefix if all(len(j) > len(prefix) for j in jobs) else ""


def terminal(rows: list[Row], baseline: Row, width: int | None = None) -> str:
    """The table as plain text within `width` columns (default: terminal_width()), never dropping a column.

    Job names lose the prefix they all share (a note names it) and headers wrap over lines when the
    columns need it; cells never wrap. When the runs do not fit side by side as rows, they become columns
    (one row per measure); when that does not fit either, each run is a block of `measure value` pairs.
    """
    width = width or terminal_width()
    cells = table(rows)
    prefix = _common_prefix([r.job for r in rows])
    if prefix:
        cells = [cells[0], *([line[0][len(prefix):], *line[1:]] for line in cells[1:])]
    transposed = [[title, *(line[i] for line in cells[1:])] for i, title in enumerate(cells[0])]
    lines: list[str] | None = None
    for grid, left in ((cells, 2), (transposed, len(transposed[0]))):
        for widths in (_widths(grid, wrap=False), _widths(grid, wrap=True)):
            if sum(widths) + _GAP * (len(widths) - 1) <= width:
                lines = _render(grid, widths, left)
                break
        if lines:
            break
    if lines is None:
        lines = []
        for line in cells[1:]:
            lines.append(line[0])
            pairs = ", ".join(f"{t} {v}" for t, v in zip(cells[0][1:], line[1:], strict=True))
            lines += textwrap.wrap(pairs, width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    for note in ([f"run names start with {prefix}"] if prefix else []) + notes(rows, baseline):
        lines += textwrap.wrap(note, width, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines) + "\n"


_GAP = 2  # spaces between two columns


def _widths(grid: list[list[str]], wrap: bool) -> list[int]:
    """Per column: its longest cell, or its header (its longest word when headers may wrap)."""
    def header(text: str) -> int:
        return max(len(w) for w in text.split()) if wrap else len(text)

    return [max(header(grid[0][i]), *(len(line[i]) for line in grid[1:])) for i in range(len(grid[0]))]


def _render(grid: list[list[str]], widths: list[int], left: int) -> list[str]:
    """Text lines: the header (wrapped within each column, bottom-aligned), a rule, then the rows; the first
    `left` columns are aligned left, the others (numbers) right."""
    def cell(text: str, index: int) -> str:
        return text.ljust(widths[index]) if index < left else text.rjust(widths[index])

    heads = [textwrap.wrap(title, w, break_long_words=False) or [""] for title, w in zip(grid[0], widths, strict=True)]
    depth = max(len(h) for h in heads)
    heads = [[""] * (depth - len(h)) + h for h in heads]
    gap = " " * _GAP
    lines = [gap.join(cell(heads[i][d], i) for i in range(len(widths))).rstrip() for d in range(depth)]
    lines.append("-" * (sum(widths) + _GAP * (len(widths) - 1)))
    lines += [gap.join(cell(text, i) for i, text in enumerate(line)).rstrip() for line in grid[1:]]
    return lines
