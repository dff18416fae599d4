"""The typed summary (runner/rundir/summary.py): summary.schema.json is generated from it, it declares every key a
run writes, and real runs under both backends write nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
import typing

import jsonschema
import pydantic
import pytest

from runner.rundir import recorded
from runner.rundir import summary as typed
from runner.rundir.attempt import Facts
from runner.rundir.timing import Phases, build_summary
from tests.conftest import REPO, last_json, run_cli
from tests.test_backend_jax import tiny_model

SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())


def open_objects(schema: dict, path: str = "$") -> list[str]:
    """Every object in the schema that admits a key it does not declare, by its path (metrics admit numbers)."""
    found = []
    if schema.get("type") == "object" and "properties" in schema and schema.get("additionalProperties") is not False:
        if path != "$.metrics":
            found.append(path)
    for name, sub in schema.get("properties", {}).items():
        found += open_objects(sub, f"{path}.{name}")
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key, []):
            found += open_objects(sub, path)
    if isinstance(schema.get("items"), dict):
        found += open_objects(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += open_objects(schema["additionalProperties"], f"{path}.*")
    return found


def check(summary: dict) -> None:
    """Valid against the committed schema and the model, with no key either does not declare."""
    jsonschema.validate(summary, SCHEMA)
    assert typed.Summary.checked(summary) == summary  # written as the model writes it: nothing dropped or added


def test_the_committed_schema_is_the_one_the_model_generates() -> None:
    committed = (REPO / "runner" / "rundir" / "summary.schema.json").read_text()
    assert committed == typed.schema_text(), "run `python -m runner.rundir.summary --write-schema` and commit it"
    checked = subprocess.run([sys.executable, "-m", "runner.rundir.summary", "--check-schema"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_object_of_the_schema_refuses_a_key_it_does_not_declare() -> None:
    assert SCHEMA.get("additionalProperties") is False
    assert open_objects(SCHEMA) == []
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_every_fact_an_attempt_records_is_a_declared_key() -> None:
    declared = set(typed.Summary.model_fields)
    facts = {name for name in Facts.__dataclass_fields__ if name != "bench"} | {"tflops", "matmul"}
    assert facts - declared == set()
    assert {"train_epochs", "steps_per_execution", "time_limit", "warnings", "kind"} <= declared


def test_a_key_not_declared_cannot_be_written() -> None:
    def built(**extra) -> typed.Summary:
        return build_summary(status="failed", job="j", accelerator=None, phases=Phases(), epochs=[], global_batch=8,
                             metrics={}, extra=extra)

    assert built(train_epochs=3).to_json()["train_epochs"] == 3
    with pytest.raises(pydantic.ValidationError, match="undeclared"):
        built(undeclared=1)
    with pytest.raises(pydantic.ValidationError, match="surprise"):
        built(checkpoint_saves={"mode": "sync", "saves": 0, "blocked_s": 0, "write_s": 0, "surprise": 1})
    summary = built()
    with pytest.raises(pydantic.ValidationError):
        summary.final_step = "six"  # assignments are checked too


def test_a_figure_out_of_its_bounds_is_written_and_the_schema_flags_it() -> None:
    """A key or a type the model does not declare is the code's error, caught by the suite; a measured figure out
    of its declared bounds (goodput above 1, a negative phase) is the runner's defect too, but a run that trained
    must not end in a traceback without its summary: the model takes it, the schema (and this suite) flags it."""
    summary = build_summary(status="succeeded", job="j", accelerator=None, phases=Phases(), epochs=[],
                            global_batch=8, metrics={})
    summary.timing.goodput = 1.5
    summary.timing.eval_s = -0.25
    written = summary.to_json()
    assert (written["timing"]["goodput"], written["timing"]["eval_s"]) == (1.5, -0.25)
    with pytest.raises(jsonschema.ValidationError, match="1.5 is greater than the maximum of 1"):
        jsonschema.validate(written, SCHEMA)


def test_the_resume_rule_reads_the_typed_summary_and_survives_an_older_one() -> None:
    from runner.rundir.timing import completion

    assert completion({"status": "succeeded", "train_epochs": 2, "schema_version": 1, "gone": {}}, 2) == "complete"
    assert completion({"status": "succeeded", "train_epochs": 3}, 2) == "shrunk"
    assert completion({"status": "succeeded", "train_epochs": "x"}, 2) == "open"
    assert completion(None, 2) == "open"


_TYPES = {int: {"integer"}, float: {"number", "integer"}, str: {"string"}}  # a JSON type each Python type reads


def _objects(node: dict) -> list[dict]:
    """The object forms a schema node takes: itself, a branch of anyOf, or its list's items."""
    found = [node] if "properties" in node or node.get("type") == "object" else []
    for sub in node.get("anyOf", []):
        found += _objects(sub)
    if isinstance(node.get("items"), dict):
        found += _objects(node["items"])
    return found


