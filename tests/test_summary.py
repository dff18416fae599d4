"""The typed summary (runner/rundir/summary.py): summary.schema.json is generated from it, it declares every key a
run writes, and real runs under both backends write nothing else."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pydantic
import pytest

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


def test_the_resume_rule_reads_the_typed_summary_and_survives_an_older_one() -> None:
    from runner.rundir.timing import completion

    assert completion({"status": "succeeded", "train_epochs": 2, "schema_version": 1, "gone": {}}, 2) == "complete"
    assert completion({"status": "succeeded", "train_epochs": 3}, 2) == "shrunk"
    assert completion({"status": "succeeded", "train_epochs": "x"}, 2) == "open"
    assert completion(None, 2) == "open"


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
