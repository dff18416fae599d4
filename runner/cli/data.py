"""`runner prepare`, `verify` and `manifest`: datasets as sharded TFRecords with a manifest, checked against it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from runner import EXIT_USAGE, RunnerError, SpecError
from runner.cli.common import Debug, fail, load, setup_logging, start_tensorflow
from runner.data.storage import DEFAULT_TIMEOUT_S

app = typer.Typer()


# The forms of your own data `runner prepare FORM LOCATION` reads (runner/prepare/own.py, images.py, tfds.py).
OWN_FORMS = ("arrays", "images", "csv", "tfds", "text")


@app.command()
def prepare(
    dataset: Annotated[
        str, typer.Argument(help="A built-in dataset (mnist, fashion_mnist, cifar10, imdb, weather) or a form of your "
                                 "own data: arrays, images, csv, tfds, text.")
    ],
    location: Annotated[
        str | None,
        typer.Argument(help="Your own data: the .npz file or .npy folder, the image folder, the CSV, the tfds name, "
                            "the .jsonl or .txt of texts."),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option("--out", "-o", help="Folder or gs://bucket/prefix for shards + manifest (default data/NAME)."),
    ] = None,
    source: Annotated[
        str,
        typer.Option(help="Built-in datasets: offline (data shipped in a package); keras (keras.datasets, online); "
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
    features: Annotated[
        str | None,
        typer.Option(help="arrays, csv, tfds: the input features, comma-separated (csv: default every other column)."),
    ] = None,
    label: Annotated[str | None, typer.Option(help="arrays, csv, tfds: the label array or column.")] = None,
    split: Annotated[
        str | None,
        typer.Option(help="arrays, images, csv: cut one pool of records into splits, e.g. train=0.9,test=0.1 "
                          "(default when the data has no splits of its own: train=0.8,validation=0.1,test=0.1)."),
    ] = None,
    missing: Annotated[
        str | None,
        typer.Option(help="csv: what to do with missing cells (default: stop, naming every one): drop (leave out "
                          "their records), fill=median, fill=VALUE or fill=COLUMN:VALUE,..."),
    ] = None,
    size: Annotated[str | None, typer.Option(help="images: resize every image to HEIGHTxWIDTH, e.g. 180x180.")] = None,
    color: Annotated[str, typer.Option(help="images: rgb, grayscale or rgba (Keras's color_mode).")] = "rgb",
    store: Annotated[str, typer.Option(help="images: png (re-encoded, smaller) or raw (decoded pixels).")] = "png",
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="tfds: the folder tfds wrote the dataset to.")
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="text: the KerasHub preset (model.hub) whose tokenizer makes the token ids.")
    ] = None,
    sequence_length: Annotated[
        int | None, typer.Option("--sequence-length", help="text: tokens of a record (its model's context), e.g. 256.")
    ] = None,
    storage_timeout: Annotated[
        float, typer.Option(min=1, help="gs:// only: seconds of failed uploads (retried with backoff) before exit 3.")
    ] = DEFAULT_TIMEOUT_S,
    debug: Debug = False,
) -> None:
    """Turn a dataset into sharded TFRecords plus a manifest (schema, record counts, sizes, sha256 per shard,
    label ranges, value ranges), in a folder or a bucket; the manifest is written last.

    Built-in: mnist, fashion_mnist, cifar10, imdb, weather. `--source keras` downloads through
    `keras.datasets` and needs internet (a TPU VM has it); `--source offline` reads data shipped in packages.
    Your own data: arrays, images, csv, tfds (docs/data.md, "Your own data"); text: prompt/response pairs or texts
    as token ids of a KerasHub preset (docs/language-models.md). A bad file stops with exit 2
    naming it, before anything is written.

    **Examples**

    * `runner prepare mnist --out data/mnist`
    * `runner prepare mnist --out gs://my-bucket/mnist --limit 4096`
    * `runner prepare arrays data.npz --features x --label y --split train=0.9,test=0.1`
    * `runner prepare images flowers/ --size 180x180`
    * `runner prepare csv heart.csv --label target`
    * `runner prepare csv heart.csv --label target --missing fill=median`
    * `runner prepare tfds mnist --data-dir ~/tensorflow_datasets`
    * `runner prepare text chats.jsonl --preset gemma3_1b --sequence-length 256`
    """
    start_tensorflow("prepare", None, debug, storage_timeout)
    from runner.prepare import shards as prepare_mod

    try:
        if dataset in OWN_FORMS:
            load = _own_loader(dataset, location, features, label, split, size, color, store, data_dir, limit,
                               missing, (preset, sequence_length))
            target = out or _default_out(dataset, location)
            manifest_path = prepare_mod.publish(load, target, shards, storage_timeout)
        else:
            if location is not None:
                raise SpecError(f"{dataset} is a built-in dataset: it takes no {location!r}; "
                                f"your own data is one of: {', '.join(OWN_FORMS)}")
            settings = dict(_key_value(p) for p in params or [])
            manifest_path = prepare_mod.prepare(
                dataset, out or f"data/{dataset}", source=source, shards=shards, limit=limit, params=settings,
                storage_timeout_s=storage_timeout,
            )
    except RunnerError as error:
        raise fail(error, debug) from None
    typer.echo(manifest_path)


def _default_out(form: str, location: str | None) -> str:
    from runner.prepare.own import default_out

    return default_out(form, location or form)


def _own_loader(form, location, features, label, split, size, color, store, data_dir, limit, missing=None,
                text=(None, None)):
    """A function that reads and checks the user's data (called by publish once the bucket is known to exist)."""
    if location is None:
        what = {"arrays": "FILE.npz or a folder of .npy", "images": "FOLDER", "csv": "FILE.csv", "tfds": "NAME",
                "text": "FILE.jsonl"}[form]
        raise SpecError(f"runner prepare {form} needs {what}: `runner prepare {form} {what} ...`")
    names = tuple(n.strip() for n in features.split(",") if n.strip()) if features else ()
    if form == "arrays" and (not names or not label):
        raise SpecError("runner prepare arrays needs --features (the input arrays) and --label (the label array)")
    if form == "csv" and not label:
        raise SpecError("runner prepare csv needs --label COLUMN")
    if form == "tfds" and not data_dir:
        raise SpecError("runner prepare tfds needs --data-dir (the folder tfds wrote the dataset to)")
    if missing is not None and form != "csv":
        raise SpecError(f"--missing is for CSV tables; runner prepare {form} refuses a missing value outright")
    if form == "tfds" and split:
        raise SpecError("runner prepare tfds keeps the dataset's own splits: drop --split")
    if form != "text" and any(v is not None for v in text):
        raise SpecError(f"--preset and --sequence-length are for runner prepare text, not {form}")

    def load():
        from runner.prepare import own

        if form == "arrays":
            dataset = own.arrays_dataset(location, names, label, split)
        elif form == "csv":
            dataset = own.csv_dataset(location, label, names, split, missing)
        elif form == "text":
            from runner.prepare.lm import text_dataset

            dataset = text_dataset(location, *text, split)
        elif form == "images":
            from runner.prepare.images import images_dataset

            dataset = images_dataset(location, size=size, color=color, store=store, split=split)
        else:
            from runner.prepare.tfds import tfds_dataset

            dataset = tfds_dataset(location, data_dir, names, label)
        return dataset.head(limit) if limit is not None else dataset

    return load


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
    storage_timeout: Annotated[
        float, typer.Option(min=1, help="gs:// only: seconds an unanswered read is retried (with backoff) before "
                            "exit 3.")
    ] = DEFAULT_TIMEOUT_S,
    debug: Debug = False,
) -> None:
    """Check every shard of a prepared dataset against its manifest: present, its size, its sha256.

    Shards are read in parallel; the last line says how fast (MB/s). Exit 2 naming each shard that differs.

    **Examples**

    * `runner verify data/mnist`
    * `runner verify gs://my-bucket/mnist`
    * `runner verify gs://my-bucket/mnist --storage-timeout 30`
    """
    setup_logging(debug)
    folder = folder.rstrip("/") or "/"
    if "://" not in folder and os.path.exists(folder) and not os.path.isdir(folder):
        raise fail(not_a_dataset_folder(folder, local=True), debug)  # before TensorFlow loads: at once
    start_tensorflow("verify", None, debug, storage_timeout)
    import tensorflow as tf

    from runner.data import pipeline

    try:
        checked, manifest = pipeline.verify_folder(folder)
    except RunnerError as exc:
        # A bucket object given for the folder: its manifest.json is not found.
        given_a_file = "://" in folder and tf.io.gfile.exists(folder) and not tf.io.gfile.isdir(folder)
        raise fail(not_a_dataset_folder(folder, local=False) if given_a_file else exc, debug) from None
    except Exception as exc:
        raise _storage_fault(exc, [folder], storage_timeout, debug, "--storage-timeout") from None
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


