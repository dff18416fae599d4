"""Seeded fuzzing of `runner validate`: hundreds of mutations of jobs/*.yaml and of `--set` texts, each run
in process through the command itself (Typer's CliRunner), as a user's mistakes (or an attacker's file) reach it.

Every case must end with exit 0 (stdout: the resolved spec as JSON, asked for with --show) or exit 2 (stderr:
`error:` naming the file and line, or the `--set` text), never a traceback, within 2 s of CPU and 200 MB. The
cases are reproducible: case N of a family always makes the same input (random.Random seeded with the family
and N).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import sys
import time
import traceback
import tracemalloc
import typing
from pathlib import Path

import pytest
import typer
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

from runner.cli import app
from runner.spec.types import JobSpec
from tests.conftest import REPO

JOBS = sorted((REPO / "jobs").glob("*.yaml"))
FILE_CASES = 300
SET_CASES = 200
# CPU seconds: on a shared machine wall time also measures the neighbours. A hang spends no CPU, so wall time
# is bounded too, loosely.
MAX_CPU_S, MAX_WALL_S = 2.0, 20.0
MAX_BYTES = 200e6


def dotted_keys(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[str]:
    """Every key of the spec, sections included (`train`, `train.epochs`, ...)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        annotation = field.annotation
        section = next(
            (c for c in (annotation, *typing.get_args(annotation)) if isinstance(c, type) and issubclass(c, BaseModel)),
            None,
        )
        if section is not None:
            keys += dotted_keys(section, f"{prefix}{name}.")
    return keys


KEYS = dotted_keys()


def defaults(doc: dict, prefix: str = "") -> dict[str, object]:
    """Every leaf of the default spec by dotted key: values that are valid where they belong."""
    found: dict[str, object] = {}
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            found.update(defaults(value, f"{prefix}{key}."))
        else:
            found[prefix + key] = value
    return found


DEFAULTS = {k: v for k, v in defaults(JobSpec().model_dump(mode="json")).items() if not k.startswith("matmul.")}

# Values that have broken spec loaders: type swaps, edges of every range, non-finite numbers, odd text.
VALUES: list[object] = [
    None, True, False, 0, 1, -1, 2, 3, 7, 64, 65, 127, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, -(2**63), 10**40,
    0.0, -0.0, 0.5, 1.5, 1e-30, 1e12, 1e308, float("inf"), float("-inf"), float("nan"),
    "", " ", "auto", "true", "null", "1e3", "0x1F", "1_000", "3.0", "mnist_cnnn", "mnist_cnn", "mse", "accuracy",
    "os:system", "setuptools._distutils.spawn:spawn", "runner.models:mnist_cnn", "a.b.c", "a:b:c", "lambda x: x",
    "runs[1]", "runs*", "~", "~/runs", "/", "gs://", "gs://bucket/runs", "s3://bucket/x", "../../../../etc",
    "a\tb", "a\nb", "ü∂漢字🙂", "\u202eevil", "\ufeffbom", "x" * 3000,
    [], [1], ["image"], ["", ""], [[[]]], {}, {"a": 1}, {"epochs": 3}, {"kind": "cpu"},
]
UNKNOWN_KEYS = ["epoch", "trian", "lr", "batch_size", "Name", "name ", "", "x" * 300, "1", "__class__", "🙂"]


def random_key(rng: random.Random) -> str:
    key = rng.choice(KEYS)
    roll = rng.random()
    if roll < 0.15:
        return f"{key}.{rng.choice(UNKNOWN_KEYS) or 'x'}"
    if roll < 0.25:  # a typo: one character dropped or doubled
        i = rng.randrange(len(key))
        return key[:i] + key[i + 1:] if rng.random() < 0.5 else key[:i] + key[i] + key[i:]
    return key


def random_value(rng: random.Random) -> object:
    value = rng.choice(VALUES)
    if rng.random() < 0.1:
        value = [value] * rng.randint(1, 50)
    return value


# --- mutations of a job file ------------------------------------------------------------------------------


