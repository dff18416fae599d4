"""The `runner` command line: thin commands, each calling one library function and mapping errors to exit codes.

Exit codes (runner/__init__.py): 0 ok; 1 training failed; 2 bad spec, flag or data; 3 infrastructure
(accelerator, storage); 75 preempted after saving a checkpoint (run the same job again to continue);
130 interrupted by Ctrl-C after saving a checkpoint (the same; a second Ctrl-C exits at once).
TensorFlow is imported only by the commands that need it, so `validate` and `--help` stay fast.
"""

from __future__ import annotations

# isort: off
# First: it holds a preemption notice (`runner run`) while the rest imports (runner/cli/signals.py).
from runner.cli import signals  # noqa: F401
# isort: on

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from runner.cli import cloud, compare, data, doctor, run, runs
from runner.cli.common import Version

if TYPE_CHECKING:
    from runner.job.startup import StartupPlan

app = typer.Typer(
    help=(
        "Run TensorFlow/Keras training jobs on Cloud TPU, GPU or CPU from a YAML job spec, "
        "with checkpoints that resume and a JSON timing summary.\n\n"
        "Typical use: `runner prepare mnist --out data/mnist`, then `runner run jobs/mnist_cnn.yaml`."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
for group in (run, data, runs, doctor, compare, cloud):
    app.add_typer(group.app)


@app.callback()
def _options(version: Version = False) -> None:
    """Options that apply before any command."""


def main() -> None:
    app()


def startup_plan(argv: list[str], environ: Mapping[str, str], cwd: str | os.PathLike[str] | None = None) -> StartupPlan:
    """How `runner ARGV` would start under `environ` in `cwd` (runner/job/startup.py `plan`, the function every
    command's own start-up calls), without running it: the command line is parsed by this app, the spec read
    as the command reads it. Reads no file but the spec, imports no TensorFlow, fetches nothing (`--code` only
    adds the code folder, which start-up does not read).

    Raises RunnerError where the command itself would stop before TensorFlow loads (a bad spec or backend)."""
    import click
    import typer.main

    from runner.job import startup
    from runner.spec.load import load_spec

    args = [str(arg) for arg in argv]
    command_name = args[0] if args else ""
    if command_name not in startup.LOADING_COMMANDS:
        return startup.plan(command_name, None, "--debug" in args, environ)
    group = typer.main.get_command(app)
    command = group.get_command(click.Context(group), command_name)
    with command.make_context(command_name, args[1:], resilient_parsing=True) as context:
        params = context.params
    job = None
    if params.get("spec") is not None:
        job = load_spec(Path(cwd or os.getcwd(), params["spec"]), list(params.get("overrides") or []))
    return startup.plan(command_name, job, bool(params.get("debug")), environ, params.get("storage_timeout"))
