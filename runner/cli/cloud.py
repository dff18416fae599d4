"""`runner submit`, `status`, `cancel` and `logs`: a job on a Cloud TPU VM, from launch to its summary and cost."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer()

Project = Annotated[
    Optional[str],
    typer.Option(envvar=["GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"], help="Google Cloud project of the TPU."),
]
Zone = Annotated[str, typer.Option(help="Zone of the TPU, e.g. us-central1-a (a v5litepod or v6e zone for those types).")]
Name = Annotated[str, typer.Argument(help="The queued resource: the job name as `runner submit` printed it.")]


def _print(doc: dict) -> None:
    typer.echo(json.dumps(doc, separators=(",", ":")))


@app.command()
def submit(
    spec: Annotated[Path, typer.Argument(help="Job spec (YAML); data and output.dir must be gs:// paths.", exists=True, dir_okay=False, readable=True)],
    tpu_type: Annotated[str, typer.Option("--tpu-type", help="Accelerator type, e.g. v5litepod-8, v6e-8, v5p-8, v4-8.")],
    zone: Zone,
    image: Annotated[
        Optional[str],
        typer.Option(envvar="RUNNER_IMAGE", help="The pushed TPU image, e.g. us-central1-docker.pkg.dev/PROJECT/runner/runner:tpu."),
    ] = None,
    project: Project = None,
    spot: Annotated[bool, typer.Option("--spot", help="Spot capacity: cheaper, may be preempted (run again to resume).")] = False,
    runtime_version: Annotated[
        Optional[str], typer.Option("--runtime-version", help="TPU VM software (default: the base image of the TPU generation).")
    ] = None,
    name: Annotated[Optional[str], typer.Option(help="Queued resource name (default: the job name, lowercased, '_' -> '-').")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the TPU VM after the job ends (it bills until `runner cancel`).")] = False,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override a spec key, e.g. `--set output.dir=gs://b/runs`.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the request and the same request as gcloud commands; send nothing.")] = False,
) -> None:
    """Run a job on a Cloud TPU VM: create a queued resource whose startup script runs IMAGE on every worker.

    The VM boots when capacity allows (`runner status NAME`); each worker runs
    `docker run --net=host --privileged -e TPU_NAME=local IMAGE run SPEC` and copies its output to
    RUN_DIR/logs/ (`runner logs RUN_DIR`). When the job ends, worker 0 deletes the queued resource unless
    --keep. Prints one JSON line: name, zone, run folder, operation. Exit 2 on a bad flag or spec (before
    any call), 3 when the Cloud TPU API cannot be reached or refuses.
    """
    from runner.cloud import submit as submit_mod
    from runner.cli.common import fail
    from runner.errors import RunnerError

    try:
        sub = submit_mod.prepare_submission(
            spec, overrides or [], tpu_type=tpu_type, zone=zone, image=image, project=project,
            spot=spot, keep=keep, runtime_version=runtime_version, name=name,
        )
        if dry_run:
            typer.echo(submit_mod.gcloud_script(sub), nl=False)
            return
        result = submit_mod.create(sub)
    except RunnerError as error:
        raise fail(error) from None
    typer.secho(
        f"queued {sub.name} ({sub.tpu.name}{', spot' if spot else ''}) in {sub.zone}; "
        f"watch: runner status {sub.name} --zone {sub.zone}; logs: runner logs {sub.spec.run_dir}",
        err=True,
    )
    _print(result)


@app.command()
def status(name: Name, zone: Zone, project: Project = None) -> None:
    """Show a submitted job's queued resource: its state (ACCEPTED, PROVISIONING, ACTIVE, ...), its VM's state
    and health, and the run folder. Exit 2 if there is no such queued resource (its job may have ended)."""
    from runner.cloud import submit as submit_mod
    from runner.cli.common import fail
    from runner.errors import RunnerError, SpecError

    try:
        if not project:
            raise SpecError("missing --project (or GOOGLE_CLOUD_PROJECT)")
        _print(submit_mod.status(name, project, zone))
    except RunnerError as error:
        raise fail(error) from None


@app.command()
def cancel(name: Name, zone: Zone, project: Project = None) -> None:
    """Delete a submitted job's queued resource and its TPU VM, even while the job runs.

    Checkpoints already in the bucket stay: submitting the same job again resumes from the newest one."""
    from runner.cloud import submit as submit_mod
    from runner.cli.common import fail
    from runner.errors import RunnerError, SpecError

    try:
        if not project:
            raise SpecError("missing --project (or GOOGLE_CLOUD_PROJECT)")
        _print(submit_mod.cancel(name, project, zone))
    except RunnerError as error:
        raise fail(error) from None


@app.command()
def logs(
    run_dir: Annotated[str, typer.Argument(help="The job's run folder, e.g. gs://BUCKET/runs/mnist_cnn (`runner status` prints it).")],
    worker: Annotated[int, typer.Option(min=0, help="Which TPU VM worker's log.")] = 0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing the log as it grows until the job ends.")] = False,
    summary: Annotated[bool, typer.Option("--summary", help="Print the job's summary with its cost estimate instead.")] = False,
    interval: Annotated[float, typer.Option(min=1.0, help="Seconds between reads with --follow.")] = 15.0,
) -> None:
    """Read a submitted job's output from its run folder: a worker's log, or (--summary) the JSON summary
    with `cost`: TPU chips x hours x the list price per chip-hour (runner/cloud/tpu_prices.json, dated).

    With --follow the exit status is the job's own (0 done, 75 preempted, ...)."""
    from runner.cloud import logs as joblogs
    from runner.cli.common import fail
    from runner.errors import RunnerError

    try:
        if summary:
            _print(joblogs.summary_with_cost(run_dir))
            return
        if not follow:
            typer.echo(joblogs.worker_log(run_dir, worker), nl=False)
            return
        record = joblogs.follow(run_dir, worker, lambda text: (sys.stdout.write(text), sys.stdout.flush()), interval)
    except RunnerError as error:
        raise fail(error) from None
    raise typer.Exit(int(record.get("exit_code", 1)))
