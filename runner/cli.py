"""The `runner` command line: thin commands, each calling one library function and mapping errors to exit codes.

Exit codes: 0 ok; 1 training failed; 2 bad spec, flag or data; 3 infrastructure (accelerator, storage);
75 preempted after saving a checkpoint (run the same job again to continue).
TensorFlow is imported only by the commands that need it, so `validate` and `--help` stay fast.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from runner.errors import EXIT_USAGE, RunnerError, SpecError
from runner.spec import JobSpec
from runner.specfile import load_spec
from runner.storage import DEFAULT_TIMEOUT_S, configure_tensorflow

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

SpecPath = Annotated[
    Path, typer.Argument(help="Job spec (YAML), e.g. jobs/mnist_cnn.yaml.", exists=True, dir_okay=False, readable=True)
]
Overrides = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a spec key, e.g. `--set train.epochs=3` (repeatable; YAML values)."),
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks and TensorFlow's own log lines.")]


def _setup_logging(debug: bool) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if debug else "2")
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("absl", "tensorflow", "h5py", "urllib3", "google"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)


def _fail(error: RunnerError, debug: bool = False) -> typer.Exit:
    if debug and error.__cause__ is not None:
        logging.getLogger("runner").exception("cause", exc_info=error.__cause__)
    typer.secho(f"error: {error}", err=True, fg=typer.colors.RED)
    return typer.Exit(error.exit_code)


def _load(spec: Path, overrides: list[str] | None) -> JobSpec:
    try:
        return load_spec(spec, overrides or [])
    except RunnerError as error:
        raise _fail(error) from None


@app.command()
def validate(spec: SpecPath, overrides: Overrides = None) -> None:
    """Check a job spec (and `--set` overrides) without importing TensorFlow; print the resolved spec.

    Exit 0 when valid, 2 with every problem (file:line, dotted key, what to change) when not.
    """
    job = _load(spec, overrides)
    typer.echo(json.dumps(job.to_dict(), indent=2))


@app.command()
def prepare(
    dataset: Annotated[str, typer.Argument(help="Dataset name, e.g. mnist.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder or gs://bucket/prefix for shards + manifest.json.")],
    source: Annotated[str, typer.Option(help="offline: data shipped in a package; keras: keras.datasets (online); csv (weather): a CSV named by --param.")] = "offline",
    shards: Annotated[Optional[int], typer.Option(min=1, help="Shards per split (default: about 8 MB each).")] = None,
    limit: Annotated[
        Optional[int], typer.Option(min=1, help="Keep only the first N records of each split (a quick pipeline check).")
    ] = None,
    params: Annotated[
        Optional[list[str]],
        typer.Option(
            "--param", "-p",
            help="A source setting as key=value (repeatable), e.g. `runner prepare weather --source csv "
            "--param location=gs://b/w.csv --param time=date --param target=temp`.",
        ),
    ] = None,
    storage_timeout: Annotated[
        float, typer.Option(min=1, help="gs:// only: seconds of failed uploads (retried with backoff) before exit 3.")
    ] = DEFAULT_TIMEOUT_S,
    debug: Debug = False,
) -> None:
    """Turn a real dataset into sharded TFRecords plus a manifest (record counts, schema, sha256 per shard).

    Datasets: mnist, fashion_mnist, cifar10, imdb, weather. `--source keras` downloads through
    `keras.datasets` and needs internet (a TPU VM has it); `--source offline` reads data shipped in packages.
    """
    _setup_logging(debug)
    configure_tensorflow(storage_timeout)
    from runner import prepare as prepare_mod

    try:
        settings = dict(_key_value(p) for p in params or [])
        manifest_path = prepare_mod.prepare(
            dataset, out, source=source, shards=shards, limit=limit, params=settings, storage_timeout_s=storage_timeout
        )
    except RunnerError as error:
        raise _fail(error, debug) from None
    typer.echo(manifest_path)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--param {text!r} must look like key=value (for example --param window=48)")
    return key.strip(), value


@app.command()
def verify(
    folder: Annotated[str, typer.Argument(help="A prepared dataset folder or gs:// prefix (holds manifest.json).")],
    debug: Debug = False,
) -> None:
    """Check every shard of a prepared dataset against its manifest (presence and sha256). Exit 2 on a mismatch."""
    _setup_logging(debug)
    configure_tensorflow(DEFAULT_TIMEOUT_S)
    from runner import data
    from runner.storage import storage_error

    try:
        problems = data.verify_shards(folder.rstrip("/"))
    except RunnerError as error:
        raise _fail(error, debug) from None
    except Exception as exc:  # TensorFlow giving up on a bucket: exit 3 naming it
        error = storage_error(exc, [folder], DEFAULT_TIMEOUT_S)
        if error is None:
            raise
        raise _fail(error, debug) from None
    for problem in problems:
        typer.secho(problem, err=True, fg=typer.colors.RED)
    if problems:
        raise typer.Exit(EXIT_USAGE)
    typer.echo(f"{folder}: every shard matches manifest.json")


class EarlyNotice:
    """Holds a SIGTERM that arrives before the job installs its preemption handler (runner/train.py), mostly
    while TensorFlow imports, so a preemption then ends the run as `preempted` (exit 75), not killed (143)."""

    def __init__(self) -> None:
        self.at: float | None = None
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, *_: object) -> None:
        if self.at is None:
            self.at = time.monotonic()

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


@app.command()
def run(spec: SpecPath, overrides: Overrides = None, debug: Debug = False) -> None:
    """Train the job (or resume it from its newest checkpoint); the JSON summary is the last stdout line.

    Re-running a finished job prints its summary and trains nothing. Exit codes: 0, 1 training failed,
    2 spec/data, 3 accelerator/storage, 75 preempted (checkpoint saved: run again to continue).
    """
    early = EarlyNotice()
    job = _load(spec, overrides)
    loaded_at = time.monotonic()
    _setup_logging(debug)
    configure_tensorflow(job.storage.timeout_s)  # before TensorFlow loads: it reads them once
    from runner.flavour import choose_keras

    try:
        choose_keras()
    except RunnerError as error:
        raise _fail(error) from None
    from runner.errors import Preempted
    from runner.job import run_job

    if job.kind == "matmul_bench":  # no checkpoints to save: a notice just stops it before it starts
        early.restore()
        if early.at is not None:
            raise _fail(Preempted("preemption notice received while starting; nothing was run; run the job again"))
    result = run_job(job, spec_loaded_at=loaded_at, verbose=1 if sys.stdout.isatty() else 0, early_notice=early.at)
    typer.echo(json.dumps(result.summary, separators=(",", ":")))
    if result.error is not None:
        raise _fail(result.error, debug)


def _trained_command_setup(spec: Path, overrides: list[str] | None, debug: bool) -> JobSpec:
    job = _load(spec, overrides)
    _setup_logging(debug)
    configure_tensorflow(job.storage.timeout_s)
    from runner.flavour import choose_keras

    try:
        choose_keras()
    except RunnerError as error:
        raise _fail(error) from None
    return job


@app.command()
def evaluate(spec: SpecPath, overrides: Overrides = None, debug: Debug = False) -> None:
    """Evaluate the job's newest checkpoint on `data.eval`, on whatever device this machine has.

    Prints the metrics as one JSON line. A model trained on many TPU cores evaluates on one CPU.
    """
    job = _trained_command_setup(spec, overrides, debug)
    from runner import predict as predict_mod

    try:
        report = predict_mod.evaluate(job)
    except RunnerError as error:
        raise _fail(error, debug) from None
    typer.echo(json.dumps(report, separators=(",", ":")))


@app.command()
def predict(
    spec: SpecPath,
    input: Annotated[str, typer.Option("--input", "-i", help="Rows to predict: .npy, .npz (by input name) or a TFRecord glob.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write predictions to this .npy file instead of stdout.")] = None,
    overrides: Overrides = None,
    debug: Debug = False,
) -> None:
    """Predict with the job's newest checkpoint, any number of rows, on whatever device this machine has.

    Without `--output`, prints one JSON line per row: the model's outputs and, for a classifier, the class.
    """
    job = _trained_command_setup(spec, overrides, debug)
    import numpy as np

    from runner import predict as predict_mod

    try:
        outputs, trained = predict_mod.predict(job, input)
    except RunnerError as error:
        raise _fail(error, debug) from None
    if output is not None:
        np.save(output, outputs)
        typer.echo(f"{len(outputs)} predictions from {trained.checkpoint} -> {output}")
        return
    for index, row in enumerate(outputs):
        line = {"index": index, "output": np.atleast_1d(row).round(6).tolist()}
        if np.ndim(row) == 1 and len(row) > 1:
            line["class"] = int(np.argmax(row))
        typer.echo(json.dumps(line))


# Commands of other areas live in their own modules (each a `typer.Typer()` named `app`, importing
# TensorFlow lazily) and are added here, so `runner --help` lists them all.
_COMMAND_MODULES: tuple[str, ...] = ("runner.cli_manifest", "runner.cli_doctor", "runner.cli_report", "runner.cli_cloud")


def _register_commands() -> None:
    import importlib

    for name in _COMMAND_MODULES:
        app.registered_commands.extend(importlib.import_module(name).app.registered_commands)


_register_commands()


def main() -> None:
    app()
