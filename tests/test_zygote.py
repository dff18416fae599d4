"""The suite's fork server (tests/support/zygote.py): its children answer as fresh processes do, and a command
whose spec would load TensorFlow otherwise is stopped, never run with settings it did not ask for."""

from __future__ import annotations

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
    assert zygote.needs_fresh(["run", str(spec)], REPO), "the router sends it to a fresh process"
    forked = zygote.run(["run", str(spec)], env=cli_env(), cwd=REPO, timeout=120)
    assert forked.returncode == zygote.MISMATCH, forked.stderr
    assert "GCS_RETRY_CONFIG_MAX_RETRIES" in forked.stderr and "fresh=True" in forked.stderr
    assert not (tmp_path / "runs" / "other_timeout" / "checkpoints").exists(), "it stopped before training"


def test_commands_that_load_no_tensorflow_or_ask_for_jax_start_fresh(tmp_path: Path) -> None:
    jax_spec = write_spec(tmp_path, {"name": "j", "accelerator": {"backend": "jax"}})
    assert zygote.needs_fresh(["validate", "jobs/mnist_cnn.yaml"], REPO)
    assert zygote.needs_fresh(["run", str(jax_spec)], REPO)
    assert zygote.needs_fresh(["run", "jobs/mnist_cnn.yaml", "--debug"], REPO)
    assert not zygote.needs_fresh(["run", "jobs/mnist_cnn.yaml"], REPO)
