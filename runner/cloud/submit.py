"""Cloud TPU VM jobs: the checks before a queued resource is asked for, and the Submission they make.

    runner submit SPEC --tpu-type v5litepod-8 [--zone Z] [--project P] --image IMAGE [--spot] [--keep] [--watch]
        checks the flags and the spec before any call (data and outputs must be in gs://: the VM's disk goes
        with the VM, and the hosts of a multi-host slice share none), then asks the Cloud TPU API for a queued
        resource NAME (default: the job name) labelled runner-job=NAME and runner-submission=SUB (a new id for
        every submission; runner/cloud/request.py makes the request). When capacity allows, the slice boots and
        its startup script (runner/cloud/tpu_startup.sh) runs `docker run --net=host --privileged IMAGE run
        spec.yaml` on every worker (one JAX process per host), writes RUN_DIR/logs/SUB/, and deletes the queued
        resource when the job ends: worker 0, or another worker when worker 0 is lost. RUN_DIR/job.json records
        the submission, so a watcher (runner/cloud/recovery.py) can create it again after a preemption. Code
        the spec names from this machine is packed (runner/cloud/codepack.py) and handed to the container as
        RUNNER_CODE.
    runner status [NAME] / cancel NAME / logs NAME / watch NAME     (runner/cloud/jobs.py finds NAME)

Nothing bills unwatched: the job runs at most --max-run-duration (default 24h; `none` for no limit) and
stops after --stall-timeout (default 30m) without progress; the job enforces both itself (`--set
train.max_duration=S --set train.stall_timeout=S` on its `runner run` line: it saves and exits 124) and the
startup script kills the container a grace period after the limit, then deletes the slice as after any end.

`--dry-run` prints the request and a bash script sending it with gcloud, and sends nothing: without --preflight it
reads nothing remote either (runner/cloud/launch.py leaves the previous run's summary unread). The client honours
gcloud's CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU and CLOUDSDK_AUTH_ACCESS_TOKEN (google-cloud-tpu, imported late).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import shlex
from pathlib import Path
from typing import Any

from runner import SpecError
from runner.cloud import advice, codepack, record, tpu_types
from runner.cloud.durations import limit_overrides, parse_limits, parse_valid_until, valid_until_text
from runner.data import storage
from runner.spec.load import load_spec
from runner.spec.types import JobSpec

_ZONE = re.compile(r"[a-z]+-[a-z]+\d+-[a-z]")
_REGION = re.compile(r"[a-z]+-[a-z]+\d+")
_RESOURCE_ID = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_PROJECT = re.compile(r"[a-z][-a-z0-9.:]{4,61}[a-z0-9]")
_EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.[a-z]+")
# registry[:port]/path[:tag][@digest]; the registry part has a dot or a port, or is localhost.
_IMAGE = re.compile(
    r"(?P<registry>[a-z0-9.-]+\.[a-z0-9.-]+(:\d+)?|localhost(:\d+)?)/[a-z0-9._/-]+(:[\w.-]+)?(@sha256:[0-9a-f]{64})?"
)
# What cloudbuild.yaml pushes with _BUILD_TPU=true (its defaults: _REGION us-central1, repository and image `runner`).
_IMAGE_EXAMPLE = "{region}-docker.pkg.dev/{project}/runner/runner:tpu"


def image_example(project: str | None, zone: str | None) -> str:
    """The TPU image cloudbuild.yaml pushes for this project, in the zone's region (placeholders where unknown)."""
    region = zone.rsplit("-", 1)[0] if zone and _ZONE.fullmatch(zone) else "REGION"
    return _IMAGE_EXAMPLE.format(region=region, project=project or "PROJECT")
# Restarts after a preemption when --max-restarts is not given: Spot capacity is preempted as a matter of
# course; on-demand capacity is not, so there a failure is worth a look before paying for another VM.
DEFAULT_SPOT_RESTARTS = 3


@dataclasses.dataclass(frozen=True)
class Submission:
    name: str  # the queued resource and its node
    project: str
    zone: str
    tpu: tpu_types.TpuType
    image: str
    spot: bool
    keep: bool
    runtime_version: str
    spec: JobSpec
    submission_id: str
    max_restarts: int = 0
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None
    internal_ips: bool = False  # no external IP (gcloud's --internal-ips): Cloud NAT or Private Google Access
    submission_named: bool = True  # --submission-id given (False: made here, and a dry run's script makes its own)
    reservation: str | None = None  # the project whose reservations the TPU may use
    valid_until: str | None = None  # a duration (6h, 1h30m), or an RFC 3339 time as gcloud sends it
    max_run_s: int | None = None  # the job's wall-clock limit (None: no limit)
    stall_timeout_s: int | None = None  # stop after this long without progress (None: no guard)
    unverified: str | None = None  # why this TPU type's runtime version is unverified (tpu_types)
    allow_unverified: bool = False
    # RUNNER_CODE for the job's container: the code archive's URL and sha256 (None: no code sent), and the
    # archive itself on the first submission (runner/cloud/codepack.py); a relaunch has the reference only.
    code_ref: str | None = None
    code: codepack.CodePack | None = None

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def labels(self) -> dict[str, str]:
        return {"runner-job": self.name, "runner-submission": self.submission_id}


