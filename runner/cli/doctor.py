"""`runner doctor`: find the classic TPU job failures in seconds, before they waste accelerator time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated

import typer

from runner import SpecError
from runner.cli.common import fail, load

app = typer.Typer()

_COLORS = {"ok": "green", "warn": "yellow", "fail": "red"}


def _table(report) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table("check", "status", "evidence", "what to do", show_lines=True, expand=True)
    for check in report.checks:
        table.add_row(check.name, f"[{_COLORS[check.status]}]{check.status}[/]", check.evidence, check.action or "-")
    console = Console(width=max(100, shutil.get_terminal_size((140, 24)).columns), record=True, force_terminal=False)
    with console.capture() as captured:
        console.print(table)
    return captured.get()


def cloud_clients():
    """The clients `runner submit` uses, for the doctor's cloud checks (the two do not import each other)."""
    from runner.cloud import gcloud_config, request, tpu_api
    from runner.doctor.cloud import CloudClients

    def vertex_client(region: str):
        from runner.cloud.engines import vertex

        return vertex.make_client(region)

    return CloudClients(tpu=tpu_api.make_client, vertex=vertex_client, default_project=gcloud_config.default_project,
                        scope=request.SCOPE)


def _cloud_report(job, spec, tpu_type, zone, image, project, on, timeout, service_account=None):
    import time

    from runner.cloud import gcloud_config
    from runner.cloud.submit import check_zone
    from runner.doctor.cloud import ENGINES, preflight
    from runner.doctor.report import Report

    if on not in ENGINES:
        raise fail(SpecError(f"--on {on!r}: choose one of {', '.join(ENGINES)}"))
    if not tpu_type:
        raise fail(SpecError("--cloud needs --tpu-type (e.g. v5litepod-8): its zone must offer it"))
    zone = zone or gcloud_config.default_zone()
    if not zone:
        raise fail(SpecError("--cloud needs --zone (or gcloud config set compute/zone ZONE)"))
    try:
        check_zone(zone)
    except SpecError as error:
        raise fail(error) from None
    began = time.monotonic()
    found = preflight(tpu_type=tpu_type, zone=zone, image=image, project=project, on=on, spec=job, timeout=timeout,
                      clients=cloud_clients(), service_account=service_account)
    return Report(found, time.monotonic() - began, str(spec) if spec else None)


@app.command()
def doctor(
    spec: Annotated[
        Path | None,
        typer.Argument(
            help="Job spec (YAML): also check its buckets, data and batch size."
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="Override a spec key, e.g. `--set data.global_batch_size=1000` (repeatable)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON line instead of a table.")
    ] = False,
    save: Annotated[
        bool,
        typer.Option("--save", help="Also write the report as doctor.json in the job's run folder, by summary.json."),
    ] = False,
    timeout: Annotated[
        float,
        typer.Option(min=1, help="Bound on each check, in seconds; the TPU start also within accelerator.timeout_s."),
    ] = 60.0,
    replicas: Annotated[
        int | None,
        typer.Option(min=1, help="Check the batch arithmetic for this many replicas (e.g. 8 for a v3-8)."),
    ] = None,
    cloud: Annotated[
        bool,
        typer.Option("--cloud", help="Check the cloud a submission goes to instead of this machine: credentials, "
                     "project, TPU API, TPU type in the zone, engine, buckets, image (docs/doctor.md)."),
    ] = False,
    tpu_type: Annotated[str | None, typer.Option(help="With --cloud: the TPU type, e.g. v5litepod-8.")] = None,
    zone: Annotated[
        str | None, typer.Option(help="With --cloud: the zone (default: gcloud's compute/zone).")
    ] = None,
    image: Annotated[str | None, typer.Option(help="With --cloud: the image `runner submit` will be given.")] = None,
    project: Annotated[
        str | None,
        typer.Option(help="With --cloud: the project (default: GOOGLE_CLOUD_PROJECT, then gcloud's core/project)."),
    ] = None,
    on: Annotated[
        str, typer.Option(help="With --cloud: where the job goes: tpu-vm, skypilot, gke or vertex.")
    ] = "tpu-vm",
    service_account: Annotated[
        str | None, typer.Option("--service-account", help="With --cloud: the TPU VM's service account, as given to "
                                 "`runner submit` (default: the project's Compute Engine default); it must hold "
                                 "roles/tpu.admin to delete its slice.")
    ] = None,
) -> None:
    """Check this machine (and a job spec) for the ways TPU jobs fail: versions, devices, libtpu lockfile,
    credentials, GCS, TensorFlow import and TPU start, buckets, data shards, batch size.

    Prints a table (check, status, evidence, what to do), or one JSON line with `--json`. Exit 0 when nothing
    fails, 3 when an infrastructure check fails, 2 when only the data or batch checks fail. The TensorFlow
    and TPU checks run in a child process that is killed when it outlives `--timeout`.

    **Examples**

    * `runner doctor`
    * `runner doctor jobs/mnist_cnn.yaml`
    * `runner doctor jobs/mnist_cnn.yaml --json --save`
    * `runner doctor --cloud jobs/mnist_cnn.yaml --tpu-type v5litepod-8 --zone us-central1-a --image IMAGE`
    """
    cloud_flags = {"--tpu-type": tpu_type, "--zone": zone, "--image": image, "--project": project,
                   "--on": None if on == "tpu-vm" else on}
    given = [flag for flag, value in cloud_flags.items() if value is not None]
    if given and not cloud:
        raise fail(SpecError(f"{', '.join(given)} apply only with --cloud"))
    if save and spec is None:
        raise fail(SpecError("--save needs a SPEC: the report goes to its run folder"))
    job = load(spec, overrides) if spec is not None else None
    if cloud:
        report = _cloud_report(job, spec, tpu_type, zone, image, project, on, timeout, service_account)
    else:
        from runner.doctor import run_doctor

        settings = load(None, overrides) if spec is None and overrides else None  # `--set` without a spec
        report = run_doctor(job, spec_path=str(spec) if spec else None, timeout=timeout, replicas=replicas, save=save,
                            settings=settings)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), separators=(",", ":")))
    else:
        typer.echo(_table(report), nl=False)
        counts = {s: sum(c.status == s for c in report.checks) for s in ("fail", "warn", "ok")}
        saved = f"; report saved to {report.saved_to}" if report.saved_to else ""
        tally = f"{counts['fail']} fail, {counts['warn']} warn, {counts['ok']} ok"
        typer.echo(f"doctor: {tally} in {report.seconds:.1f} s{saved}")
    raise typer.Exit(report.exit_code)