def not_a_dataset_folder(path: str, local: bool) -> SpecError:
    """The usage error for `runner verify PATH` given a file where the dataset folder goes: the folder to give
    instead (that of a manifest or a shard, or the folders a job spec's data patterns point into)."""
    import posixpath

    from runner.data.pipeline import MANIFEST

    said = (f"{path} is a file, not a dataset folder: `runner verify` takes the folder that holds {MANIFEST} and "
            "the shards it lists")
    name = posixpath.basename(path)
    parent = posixpath.dirname(path) or "."
    if name == MANIFEST:
        return SpecError(f"{said}; this is that manifest: `runner verify {parent}`")
    if name.endswith(".tfrecord") or ".tfrecord-" in name:
        return SpecError(f"{said}; this is a shard: `runner verify {parent}` checks it with the others")
    read = _spec_data_folders(path) if local else None
    if read is None:
        return SpecError(f"{said} (written by `runner prepare` or `runner manifest`)")
    if not read:
        return SpecError(f"{said}; this is a job spec, and it names no data folder (data.train, data.eval)")
    pointed = "; ".join(f"{' and '.join(keys)} point{'s' if len(keys) == 1 else ''} into {where}"
                        for where, keys in read.items())
    commands = ", ".join(f"`runner verify {where}`" for where in read)
    return SpecError(f"{said}; this is a job spec, whose {pointed}: {commands}")