# --- checks (before any call) -------------------------------------------------------------------


def resource_id(job_name: str) -> str:
    """A job name as a queued-resource id: lowercase letters, digits and dashes, starting with a letter."""
    text = re.sub(r"[^a-z0-9-]+", "-", job_name.lower()).strip("-")
    text = re.sub(r"^[^a-z]+", "", text)[:63].rstrip("-")
    return text or "runner-job"


def check_zone(zone: str) -> str:
    if _ZONE.fullmatch(zone):
        return zone
    if _REGION.fullmatch(zone):
        # A region's zone letters differ (us-east1 has b, c, d; no -a), so none is guessed here.
        raise SpecError(f"--zone {zone!r} is a region; give one of its zones ({zone}- and a letter): "
                        "`gcloud compute tpus locations list` lists the zones with Cloud TPUs")
    raise SpecError(f"--zone {zone!r} is not a zone name; zones look like us-central1-a or europe-west4-b")


def check_name(name: str) -> str:
    if not _RESOURCE_ID.fullmatch(name):
        raise SpecError(f"--name {name!r} cannot name a queued resource: use 1-63 lowercase letters, digits and '-', "
                        f"starting with a letter (e.g. {resource_id(name)})")
    return name


def _check_image(image: str | None, example: str) -> str:
    if not image:
        raise SpecError(f"missing --image: build and push the TPU image first (docs/cloud.md), e.g. --image {example}")
    if not _IMAGE.fullmatch(image):
        raise SpecError(f"--image {image!r} names no registry the TPU VM can pull from; push the image and give its "
                        f"full name, e.g. --image {example}")
    return image


def _check_flags(network, subnetwork, service_account, reservation, valid_until, max_restarts,
                 project: str | None = None) -> list[str]:
    problems = []
    for flag, value in (("--network", network), ("--subnetwork", subnetwork)):
        if value is not None and not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?|projects/[^ ]+", value):
            problems.append(
                f"{flag} {value!r} is not a network name (lowercase letters, digits, '-'; or a full "
                "projects/.../networks/NAME path)"
            )
    if service_account is not None and not _EMAIL.fullmatch(service_account):
        problems.append(f"--service-account {service_account!r} is not a service account's email, e.g. "
                        f"runner@{project or 'PROJECT'}.iam.gserviceaccount.com")
    if reservation is not None and not _PROJECT.fullmatch(reservation):
        problems.append(f"--reservation {reservation!r} must name the project that holds the reservation "
                        "(the TPU v2 API takes any reservation of that project, as `gcloud ... --reserved` does)")
    if valid_until is not None:
        try:
            kind, value = parse_valid_until(valid_until)
            if kind == "time" and value <= datetime.datetime.now(datetime.timezone.utc):
                problems.append(f"--valid-until {valid_until!r} has already passed: give a later time, or how long "
                                "to wait for capacity as a duration (e.g. --valid-until 6h)")
        except SpecError as error:
            problems.append(str(error))
    if max_restarts is not None and max_restarts < 0:
        problems.append(f"--max-restarts {max_restarts} must be 0 or more")
    return problems


def _bucket_of(spec: JobSpec) -> str:
    """The bucket the spec already uses (output.dir first, then its data), else the placeholder BUCKET."""
    paths = [spec.output.dir]
    if spec.kind == "train":
        paths += [getattr(spec.data, key) for key in ("train", "eval", "validation")]
    found = next((storage.split_gcs(p)[0] for p in paths if p and storage.is_gcs(p)), None)
    return found or "BUCKET"


def _check_spec(spec: JobSpec, hosts: int = 1) -> list[str]:
    """What a spec needs on a TPU VM: every path it reads or writes in a bucket (`hosts`: the slice's)."""
    problems = []
    bucket = _bucket_of(spec)
    if not storage.is_gcs(spec.output.dir):
        why = ("a TPU VM's disk goes with the VM" if hosts == 1 else
               f"the {hosts} hosts of a multi-host slice share no disk: process 0 writes the run folder, every "
               "host its own log and its part of each checkpoint, all in one place they can all reach")
        problems.append(f"output.dir is {spec.output.dir!r}: {why}; write to a bucket, "
                        f"e.g. --set output.dir=gs://{bucket}/runs")
    if spec.kind == "train":
        for key in ("train", "eval", "validation"):
            path = getattr(spec.data, key)
            if path and not storage.is_gcs(path):
                folder, _, pattern = path.rpartition("/")
                target = f"gs://{bucket}/data/{Path(folder).name or spec.name}"
                problems.append(
                    f"data.{key} is {path!r}: the TPU VM cannot see this machine's files; copy the folder with its "
                    f"manifest.json to a bucket (`gcloud storage cp -r {shlex.quote(folder or '.')}/. {target}`) and "
                    f"--set data.{key}={target}/{pattern}"
                )
    if spec.accelerator.kind in ("cpu", "gpu"):
        problems.append(f"accelerator.kind is {spec.accelerator.kind!r}: a TPU VM job needs 'tpu' (or 'auto'): "
                        "--set accelerator.kind=tpu")
    return problems


