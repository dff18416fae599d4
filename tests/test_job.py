"""A job end to end through the CLI, as a user runs it: train, evaluate, summarise, resume, refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.device.host import TCMALLOC_PRELOAD
from tests.conftest import cli_env, last_json, run_cli

pytestmark = pytest.mark.slow


def checkpoint_files(run_dir: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").iterdir()}


def test_run_trains_then_reruns_as_complete_then_extends(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("tiny")
    glibc = {k: v for k, v in cli_env().items() if k != "LD_PRELOAD"}
    first = run_cli("run", spec, env=glibc)
    assert first.returncode == 0, first.stderr
    # Not a terminal: no progress bars, so the summary is the only stdout line.
    assert len(first.stdout.strip().splitlines()) == 1
    summary = last_json(first.stdout)
    run_dir = tmp_path / "runs" / "tiny"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["status"] == "succeeded"
    assert summary["accelerator"]["kind"] == "cpu" and summary["accelerator"]["replicas"] == 1
    assert summary["accelerator"]["allocator"] == "glibc"
    assert summary["steps_per_epoch"] == 512 // 32
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert [e["steps"] for e in summary["epochs"]] == [16, 16]
    assert summary["final_step"] == 32
    timing = summary["timing"]
    assert timing["first_epoch_s"] == summary["epochs"][0]["seconds"]
    assert timing["steady_epoch_s"] == summary["epochs"][1]["seconds"]
    assert timing["first_step_s"] < timing["first_epoch_s"]
    assert timing["examples_per_sec"] == pytest.approx(32 / (timing["step_time_ms"] / 1e3), rel=1e-3)
    assert 0.5 < summary["metrics"]["accuracy"] <= 1.0, "two epochs on 512 real digits learn something"
    assert summary["metrics"]["examples"] == 512
    assert (run_dir / "model.keras").stat().st_size > 0
    assert json.loads((run_dir / "spec.json").read_text())["name"] == "tiny"
    assert "epoch 2/2" in first.stderr and "accelerator: cpu x1" in first.stderr
    saved = checkpoint_files(run_dir)
    assert "ckpt-32.index" in saved

    again = run_cli("run", spec)
    assert again.returncode == 0, again.stderr
    assert "already complete" in again.stderr
    assert last_json(again.stdout) == summary
    assert checkpoint_files(run_dir) == saved, "a finished job re-run writes nothing"

    # The third epoch on tcmalloc: the summary says which malloc the run had (runs compared side by side).
    longer = run_cli("run", spec, "--set", "train.epochs=3", env=cli_env(LD_PRELOAD=TCMALLOC_PRELOAD))
    assert longer.returncode == 0, longer.stderr
    extended = last_json(longer.stdout)
    assert extended["accelerator"]["allocator"] == "tcmalloc"
    assert extended["resumed_from_step"] == 32
    # The summary lists the job's epochs across its attempts; this attempt trained the third.
    assert [(e["attempt"], e["epoch"]) for e in extended["epochs"]] == [(1, 1), (1, 2), (2, 3)]
    assert extended["final_step"] == 48
    assert extended["attempt"] == 3 - 1  # the already-complete re-run was not an attempt

    other = run_cli("run", spec, "--set", "train.epochs=3", "--set", "data.global_batch_size=64")
    assert other.returncode == 2
    assert "data.global_batch_size: 32 -> 64" in other.stderr
    assert "choose a new job name" in other.stderr


def test_mirrored_strategy_over_two_logical_cpus(mnist_job) -> None:
    spec = mnist_job("mirrored", accelerator={"kind": "cpu", "cpu_devices": 2}, train={"epochs": 1})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["accelerator"]["replicas"] == 2
    assert "MirroredStrategy over 2 cpu devices" in summary["accelerator"]["detail"]
    assert summary["epochs"][0]["steps"] == 16

    odd = run_cli("run", spec, "--set", "name=odd", "--set", "data.global_batch_size=127")
    assert odd.returncode == 2
    assert "data.global_batch_size (127) must be divisible by the number of replicas (2)" in odd.stderr
    failed = last_json(odd.stdout)
    assert failed["status"] == "failed" and "divisible" in failed["error"]


def test_missing_data_is_a_usage_error_summarised_on_stdout_only(mnist_job, tmp_path: Path) -> None:
    """Data that is not as promised stops the run before its run folder is touched: the summary goes to
    stdout, and nothing (no summary, no spec, no attempt) is written where a good run's outputs would be."""
    spec = mnist_job("nodata", data={"train": str(tmp_path / "nowhere" / "train-*.tfrecord")})
    result = run_cli("run", spec)
    assert result.returncode == 2
    assert f"no files match '{tmp_path}/nowhere/train-*.tfrecord'" in result.stderr
    summary = last_json(result.stdout)
    assert summary["status"] == "failed"
    assert not (tmp_path / "runs" / "nodata").exists()


def test_a_data_folder_misspelt_is_named_with_the_one_meant_as_validate_names_it(mnist_job, small_mnist) -> None:
    spec = mnist_job("typo", data={"train": f"{small_mnist}x/train-*.tfrecord"})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"{small_mnist}x does not exist; did you mean '{small_mnist}/train-*.tfrecord'? "
            f"({small_mnist.parent} holds {small_mnist.name})") in result.stderr
