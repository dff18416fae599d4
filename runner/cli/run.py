"""`runner validate`, `run`, `evaluate` and `predict`: a job spec checked, trained, and its model used."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from runner import RunnerError
from runner.cli.common import (
    Debug,
    Overrides,
    SpecPath,
    fail,
    load,
    start_tensorflow,
    trained_command_setup,
)
from runner.cli.signals import early_notice

app = typer.Typer()

Show = Annotated[bool, typer.Option("--show", help="Also print the resolved spec (defaults filled in, paths made "
                                     "absolute) as JSON on stdout.")]
NoData = Annotated[bool, typer.Option("--no-data", help="The data comes later: do not check it (by default a "
                                      "local data pattern that matches nothing is an error).")]


TpuTypeCheck = Annotated[
    str | None,
    typer.Option("--tpu-type", metavar="TYPE",
                 help="Also estimate the bytes per device of the job's model on this TPU type (e.g. v6e-8) against "
                 "its chips' HBM: exit 2 when it does not fit (docs/sharding.md)."),
]


@app.command()
def validate(spec: SpecPath, overrides: Overrides = None, show: Show = False, no_data: NoData = False,
             tpu_type: TpuTypeCheck = None) -> None:
    """Check that a job spec (and `--set` overrides) is ready to run, without importing TensorFlow or running
    any of its code.

    Checks every key, type and range; built-in model names; Keras optimizer, loss, metric and schedule names and
    config keys; that each `package.module:function` is found in the spec's code (`code.folder`,
    `code.packages`: found, not imported) and defines the function; and for local data, that the pattern
    matches files, their manifest is there and the records fill one global batch (`--no-data`: the data comes
    later). Exit 0 when ready (notes on stderr say what was not checked, e.g. data in a bucket), 2 with every
    problem (file:line or `--set`, key, what to change) first on stderr.

    **Examples**

    * `runner validate jobs/mnist_cnn.yaml`
    * `runner validate jobs/mnist_cnn.yaml --set data.global_batch_size=4096 --show`
    * `runner validate my_job.yaml --no-data`
    * `runner validate jobs/my_lm.yaml --tpu-type v6e-8`
    """
    from runner import EXIT_USAGE
    from runner.spec.load import preflight

    try:
        checked = preflight(spec, overrides or [], data=not no_data)
    except RunnerError as error:
        raise fail(error) from None
    if checked.problems:
        typer.secho("error: " + "\n".join(checked.problems), err=True, fg=typer.colors.RED)
    for key, origin in checked.code.items():
        typer.echo(f"code: {key} {checked.spec.import_paths[key]} is {origin}", err=True)
    for note in checked.notes:
        typer.echo(f"note: {note}", err=True)
    if tpu_type and not checked.problems:
        from runner.device import memory

        try:
            fits, line = memory.check_for_tpu(checked.spec, tpu_type)
        except RunnerError as error:
            raise fail(error) from None
        if fits == "too_big":
            checked.problems.append(line)
            typer.secho(f"error: {line}", err=True, fg=typer.colors.RED)
        else:
            typer.echo(("warning: " if fits == "tight" else "") + line, err=True)
    if checked.problems:
        raise typer.Exit(EXIT_USAGE)
    if show:
        typer.echo(json.dumps(checked.spec.to_dict(), indent=2))
    typer.echo(f"ok: {spec} is ready to run" + ("" if show else " (--show prints the resolved spec)"), err=True)


ProgressEvery = Annotated[
    float,
    typer.Option(
        "--progress-every", min=0, metavar="SECONDS",
        help="Without a terminal (a log, a container): a progress line every SECONDS (0: none). "
        "On a terminal a progress bar is shown instead.",
    ),
]


Fresh = Annotated[
    bool,
    typer.Option(
        "--fresh",
        help="Start the job over at step 0: its run folder is moved aside to <folder>.old-<time> (never deleted).",
    ),
]


Code = Annotated[
    str | None,
    typer.Option(
        "--code", envvar="RUNNER_CODE", metavar="ARCHIVE",
        help="Code sent with the job, gs://.../SHA256.tar.gz#sha256=SHA256 (`runner submit` sets RUNNER_CODE): "
        "fetched, its sha256 checked, unpacked and used as code.folder (its packages put on the path) before the "
        "spec is read.",
    ),
]


@app.command()
def run(
    spec: SpecPath, overrides: Overrides = None, debug: Debug = False, progress_every: ProgressEvery = 30.0,
    fresh: Fresh = False, code: Code = None,
) -> None:
    """Train the job (or resume it from its newest checkpoint); the JSON summary is the last stdout line.

    Re-running a finished job prints its summary and trains nothing. A closing line on stderr says how it
    ended and where the model is. Exit codes: 0, 1 training failed, 2 spec/data, 3 accelerator/storage,
    4 trained but learned nothing (at chance), 75 preempted (checkpoint saved: run again to continue), 124
    train.max_duration reached (saved) or stalled, 130 interrupted by Ctrl-C (the same, saved; a second Ctrl-C
    exits at once). `--fresh` starts over, moving the earlier run folder aside.

    **Examples**

    * `runner run jobs/mnist_cnn.yaml`
    * `runner run jobs/mnist_cnn.yaml --set train.epochs=3 --set data.global_batch_size=512`
    * `runner run jobs/mnist_cnn.yaml --progress-every 10 2>train.log`
    * `runner run jobs/mnist_cnn.yaml --set train.epochs=3 --fresh` (an earlier run of the job is moved aside)
    """
    early = early_notice()
    job = load(spec, _with_code(overrides, code, debug))
    _with_requirements(job.code.requirements, debug)
    loaded_at = time.monotonic()
    start_tensorflow("run", job, debug)
    from runner.job.run import run_job

    if fresh:
        from runner.rundir.fresh import move_aside
        from runner.rundir.outputs import RunFolder

        try:
            moved = move_aside(RunFolder(job.run_dir), job.name, job.storage.timeout_s)
        except RunnerError as error:
            raise fail(error, debug) from None
        said = f"{job.run_dir} moved to {moved}" if moved else f"no earlier run in {job.run_dir}"
        typer.echo(f"--fresh: {said}", err=True)
    from runner import EXIT_USAGE
    from runner.train.progress import closing_line

    result = run_job(job, spec_loaded_at=loaded_at, early_notice=early, progress_every=progress_every)
    refused = getattr(result.error, "exit_code", None) == EXIT_USAGE
    typer.echo(closing_line(result.summary, already_complete=result.already_complete, refused=refused), err=True)
    if result.already_complete:
        from runner.rundir.outputs import RunFolder
        from runner.rundir.reported import abandoned_note

        if note := abandoned_note(RunFolder(job.run_dir)):
            typer.echo(f"note: {note}", err=True)
    typer.echo(json.dumps(result.summary, separators=(",", ":")))
    if result.error is not None:
        ended = fail(result.error, debug)
        from runner.device import processes

        if processes.in_job():
            processes.leave(ended.exit_code)  # not JAX's exit barrier, which waits on processes that are gone
        raise ended


def _with_code(overrides: list[str] | None, ref: str | None, debug: bool) -> list[str]:
    """The overrides, and with --code (RUNNER_CODE) the sent code unpacked and on the path, plus the `--set`
    that makes it the spec's code folder."""
    if not ref:
        return list(overrides or [])
    from runner.cloud import codefetch

    try:
        unpacked = codefetch.fetch(ref)
    except RunnerError as error:
        raise fail(error, debug) from None
    typer.echo(unpacked.line(), err=True)
    return [*(overrides or []), *unpacked.overrides()]


