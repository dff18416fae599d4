"""Run one spec as several variants: `--set key=a,b,c` gives one run per value (every combination when
several keys list values). Each variant is a separate `runner run` process with its own job name, run
folder and summary, so each is timed from a cold start, resumes on its own, and is skipped once done.
"""

from __future__ import annotations

import dataclasses
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

from runner import EXIT_PREEMPTED, RunnerError, SpecError
from runner.compare import report
from runner.rundir.timing import completion
from runner.spec.load import load_spec, parse_override
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # every --set for this variant, the job name included
    spec: JobSpec


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
    variants = []
    for combo in itertools.product(*(vs for _, vs in swept)):
        labels = [_label(k, v) for (k, _), v in zip(swept, combo, strict=True)]
        name = f"{base.name}-{'-'.join(labels)}"[:128]
        overrides = (*fixed, *(f"{k}={v}" for (k, _), v in zip(swept, combo, strict=True)), f"name={name}")
        try:
            spec = load_spec(spec_path, list(overrides))
        except SpecError as exc:
            raise SpecError(f"variant {name}: {exc}") from None
        variants.append(Variant(name, overrides, spec))
    names = [v.name for v in variants]
    if len(set(names)) < len(names):
        raise SpecError(f"two variants would share a job name ({', '.join(names)}); "
                        "make the values differ in letters or digits")
    return variants


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
        summary = json.loads(report.read_text(posixpath.join(spec.run_dir, "summary.json")))
        if completion(summary, spec.train.epochs) != "complete":
            return None
        recorded = json.loads(report.read_text(posixpath.join(spec.run_dir, "spec.json")))
    except (OSError, ValueError, RunnerError) as exc:  # missing, unreadable or not JSON: the run decides
        log.debug("%s: not known to be finished (%s)", variant.name, exc)
        return None
    recorded.pop("pinned", None)
    if recorded != json.loads(json.dumps(spec.to_dict())):
        return None  # made with another spec: the run refuses it or resumes it, naming why
    return summary


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


def exit_code(outcomes: list[Outcome], planned: int) -> int:
    """0 when every variant succeeded; 75 when one was preempted (run the sweep again); else the first failure's."""
    codes = [o.exit_code for o in outcomes]
    if EXIT_PREEMPTED in codes or len(outcomes) < planned:
        return EXIT_PREEMPTED
    return next((c for c in codes if c != 0), 0)
