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

import typer

from runner.cli import cloud, compare, data, doctor, run, runs
from runner.cli.common import Version

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