def _with_requirements(entries: tuple[str, ...], debug: bool) -> None:
    """code.requirements installed (once per requirements hash) and appended to the path, before the job's own
    code is imported (runner/spec/requirements.py)."""
    if not entries:
        return
    from runner.spec import requirements

    typer.echo(requirements.describe(entries), err=True)
    try:
        folder, cached = requirements.install(entries)
        tops = requirements.use(folder)
    except RunnerError as error:
        raise fail(error, debug) from None
    typer.echo(f"code.requirements: {'already installed' if cached else 'installed'} in {folder}; on the path "
               f"after the image's packages: {', '.join(tops) or 'no module'}", err=True)


Scale = Annotated[
    float | None,
    typer.Option("--scale", metavar="FACTOR", help="Multiply every input by FACTOR before predicting (e.g. 255 "
                 "for 0..1 pixels when the model was trained on 0..255)."),
]
Checkpoint = Annotated[
    str | None,
    typer.Option("--checkpoint", metavar="CKPT", help="Use these weights instead of the ones the run folder reports "
                 "(model.keras of a finished job, else the newest checkpoint): checkpoints/ckpt-<step> (or its name "
                 "alone, ckpt-<step>) or a .keras file."),
]
NoCheck = Annotated[
    bool,
    typer.Option("--no-check", help="Do not compare the rows' values with the training data's (the manifest's "
                 "value_ranges); the shape is always checked."),
]


@app.command()
def evaluate(
    spec: SpecPath,
    input: Annotated[str | None, typer.Option("--input", "-i", help="Rows with labels instead of data.eval: an .npz "
                                              "holding each input and the label, a .csv with those columns, or a "
                                              "TFRecord glob.")] = None,
    scale: Scale = None,
    no_check: NoCheck = False,
    checkpoint: Checkpoint = None,
    overrides: Overrides = None,
    debug: Debug = False,
    code: Code = None,
) -> None:
    """Evaluate the job on `data.eval` (or `--input`), on whatever device this machine has.

    The weights are those the run folder reports: model.keras once summary.json says the job succeeded, else
    the newest checkpoint; `--checkpoint` names others. A newer checkpoint left by an attempt that was not
    finished is named on stderr.

    Prints the metrics as one JSON line. A model trained on many TPU cores evaluates on one CPU. Rows in an
    .npz are first compared with the training data (the manifest's value_ranges beside data.train): another
    range, dtype kind or shape stops with exit 2 naming both and the fix (`--scale`, `--no-check`).

    **Examples**

    * `runner evaluate jobs/mnist_cnn.yaml`
    * `runner evaluate jobs/mnist_cnn.yaml --set data.eval='gs://my-bucket/mnist/test-*.tfrecord'`
    * `runner evaluate jobs/mnist_cnn.yaml --input labelled.npz` (arrays `image` and `label`)
    * `runner evaluate job.yaml --input labelled.csv` (a table prepared with `runner prepare csv`, its label column)
    * `runner evaluate job.yaml --code gs://b/runs/job/code/SHA.tar.gz#sha256=SHA` (the model code `submit` sent)
    """
    job = trained_command_setup("evaluate", spec, _with_code(overrides, code, debug), debug)
    _with_requirements(job.code.requirements, debug)
    from runner.job import predict as predict_mod

    options = predict_mod.InputOptions(scale=scale, check=not no_check)
    try:
        evaluated = predict_mod.evaluate(job, input, options, checkpoint)
    except RunnerError as error:
        raise fail(error, debug) from None
    for note in evaluated.notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(json.dumps(evaluated.report, separators=(",", ":")))


