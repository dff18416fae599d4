"""`runner sweep` and `runner report`: run a spec at several settings, then compare the runs side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer()

Baseline = Annotated[
    str | None,
    typer.Option(help="Run the speed-up is measured against: a job name, a path as given, or a row number "
                      "(default: the first row; rows are sorted by the swept setting, e.g. the smallest batch "
                      "first)."),
]
PlotPath = Annotated[
    str | None,
    typer.Option("--plot", help="Also draw epoch time and throughput by batch size and device into this PNG."),
]


@app.command()
def sweep(
    spec: Annotated[
        Path, typer.Argument(help="Job spec (YAML), e.g. jobs/mnist_cnn.yaml.")
    ],
    sets: Annotated[
        list[str],
        typer.Option(
            "--set", "-s",
            help="A key and its values, e.g. `--set data.global_batch_size=256,512,1024` (repeatable: every "
            "combination runs). A single value applies to every variant.",
        ),
    ],
    baseline: Baseline = None,
    plot_path: PlotPath = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the closing table as Markdown.")] = False,
    progress_every: Annotated[
        float | None,
        typer.Option("--progress-every", min=0, metavar="SECONDS", help="Passed to each `runner run` (default 30)."),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and TensorFlow's own log lines.")] = False,
) -> None:
    """Run a spec once per value (or combination of values) as separate jobs, then print the comparison.

    Each variant is its own `runner run` with the job name `<name>-<key>-<value>`, followed by
    `-<key>-<value>` for every single-valued `--set` that changes the spec: its own run folder, summary and
    checkpoints. Running the same sweep again skips finished variants (without loading TensorFlow) and
    resumes the others. Each row is checked against the spec asked for (the run folder's spec.json); one
    made otherwise is marked `!` and the sweep names the `--set name=` that gives new run folders. Exit 0
    when every variant succeeded as asked, 75 when one was preempted (run the sweep again), 2 when a row is
    not as asked, else the first failing variant's code.

    **Examples**

    * `runner sweep jobs/mnist_cnn.yaml --set data.global_batch_size=256,512,1024 --set train.epochs=3`
    * `runner sweep jobs/mnist_cnn.yaml --set accelerator.kind=tpu,cpu --markdown --plot compare.png`
    """
    from runner import RunnerError
    from runner.cli.common import fail, setup_logging
    from runner.compare import plot
    from runner.compare import sweep as sweep_mod

    setup_logging(debug)
    try:
        if plot_path:
            plot.check_plotting()  # before hours of training, not after
        variants = sweep_mod.plan_variants(spec, sets)
    except RunnerError as error:
        raise fail(error) from None
    outcomes = sweep_mod.run_variants(spec, variants, debug=debug, progress_every=progress_every)
    shown = sweep_mod.shown(outcomes)
    # Each row is checked against the spec asked for: a run folder finished with other settings is marked `!`.
    not_asked = {o.run_dir: sweep_mod.not_as_asked(o.variant) for o in shown}
    if shown:
        _print_report([o.run_dir for o in shown], baseline, plot_path, markdown, not_asked)
        typer.echo(f"runs: {' '.join(o.run_dir for o in shown)}", err=True)
    try:
        lines = sweep_mod.advice(spec, sets, variants, outcomes, not_asked)
    except RunnerError as error:
        raise fail(error) from None
    for line in lines:
        typer.secho(line, err=True, fg=typer.colors.RED)
    code = sweep_mod.exit_code(outcomes, len(variants), not_asked)
    if code:
        raise typer.Exit(code)


@app.command()
def report(
    runs: Annotated[
        list[str],
        typer.Argument(help="Run folders or summary files (summary.json, or a saved stdout of `runner run`), "
                            "local or gs://."),
    ],
    baseline: Baseline = None,
    plot_path: PlotPath = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the table as Markdown instead of plain text.")
    ] = False,
) -> None:
    """Compare runs: device, replicas, batch, epochs, learning rate, precision, first epoch (with compile),
    steady epoch, step time, examples/s, MFU, goodput, accuracy, input wait, total time and speed-up over a
    baseline; optionally a PNG plot.

    Reads summaries of every schema_version this runner knows (1 and 2), and the spec.json beside each,
    without loading TensorFlow. Rows are sorted by the swept setting (the one every run's name holds, as
    `runner sweep` names them), then the other settings that differ, then name; the baseline is the first
    row unless `--baseline` names another. A row made with other settings than the baseline's, beyond the
    swept one, is marked `*` and a note names them. The table fits the terminal's width.
    A path that cannot be read is named with the reason on stderr; exit 2
    if any could not be read (the others are still shown). `--plot` needs matplotlib (the `plot` extra).

    **Examples**

    * `runner report runs/mnist_cnn-global_batch_size-* --baseline mnist_cnn-global_batch_size-256`
    * `runner report gs://my-bucket/runs/mnist_cnn runs/other/summary.json --markdown`
    * `runner report runs/a runs/b --plot compare.png`
    """
    _print_report(runs, baseline, plot_path, markdown)


def _print_report(
    runs: list[str], baseline: str | None, plot_path: str | None, markdown: bool,
    not_asked: dict[str, list[str]] | None = None,
) -> None:
    from runner import EXIT_USAGE, RunnerError
    from runner.cli.common import fail
    from runner.compare import plot
    from runner.compare import report as report_mod

    try:
        if plot_path:
            plot.check_plotting()
        rows, problems = report_mod.load_rows(runs, baseline, not_asked)
        for problem in problems:
            typer.secho(f"cannot read: {problem}", err=True, fg=typer.colors.RED)
        if not rows:
            raise typer.Exit(EXIT_USAGE)
        base = report_mod.pick_baseline(rows, baseline)
        typer.echo(report_mod.markdown(rows, base) if markdown else report_mod.terminal(rows, base), nl=False)
        if plot_path:
            typer.echo(f"plot: {plot.plot(rows, plot_path)}", err=True)
    except RunnerError as error:
        raise fail(error) from None
    if problems:
        raise typer.Exit(EXIT_USAGE)
