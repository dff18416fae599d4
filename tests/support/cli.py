"""The runner CLI run in this process with Typer's CliRunner, for the commands that import no TensorFlow
(validate, report, status, submit --dry-run, --help...): the exit code, stdout and stderr a user would see,
without a Python start-up. `run`, `evaluate`, `predict` and anything that handles signals or exits runs as a
child process (tests/conftest.py: run_cli)."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from tests.conftest import cli_env


def invoke(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `runner ARGS` in this process in the environment `env` (default: the suite's CLI environment;
    os.environ is put back afterwards). For the commands that import no TensorFlow; a command that must run
    beside the test (a watcher, a follower) runs in its own process. The current folder stays the test's:
    give the command absolute paths. PYTHONPATH in `env` does not reach this process's sys.path: a test that
    needs it runs the command as a child."""
    from typer.testing import CliRunner

    from runner.cli import app

    env = cli_env() if env is None else env
    changes: dict[str, str | None] = {key: value for key, value in env.items() if os.environ.get(key) != value}
    changes.update({key: None for key in os.environ if key not in env})
    argv = [str(arg) for arg in args]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        result = CliRunner().invoke(app, argv, env=changes, catch_exceptions=False)
    finally:  # the command's log handler writes to CliRunner's stream, which is closed once it returns
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(["runner", *argv], result.exit_code, result.stdout, result.stderr)
