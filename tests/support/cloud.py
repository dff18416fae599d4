"""What the tests of the Cloud TPU commands share (`runner submit`, `watch`, `status`, `cancel`, `logs` and
the VM's startup script): the names of the place they submit to, the environment that points runner and gcloud
at the fakes, and the CLI run in this process. Their fixtures are in tests/support/cloud_fixtures.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import cli_env

PROJECT, ZONE = "runner-test", "us-central1-a"
IMAGE = "us-central1-docker.pkg.dev/runner-test/runner/runner:tpu"


def cloud_env(tpu_endpoint: str, folder: Path, **extra: str) -> dict[str, str]:
    """The environment of a `runner` (and gcloud) on this machine whose Cloud TPU API is the fake at
    `tpu_endpoint`; gcloud's configuration and runner's own state live in `folder`."""
    return cli_env(
        CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=f"{tpu_endpoint}/",
        CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token",
        CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
        CLOUDSDK_CONFIG=str(folder / "gcloud"),
        CLOUDSDK_CORE_DISABLE_PROMPTS="1",
        RUNNER_STATE_DIR=str(folder / "state"),
        **extra,
    )


def invoke(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs `runner ARGS` in this process with Typer's CliRunner, in the environment `env` (os.environ is
    put back afterwards): the exit code, stdout and stderr a user would see, without a Python start-up.
    For the commands that import no TensorFlow; a command that must run beside the test (a watcher, a
    follower) runs in its own process."""
    from typer.testing import CliRunner

    from runner.cli import app

    changes: dict[str, str | None] = {key: value for key, value in env.items() if os.environ.get(key) != value}
    changes.update({key: None for key in os.environ if key not in env})
    argv = [str(arg) for arg in args]
    result = CliRunner().invoke(app, argv, env=changes, catch_exceptions=False)
    return subprocess.CompletedProcess(["runner", *argv], result.exit_code, result.stdout, result.stderr)
