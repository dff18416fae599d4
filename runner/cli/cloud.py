"""`runner submit`, `status`, `logs`, `cancel` and `watch`: a job on a Cloud TPU VM, by one name, from launch
through its restarts to its summary and cost (docs/cloud.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from runner import RunnerError

app = typer.Typer()

Project = Annotated[
    str | None,
    typer.Option(envvar=["GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"],
                 help="Google Cloud project of the TPU (default: gcloud's core/project)."),
]
Zone = Annotated[
    str | None,
    typer.Option(envvar="CLOUDSDK_COMPUTE_ZONE",
                 help="Zone of the TPU, e.g. us-central1-a (default: gcloud's compute/zone)."),
]
Name = Annotated[str, typer.Argument(help="The job's name as `runner submit` printed it (or its run folder).")]
Interval = Annotated[float, typer.Option(min=0.2, help="Seconds between the watcher's polls.")]
MaxRestarts = Annotated[
    int | None,
    typer.Option(
        "--max-restarts", min=0, help="Restarts after a preemption or exit 75/3 (default: 3 with --spot, else 0)."
    ),
]


def _print(doc) -> None:
    typer.echo(json.dumps(doc, separators=(",", ":")))


def _say(line: str) -> None:
    typer.echo(line, err=True)


def _where(project: str | None, zone: str | None, need: bool = True) -> tuple[str | None, str | None]:
    """--project and --zone, else gcloud's configuration (read from its files: no gcloud run, no network)."""
    from runner import SpecError
    from runner.cloud import gcloud_config

    project = project or gcloud_config.default_project()
    zone = zone or gcloud_config.default_zone()
    if need and not (project and zone):
        missing = [
            text
            for text, value in (
                ("--project (or `gcloud config set project PROJECT`)", project),
                ("--zone (or `gcloud config set compute/zone ZONE`)", zone),
            )
            if not value
        ]
        raise SpecError("missing " + " and ".join(missing))
    return project, zone


def _watch(job: dict, interval: float) -> int:
    """Runs the watcher in the foreground; prints the final summary; returns the job's exit code."""
    from runner.cloud import record, recovery, tpu_api

    record.remember(job["name"], job["project"], job["zone"], job["run_dir"])
    watcher = recovery.Watcher(job, tpu_api.make_client(), interval_s=interval, emit=_say)
    try:
        final = watcher.run()
    except KeyboardInterrupt:
        _say(f"stopped watching; the job goes on without restarts: `runner watch {job['name']}` picks it up again")
        return 130
    _print(final)
    return int((final.get("outcome") or {}).get("exit_code", 1))


