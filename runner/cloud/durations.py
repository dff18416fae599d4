"""Durations and times as `runner submit`'s flags take them: --valid-until, --max-run-duration, --stall-timeout.

A duration is whole days, hours, minutes and seconds (`6h`, `1h30m`, `2d`, `90s`), forms gcloud's duration flags
read the same way. A --valid-until time is RFC 3339 with Z or an offset and is kept as gcloud sends it: the
offset as given, the fraction cut to whole milliseconds (measured with the real gcloud: tests/test_submit.py).
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from runner import SpecError

_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
# The job's wall-clock limit and stall guard when not given: finite, so that a job nobody watches stops billing.
DEFAULT_MAX_RUN = "24h"
DEFAULT_STALL_TIMEOUT = "30m"
# How long after --max-run-duration something outside the container ends the job: the job saves and exits 124
# at the limit by itself, and a checkpoint of a large model takes minutes to write. The TPU VM's startup script
# has the same default (RUNNER_LIMIT_GRACE_S in tpu_startup.sh); the engines' own deadlines add it too.
LIMIT_GRACE_S = 600
_TIME = re.compile(r"(\d{4}-\d\d-\d\d)[Tt](\d\d:\d\d)(:\d\d)?(\.\d+)?([Zz]|[+-]\d\d:?\d\d)")


def parse_duration(flag: str, text: str) -> int:
    """`6h`, `1h30m`, `2d`, `90s` -> seconds, more than 0 (forms gcloud's duration flags take alike)."""
    match = _DURATION.fullmatch(text.strip().lower())
    if not text.strip() or not match or not any(match.groups()):
        raise SpecError(f"{flag} {text!r} is not a duration: whole numbers of d, h, m and s, e.g. 6h, 1h30m, 2d, 90s")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise SpecError(f"{flag} {text!r} must be longer than 0 s")
    return total


def parse_limit(flag: str, text: str | None, default: str) -> int | None:
    """A limit in seconds: `default` when not given, None for `none` (no limit)."""
    text = default if text is None else text
    return None if text.strip().lower() == "none" else parse_duration(flag, text)


def parse_limits(max_run_duration: str | None, stall_timeout: str | None,
                 problems: list[str]) -> tuple[int | None, int | None]:
    """--max-run-duration and --stall-timeout in seconds (None: no limit); a bad one is added to `problems`."""
    limits = []
    for flag, text, default in (("--max-run-duration", max_run_duration, DEFAULT_MAX_RUN),
                                ("--stall-timeout", stall_timeout, DEFAULT_STALL_TIMEOUT)):
        try:
            limits.append(parse_limit(flag, text, default))
        except SpecError as error:
            problems.append(f"{error} (or `none` for no limit)")
            limits.append(None)
    return limits[0], limits[1]


def limit_overrides(max_run_s: int | None, stall_timeout_s: int | None) -> list[str]:
    """The job's limits as `runner run` takes them (`--set KEY=VALUE`, without the flag)."""
    return ([] if max_run_s is None else [f"train.max_duration={max_run_s}"]) + (
        [] if stall_timeout_s is None else [f"train.stall_timeout={stall_timeout_s}"])


def parse_valid_until(text: str) -> tuple[str, Any]:
    """`6h`, `1h30m`, `2d` -> ("duration", seconds); an RFC 3339 time with Z or an offset -> ("time", datetime).

    A time keeps its offset and is cut to whole milliseconds, as gcloud's --valid-until-time sends it
    (`2031-01-01T00:00:00.123456789+05:30` -> `...00.123+05:30`: measured with the real gcloud, tests/test_submit.py).
    A time without an offset is refused: gcloud would read it in this machine's local time zone.
    """
    value = text.strip()
    if _DURATION.fullmatch(value.lower()) and any(_DURATION.fullmatch(value.lower()).groups()):
        return "duration", parse_duration("--valid-until", value)
    match = _TIME.fullmatch(value)
    when = None
    if match:
        date, clock, seconds, fraction, zone = match.groups()
        zone = "+00:00" if zone in "Zz" else f"{zone[:3]}:{zone[-2:]}"
        millis = (fraction or "")[1:4].ljust(3, "0")
        try:
            when = datetime.datetime.fromisoformat(f"{date}T{clock}{seconds or ':00'}.{millis}{zone}")
        except ValueError:
            when = None
    if when is None:
        raise SpecError(
            f"--valid-until {text!r} is neither a duration (6h, 1h30m, 2d) nor a time with its offset "
            "(2026-12-01T00:00:00Z, 2026-12-01T09:30:00.5+05:30)"
        )
    return "time", when


def gcloud_time(when: datetime.datetime) -> str:
    """A time as gcloud writes --valid-until-time in its request: milliseconds, the offset as given."""
    offset = when.utcoffset() or datetime.timedelta(0)
    minutes = int(offset.total_seconds()) // 60
    zone = "Z" if minutes == 0 else f"{'+' if minutes > 0 else '-'}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
    return f"{when:%Y-%m-%dT%H:%M:%S}.{when.microsecond // 1000:03d}{zone}"


def valid_until_text(text: str) -> str:
    """--valid-until as it is kept and shown: a duration as given, a time as gcloud sends it."""
    kind, value = parse_valid_until(text)
    return text.strip() if kind == "duration" else gcloud_time(value)


def valid_until_passed(request: dict[str, Any], now: datetime.datetime | None = None) -> bool:
    """Whether a job's time bound has passed (a duration counts again from each new queued resource)."""
    if not request.get("valid_until"):
        return False
    kind, value = parse_valid_until(request["valid_until"])
    return kind == "time" and value <= (now or datetime.datetime.now(datetime.timezone.utc))