@app.command()
def predict(
    spec: SpecPath,
    input: Annotated[
        str, typer.Option("--input", "-i", help="Rows to predict: .npy, .npz (by input name), .csv (a column per "
                          "input), an image file or a folder of images, or a TFRecord glob.")
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write predictions to this .npy file instead of stdout.")
    ] = None,
    scale: Scale = None,
    no_check: NoCheck = False,
    checkpoint: Checkpoint = None,
    overrides: Overrides = None,
    debug: Debug = False,
    code: Code = None,
    max_length: Annotated[
        int | None, typer.Option("--max-length", help="model.hub: tokens of a prompt and its answer together "
                                 "(default: the records' sequence length).")
    ] = None,
    sampler: Annotated[str, typer.Option(help="model.hub: KerasHub's sampler (greedy, top_k, top_p, beam...).")
                       ] = "greedy",
) -> None:
    """Predict with the job's reported weights (as `runner evaluate`), any number of rows, on whatever device.

    Without `--output`, prints one JSON line per row: for a classifier its `class`, the class's name from the
    manifest (`class_name`) and `probabilities` (softmax applied, and said on stderr, when the model ends in
    logits); for other models `output`; a CSV row's `line`, an image's `file`. A CSV's category words go
    through the manifest's vocabularies and images are decoded as `runner prepare images` decoded them.
    Rows in .npy/.npz/.csv are first compared with the training data (the manifest's value_ranges beside
    data.train): values in another range (0..1 given, 0..255 trained), of another dtype kind or shape stop
    with exit 2 naming both and the fix; `--scale FACTOR` multiplies the rows, `--no-check` skips the check.

    **Examples**

    * `runner predict jobs/mnist_cnn.yaml --input digits.npy`
    * `runner predict jobs/mnist_cnn.yaml --input digits01.npy --scale 255` (pixels saved as 0..1)
    * `runner predict jobs/mnist_cnn.yaml --input 'data/mnist/test-*.tfrecord' --output predictions.npy`
    * `runner predict job.yaml --input new_rows.csv` (a table prepared with `runner prepare csv`)
    * `runner predict job.yaml --input photos/` (a model trained on `runner prepare images`)
    * `runner predict jobs/gemma3_lora.yaml --input prompts.txt --max-length 128` (a model.hub job: one JSON line
      a prompt, with the text generated)
    """
    job = trained_command_setup("predict", spec, _with_code(overrides, code, debug), debug)
    _with_requirements(job.code.requirements, debug)
    import numpy as np

    from runner.job import predict as predict_mod

    if job.model.hub is not None:
        _generate(job, input, max_length, sampler, checkpoint, debug, output)
        return
    options = predict_mod.InputOptions(scale=scale, check=not no_check)
    try:
        predicted = predict_mod.predict(job, input, options, checkpoint)
    except RunnerError as error:
        raise fail(error, debug) from None
    for note in predicted.notes:
        typer.echo(f"note: {note}", err=True)
    if output is not None:
        np.save(output, predicted.outputs)
        typer.echo(f"{len(predicted.outputs)} predictions from {predicted.trained.checkpoint} -> {output}")
        return
    for line in predicted.lines:
        typer.echo(json.dumps(line))


def _generate(job, prompts: str, max_length: int | None, sampler: str, checkpoint: str | None, debug: bool,
              output: Path | None) -> None:
    """A model.hub job's predict: one JSON line of generated text a prompt (runner/job/generate.py), on stdout or
    into `output` (JSON lines)."""
    from runner.job import generate

    try:
        generated = generate.generate(job, prompts, max_length, sampler, checkpoint)
    except RunnerError as error:
        raise fail(error, debug) from None
    for note in generated.notes:
        typer.echo(f"note: {note}", err=True)
    if output is not None:
        output.write_text("".join(json.dumps(line) + "\n" for line in generated.lines))
        typer.echo(f"{len(generated.lines)} answers from {generated.trained.checkpoint} -> {output}")
        return
    for line in generated.lines:
        typer.echo(json.dumps(line))