class PreflightFailed(RunnerError):
    """A cloud check of `runner submit`'s preflight failed; the exit code is `runner doctor --cloud`'s."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


PREFLIGHT_TIMEOUT_S = 30.0  # each check's bound, as `runner doctor --cloud`'s preflight() has it by default


def _preflight(sub, on: str) -> None:
    """The checks of `runner doctor --cloud` for this submission (its project, zone, TPU type, image, engine and
    buckets); says what passed, raises PreflightFailed listing each failed check with its fix."""
    import time

    from runner.cli.doctor import cloud_clients
    from runner.doctor.cloud import preflight
    from runner.doctor.report import Report

    began = time.monotonic()
    found = preflight(tpu_type=sub.tpu.name, zone=sub.zone, image=sub.image, project=sub.project or None, on=on,
                      spec=sub.spec, timeout=PREFLIGHT_TIMEOUT_S, clients=cloud_clients(),
                      service_account=sub.service_account)
    report = Report(found, time.monotonic() - began)
    for check in found:
        if check.status == "warn":
            _say(f"preflight: {check.name}: {check.evidence}" + (f" ({check.action})" if check.action else ""))
    failed = [check for check in found if check.status == "fail"]
    if failed:
        lines = [f"{check.name}: {check.evidence}" + (f"\n    fix: {check.action}" if check.action else "")
                 for check in failed]
        raise PreflightFailed(f"preflight: {len(failed)} of {len(found)} checks failed; nothing was created "
                              "(--no-preflight skips the checks):\n  " + "\n  ".join(lines), report.exit_code)
    _say(f"preflight: {len(found)} checks passed in {report.seconds:.1f} s (runner doctor --cloud; "
         "--no-preflight skips them)")


VM, GKE = "TPU VM (--on tpu-vm)", "GKE (--on gke)"  # the --help panels of the options only one target takes


def _opt(help_text: str, *names: str, panel: str | None = None, **extra):
    return typer.Option(*names, help=help_text, rich_help_panel=panel, **extra)


Spec = Annotated[Path, typer.Argument(help="Job spec (YAML); data and output.dir must be gs:// paths.")]
TpuType = Annotated[str, _opt("Accelerator type, e.g. v5litepod-8, v6e-8, v5p-8, v4-8; the multi-host slices "
                              "v6e-16/32, v5litepod-16/32, v5p-16/32 (one process per host); tpu7x-8 with --on gke "
                              "(docs/tpu.md).", "--tpu-type")]
Image = Annotated[str | None, _opt("The pushed TPU image, e.g. us-central1-docker.pkg.dev/PROJECT/runner/runner:tpu.",
                                   envvar="RUNNER_IMAGE")]
Spot = Annotated[bool, _opt("Spot capacity: cheaper, may be preempted. Only a watcher restarts a preempted job: "
                            "--watch, or `runner watch NAME` later (up to --max-restarts, default 3 with --spot); "
                            "without one nothing restarts it.", "--spot")]
QrName = Annotated[str | None, _opt("Queued resource name (default: the job name, lowercased, '_' -> '-').")]
Overrides = Annotated[list[str] | None, _opt("Override a spec key, e.g. `--set output.dir=gs://b/runs`.",
                                             "--set", "-s")]
DryRun = Annotated[bool, _opt("Print the price and the request as a gcloud script; send nothing and read nothing "
                              "remote (no credentials looked for, no bucket read: the previous run's remaining "
                              "epochs are not estimated) unless --preflight. The same inputs and --submission-id "
                              "print the same bytes.", "--dry-run")]
SubmissionId = Annotated[str | None, _opt("The submission's id, a label value (default: a new one from the time, "
                                           "e.g. 20260315-101500-7f3a).", "--submission-id")]
On = Annotated[str, _opt("Where to run: tpu-vm (a queued resource), skypilot (a managed job), gke (a JobSet) or "
                         "vertex (a CustomJob); docs/engines.md.", "--on")]
RuntimeVersion = Annotated[str | None, _opt("TPU VM software (default: the one Google names for JAX on the TPU "
                                            "generation, docs/tpu.md).", "--runtime-version", panel=VM)]
Keep = Annotated[bool, _opt("Keep the TPU VM after the job ends (it bills until `runner cancel`).", "--keep",
                            panel=VM)]
Watch = Annotated[bool, _opt("Stay in the foreground: restart the job after preemptions until it is complete.",
                             "--watch", panel=VM)]
Network = Annotated[str | None, _opt("VPC network of the TPU VM (default: default).", panel=VM)]
Subnetwork = Annotated[str | None, _opt("Subnetwork of the TPU VM.", panel=VM)]
ServiceAccount = Annotated[str | None, _opt("The VM's service account email (default: Compute Engine's default). "
                                            "It deletes the slice when the job ends: the preflight checks that the "
                                            "project grants it roles/tpu.admin (docs/cloud.md).",
                                            "--service-account", panel=VM)]
InternalIps = Annotated[bool, _opt("No external IP on the TPU VMs (gcloud's --internal-ips, e.g. where "
                                   "constraints/compute.vmExternalIpAccess forbids them): the subnetwork then needs "
                                   "Cloud NAT or Private Google Access to reach the registry, the bucket and the TPU "
                                   "API (docs/cloud.md).", "--internal-ips", panel=VM)]
Reservation = Annotated[str | None, _opt("Use reserved capacity of this project (its own: the job's project).",
                                         panel=VM)]
ValidUntil = Annotated[str | None, _opt("Give up waiting for capacity after a duration (6h) or at a time with its "
                                        "offset (2026-12-01T00:00:00Z).", "--valid-until", panel=VM)]
MaxRun = Annotated[str | None, _opt("Stop the job after this long (e.g. 6h, 2d; `none`: no limit): it saves and exits "
                                    "124. Default 24h. Every target; a TPU VM is then deleted, GKE's and Vertex AI's "
                                    "own deadline is 10 min later (docs/engines.md).", "--max-run-duration")]
StallTimeout = Annotated[str | None, _opt("Stop the job after this long without progress (at least 10s; `none`: "
                                          "never). Default 30m. Every target.", "--stall-timeout")]
AllowUnverified = Annotated[bool, _opt("Create the TPU VM with a --runtime-version no source names for JAX on the "
                                       "generation (docs/tpu.md). Recorded in job.json (tpu-vm).",
                                       "--allow-unverified")]
Preflight = Annotated[bool | None, _opt("Check the cloud first, as `runner doctor --cloud` does: credentials, "
                                        "project, TPU API and type, engine, buckets, image; a failed check stops "
                                        "with exit 3 and nothing is created. Default: on; off with --dry-run "
                                        "(offline) unless --preflight, which also reads the previous run's "
                                        "summary.json for the estimate and a gs:// model.hub preset's "
                                        "config for the memory per chip.", "--preflight/--no-preflight")]
VmRestarts = Annotated[int | None, _opt("Restarts a watcher makes (--watch, or `runner watch NAME` later) after a "
                                        "preemption or exit 75/3 (default: 3 with --spot, else 0); each attempt runs "
                                        "up to --max-run-duration.", "--max-restarts", min=0, panel=VM)]
Queue = Annotated[str | None, _opt("The Kueue LocalQueue (kueue.x-k8s.io/queue-name).", panel=GKE)]
Namespace = Annotated[str | None, _opt("The namespace (default: default).", panel=GKE)]
Cluster = Annotated[str | None, _opt("--format xpk: the xpk cluster.", panel=GKE)]
Format = Annotated[str | None, _opt("manifest (the JobSet) or xpk (the `xpk workload create` line).", "--format",
                                    panel=GKE)]


def _memory_per_chip(spec: str, overrides: list[str], tpu_type: str, read_bucket: bool = False) -> None:
    """The job's bytes per device on `tpu_type` against its HBM, said before anything else (runner/device/memory.py):
    SpecError (exit 2) when it does not fit, or when accelerator.mesh does not hold the type's devices. With
    `read_bucket` (submit's preflight), a gs:// preset's small files are read so that it is estimated as a folder."""
    import tempfile

    from runner import SpecError
    from runner.device import memory
    from runner.spec.load import load_spec

    try:
        job = load_spec(spec, overrides)
    except SpecError:
        return  # the launch refuses it, as it refuses every bad spec
    if job.kind != "train" or (job.accelerator.mesh == "auto" and job.model.hub is None):
        return  # a model whose size is known only once built: `runner run` measures it
    with tempfile.TemporaryDirectory(prefix="runner-preset-") as copy:
        preset = job.model.hub or ""
        if read_bucket and preset.startswith("gs://") and _preset_files(preset, copy):
            job = job.model_copy(update={"model": job.model.model_copy(update={"hub": copy})})
        try:
            fits, line = memory.check_for_tpu(job, tpu_type)
        except SpecError as exc:  # said of the bucket's preset, not of its copy here
            raise SpecError(str(exc).replace(copy, preset.rstrip("/"))) from None
        line = line.replace(copy, preset.rstrip("/"))
    if fits == "too_big":
        raise SpecError(line)
    typer.echo(("warning: " if fits == "tight" else "") + line, err=True)


def _preset_files(preset: str, into: str) -> bool:
    """Copies a gs:// preset's config.json, metadata.json and preprocessor.json (when it has one) into `into`: True
    with the first two there; a bucket that does not answer, or a file missing, is said and the estimate skipped."""
    from runner import StorageError
    from runner.cloud import record

    for name in ("config.json", "metadata.json", "preprocessor.json"):
        try:
            text = record.read_text(f"{preset.rstrip('/')}/{name}", patient=False)
        except StorageError as exc:
            _say(f"memory per device: {preset} not read ({exc}): estimated only as the job loads it")
            return False
        if text is None and name != "preprocessor.json":
            _say(f"memory per device: {preset}/{name} not found: a preset folder holds config.json and "
                 "metadata.json (save_to_preset writes them)")
            return False
        if text is not None:
            Path(into, name).write_text(text)
    return True


@app.command()
def submit(
    spec: Spec, tpu_type: TpuType, zone: Zone = None, image: Image = None, project: Project = None, spot: Spot = False,
    name: QrName = None, overrides: Overrides = None, dry_run: DryRun = False, on: On = "tpu-vm",
    submission_id: SubmissionId = None, runtime_version: RuntimeVersion = None, keep: Keep = False,
    watch: Watch = False, max_restarts: VmRestarts = None, interval: Interval = 30.0, network: Network = None,
    subnetwork: Subnetwork = None, service_account: ServiceAccount = None, internal_ips: InternalIps = False,
    reservation: Reservation = None,
    valid_until: ValidUntil = None, max_run_duration: MaxRun = None, stall_timeout: StallTimeout = None,
    allow_unverified: AllowUnverified = False, queue: Queue = None, namespace: Namespace = None,
    cluster: Cluster = None, output_format: Format = None, preflight: Preflight = None, *, ctx: typer.Context,
) -> None:
    """Run a job on a Cloud TPU VM: create a queued resource whose startup script runs IMAGE on the VM.

    First it prints (stderr) the TPU VM's software version and its source, the price per hour, the limits,
    whether a --runtime-version is unverified (if so: --allow-unverified) and what a previous run's remaining
    epochs should cost; the zone must offer the TPU type (docs/tpu.md has the table). Then it
    checks the cloud as `runner doctor --cloud` does (--no-preflight skips it; a dry run skips it unless
    --preflight), and a failed check stops it (exit 3) before anything is created. The job
    runs in `docker run --net=host --privileged IMAGE run SPEC` on every host of the slice for at most
    --max-run-duration; `runner logs NAME --follow [--worker N]` shows it; when it ends, worker 0 deletes the
    queued resource (another worker if worker 0 is lost) unless --keep. With --watch
    (or `runner watch NAME`) a preempted job is created again, up to --max-restarts times. Prints one JSON
    line (--watch: the final summary). Exit 2 on a bad flag or spec (before any call), 3 when a preflight
    check fails or the Cloud TPU API cannot be reached or refuses; with --watch, the job's.

    **Examples**

    * `runner submit jobs/mnist_cnn.yaml --tpu-type v5litepod-8 --zone us-central1-a --image IMAGE --dry-run`
    * `runner submit jobs/mnist_cnn.yaml --tpu-type v5litepod-8 --spot --watch --max-run-duration 6h --image IMAGE`
    * `runner submit jobs/mnist_cnn.yaml --tpu-type v6e-16 --zone us-central1-b --image IMAGE --dry-run`
    """
    from runner import RunnerError
    from runner.cli.common import fail
    from runner.cloud import launch

    vm = launch.TpuVmOptions(keep, watch, runtime_version, max_restarts, network, subnetwork, service_account,
                             reservation, valid_until, max_run_duration, stall_timeout, allow_unverified,
                             internal_ips)
    checks = _preflight if (not dry_run if preflight is None else preflight) else None
    try:
        _memory_per_chip(spec, overrides or [], tpu_type, read_bucket=checks is not None)
        done = launch.launch(spec, overrides or [], tpu_type=tpu_type, zone=zone, image=image, project=project,
                             spot=spot, name=name, on=on, dry_run=dry_run, submission_id=submission_id, vm=vm,
                             engine=launch.EngineFlags(queue, namespace, cluster, output_format), say=_say,
                             # typed, not read from GOOGLE_CLOUD_PROJECT (Typer carries its own click: by name)
                             project_given=getattr(ctx.get_parameter_source("project"), "name", "") == "COMMANDLINE",
                             preflight=checks)
        typer.echo(done.text, nl=False) if done.text else _print(done.doc)
        if done.job is not None:
            raise typer.Exit(_watch(done.job, interval))
    except RunnerError as error:
        raise fail(error) from None


@app.command()
def watch(
    name: Name,
    zone: Zone = None,
    project: Project = None,
    interval: Interval = 30.0,
    max_restarts: MaxRestarts = None,
) -> None:
    """Watch a submitted job until it is complete, restarting it after preemptions (docs/cloud.md, Recovery).

    Safe to start again after it was stopped or killed: it picks up the same job (and a restart it had
    begun), and never creates a second queued resource. Prints the final summary with `restarts`; the
    exit status is the job's (0 complete, 1/2 the job failed, 75 restarts spent, 130 cancelled).

    **Examples**

    * `runner watch mnist-cnn --zone us-central1-a`
    """
    from runner import RunnerError
    from runner.cli.common import fail
    from runner.cloud import jobs

    try:
        project, zone = _where(project, zone, need=not jobs.is_run_dir(name))
        job = jobs.locate(name, project, zone)
        if max_restarts is not None:
            job["max_restarts"] = max_restarts
        code = _watch(job, interval)
    except RunnerError as error:
        raise fail(error) from None
    raise typer.Exit(code)


@app.command()
def status(
    name: Annotated[
        str | None, typer.Argument(help="A job's name (or run folder); none: list every runner job in the zone.")
    ] = None,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Show a job: its queued resource's state (ACCEPTED, PROVISIONING, ACTIVE, SUSPENDED, ...), its VM's
    state and health, its restarts, newest checkpoint step and cost so far. Without a name: one JSON line per
    runner job in the zone (queued resources labelled runner-job, and jobs this machine submitted).

    **Examples**

    * `runner status mnist-cnn --zone us-central1-a --project my-project`
    * `runner status`
    """
    from runner import RunnerError
    from runner.cli.common import fail
    from runner.cloud import jobs

    try:
        if name is None:
            project, zone = _where(project, zone)
            for row in jobs.list_jobs(project, zone):
                _print(row)
            return
        project, zone = _where(project, zone, need=False)
        _print(jobs.status(name, project, zone))
    except RunnerError as error:
        raise fail(error) from None


@app.command()
def cancel(name: Name, zone: Zone = None, project: Project = None) -> None:
    """Delete a job's queued resource and its TPU VM, even while the job runs; a watcher stops instead of
    restarting it. Checkpoints already in the bucket stay: submitting the same job again resumes.

    **Examples**

    * `runner cancel mnist-cnn --zone us-central1-a`
    """
    from runner import RunnerError
    from runner.cli.common import fail
    from runner.cloud import jobs

    try:
        # Not required: a job this machine submitted is found without them, and an unknown one is said to be
        # unknown (with where else to look) before anything is asked for.
        project, zone = _where(project, zone, need=False)
        _print(jobs.cancel(name, project, zone))
    except RunnerError as error:
        raise fail(error) from None


@app.command()
def logs(
    name: Name,
    worker: Annotated[int, typer.Option(min=0, help="Which TPU VM worker's log.")] = 0,
    submission: Annotated[str | None, typer.Option(help="Which submission (default: the newest).")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing the job's lines as they come until it ends.")
    ] = False,
    summary: Annotated[
        bool, typer.Option("--summary", help="Print the job's summary with its restarts and cost instead.")
    ] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between reads with --follow.")] = 5.0,
    source: Annotated[
        str,
        typer.Option(
            help="With --follow: auto (Cloud Logging when the job logs there, else the bucket), cloud-logging "
            "or bucket."
        ),
    ] = "auto",
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Read a submitted job's output: a worker's log (the bucket copy, RUN_DIR/logs/SUB/), its lines as they
    come (--follow: Cloud Logging, seconds behind the job), or the summary with restarts and `cost` (chips x
    hours the node existed, from the API's timestamps, x the price per chip-hour).

    With --follow the exit status is the job's own (0 done, 75 preempted, ...).

    **Examples**

    * `runner logs mnist-cnn --follow`
    * `runner logs mnist-cnn --summary`
    * `runner logs gs://my-bucket/runs/mnist_cnn --worker 1`
    """
    from runner import RunnerError, SpecError
    from runner.cli.common import fail
    from runner.cloud import jobs
    from runner.cloud import logs as joblogs

    try:
        if source not in ("auto", "cloud-logging", "bucket"):
            raise SpecError(f"--source {source!r}: choose auto, cloud-logging or bucket")
        if jobs.is_run_dir(name):
            run_dir = name.rstrip("/")
        else:
            project, zone = _where(project, zone, need=False)
            run_dir = jobs.locate(name, project, zone)["run_dir"]
        if summary:
            _print(joblogs.summary_with_cost(run_dir))
            return
        chosen = submission or joblogs.newest_submission(run_dir)
        if not follow:
            typer.echo(joblogs.worker_log(run_dir, chosen, worker), nl=False)
            return
        ended = joblogs.follow(
            run_dir,
            lambda text: (sys.stdout.write(text), sys.stdout.flush()),
            worker=worker,
            submission=submission,
            interval_s=interval,
            source=source,
            note=_say,
        )
    except RunnerError as error:
        raise fail(error) from None
    raise typer.Exit(int(ended.get("exit_code", 1)))