def _written_types(node: dict) -> set[str]:
    kinds = {node["type"]} if isinstance(node.get("type"), str) else set(node.get("type") or [])
    for sub in node.get("anyOf", []):
        kinds |= _written_types(sub)
    return kinds - {"null"}


def undeclared_reads(model: type[pydantic.BaseModel], node: dict, path: str = "$") -> list[str]:
    """The fields of a reading (runner/rundir/recorded.py) the schema does not declare at the same path, or declares
    with a type the reading would take for unknown, each as "$.path: why"."""
    found = []
    for name, field in model.model_fields.items():
        where = f"{path}.{name}"
        declared = next((o["properties"][name] for o in _objects(node) if name in o.get("properties", {})), None)
        if declared is None:
            found.append(f"{where}: not declared")
            continue
        args = typing.get_args(field.annotation) or (field.annotation,)
        args = [a for arg in args for a in (typing.get_args(arg) if typing.get_origin(arg) is list else (arg,))]
        parts = [a for a in args if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
        if parts:
            found += undeclared_reads(parts[0], declared, where)
        elif typing.get_origin(field.annotation) is dict:
            if not _objects(declared):
                found.append(f"{where}: read as an object, declared {_written_types(declared)}")
        else:
            reads = set().union(*(_TYPES.get(a, set()) for a in args))
            if not _written_types(declared) <= reads:
                found.append(f"{where}: reads {sorted(reads)}, declared {sorted(_written_types(declared))}")
    return found


def test_every_key_a_reader_reads_is_declared_where_it_reads_it() -> None:
    """The readers (report, sweep, runs, the closing line, the cloud's) read summaries only through `Recorded`: a
    field of it, nested parts included, is a key the schema declares at that path, of a type it reads."""
    assert undeclared_reads(recorded.Recorded, SCHEMA) == []

    class Misread(recorded.TimingRead):  # planted: a key's name misspelt, a number read as text
        totl_s: float | None = None
        goodput: str | None = None

    class Planted(recorded.Recorded):
        timing: Misread | None = None
        epochs: list[recorded.EpochRead] = []
        train_epoch: int | None = None

    assert undeclared_reads(Planted, SCHEMA) == [
        "$.timing.goodput: reads ['string'], declared ['number']", "$.timing.totl_s: not declared",
        "$.train_epoch: not declared"]


def test_a_reading_takes_a_missing_or_wrongly_typed_value_for_unknown() -> None:
    said = recorded.Recorded.of({
        "status": "succeeded", "schema_version": 1, "attempt": True, "accelerator": "cpu", "timing": {"total_s": "9"},
        "epochs": [3, {"epoch": 1, "steps": "x", "loss": 0.5, "metrics": {"val_loss": None, "accuracy": 1}}],
        "metrics": {"accuracy": "high", "loss": 2, "examples": 8}, "checkpoint_saves": None, "unknown": {}})
    assert (said.status, said.schema_version, said.attempt, said.accelerator.kind) == ("succeeded", 1, None, None)
    assert said.times.total_s is None and said.checkpoint_saves is None
    assert [(e.epoch, e.steps, e.loss, e.metrics) for e in said.epochs] == [(1, None, 0.5, {"accuracy": 1})]
    assert said.metrics == {"loss": 2, "examples": 8} and said.evaluated == {"loss": 2}
    assert recorded.Recorded.of([1]) is None and recorded.Recorded.of({}).times.total_s is None


@pytest.mark.parametrize("engine", ["tensorflow", "jax"])
def test_a_real_run_writes_only_declared_keys(engine, mnist_job, tmp_path) -> None:
    """One epoch, then a second attempt raising train.epochs to two, with eval and a profile: the keys a run writes
    most often, under each backend (stdout's last line, summary.json and attempts/<n>.json alike). A time limit's
    and a notice's summaries are checked against the same schema in tests/test_first_contact.py,
    tests/test_interrupt.py and tests/test_jax_job.py."""
    spec = mnist_job(f"typed-{engine}", accelerator={"kind": "cpu", "backend": engine},
                     data={"global_batch_size": 64}, model={"name": tiny_model(tmp_path)},
                     train={"epochs": 2, "steps_per_epoch": 3, "allow_chance": True},
                     profile={"start_step": 2, "steps": 1})
    first = run_cli("run", spec, "--set", "train.epochs=1", timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    check(last_json(first.stdout))
    assert last_json(first.stdout)["train_epochs"] == 1
    finished = run_cli("run", spec, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = last_json(finished.stdout)
    check(summary)
    assert summary["accelerator"]["backend"]["name"] == engine
    assert summary["train_epochs"] == 2 and summary["steps_per_execution"] >= 1
    assert summary["throughput"]["flops_method"] and summary["metrics"]["examples"] == 512
    assert [e["attempt"] for e in summary["epochs"]][-1] == 2
    run_dir = tmp_path / "runs" / f"typed-{engine}"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    for path in sorted((run_dir / "attempts").glob("*.json")):
        check(json.loads(path.read_text()))
