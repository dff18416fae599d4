"""What every command shares: the spec argument and flags, logging set-up, loading a spec, and turning a
RunnerError into its message and exit code (runner/__init__.py holds the exit-code table)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from runner import RunnerError
from runner.job import startup
from runner.spec.load import load_spec
from runner.spec.types import JobSpec

SpecPath = Annotated[
    Path, typer.Argument(help="Job spec (YAML), e.g. jobs/mnist_cnn.yaml.")
]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a spec key, e.g. `--set train.epochs=3` (repeatable; YAML values)."),
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks and TensorFlow's own log lines.")]


def setup_logging(debug: bool) -> None:
    """Log lines on stderr (`HH:MM:SS L logger: message`); call before TensorFlow loads.

    Quiet by default: TensorFlow's C++ start-up notices (absl's "before absl::InitializeLog()" warning, the CPU
    feature and oneDNN notices) are hidden with TF_CPP_MIN_LOG_LEVEL=2, which TensorFlow reads once, when it
    loads; a level already in the environment is kept. `--debug` shows them (level 0), with tracebacks and the
    Python loggers of TensorFlow, absl and Google's clients.
    """
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = startup.log_level(debug, os.environ)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(handler)  # set up once per process, whichever command asks again
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("absl", "tensorflow", "h5py", "urllib3", "google", "matplotlib", "PIL", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)


_HANDLER_NAME = "runner-stderr"


def version_text() -> str:
    """`runner --version`: the runner's version and the distribution it came from."""
    from importlib import metadata

    from runner import __version__

    try:
        installed = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return f"runner {__version__}"
    return f"runner {installed} ({DISTRIBUTION})"


# The name `pip install` knows the runner by (`runner` on PyPI is another project); the command stays `runner`.
DISTRIBUTION = "tpu-job-runner"


def show_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


Version = Annotated[
    bool,
    typer.Option("--version", callback=show_version, is_eager=True, help="Print the runner's version and exit."),
]


def fail(error: RunnerError, debug: bool = False) -> typer.Exit:
    if debug and error.__cause__ is not None:
        logging.getLogger("runner").exception("cause", exc_info=error.__cause__)
    typer.secho(f"error: {error}", err=True, fg=typer.colors.RED)
    return typer.Exit(error.exit_code)


def load(spec: Path | None, overrides: list[str] | None) -> JobSpec:
    try:
        return load_spec(spec, overrides or [])
    except RunnerError as error:
        raise fail(error) from None


def start_tensorflow(command: str, job: JobSpec | None, debug: bool, storage_timeout_s: float | None = None) -> None:
    """Logging, then the command's start-up plan (runner/job/startup.py: everything TensorFlow reads while it
    loads), then TensorFlow."""
    setup_logging(debug)
    try:
        startup.start(startup.plan(command, job, debug, os.environ, storage_timeout_s))
    except RunnerError as error:
        raise fail(error, debug) from None


def trained_command_setup(command: str, spec: Path, overrides: list[str] | None, debug: bool) -> JobSpec:
    job = load(spec, overrides)
    start_tensorflow(command, job, debug)
    return job