def _spec_data_folders(path: str) -> dict[str, list[str]] | None:
    """folder -> the data keys of the job spec at `path` whose patterns point into it; None when `path` is not
    a job spec. Its patterns as the runner resolves them; from the YAML as written if the spec does not load."""
    import posixpath

    from runner.spec.load import load_spec
    from runner.spec.types import JobSpec
    from runner.spec.yaml_lines import MAX_BYTES, parse_yaml

    keys = ("train", "eval", "validation")
    try:
        with open(path, "rb") as handle:
            doc, _ = parse_yaml(handle.read(MAX_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError, RunnerError, ValueError):
        return None
    if not isinstance(doc, dict) or not set(doc) & set(JobSpec.model_fields):
        return None
    try:
        data = load_spec(path).data
        patterns = {k: getattr(data, k) for k in keys}
    except (RunnerError, ValueError, TypeError):
        data = doc.get("data") if isinstance(doc.get("data"), dict) else {}
        base = os.path.dirname(os.path.abspath(path))
        patterns = {k: v if "://" in v or os.path.isabs(v) else os.path.normpath(os.path.join(base, v))
                    for k, v in data.items() if k in keys and isinstance(v, str)}
    folders: dict[str, list[str]] = {}
    for key, pattern in patterns.items():
        if pattern:
            folders.setdefault(posixpath.dirname(pattern) or ".", []).append(f"data.{key}")
    return folders


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
    start_tensorflow("manifest", job, debug)  # gs:// data is read under the spec's own bound
    from runner.prepare.manifest import write_user_manifests

    try:
        paths = write_user_manifests(job, str(spec), force=force)
    except RunnerError as error:
        raise fail(error, debug) from None
    except Exception as exc:
        raise _storage_fault(exc, [job.data.train, job.data.eval], job.storage.timeout_s, debug) from None
    for path in paths:
        typer.echo(path)


def _storage_fault(exc: Exception, paths: list[str | None], timeout_s: float, debug: bool,
                   setting: str = "storage.timeout_s") -> Exception:
    """TensorFlow giving up on a bucket, as the exit 3 that names it (and `setting`, what bounded the wait); any
    other error goes on as it was."""
    from runner.data.storage import storage_error

    error = storage_error(exc, paths, timeout_s, setting)
    if error is None:
        raise exc
    return fail(error, debug)
