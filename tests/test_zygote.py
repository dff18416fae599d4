"""The suite's fork server (tests/support/zygote.py): its children answer as fresh processes do, its router takes
the runner's own start-up plan (runner/job/startup.py), and a command whose plan differs from the one its zygote
loaded under is stopped by the runner, never run with settings it did not ask for."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import startup_plan
from runner.job import startup
from tests.conftest import REPO, cli_env, write_spec
from tests.support import zygote


def test_a_forked_command_answers_as_a_fresh_one(mnist_job) -> None:
    spec = mnist_job("forked")
    args = ["validate", str(spec), "--set", "train.epochs=0"]  # refused: exit 2 with its message
    forked = zygote.run(args, env=cli_env(), cwd=REPO, timeout=120)
    fresh = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=cli_env(),
                           cwd=REPO, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and "train.epochs" in forked.stderr


def test_a_spec_that_loads_tensorflow_otherwise_is_stopped_naming_what_differs(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("other_timeout", storage={"timeout_s": 7})
    env = {k: v for k, v in cli_env().items() if not k.startswith("GCS_")}
    default = zygote.plan_for(["run", "jobs/mnist_cnn.yaml"], REPO, env)
    own = zygote.plan_for(["run", str(spec)], REPO, env)
    assert own.storage_timeout_s == 7 and own.loaded_as() != default.loaded_as(), "a zygote of its own"
    forked = zygote.run(["run", str(spec)], env=env, cwd=REPO, timeout=120, plan=default)
    assert forked.returncode == startup.EXIT_PRELOADED_OTHERWISE, forked.stderr
    assert "GCS_RETRY_CONFIG_MAX_RETRIES" in forked.stderr and "new process" in forked.stderr
    assert "KERAS_BACKEND" not in forked.stderr, "the same backend"
    assert not (tmp_path / "runs" / "other_timeout" / "checkpoints").exists(), "it stopped before training"


def test_a_forked_child_is_signalled_and_reaped_as_a_popen_child(mnist_job) -> None:
    """What the signal tests use: Popen's pid, poll, send_signal, wait and communicate on a forked child."""
    spec = mnist_job("signalled", data={"eval": None}, train={"epochs": 50})
    process = zygote.popen(["run", str(spec), "--progress-every", "0.1"], env=cli_env(), cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(process, zygote.Forked) and process.poll() is None
    first = process.stderr.readline()
    while "step" not in first:
        assert process.poll() is None, first + process.stderr.read()
        first = process.stderr.readline()
    fresh = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"], capture_output=True,
                           text=True, timeout=60).stdout
    with open(f"/proc/{process.pid}/status") as status:
        forked = status.read()
    ignored = [re.search(r"^SigIgn:\s+(\w+)", text, re.M).group(1) for text in (fresh, forked)]
    assert [int(mask, 16) & (1 << (signal.SIGPIPE - 1)) for mask in ignored] == [1 << (signal.SIGPIPE - 1)] * 2, (
        "SIGPIPE is ignored in a forked child as Python ignores it in a fresh one")
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 75 and process.wait() == 75, err[-2000:]
    assert json.loads(out.splitlines()[-1])["status"] == "preempted"


def test_the_router_takes_the_runners_plan_and_starts_the_rest_fresh(tmp_path: Path) -> None:
    def plan(*args: str, env: dict[str, str] | None = None) -> startup.StartupPlan | None:
        return zygote.plan_for(list(args), REPO, env or {})

    jax_spec = write_spec(tmp_path, {"name": "j", "accelerator": {"kind": "cpu", "backend": "jax"}})
    assert plan("validate", "jobs/mnist_cnn.yaml") is None, "loads no TensorFlow: fresh"
    assert plan("run", "jobs/mnist_cnn.yaml", "--debug") is None, "TensorFlow's notices are the child's own"
    assert plan("run", "jobs/mnist_cnn.yaml", "--set", "accelerator.backend=jax") is None, "JAX not pinned to the CPU"
    default = plan("run", "jobs/mnist_cnn.yaml")
    assert default.backend == "tensorflow" and default.environment["GCS_RETRY_CONFIG_MAX_RETRIES"]
    assert plan("prepare", "mnist", "--out", "x").loaded_as() == default.loaded_as(), "one zygote for both"
    assert plan("run", "jobs/mnist_cnn.yaml", "--set", "storage.timeout_s=5").storage_timeout_s == 5
    assert plan("run", str(jax_spec)).environment["JAX_PLATFORMS"] == "cpu"
    assert plan("run", str(tmp_path / "missing.yaml")).loaded_as() == default.loaded_as(), "refused in its child"


_SEVERAL = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:1,127.0.0.1:2", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            "KERAS_DISTRIBUTION_PROCESS_ID": "1"}


@pytest.mark.parametrize("case", ["tensorflow", "jax", "jax-2-devices", "several-processes", "gs"])
def test_a_fresh_start_agrees_with_the_plan_the_router_was_given(case: str, tmp_path: Path) -> None:
    """A fresh `runner run` told (RUNNER_TENSORFLOW_PRELOADED) that TensorFlow was loaded under the router's plan
    plus one planted variable names that variable alone, and stops before TensorFlow loads: its own start-up
    agrees on everything else. Without the planted one a forked child runs (the rest of the suite)."""
    expected = {"tensorflow": "tensorflow", "gs": "tensorflow"}.get(case, "jax")
    accelerator = {"kind": "cpu", "backend": "auto" if case == "several-processes" else expected}
    doc = {"name": case, "accelerator": accelerator, "data": {"train": "data/mnist/train-*.tfrecord"}}
    env = cli_env()
    if case == "jax-2-devices":
        accelerator["cpu_devices"] = 2
    if case == "several-processes":
        env.update(_SEVERAL)
    if case == "gs":
        doc.update(data={"train": "gs://bucket/mnist/train-*.tfrecord"}, storage={"timeout_s": 20},
                   output={"dir": "gs://bucket/runs"})
        env["GCS_READ_CACHE_BLOCK_SIZE_MB"] = "16"  # the user's value, kept
    spec = write_spec(tmp_path, doc)
    plan = zygote.plan_for(["run", str(spec)], REPO, env)
    assert plan == startup_plan(["run", str(spec)], env, REPO)
    assert plan.backend == expected, plan.reason
    if case == "gs":
        assert plan.environment["GCS_READ_CACHE_BLOCK_SIZE_MB"] == "16" and plan.storage_timeout_s == 20
    if case == "jax-2-devices":
        assert plan.environment["JAX_NUM_CPU_DEVICES"] == "2"
    planted = plan.loaded_as()
    planted["environment"]["PLANTED"] = "1"
    env[startup.PRELOADED] = json.dumps(planted)
    result = zygote.fresh(["run", str(spec)], env=env, cwd=REPO, timeout=120)
    assert result.returncode == startup.EXIT_PRELOADED_OTHERWISE, result.stderr[-2000:]
    assert "other values of PLANTED than it sets" in result.stderr, result.stderr[-2000:]


@pytest.mark.fresh
def test_a_test_marked_fresh_starts_its_commands_as_a_user_does(tmp_path: Path) -> None:
    """Unmarked, this command (refused before TensorFlow loads) would be forked from the default zygote."""
    assert zygote.plan_for(["run", str(tmp_path / "missing.yaml")], REPO, cli_env()) is not None
    process = zygote.popen(["run", str(tmp_path / "missing.yaml")], env=cli_env(), cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = process.communicate(timeout=120)
    assert not isinstance(process, zygote.Forked) and process.returncode == 2, err