def prepare_submission(
    spec_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    tpu_type: str,
    zone: str | None,
    image: str | None,
    project: str | None,
    spot: bool = False,
    keep: bool = False,
    runtime_version: str | None = None,
    name: str | None = None,
    max_restarts: int | None = None,
    network: str | None = None,
    subnetwork: str | None = None,
    service_account: str | None = None,
    internal_ips: bool = False,
    reservation: str | None = None,
    valid_until: str | None = None,
    submission_id: str | None = None,
    max_run_duration: str | None = None,
    stall_timeout: str | None = None,
    allow_unverified: bool = False,
    need_project: bool = True,
    creates_vm: bool = True,
) -> Submission:
    """Checks every flag and the spec; raises SpecError listing all problems. Sends nothing.

    max_run_duration / stall_timeout: a duration, `none`, or None for the defaults (24h, 30m).
    need_project: False where the engine picks the project itself (SkyPilot); `project` is then "" if unknown;
    creates_vm: a TPU VM is made with the runtime version (tpu-vm, SkyPilot), so its recipe is judged too."""
    problems: list[str] = []
    checked: dict[str, Any] = {}
    example = image_example(project, zone)
    for key, check, value in (
        ("tpu", tpu_types.slice_type, tpu_type),
        ("zone", check_zone, zone),
        ("image", lambda text: _check_image(text, example), image),
        ("name", check_name, name),
    ):
        if value is None and key == "name":
            continue
        if value is None and key == "zone":
            problems.append("missing --zone (and gcloud has no compute/zone): the zone to create the TPU in, "
                            "e.g. --zone us-central1-a")
            continue
        try:
            checked[key] = check(value)
        except SpecError as error:
            problems.append(str(error))
    if not project and need_project:
        problems.append("missing --project (or GOOGLE_CLOUD_PROJECT, or gcloud's core/project): the Google Cloud "
                        "project to create the TPU in")
    problems += _check_flags(network, subnetwork, service_account, reservation, valid_until, max_restarts, project)
    max_run_s, stall_timeout_s = parse_limits(max_run_duration, stall_timeout, problems)
    spec = load_spec(spec_path, overrides)
    if spec.accelerator.kind == "auto":
        # On the VM the TPU must be found: a job that fell back to the CPU would still bill TPU hours.
        spec = load_spec(spec_path, [*overrides, "accelerator.kind=tpu"])
    problems += _check_spec(spec, checked["tpu"].hosts if "tpu" in checked else 1)
    # The code the spec names travels with the job (runner/cloud/codepack.py), its run folder the archive's home.
    code, code_problems = codepack.code_to_send(spec.import_paths, spec.code_roots, spec.run_dir)
    problems += code_problems
    # The job's own bounds for its limits: the container gets them as --set; refuse here, not on the VM.
    for flag, given, override in (
        ("--max-run-duration", max_run_duration, limit_overrides(max_run_s, None)),
        ("--stall-timeout", stall_timeout, limit_overrides(None, stall_timeout_s)),
    ):
        try:
            load_spec(spec_path, [*overrides, *override])
        except SpecError as error:
            problems.append(f"{flag} {given!r} is outside what the job accepts: {error}")
    if "tpu" in checked:
        problems += tpu_types.where_problems(checked["tpu"], checked.get("zone"), creates_vm)
        problems += advice.batch_problems(spec, checked["tpu"])  # the job would refuse it after the boot
    if problems:
        raise SpecError("cannot submit:\n  " + "\n  ".join(problems))
    tpu = checked["tpu"]
    return Submission(
        name=checked.get("name") or resource_id(spec.name),
        project=project or "",
        zone=str(zone),
        tpu=tpu,
        image=str(image),
        spot=spot,
        keep=keep,
        runtime_version=runtime_version or tpu_types.runtime_of(tpu)[0] or "",
        spec=spec,
        submission_id=submission_id or record.new_submission_id(),
        submission_named=submission_id is not None,
        max_restarts=(DEFAULT_SPOT_RESTARTS if spot else 0) if max_restarts is None else max_restarts,
        network=network,
        subnetwork=subnetwork,
        service_account=service_account,
        internal_ips=internal_ips,
        reservation=reservation,
        valid_until=valid_until_text(valid_until) if valid_until else None,
        max_run_s=max_run_s,
        stall_timeout_s=stall_timeout_s,
        unverified=tpu_types.unverified_reason(tpu, runtime_version, vm=creates_vm),
        allow_unverified=allow_unverified,
        code_ref=code.ref if code is not None else None,
        code=code,
    )


def check_verified(sub: Submission) -> None:
    """A runtime version no source names (tpu_types.unverified_reason) is submitted only with --allow-unverified."""
    if sub.unverified and not sub.allow_unverified:
        raise SpecError(f"cannot submit: {sub.unverified}. Give --allow-unverified to submit it anyway (a TPU VM "
                        "job records it in its job.json)")