def set_path(doc: dict, key: str, value: object) -> None:
    node = doc
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def leaves(doc: object, prefix: tuple = ()) -> list[tuple]:
    if isinstance(doc, dict):
        found = [prefix] if prefix else []
        for key, value in doc.items():
            found += leaves(value, prefix + (key,))
        return found
    return [prefix]


def alias_bomb(rng: random.Random) -> str:
    width, depth = rng.randint(2, 12), rng.randint(3, 12)
    lines = ["  params:", f"    a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth)]
    return "model:\n" + "\n".join(lines) + "\n"


def mutate_file(text: str, rng: random.Random) -> tuple[bytes, str]:
    """One or a few mutations of a job file's text; returns the new bytes and what was done."""
    doc = yaml.load(text, Loader=yaml.CSafeLoader)
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.choice([
            "swap", "swap", "swap", "set", "set", "unknown", "delete", "bomb", "loop", "deep", "complex", "tag",
            "duplicate", "bytes", "unicode", "truncate", "indent", "documents", "number", "long", "merge",
        ])
        done.append(kind)
        if kind in ("swap", "set", "unknown", "delete"):
            if kind == "swap":
                path = rng.choice(leaves(doc) or [("name",)])
                set_path(doc, ".".join(map(str, path)), random_value(rng))
            elif kind == "set":
                set_path(doc, random_key(rng), random_value(rng))
            elif kind == "unknown":
                section = rng.choice([doc, *[v for v in doc.values() if isinstance(v, dict)]])
                section[rng.choice(UNKNOWN_KEYS)] = random_value(rng)
            else:
                path = rng.choice(leaves(doc) or [("name",)])
                node = doc
                for part in path[:-1]:
                    node = node.get(part, {}) if isinstance(node, dict) else {}
                if isinstance(node, dict):
                    node.pop(path[-1], None)
            text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=rng.random() < 0.5)
            continue
        doc = _loads(text) or doc
        lines = text.splitlines(keepends=True) or ["\n"]
        at = rng.randrange(len(lines) + 1)
        if kind == "bomb":
            text += alias_bomb(rng)
        elif kind == "loop":
            text += "model:\n  params:\n    me: &me [1, {again: *me}]\n"
        elif kind == "deep":
            depth = rng.choice([19, 21, 25, 100, 5000, 100_000])
            opener, closer = rng.choice([("[", "]"), ("{a: ", "}")])
            text += f"model:\n  params:\n    deep: {opener * depth}1{closer * depth}\n"
        elif kind == "complex":
            lines.insert(at, rng.choice(["? [a, b]\n: 1\n", "? {a: 1}\n: 2\n", "[x]: 1\n", "{? [a]: 1}: 3\n"]))
            text = "".join(lines)
        elif kind == "tag":
            tag = rng.choice(["!!binary aGk=", "!!python/object/apply:os.system ['true']", "!!set {a, b}",
                              "!!omap [a: 1]", "!!timestamp 2024-13-45", "!!float nope", "!!int 12x", "!custom 1",
                              "!!python/name:os.system", "!!str 3", "!!null ''"])
            text += f"model:\n  params:\n    tagged: {tag}\n"
        elif kind == "duplicate":
            lines.insert(at, lines[min(at, len(lines) - 1)])
            text = "".join(lines)
        elif kind == "bytes":
            raw = text.encode()
            cut = rng.randrange(len(raw) + 1)
            return raw[:cut] + os.urandom(rng.randint(1, 64)) + raw[cut:], "+".join(done)
        elif kind == "unicode":
            chars = rng.choice(["\x00", "\x07", "\ufeff", "\u202e", "\u2028", "\ud800", "\U0001f642", "é", "\x85"])
            cut = rng.randrange(len(text) + 1)
            mutated = (text[:cut] + chars * rng.randint(1, 5) + text[cut:]).encode("utf-8", "surrogatepass")
            return mutated, "+".join(done)
        elif kind == "truncate":
            text = text[: rng.randrange(len(text) + 1)]
        elif kind == "indent":
            line = lines[min(at, len(lines) - 1)]
            lines[min(at, len(lines) - 1)] = rng.choice(["\t", "   ", " "]) + line
            text = "".join(lines)
        elif kind == "documents":
            text = (rng.choice(["---\n", "...\n---\n", "%YAML 1.1\n---\n"]) + text
                    + rng.choice(["---\nname: x\n", "...\n", ""]))
        elif kind == "number":
            number = rng.choice(["1e999", "-1e999", ".inf", ".NaN", "9" * 50, "9" * 5000, "0o777", "0x" + "f" * 30,
                                 "1:30:00", "-0", "+1", "1__0", "0b101"])
            text = (re.sub(r"(?<=: )\d+", number, text, count=1) if re.search(r": \d+", text)
                    else text + f"seed: {number}\n")
        elif kind == "long":
            text += rng.choice(["# " + "x" * 200_000 + "\n", "name: " + "n" * 100_000 + "\n", "x" * 2000 + ": 1\n"])
        elif kind == "merge":
            text += "defaults: &d {epochs: 2}\ntrain:\n  <<: *d\n  seed: 1\n"
    return text.encode("utf-8", "surrogatepass"), "+".join(done)


