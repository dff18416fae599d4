"""Compare runs: read their summaries (any schema version this runner knows), tabulate, plot.

A run is a run folder (holding summary.json) or a summary file, local or gs://. Each becomes one row:
device, replicas, batch, epochs trained, learning rate, precision, first epoch, steady epoch, step time,
examples/s, MFU, goodput, accuracy, input wait, total time, and the speed-up of its throughput over a
baseline row; then what it learned (the last and the best training loss, the last and the best val_loss, from
its epoch records), and a column for each other setting the runs differ in (an optimizer, as `adam` beside
`AdamW(weight_decay=0.004)`). The settings each run was made with come from the spec.json beside its summary.

The order and the baseline (`runner sweep` and `runner report` apply the same rule, `order_rows`): rows are
sorted by the swept settings (those that differ between the runs and that every run's name holds as
`-<key>-`, as a sweep names its variants), in the spec's order, numbers by value; then by the other settings
that differ; then by job name. The baseline is the first row unless `--baseline` names another. A row whose
settings differ from the baseline's in anything but the swept settings is marked `*` and a note names the
difference: a 12-epoch run beside 1-epoch ones is not a speed-up.

No TensorFlow: gs:// paths are read and written with google-cloud-storage; the plot (runner/compare/plot.py)
needs matplotlib, the `plot` extra.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import textwrap
from collections.abc import Iterable
from typing import Any

from runner.compare.settings import differing, readable, settings_of, value_at
from runner.compare.summaries import SummaryError, read_from_version, read_spec, read_summary
from runner.rundir.recorded import EpochRead, Recorded


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
    epochs: int | None = None  # epochs trained: the last epoch record's number (records span every attempt)
    learning_rate: str | None = None  # from spec.json: the rate, or the schedule's class
    precision: str | None = None  # accelerator.precision.policy
    total_s: float | None = None  # the latest attempt's timing.total_s
    mfu: float | None = None  # throughput.mfu (absent before it was recorded)
    mfu_why: str | None = None  # throughput.why_null, when the summary has a throughput block without an MFU
    attempts: tuple[int, ...] = ()  # the attempts whose epochs the summary lists
    attempt: int | None = None  # the attempt the timing block describes
    settings: tuple[tuple[str, Any], ...] = ()  # (dotted key, value) the run was made with, comparable ones only
    beyond_swept: tuple[str, ...] = ()  # "key value (baseline value)": differs from the baseline beyond the sweep
    not_asked: tuple[str, ...] = ()  # "key: made with value, asked value" (runner sweep's check of spec.json)
    loss: float | None = None  # the last epoch's training loss
    best_loss: float | None = None  # the lowest epoch training loss
    val_loss: float | None = None  # the last validated epoch's val_loss
    best_val_loss: float | None = None  # the lowest val_loss
    curve: tuple[tuple[int, float | None, float | None], ...] = ()  # (epoch, loss, val_loss), one per whole epoch
    spec_known: bool = False  # the spec.json it was made with was found


# --- rows --------------------------------------------------------------------------------------


def to_row(source: str, doc: dict[str, Any], spec: dict[str, Any] | None = None) -> Row:
    """One row from a summary and, when known, the resolved spec it was made with (the run folder's spec.json)."""
    said = Recorded.of(doc) or Recorded()
    timing, accelerator, epochs = said.times, said.accelerator, said.epochs
    return Row(
        source=source,
        job="?" if said.job is None else said.job,
        status=said.status or "?",
        schema_version=read_from_version(doc),
        device=accelerator.kind,
        replicas=accelerator.replicas,
        batch=said.global_batch_size,
        first_epoch_s=timing.first_epoch_s,
        steady_epoch_s=timing.steady_epoch_s,
        step_time_ms=timing.step_time_ms,
        examples_per_sec=timing.examples_per_sec,
        goodput=timing.goodput,
        accuracy=said.metrics.get("accuracy"),
        input_wait_fraction=timing.input_wait_fraction,
        software=tuple((name, value) for name, value in (
            ("TensorFlow", accelerator.tensorflow), ("Keras", accelerator.keras), ("malloc", accelerator.allocator))
            if value),
        train_input=said.train_input.mode,
        # Not len(epochs): the list spans every attempt, and a resumed partial epoch has two records.
        epochs=epochs[-1].epoch if epochs else None,
        learning_rate=_learning_rate(spec),
        precision=accelerator.precision.policy,
        total_s=timing.total_s,
        mfu=said.throughput.mfu,
        mfu_why=said.throughput.why_null,
        attempts=tuple(sorted({e.attempt for e in epochs if e.attempt is not None})),
        attempt=said.attempt,
        settings=settings_of(said, spec),
        **_learning(epochs),
        spec_known=spec is not None,
    )


def _learning(epochs: list[EpochRead]) -> dict[str, Any]:
    """What a run learned, from its epoch records: the last and the best training loss and val_loss, and the
    curve (one point per epoch: a resumed partial epoch's record gives way to the record that finished it)."""
    by_epoch = {record.epoch: record for record in epochs if record.epoch is not None}
    curve = tuple((n, _number(r.loss), _number(r.metrics.get("val_loss"))) for n, r in sorted(by_epoch.items()))
    losses = [loss for _, loss, _ in curve if loss is not None]
    validated = [val for _, _, val in curve if val is not None]
    return {"loss": losses[-1] if losses else None, "best_loss": min(losses, default=None),
            "val_loss": validated[-1] if validated else None, "best_val_loss": min(validated, default=None),
            "curve": curve}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _learning_rate(spec: dict[str, Any] | None) -> str | None:
    """The rate as training used it (runner/spec/train.py's precedence): a schedule's class, an optimizer
    config's rate, else train.learning_rate."""
    train = (spec or {}).get("train") or {}
    if train.get("schedule"):
        schedule = train["schedule"]
        return str(schedule.get("class_name", "schedule")) if isinstance(schedule, dict) else str(schedule)
    optimizer = train.get("optimizer")
    if isinstance(optimizer, dict) and "learning_rate" in (optimizer.get("config") or {}):
        return f"{optimizer['config']['learning_rate']:g}"
    rate = train.get("learning_rate")
    return None if rate is None else f"{rate:g}"


def _software_text(row: Row) -> str:
    return ", ".join(value if name == "Keras" else f"{name} {value}" for name, value in row.software)  # "keras 3.15.1"


def _software_differs(rows: list[Row]) -> bool:
    """Whether two runs record different versions of the same thing (a summary without one is no evidence)."""
    seen: dict[str, set[str]] = {}
    for row in rows:
        for name, value in row.software:
            seen.setdefault(name, set()).add(value)
    return any(len(values) > 1 for values in seen.values())


def differing_keys(rows: list[Row]) -> list[str]:
    """Settings not every row holds alike, a name, a config and unset alike (runner/compare/settings.py)."""
    return differing([dict(r.settings) for r in rows])


def swept_keys(rows: list[Row]) -> list[str]:
    """The differing settings every run's name holds as `-<key>-` (runner sweep names variants that way)."""
    return [k for k in differing_keys(rows) if all(f"-{k.split('.')[-1]}-" in f"{r.job}-" for r in rows)]


def _sortable(value: Any) -> tuple[int, Any]:
    if value is None:
        return (0, 0)
    if isinstance(value, (int, float)):
        return (1, value)
    return (2, str(value))


def order_rows(rows: list[Row]) -> list[Row]:
    """The rule `runner report` and `runner sweep` share (module docstring): by the swept settings, then the
    other differing ones, then job name; so both print the same order and pick the same default baseline."""
    swept = swept_keys(rows)
    keys = swept + [k for k in differing_keys(rows) if k not in swept]
    return sorted(rows, key=lambda r: ([_sortable(_setting(r, k)) for k in keys], r.job))


def _setting(row: Row, key: str) -> Any:
    value = value_at(dict(row.settings), key)
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value


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


def with_differences(rows: list[Row], baseline: Row) -> list[Row]:
    """Each row with the settings it differs from the baseline in, beyond the swept ones."""
    swept = swept_keys(rows)
    others = [k for k in differing_keys(rows) if k not in swept]
    base = dict(baseline.settings)
    marked = []
    for row in rows:
        mine = dict(row.settings)
        beyond = tuple(f"{k} {readable(value_at(mine, k))} (baseline {readable(value_at(base, k))})"
                       for k in others if value_at(mine, k) != value_at(base, k))
        marked.append(dataclasses.replace(row, beyond_swept=beyond))
    return marked


def load_rows(
    sources: Iterable[str], baseline: str | None = None, not_asked: dict[str, list[str]] | None = None
) -> tuple[list[Row], list[str]]:
    """Rows for every readable source in the shared order, with speed-ups and differences against the
    baseline; and one problem line per source that could not be read. `not_asked`: per source, how the run
    differs from the spec a sweep asked for (marked `!`)."""
    rows, problems = [], []
    for source in sources:
        try:
            doc = read_summary(source)
        except SummaryError as exc:
            problems.append(str(exc))
            continue
        row = to_row(source, doc, read_spec(source, doc))
        rows.append(dataclasses.replace(row, not_asked=tuple((not_asked or {}).get(source, ()))))
    if rows:
        rows = order_rows(rows)
        base = pick_baseline(rows, baseline)
        rows = with_differences(with_speedup(rows, base), base)
    return rows, problems


# --- rendering ---------------------------------------------------------------------------------

COLUMNS = (
    ("job", "run"), ("device", "device"), ("replicas", "replicas"), ("batch", "batch"), ("epochs", "epochs"),
    ("learning_rate", "learning rate"), ("precision", "precision"),
    ("first_epoch_s", "first epoch s"), ("steady_epoch_s", "steady epoch s"), ("step_time_ms", "step ms"),
    ("examples_per_sec", "examples/s"), ("mfu", "MFU"), ("goodput", "goodput"), ("accuracy", "accuracy"),
    ("loss", "loss"), ("best_loss", "best loss"), ("val_loss", "val_loss"), ("best_val_loss", "best val_loss"),
    ("input_wait_fraction", "input wait"), ("total_s", "total s"), ("speedup", "speed-up"),
)
_TEXT_COLUMNS = ("job", "device", "learning_rate", "precision")  # aligned left; the others are numbers
# Settings a fixed column shows already: no column of their own when they differ.
_SHOWN = ("data.global_batch_size", "train.epochs", "train.learning_rate", "train.mixed_precision")
_SETTING = "setting:"  # a column field naming a differing setting: "setting:train.optimizer"


def columns(rows: list[Row]) -> list[tuple[str, str]]:
    """COLUMNS with one column per other setting the runs differ in (titled by its key) after the settings
    COLUMNS shows, so that what made two runs learn differently is in the table beside what they learned."""
    # Only among runs whose spec.json is known: a run read from its summary alone has no settings to compare.
    known = [r for r in rows if r.spec_known]
    extra = [(f"{_SETTING}{k}", k) for k in (differing_keys(known) if len(known) > 1 else []) if k not in _SHOWN]
    after = [field for field, _ in COLUMNS].index("precision") + 1  # with the other settings, before the measures
    return [*COLUMNS[:after], *extra, *COLUMNS[after:]]


def _is_text(field: str) -> bool:
    return field in _TEXT_COLUMNS or field.startswith(_SETTING)


def _cell(row: Row, field: str) -> str:
    if field.startswith(_SETTING):
        return readable(value_at(dict(row.settings), field[len(_SETTING):]))
    value = getattr(row, field)
    if value is None:
        return "-"
    if field == "job":
        marks = ("*" if row.beyond_swept else "") + ("!" if row.not_asked else "")
        return f"{value}{marks}" + ("" if row.status == "succeeded" else f" ({row.status})")
    if field in ("goodput", "input_wait_fraction"):
        return f"{value:.0%}"
    if field == "mfu":
        return f"{value:.1%}"
    if field == "total_s":
        return f"{value:.1f}"
    if field in ("accuracy", "loss", "best_loss", "val_loss", "best_val_loss"):
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
    shown = columns(rows)
    return [[title for _, title in shown], *([_cell(r, f) for f, _ in shown] for r in rows)]


def notes(rows: list[Row], baseline: Row) -> list[str]:
    swept = swept_keys(rows)
    lines = [f"speed-up: examples/s over {baseline.job}'s (the first row unless --baseline names another; rows "
             f"sorted by {', '.join(swept) or 'the settings that differ, then job name'}); "
             "first epoch includes compilation and is kept out of step time; loss and val_loss: the last "
             "epoch's, best: the lowest of any epoch"]
    beyond = [f"{r.job}: {', '.join(r.beyond_swept)}" for r in rows if r.beyond_swept]
    if beyond:
        lines.append(f"* made with other settings than the baseline {baseline.job}, beyond "
                     f"{' and '.join(swept) or 'what the runs were compared by'}: " + "; ".join(beyond))
    asked = [f"{r.job}: {', '.join(r.not_asked)}" for r in rows if r.not_asked]
    if asked:
        lines.append("! not made with the settings this sweep asked for (its run folder was finished before): "
                     + "; ".join(asked))
    why = [f"{r.job}: {r.mfu_why}" for r in rows if r.mfu is None and r.mfu_why]
    if why:
        lines.append("MFU (model FLOPs utilisation, the summary's throughput block) is - where: " + "; ".join(why))
    resumed = [f"{r.job} (epochs trained in attempts {', '.join(map(str, r.attempts))}; timing of attempt {r.attempt})"
               for r in rows if len(r.attempts) > 1]
    if resumed:
        lines.append("resumed runs: their timing columns cover the last attempt only: " + "; ".join(resumed))
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
    shown = columns(rows)
    numeric = [i for i, (field, _) in enumerate(shown) if not _is_text(field)]
    rule = ["---:" if i in numeric else "---" for i in range(len(shown))]
    cells = [[_literal(c) for c in line] for line in cells]
    lines = ["| " + " | ".join(r) + " |" for r in (cells[0], rule, *cells[1:])]
    return "\n".join(lines + [""] + [f"_{_literal(n)}_" for n in notes(rows, baseline)]) + "\n"


def _literal(text: str) -> str:
    """`*` marks a row here: escaped, Markdown shows it instead of starting emphasis."""
    return text.replace("*", "\\*")


def terminal_width() -> int:
    """The width a table printed to stdout may take: $COLUMNS, else the terminal's, else (a pipe, a file)
    wide enough that nothing wraps."""
    return shutil.get_terminal_size(fallback=(_UNWRAPPED, 24)).columns


_UNWRAPPED = 1000  # a pipe or a file: one row per run, however many columns


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
    text_columns = {i for i, (field, _) in enumerate(columns(rows)) if _is_text(field)}
    for grid, left in ((cells, text_columns), (transposed, set(range(len(transposed[0]))))):
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


def _render(grid: list[list[str]], widths: list[int], left: set[int]) -> list[str]:
    """Text lines: the header (wrapped within each column, bottom-aligned), a rule, then the rows; the
    columns in `left` are aligned left, the others (numbers) right."""
    def cell(text: str, index: int) -> str:
        return text.ljust(widths[index]) if index in left else text.rjust(widths[index])

    heads = [textwrap.wrap(title, w, break_long_words=False) or [""] for title, w in zip(grid[0], widths, strict=True)]
    depth = max(len(h) for h in heads)
    heads = [[""] * (depth - len(h)) + h for h in heads]
    gap = " " * _GAP
    lines = [gap.join(cell(heads[i][d], i) for i in range(len(widths))).rstrip() for d in range(depth)]
    lines.append("-" * (sum(widths) + _GAP * (len(widths) - 1)))
    lines += [gap.join(cell(text, i) for i, text in enumerate(line)).rstrip() for line in grid[1:]]
    return lines
