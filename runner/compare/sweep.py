"""Run one spec as several variants: `--set key=a,b,c` gives one run per value (every combination when
several keys list values). Each variant is a separate `runner run` process with its own job name, run
folder and summary, so each is timed from a cold start, resumes on its own, and is skipped once done.

A variant's name holds every `--set` that changes the spec: the swept values and the single values that
differ from the spec file (`mnist_cnn-global_batch_size-256-learning_rate-0.01`), so a sweep at other
settings gets run folders of its own instead of meeting folders made with other settings. What the names
cannot see (the YAML edited since) is caught by comparing each run folder's spec.json with the spec asked
for: a finished run made otherwise is marked, and the sweep names the `--set name=` that gives new folders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import posixpath
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from runner import EXIT_PREEMPTED, EXIT_USAGE, RunnerError, SpecError
from runner.compare import settings, summaries
from runner.rundir.recorded import Recorded
from runner.rundir.timing import completion
from runner.spec.load import load_spec, parse_override
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # every --set for this variant, the job name included
    spec: JobSpec
    base: str  # the name the variants' names start with: the spec's (or --set name=)


@dataclasses.dataclass
class Outcome:
    variant: Variant
    exit_code: int
    summary: dict[str, Any] | None

    @property
    def run_dir(self) -> str:
        return self.variant.spec.run_dir


def split_values(text: str) -> list[str]:
    """`a,b,[c,d]` -> ['a', 'b', '[c,d]']: commas inside brackets, braces or quotes do not split."""
    values, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current))
            current = []
            continue
        current.append(char)
    values.append("".join(current))
    return [v.strip() for v in values]


def _label(key: str, raw: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.]+", "_", raw).strip("_.") or "x"
    return f"{key.split('.')[-1]}-{value}"


def _value_at(doc: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(doc, dict):
            return None
        doc = doc.get(part)
    return doc


def _changes_the_spec(written: dict[str, Any] | None, asked: dict[str, Any], key: str) -> bool:
    """Whether a single-valued `--set` changes the spec file's resolved value (when the file does not load
    without the --set values, each of them counts as a change). The name and where runs are written are not
    settings: they already give other folders."""
    if key == "name" or key.startswith("output."):
        return False
    return written is None or _value_at(written, key) != _value_at(asked, key)


_NAME_LIMIT = 128


def plan_variants(spec_path: str | Path, sets: list[str]) -> list[Variant]:
    """Every combination of the listed values, each checked as a whole spec before anything runs."""
    axes: list[tuple[str, list[str]]] = []
    for text in sets:
        key, _, raw = text.partition("=")
        values = split_values(raw)
        key, _ = parse_override(f"{key}={values[0]}")  # checks the key=value form and the first value's YAML
        if any(not v for v in values):
            raise SpecError(f"--set {text!r}: an empty value in the list; write key=a,b,c")
        if key == "name" and len(values) > 1:
            raise SpecError("--set name=a,b cannot be swept: each variant's name is derived from the base name")
        axes.append((key, values))
    base = load_spec(spec_path, [f"{k}={v[0]}" for k, v in axes])
    swept = [(k, vs) for k, vs in axes if len(vs) > 1]
    if not swept:
        raise SpecError("sweep needs a --set with several values, e.g. --set data.global_batch_size=256,512,1024")
    fixed = [f"{k}={vs[0]}" for k, vs in axes if len(vs) == 1]
    try:
        written = json.loads(json.dumps(load_spec(spec_path, []).to_dict()))
    except SpecError:  # the file needs some --set to be whole: every --set value is then a change
        written = None
    asked = json.loads(json.dumps(base.to_dict()))
    changed = {k: _label(k, vs[0]) for k, vs in axes if len(vs) == 1 and _changes_the_spec(written, asked, k)}
    variants = []
    for combo in itertools.product(*(vs for _, vs in swept)):
        labels = [_label(k, v) for (k, _), v in zip(swept, combo, strict=True)]
        name = _fit(f"{base.name}-{'-'.join([*labels, *changed.values()])}")
        overrides = (*fixed, *(f"{k}={v}" for (k, _), v in zip(swept, combo, strict=True)), f"name={name}")
        try:
            spec = load_spec(spec_path, list(overrides))
        except SpecError as exc:
            raise SpecError(f"variant {name}: {exc}") from None
        variants.append(Variant(name, overrides, spec, base.name))
    names = [v.name for v in variants]
    if len(set(names)) < len(names):
        raise SpecError(f"two variants would share a job name ({', '.join(names)}); "
                        "make the values differ in letters or digits")
    return variants


def _fit(name: str) -> str:
    """A job name within the limit: a long one keeps its start and ends with a hash of the whole, so two long
    names that share their first 119 characters still differ."""
    if len(name) <= _NAME_LIMIT:
        return name
    return f"{name[:_NAME_LIMIT - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def new_base_name(spec_path: str | Path, sets: list[str], variants: list[Variant]) -> str:
    """The `--set name=` that gives this sweep's variants run folders none of which exists yet: the base name
    with -2, -3, ... (what a refused or otherwise-made variant's message suggests, so following it works)."""
    base = variants[0].base
    for number in range(2, 1000):
        candidate = f"{base}-{number}"
        planned = plan_variants(spec_path, [*sets, f"name={candidate}"])
        if not any(_folder_exists(v.spec.run_dir) for v in planned):
            return candidate
    raise SpecError(f"no free name {base}-2 ... {base}-999 for this sweep; choose one with --set name=NAME")


def _folder_exists(path: str) -> bool:
    try:
        return summaries.is_dir(path)
    except (OSError, RunnerError):
        return True  # not known to be free: not suggested


class _Forwarder:
    """Hands SIGTERM (preemption) to the running variant so it saves a checkpoint; no later variant starts."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self._previous: Any = None

    def __enter__(self) -> _Forwarder:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, *_: Any) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def finished_summary(variant: Variant) -> dict[str, Any] | None:
    """The summary of a variant its run folder holds as finished, read without TensorFlow (google-cloud-storage
    for gs://), so a finished sweep runs again in seconds. The rule is the run's own (runner/rundir/timing.py
    `completion`, which runner/rundir/outputs.py applies), and the folder's spec.json must be this variant's spec;
    on any doubt (no summary, another spec, a folder that cannot be read) None: the variant runs, and the run
    applies every resume rule itself."""
    spec = variant.spec
    try:
        summary = json.loads(summaries.read_text(posixpath.join(spec.run_dir, "summary.json")))
        if completion(summary, spec.train.epochs) != "complete":
            return None
        recorded = json.loads(summaries.read_text(posixpath.join(spec.run_dir, "spec.json")))
    except (OSError, ValueError, RunnerError) as exc:  # missing, unreadable or not JSON: the run decides
        log.debug("%s: not known to be finished (%s)", variant.name, exc)
        return None
    recorded.pop("pinned", None)
    if recorded != json.loads(json.dumps(spec.to_dict())):
        return None  # made with another spec: the run refuses it or resumes it, naming why
    return summary


def shown(outcomes: list[Outcome]) -> list[Outcome]:
    """The variants whose run folder holds a summary to tabulate (one refused or failed at its start wrote
    none: its error is above, its advice below)."""
    kept = []
    for outcome in outcomes:
        try:
            summaries.read_text(posixpath.join(outcome.run_dir, "summary.json"))
        except (OSError, RunnerError):
            continue
        kept.append(outcome)
    return kept


def not_as_asked(variant: Variant) -> list[str]:
    """How the spec its run folder's spec.json records differs from the one this sweep asked for, one
    "key made (asked value)" each; [] when it is the same. A run folder finished before (the YAML edited since,
    a setting the name does not show) is not retrained by its run: its row must not pass for the asked one."""
    try:
        recorded = json.loads(summaries.read_text(posixpath.join(variant.spec.run_dir, "spec.json")))
    except FileNotFoundError:
        return ["no spec.json in its run folder: what it was made with is not known"]
    except (OSError, ValueError, RunnerError) as exc:
        return [f"its spec.json cannot be read ({exc})"]
    recorded.pop("pinned", None)
    made = dict(settings.flatten(recorded))
    asked = dict(settings.flatten(json.loads(json.dumps(variant.spec.to_dict()))))
    def text(run: settings.Settings, key: str) -> str:
        return settings.readable(settings.value_at(run, key))

    return [f"{k} {text(made, k)} (asked {text(asked, k)})" for k in settings.differing([asked, made])]


def refused(outcome: Outcome) -> bool:
    """The run refused its folder (made with other settings or data, or more epochs than asked): its remedy is
    another job name, which in a sweep is the sweep's base name, not the variant's."""
    error = (Recorded.of(outcome.summary) or Recorded()).error or ""
    return outcome.exit_code == EXIT_USAGE and "--set name=" in error


def advice(spec_path: str | Path, sets: list[str], variants: list[Variant], outcomes: list[Outcome],
           not_asked: dict[str, list[str]]) -> list[str]:
    """What to do next, one line each; every line is one that works when followed (tests/test_sweep.py
    follows each)."""
    lines = []
    other = [o.variant.name for o in outcomes if not_asked.get(o.run_dir) or refused(o)]
    if other:
        lines.append(
            f"sweep: {', '.join(other)} hold runs made with other settings than this sweep asks for (marked ! or "
            f"refused above). To keep them and run this sweep in new run folders, add `--set "
            f"name={new_base_name(spec_path, sets, variants)}` to the command"
        )
    code = exit_code(outcomes, len(variants))
    succeeded = sum(o.exit_code == 0 for o in outcomes)
    if code == EXIT_PREEMPTED:
        lines.append(
            f"sweep: {succeeded} of {len(variants)} variants succeeded; stopped by a preemption notice: run the "
            "same sweep again to continue (finished variants are skipped, the stopped one resumes from its "
            "checkpoint)"
        )
    failed = [o for o in outcomes if o.exit_code not in (0, EXIT_PREEMPTED) and not refused(o)]
    if failed:
        first = failed[0]
        lines.append(
            f"sweep: {succeeded} of {len(variants)} variants succeeded; {first.variant.name} exited "
            f"{first.exit_code}: fix what its error above says (in the spec, the data or the values swept), then "
            "run the sweep again (finished variants are skipped)"
        )
    return lines


def run_variants(
    spec_path: str | Path, variants: list[Variant], debug: bool = False, progress_every: float | None = None
) -> list[Outcome]:
    """Runs the variants one after another (they would compete for the same device); a finished variant is
    skipped without starting a process; a preempted variant stops the sweep so that running it again
    continues where it stopped."""
    outcomes: list[Outcome] = []
    with _Forwarder() as forwarder:
        for index, variant in enumerate(variants, 1):
            if forwarder.stopping:
                break
            done = finished_summary(variant)
            if done is not None:
                log.info("sweep %d/%d: %s is already complete (%s/summary.json); skipped",
                         index, len(variants), variant.name, variant.spec.run_dir)
                outcomes.append(Outcome(variant, 0, done))
                continue
            log.info("sweep %d/%d: %s (%s)", index, len(variants), variant.name, " ".join(variant.overrides[:-1]))
            command = [sys.executable, "-m", "runner", "run", str(spec_path)]
            for override in variant.overrides:
                command += ["--set", override]
            if debug:
                command.append("--debug")
            if progress_every is not None:
                command += ["--progress-every", f"{progress_every:g}"]
            # stderr (progress logs) passes through; stdout carries the summary as its last line.
            forwarder.child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            stdout, _ = forwarder.child.communicate()
            code = forwarder.child.returncode
            outcomes.append(Outcome(variant, code, _last_json(stdout)))
            if code != 0:
                log.warning("sweep: %s exited %d", variant.name, code)
            if code == EXIT_PREEMPTED:
                break
    return outcomes


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.strip().startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def exit_code(outcomes: list[Outcome], planned: int, not_asked: dict[str, list[str]] | None = None) -> int:
    """0 when every variant succeeded as asked; 75 when one was preempted (run the sweep again); else the first
    failure's; 2 when a run shown was made with other settings than asked (its row is marked)."""
    codes = [o.exit_code for o in outcomes]
    if EXIT_PREEMPTED in codes or len(outcomes) < planned:
        return EXIT_PREEMPTED
    failure = next((c for c in codes if c != 0), 0)
    return failure or (EXIT_USAGE if any((not_asked or {}).values()) else 0)