def _loads(text: str) -> dict | None:
    """The text as a mapping when it still is one (libyaml: the mutations make texts of 100s of KB). Deep texts
    are not built: PyYAML's C composer recurses once per level and crashes the process (SIGSEGV) on a few
    thousand, which is why the runner walks the event stream for depth before composing anything."""
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.CSafeLoader):
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > 50:
                return None
        doc = yaml.load(text, Loader=yaml.CSafeLoader)
    except Exception:
        return None
    return doc if isinstance(doc, dict) else None


# --- mutations of --set texts ------------------------------------------------------------------------------------


def mutate_set(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["valid", "valid", "typed", "typed", "raw", "binary", "bomb", "deep", "complex", "form", "long"])
    key = random_key(rng)
    if kind == "valid":  # a default where it belongs, or a near value: the checks must also let good ones through
        key = rng.choice(sorted(DEFAULTS))
        value = DEFAULTS[key]
        if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
            value += rng.choice([1, 2, 10])
        value = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()
    elif kind == "typed":
        value = yaml.safe_dump(random_value(rng), default_flow_style=True, width=10**9).strip()
        value = value.removesuffix("\n...").removesuffix("...").strip()
    elif kind == "raw":
        value = rng.choice(["", " ", "=", "a=b", "[", "{", "}", "'", '"', "&a", "*a", "!!binary", "%", "@x", "`x`",
                            "- a", "? a", "|", ">", "#", "a: b", "[1, 2", "{a: [}", "\x00", "\t", "ü", "1e3"])
    elif kind == "binary":
        value = os.fsdecode(bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))))
    elif kind == "bomb":
        width, depth = rng.randint(2, 10), rng.randint(3, 10)
        parts = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
        parts += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth)]
        value = "{" + ", ".join(parts) + "}"
    elif kind == "deep":
        depth = rng.choice([21, 50, 1000, 30_000])
        value = "[" * depth + "]" * depth
    elif kind == "complex":
        value = rng.choice(["{? [a, b]: 1}", "{[a]: 1}", "{{a: 1}: 2}", "{? a: 1}"])
    elif kind == "form":
        return rng.choice(["", "=", "=3", ".=1", "a..b=1", "train.=1", "-x=1", "a b=1", "train.epochs", "🙂=1",
                           "a" + ".a" * 40 + "=1", "train.epochs.deeper=1", "name.x=1"]), kind
    else:
        value = "9" * rng.choice([30, 41, 5000, 70_000])
    return f"{key}={value}", kind


# --- running a case -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    exit_code: int | None  # None: an exception escaped the command
    stdout: str
    stderr: str
    traceback: str
    cpu: float
    wall: float


# The command tree is built once, as `runner` builds it once per process: CliRunner.invoke would rebuild it
# (about 0.3 s) on every call. What runs per case is exactly `runner validate ARGS` inside CliRunner's isolation.
RUNNER, COMMAND = CliRunner(), typer.main.get_command(app)


