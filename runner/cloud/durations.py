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
# The TPU VM startup script's bounds (runner/cloud/tpu_startup.sh), in seconds unless a count: request.py writes
# each above the script as `: "${NAME:=VALUE}"`, so the script runs with these (an environment that sets one, as
# the tests' simulated VM does to scale time, keeps its own), and `billed_phases` adds up the same numbers.
STARTUP_BOUNDS = {
    "RUNNER_METADATA_TRIES": 10,  # reads of this worker's number from the metadata server
    "RUNNER_METADATA_RETRY_S": 3,  # the pause after each
    "RUNNER_PULL_TIMEOUT_S": 900,  # one `docker pull` attempt
    "RUNNER_PULL_FOR_S": 1800,  # no attempt starts after this (5 attempts at most)
    "RUNNER_PULL_RETRY_S": 10,  # the pause before attempt k+1 is k x this
    "RUNNER_DOCTOR_TIMEOUT_S": 600,  # one `runner doctor` run (a second one when Cloud Logging refuses docker)
    "RUNNER_LIMIT_GRACE_S": LIMIT_GRACE_S,  # after --max-run-duration, TERM to the container
    "RUNNER_KILL_AFTER_S": 60,  # then KILL
    "RUNNER_DELETE_FOR_S": 600,  # no delete attempt is retried after this
    "RUNNER_DELETE_RETRY_S": 10,  # the first pause between delete attempts (doubling to DELETE_BACKOFF_MAX_S)
    "RUNNER_WORKER_LOST_S": 300,  # a multi-host slice: worker 0's heartbeat unchanged this long, another deletes
    "RUNNER_PEER_POLL_S": 15,  # how often the other workers look
}
# Fixed in the script's own text (tests/test_submit_billing.py reads them there): `bounded` ends a call with TERM
# at its limit and KILL 10 s later; a metadata read has 5 s, a gcloud storage or describe call 120 s, the delete
# call 330 s, a `docker rm -f` 60 s; the delete's pause doubles up to 60 s; an exit record is copied up to 3 times.
KILL_S, METADATA_READ_S, GCLOUD_CALL_S, DELETE_CALL_S, DOCKER_RM_S = 10, 5, 120, 330, 60
DELETE_BACKOFF_MAX_S, EXIT_RECORD_COPIES = 60, 3
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


def billed_phases(max_run_s: int | None, hosts: int = 1, join_timeout_s: float | None = None,
                  bounds: dict[str, int] | None = None) -> list[tuple[str, int, str]]:
    """Every bounded phase of a TPU VM job that bills, as the startup script runs it, each at its longest:
    (name, seconds, how that is made up). None when the job has no wall-clock limit (then nothing bounds it).
    The queue before the VM exists bills nothing; the API's own time to delete the VM once asked is not known
    here and is left out."""
    b = {**STARTUP_BOUNDS, **(bounds or {})}
    call = GCLOUD_CALL_S + KILL_S
    setup = b["RUNNER_METADATA_TRIES"] * (METADATA_READ_S + b["RUNNER_METADATA_RETRY_S"]) + 3 * call + METADATA_READ_S
    pause = 4 * b["RUNNER_PULL_RETRY_S"]  # the longest pause, before the fifth attempt
    attempt = b["RUNNER_PULL_TIMEOUT_S"] + KILL_S
    doctor = b["RUNNER_DOCTOR_TIMEOUT_S"] + KILL_S + DOCKER_RM_S + KILL_S
    grace = b["RUNNER_LIMIT_GRACE_S"] + b["RUNNER_KILL_AFTER_S"] + call  # then `docker rm -f` or a summary read
    records = EXIT_RECORD_COPIES * (call + 2) + 2 * call  # the exit record, the log before and after the delete
    delete_attempt = DELETE_CALL_S + KILL_S
    phases = [
        ("start-up checks", setup,
         f"{b['RUNNER_METADATA_TRIES']} metadata reads, 3 bounded gcloud calls, the registry login"),
        ("image pull", b["RUNNER_PULL_FOR_S"] + pause + attempt,
         f"RUNNER_PULL_FOR_S {b['RUNNER_PULL_FOR_S']} s, then a last attempt of RUNNER_PULL_TIMEOUT_S "
         f"{b['RUNNER_PULL_TIMEOUT_S']} s + {KILL_S} s after a pause of {pause} s"),
        ("doctor", 2 * doctor + call,
         f"RUNNER_DOCTOR_TIMEOUT_S {b['RUNNER_DOCTOR_TIMEOUT_S']} s twice (again without Cloud Logging when docker "
         "cannot reach it), each with its container's removal"),
    ]
    if max_run_s is None:
        return phases
    join = ("" if join_timeout_s is None or hosts == 1 else
            f"; the join of the {hosts} hosts (accelerator.join_timeout_s {join_timeout_s:g} s) waits within it")
    phases += [
        ("the job", max_run_s, f"--max-run-duration{join}"),
        ("kill grace", grace, f"RUNNER_LIMIT_GRACE_S {b['RUNNER_LIMIT_GRACE_S']} s + RUNNER_KILL_AFTER_S "
                              f"{b['RUNNER_KILL_AFTER_S']} s, then the container's removal"),
        ("exit record and log", records, f"the exit record copied up to {EXIT_RECORD_COPIES} times, the log twice"),
    ]
    if hosts > 1:
        phases.append(("worker 0 lost", b["RUNNER_WORKER_LOST_S"] + b["RUNNER_PEER_POLL_S"] + 2 * call,
                       f"RUNNER_WORKER_LOST_S {b['RUNNER_WORKER_LOST_S']} s before worker 1 deletes instead"))
    phases.append(("delete", b["RUNNER_DELETE_FOR_S"] + DELETE_BACKOFF_MAX_S + delete_attempt,
                   f"RUNNER_DELETE_FOR_S {b['RUNNER_DELETE_FOR_S']} s of retries, a pause of up to "
                   f"{DELETE_BACKOFF_MAX_S} s and a last call of {delete_attempt} s"))
    return phases
