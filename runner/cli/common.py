"""What every command shares: the spec argument and flags, logging set-up, loading a spec, and turning a
RunnerError into its message and exit code (runner/errors.py holds the exit-code table)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from runner.errors import RunnerError
from runner.spec import JobSpec
from runner.specfile import load_spec
from runner.storage import configure_tensorflow

SpecPath = Annotated[
    Path, typer.Argument(help="Job spec (YAML), e.g. jobs/mnist_cnn.yaml.", exists=True, dir_okay=False, readable=True)
]
Overrides = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a spec key, e.g. `--set train.epochs=3` (repeatable; YAML values)."),
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks and TensorFlow's own log lines.")]


def setup_logging(debug: bool) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if debug else "2")
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("absl", "tensorflow", "h5py", "urllib3", "google"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)


def fail(error: RunnerError, debug: bool = False) -> typer.Exit:
    if debug and error.__cause__ is not None:
        logging.getLogger("runner").exception("cause", exc_info=error.__cause__)
    typer.secho(f"error: {error}", err=True, fg=typer.colors.RED)
    return typer.Exit(error.exit_code)


def load(spec: Path, overrides: list[str] | None) -> JobSpec:
    try:
        return load_spec(spec, overrides or [])
    except RunnerError as error:
        raise fail(error) from None


def trained_command_setup(spec: Path, overrides: list[str] | None, debug: bool) -> JobSpec:
    job = load(spec, overrides)
    setup_logging(debug)
    configure_tensorflow(job.storage.timeout_s)
    from runner.flavour import choose_keras

    try:
        choose_keras()
    except RunnerError as error:
        raise fail(error) from None
    return job
