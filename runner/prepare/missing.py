"""What `runner prepare csv` does with missing cells (runner/data/rows.py MISSING) in the columns it uses.

    (no --missing)            every missing cell is found in one pass and the run stops, naming each column,
                              how many cells and their lines, and both options below
    --missing drop            a record with a missing cell in a column used, or in the label, is left out
    --missing fill=VALUE      every missing input cell becomes VALUE; `median` is a number column's median and
                              a category column's most frequent value, both over the training split
    --missing fill=COLUMN:VALUE,...   per column; a column with gaps that is not named is refused

A missing label is never filled (a made-up label teaches the model the guess): under `fill` its record is left
out too, and said. What was done is recorded in the manifest (`preprocessing.missing`: the records dropped, the
value each column was filled with), and predict fills a CSV's gaps with the same values.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import statistics
from pathlib import Path

from runner import DataError, SpecError
from runner.data.rows import MISSING, column_kind

MEDIAN = "median"


@dataclasses.dataclass(frozen=True)
class Rule:
    """--missing: drop the records, or fill the cells (column -> value; the key None: every other column)."""

    drop: bool
    fills: dict[str | None, str] = dataclasses.field(default_factory=dict)


def parse_missing(text: str | None) -> Rule | None:
    """`drop`, `fill=VALUE` or `fill=COLUMN:VALUE,...` as a Rule; None for no --missing (refuse gaps)."""
    if text is None:
        return None
    form = "--missing drop, --missing fill=median, --missing fill=0 or --missing fill=age:median,city:unknown"
    if text.strip() == "drop":
        return Rule(drop=True)
    kind, sep, values = text.partition("=")
    if kind.strip() != "fill" or not sep or not values.strip():
        raise SpecError(f"--missing {text!r}: give {form}")
    if ":" not in values:
        return Rule(drop=False, fills={None: values.strip()})
    fills: dict[str | None, str] = {}
    for part in values.split(","):
        column, sep, value = part.partition(":")
        if not sep or not column.strip() or not value.strip():
            raise SpecError(f"--missing {text!r}: {part.strip()!r} must look like COLUMN:VALUE; give {form}")
        fills[column.strip()] = value.strip()
    return Rule(drop=False, fills=fills)


def gaps_of(columns: dict[str, list[str]]) -> dict[str, list[int]]:
    """column -> the indices of its missing cells, for the columns that have any."""
    gaps = {name: [i for i, cell in enumerate(cells) if cell in MISSING] for name, cells in columns.items()}
    return {name: found for name, found in gaps.items() if found}


def refuse(gaps: dict[str, list[int]], columns: dict[str, list[str]], lines: list[int], path: Path,
           label: str) -> None:
    """Stops naming the first missing cell and then every column with gaps, its count and lines, and the fixes."""
    if not gaps:
        return
    first_column = min(gaps, key=lambda name: gaps[name][0])
    first = gaps[first_column][0]
    cell = columns[first_column][first]
    held = "empty" if cell == "" else f"missing ({cell!r})"
    what = "label" if first_column == label else "column"
    cells = sum(len(found) for found in gaps.values())
    records = len({i for found in gaps.values() for i in found})
    each = ", ".join(
        f"{'label' if name == label else 'column'} {name!r} {len(found):,} ({'line' if len(found) == 1 else 'lines'} "
        f"{_some(lines[i] for i in found)})" for name, found in gaps.items()
    )
    raise DataError(
        f"{path}:{lines[first]}: {what} {first_column!r} is {held}; {cells:,} missing "
        f"{'cell' if cells == 1 else 'cells'} in {records:,} of {len(lines):,} records: {each}. "
        f"`--missing drop` leaves out those {records:,} records; `--missing fill=median` fills a number column with "
        "its median and a category with its most frequent value (a missing label's record is left out: no label is "
        "made up); `--missing fill=COLUMN:VALUE,...` chooses per column; or fill in the cells or drop the row"
    )


def kept_records(gaps: dict[str, list[int]], rule: Rule, label: str, columns: list[str], path: Path,
                 count: int) -> list[int]:
    """The records `rule` keeps: without the label's gaps, and under `drop` without any gap. A column `rule`
    names that the dataset does not use is refused: a typo would otherwise leave its gaps to another rule."""
    unknown = [name for name in rule.fills if name is not None and name not in columns]
    if unknown:
        close = difflib.get_close_matches(unknown[0], columns, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpecError(f"--missing: {path} has no column {unknown[0]!r} among those used{hint}; they are: "
                        f"{', '.join(columns)}")
    if label in (name for name in rule.fills if name is not None):
        raise SpecError(f"--missing: {label!r} is the label; a label is never filled (its records are left out)")
    dropped = set(gaps.get(label, ()))
    if rule.drop:
        dropped = {i for found in gaps.values() for i in found}
    kept = [i for i in range(count) if i not in dropped]
    if not kept:
        raise DataError(f"{path}: every record has a missing cell in a column used: --missing drop leaves none; "
                        "use --missing fill=... or leave the emptiest columns out with --features")
    return kept


def fill(columns: dict[str, list[str]], gaps: dict[str, list[int]], rule: Rule, training: list[int],
         path: Path) -> dict[str, dict]:
    """Fills the gaps in place, each column's by its rule (`median` over the `training` records' cells);
    returns column -> {"value", "cells"} for the manifest."""
    unnamed = [name for name in gaps if name not in rule.fills and None not in rule.fills]
    if unnamed:
        raise SpecError(
            f"{path}: columns {', '.join(map(repr, unnamed))} have missing cells and --missing names no value for "
            f"them: add {','.join(f'{name}:median' for name in unnamed)} (or a value of your own) to fill=..."
        )
    filled: dict[str, dict] = {}
    for name, found in gaps.items():
        cells = columns[name]
        given = rule.fills.get(name, rule.fills.get(None))
        present = [cells[i] for i in training if cells[i] not in MISSING] or [c for c in cells if c not in MISSING]
        if not present:
            raise DataError(f"{path}: column {name!r} holds no value at all; leave it out with --features")
        kind = column_kind(present)
        value = _typical(present, kind) if given == MEDIAN else given
        if kind != "category" and column_kind([value]) == "category":
            raise SpecError(f"--missing: column {name!r} holds numbers; {value!r} is no number: fill it with "
                            f"{name}:median or a number")
        for i in found:
            cells[i] = value
        filled[name] = {"value": value, "cells": len(found)}
    return filled


def _typical(present: list[str], kind: str) -> str:
    """The median of a number column (a whole number for whole numbers), a category's most frequent word
    (the first in sorted order among equals)."""
    if kind == "category":
        counts = collections.Counter(present)
        return min(counts, key=lambda word: (-counts[word], word))
    median = statistics.median(float(cell) for cell in present)
    # 12 significant digits: the median of 7.8 and 7.82 is 7.81, not its binary neighbour 7.8100000000000005
    return str(round(median)) if kind == "int64" else repr(float(f"{median:.12g}"))


def _some(numbers, shown: int = 5) -> str:
    numbers = list(numbers)
    return ", ".join(map(str, numbers[:shown])) + (", ..." if len(numbers) > shown else "")
