"""`runner prepare`, `verify` and `manifest`: datasets as sharded TFRecords with a manifest, checked against it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runner import EXIT_USAGE, RunnerError, SpecError
from runner.cli.common import Debug, fail, load, setup_logging
from runner.data.storage import DEFAULT_TIMEOUT_S, configure_tensorflow
from runner.job.startup import load_tensorflow

app = typer.Typer()


@app.command()
def prepare(
    dataset: Annotated[str, typer.Argument(help="Dataset name, e.g. mnist.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder or gs://bucket/prefix for shards + manifest.json.")],
    source: Annotated[
        str,
        typer.Option(help="offline: data shipped in a package; keras: keras.datasets (online); "
                          "csv (weather): a CSV named by --param."),
    ] = "offline",
    shards: Annotated[int | None, typer.Option(min=1, help="Shards per split (default: about 8 MB each).")] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="Keep only the first N records of each split (a quick pipeline check).")
    ] = None,
    params: Annotated[
        list[str] | None,
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

    **Examples**

    * `runner prepare mnist --out data/mnist`
    * `runner prepare mnist --out gs://my-bucket/mnist --limit 4096`
    * `runner prepare weather --source csv --param location=weather.csv --param time=date --param target=temp
      --out data/weather`
    """
    setup_logging(debug)
    configure_tensorflow(storage_timeout)
    load_tensorflow(debug)
    from runner.prepare import shards as prepare_mod

    try:
        settings = dict(_key_value(p) for p in params or [])
        manifest_path = prepare_mod.prepare(
            dataset, out, source=source, shards=shards, limit=limit, params=settings, storage_timeout_s=storage_timeout
        )
    except RunnerError as error:
        raise fail(error, debug) from None
    typer.echo(manifest_path)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--param {text!r} must look like key=value (for example --param window=48)")
    return key.strip(), value


@app.command()
def verify(
    folder: Annotated[str, typer.Argument(help="A prepared dataset folder or gs:// prefix (holds manifest.json).")],
    record_sizes: Annotated[
        bool,
        typer.Option(
            "--record-sizes",
            help="Once every shard matches its sha256, add the sizes a manifest written by an older runner lacks "
            "(data.verify: size, the default, needs them).",
        ),
    ] = False,
    debug: Debug = False,
) -> None:
    """Check every shard of a prepared dataset against its manifest: present, its size, its sha256.

    Shards are read in parallel; the last line says how fast (MB/s). Exit 2 naming each shard that differs.

    **Examples**

    * `runner verify data/mnist`
    * `runner verify gs://my-bucket/mnist`
    """
    setup_logging(debug)
    configure_tensorflow(DEFAULT_TIMEOUT_S)
    load_tensorflow(debug)
    from runner.data import pipeline
    from runner.data.storage import storage_error

    folder = folder.rstrip("/")
    try:
        checked, manifest = pipeline.verify_folder(folder)
    except RunnerError as error:
        raise fail(error, debug) from None
    except Exception as exc:  # TensorFlow giving up on a bucket: exit 3 naming it
        error = storage_error(exc, [folder], DEFAULT_TIMEOUT_S)
        if error is None:
            raise
        raise fail(error, debug) from None
    for problem in checked.problems:
        typer.secho(problem, err=True, fg=typer.colors.RED)
    if checked.problems:
        typer.secho(
            f"{len(checked.problems)} of {checked.shards} shards differ from {folder}/{pipeline.MANIFEST}: "
            f"copy them again from their source, or {pipeline.WRITE_AGAIN} if the data changed on purpose",
            err=True, fg=typer.colors.RED,
        )
        raise typer.Exit(EXIT_USAGE)
    unsized = sum(entry.get("bytes") is None for _, _, entry in pipeline.manifest_entries(manifest).values())
    if unsized and record_sizes:
        from runner.prepare.manifest import record_sizes as add_sizes

        path, added = add_sizes(folder, manifest, checked.found)
        typer.echo(f"{path}: recorded the size of {added} shards")
    elif unsized:
        typer.secho(
            f"{folder}/{pipeline.MANIFEST} lists no size for {unsized} shards (written by an older runner): "
            f"add them with `runner verify {folder} --record-sizes`; `runner run` checks sizes before training "
            "(data.verify: size)",
            err=True, fg=typer.colors.YELLOW,
        )
    rate = f"{checked.mb_per_s:,.0f} MB/s" if checked.mb_per_s else "no bytes to read"
    typer.echo(
        f"{folder}: every shard matches manifest.json "
        f"({'sha256' if unsized and not record_sizes else 'size and sha256'}): {checked.shards} shards, "
        f"{checked.bytes / 1e6:,.1f} MB in {checked.seconds:.2f} s, {rate} on {checked.threads} threads"
    )


@app.command()
def manifest(
    spec: Annotated[
        Path,
        typer.Argument(help="Job spec whose data.train/data.eval globs and data.features describe your TFRecords."),
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="Override a spec key, e.g. `--set data.train=/data/train-*.tfrecord`."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a manifest.json that is already there.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and TensorFlow's own log lines.")] = False,
) -> None:
    """Write manifest.json beside your own TFRecords, from the spec's `data.features` schema.

    Counts the records of every shard that data.train and data.eval match, records each shard's sha256
    (for `runner verify`), and parses and decodes every record as training will.
    Exit 2, naming the shard, the record and the feature, when a record does not fit the schema.

    **Examples**

    * `runner manifest examples/fashion/job.yaml`
    """
    job = load(spec, overrides)
    setup_logging(debug)
    load_tensorflow(debug)
    from runner.prepare.manifest import write_user_manifests

    try:
        paths = write_user_manifests(job, str(spec), force=force)
    except RunnerError as error:
        raise fail(error, debug) from None
    for path in paths:
        typer.echo(path)
