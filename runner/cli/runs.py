"""`runner runs`: the run folders under an output.dir, and `runner runs rm NAME` to remove one."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from runner import EXIT_USAGE, RunnerError, SpecError
from runner.cli.common import Debug, fail, setup_logging

app = typer.Typer()

_DEFAULT_DIR = "runs"  # output.dir's default (runner/spec/types.py)


@app.command()
def runs(
    words: Annotated[
        list[str] | None,
        typer.Argument(
            help="[FOLDER|gs://BUCKET/PREFIX] to list (default: runs), or `rm NAME [FOLDER]` to remove a run folder.",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document: a list of runs.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="rm: remove without asking.")] = False,
    storage_timeout: Annotated[float, typer.Option(min=1, help="gs:// only: seconds of retries before exit 3.")] = 60.0,
    debug: Debug = False,
) -> None:
    """List the run folders under an output.dir: name, status, epochs done/asked, best metric, precision,
    device, when, size. `running` means a run holds the folder's lease right now.

    `runner runs rm NAME [FOLDER]` removes one run folder, after asking (or with `--yes`); never one that a
    run holds (exit 2, naming the holder).

    **Examples**

    * `runner runs`
    * `runner runs gs://my-bucket/runs --json`
    * `runner runs rm mnist_cnn --yes`
    """
    from runner.rundir import listing

    setup_logging(debug)
    words = list(words or [])
    try:
        if words[:1] == ["rm"]:
            if len(words) not in (2, 3):
                raise SpecError("usage: runner runs rm NAME [FOLDER] (FOLDER: the output.dir, default runs)")
            folder = words[2] if len(words) == 3 else _DEFAULT_DIR
            run = listing.find_run(folder, words[1], storage_timeout)
            if run.holder is not None:
                raise SpecError(f"{run.path} is in use by a run ({run.holder}); it is not removed")
            if not yes:
                if not sys.stdin.isatty():
                    raise SpecError(f"not removing {run.path} without a confirmation: pass --yes")
                typer.confirm(f"remove {run.path} ({_size(run.bytes)}, {run.status})?", abort=True)
            removed = listing.remove_run(run, storage_timeout)
            typer.echo(f"removed {run.path} ({_size(removed)})")
            return
        if len(words) > 1:
            raise SpecError(f"runner runs takes one FOLDER, got {len(words)}: {' '.join(words)}")
        folder = words[0] if words else _DEFAULT_DIR
        found = listing.list_runs(folder, storage_timeout)
    except typer.Abort:
        typer.secho("nothing removed", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    except RunnerError as error:
        raise fail(error, debug) from None
    if as_json:
        typer.echo(json.dumps([run.to_dict() for run in found], indent=2))
        return
    if not found:
        typer.echo(f"{folder}: no run folders")
        return
    typer.echo(table(found))


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def table(found) -> str:
    """The runs as aligned columns, a header first."""
    rows = [("NAME", "STATUS", "EPOCHS", "BEST", "PRECISION", "DEVICE", "WHEN (UTC)", "SIZE")]
    for run in found:
        epochs = f"{'?' if run.epochs_done is None else run.epochs_done}/{run.epochs_asked or '?'}"
        best = f"{run.best['metric']} {run.best['value']:.4f}" if run.best else "-"
        when = run.updated.replace("T", " ").removesuffix("Z")[:16] if run.updated else "-"
        rows.append((run.name, run.status, epochs, best, run.precision or "-", run.device or "-", when,
                     _size(run.bytes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
