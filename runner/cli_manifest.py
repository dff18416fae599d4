"""`runner manifest`: describe your own TFRecords so `runner run` can train on them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer()


@app.command()
def manifest(
    spec: Annotated[
        Path,
        typer.Argument(help="Job spec whose data.train/data.eval globs and data.features describe your TFRecords.",
                       exists=True, dir_okay=False, readable=True),
    ],
    overrides: Annotated[
        Optional[list[str]],
        typer.Option("--set", "-s", help="Override a spec key, e.g. `--set data.train=/data/train-*.tfrecord`."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a manifest.json that is already there.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and TensorFlow's own log lines.")] = False,
) -> None:
    """Write manifest.json beside your own TFRecords, from the spec's `data.features` schema.

    Counts the records of every shard that data.train and data.eval match, records each shard's sha256
    (for `runner verify`), and parses and decodes every record as training will.
    Exit 2, naming the shard, the record and the feature, when a record does not fit the schema.
    """
    from runner.cli import _fail, _load, _setup_logging

    job = _load(spec, overrides)
    _setup_logging(debug)
    from runner.errors import RunnerError
    from runner.index import write_user_manifests

    try:
        paths = write_user_manifests(job, str(spec), force=force)
    except RunnerError as error:
        raise _fail(error, debug) from None
    for path in paths:
        typer.echo(path)
