"""The suite's fork server (tests/support/zygote.py): its children answer as fresh processes do, and a command
whose spec would load TensorFlow otherwise is stopped, never run with settings it did not ask for."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

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
    assert zygote.kind_for(["run", str(spec)], REPO, env) is None, "the router sends it to a fresh process"
    forked = zygote.run(["run", str(spec)], env=env, cwd=REPO, timeout=120, kind="tensorflow")
    assert forked.returncode == zygote.MISMATCH, forked.stderr
    assert "GCS_RETRY_CONFIG_MAX_RETRIES" in forked.stderr and "fresh=True" in forked.stderr
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


def test_the_router_reads_each_spec_as_the_runner_does(tmp_path: Path) -> None:
    def kind(*args: str, env: dict[str, str] | None = None) -> str | None:
        return zygote.kind_for(list(args), REPO, env or {})

    jax_spec = write_spec(tmp_path, {"name": "j", "accelerator": {"kind": "cpu", "backend": "jax"}})
    two_devices = write_spec(tmp_path, {"name": "d", "accelerator": {"kind": "cpu", "backend": "jax",
                                                                     "cpu_devices": 2}}, "d.yaml")
    assert kind("validate", "jobs/mnist_cnn.yaml") is None, "loads no TensorFlow: fresh"
    assert kind("run", "jobs/mnist_cnn.yaml", "--debug") is None
    assert kind("run", "jobs/mnist_cnn.yaml") == "tensorflow"
    assert kind("run", "jobs/mnist_cnn.yaml", "--set", "storage.timeout_s=5") is None
    assert kind("run", "jobs/mnist_cnn.yaml", "--set", "accelerator.backend=jax") is None, "kind auto: no JAX_PLATFORMS"
    assert kind("run", str(jax_spec)) == "jax"
    assert kind("run", str(two_devices)) is None
    several = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:1", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
               "KERAS_DISTRIBUTION_PROCESS_ID": "1"}
    assert kind("run", str(jax_spec), env=several) == "jax"
    assert kind("prepare", "mnist", "--out", "x") == "tensorflow"