def validate(spec: Path, sets: list[str]) -> Outcome:
    # --no-data: the copies' data folders do not exist (checked elsewhere); --show: the resolved spec on stdout.
    args = ["validate", str(spec), "--no-data", "--show", *[a for s in sets for a in ("--set", s)]]
    code, trace = None, ""
    cpu, wall = time.process_time(), time.monotonic()
    with RUNNER.isolation() as (out, err, _):
        try:
            COMMAND.main(args=args, prog_name="runner")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:
            trace = traceback.format_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            stdout, stderr = out.getvalue().decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace")
    return Outcome(code, stdout, stderr, trace, time.process_time() - cpu, time.monotonic() - wall)


def check(spec: Path, sets: list[str], what: str) -> None:
    result = validate(spec, sets)
    tracemalloc.start()
    try:
        validate(spec, sets)  # again, traced for its peak (tracing slows it: the time is the first run's)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    shown = f"{what}: exit {result.exit_code}\n{result.stderr[-2000:]}"
    assert not result.traceback, f"{what}: traceback\n{result.traceback[-4000:]}"
    assert "Traceback" not in result.stdout + result.stderr, shown
    assert result.exit_code in (0, 2), shown
    assert result.cpu < MAX_CPU_S and result.wall < MAX_WALL_S, f"{what}: {result.cpu:.2f} s CPU, {result.wall:.2f} s"
    assert peak < MAX_BYTES, f"{what}: {peak / 1e6:.0f} MB"
    if result.exit_code == 0:
        assert json.loads(result.stdout)["name"], shown
        return
    # `code:` and `note:` lines may come first (what validate found, what it could not check).
    assert "error: " in result.stderr, shown
    first = result.stderr[result.stderr.index("error: "):].removeprefix("error: ").splitlines()[0]
    located = first.startswith(f"{spec}:") and re.match(rf"{re.escape(str(spec))}:\d+: ", first)
    whole_file = re.match(rf"{re.escape(str(spec))}: (the file is empty|is [\d,]+ bytes|is over)", first)
    named_set = first.startswith("--set ") and any(repr(s)[:20] in first for s in sets)
    assert located or whole_file or named_set, f"the rejection names no file:line nor --set: {shown}"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> list[Path]:
    """Copies of the shipped jobs (their relative paths then point at folders that do not exist: --no-data)."""
    folder = tmp_path_factory.mktemp("jobs")
    copies = []
    for job in JOBS:
        copy = folder / job.name
        copy.write_text(job.read_text())
        copies.append(copy)
    return copies


@pytest.mark.parametrize("case", range(FILE_CASES))
def test_a_mutated_job_file_is_valid_or_refused_by_line(case: int, jobs: list[Path], tmp_path: Path) -> None:
    rng = random.Random(f"file-{case}")
    job = rng.choice(jobs)
    raw, what = mutate_file(job.read_text(), rng)
    spec = tmp_path / "mutated.yaml"
    spec.write_bytes(raw)
    check(spec, [], f"file case {case} ({job.name}: {what})")


@pytest.mark.parametrize("case", range(SET_CASES))
def test_a_mutated_set_is_valid_or_refused_naming_it(case: int, jobs: list[Path]) -> None:
    rng = random.Random(f"set-{case}")
    job = rng.choice(jobs)
    sets, kinds = [], []
    for _ in range(rng.choice([1, 1, 2, 3])):
        text, kind = mutate_set(rng)
        sets.append(text)
        kinds.append(kind)
    check(job, sets, f"--set case {case} ({job.name}: {'+'.join(kinds)}: {[s[:60] for s in sets]!r})")


def test_the_fuzzing_reaches_both_outcomes(jobs: list[Path], tmp_path: Path) -> None:
    """The mutations are not all refused (or all accepted): the fuzz explores both sides of the checks."""
    outcomes = {0: 0, 2: 0}
    for case in range(100):
        rng = random.Random(f"file-{case}")
        job = rng.choice(jobs)
        raw, _ = mutate_file(job.read_text(), rng)
        spec = tmp_path / f"m{case}.yaml"
        spec.write_bytes(raw)
        result = validate(spec, [])
        outcomes[result.exit_code] = outcomes.get(result.exit_code, 0) + 1
    assert outcomes[0] >= 5 and outcomes[2] >= 20, outcomes
