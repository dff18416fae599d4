"""Cloud TPU VM jobs: a queued resource whose startup script runs the runner image on every worker.

    runner submit SPEC --tpu-type v5litepod-8 --zone us-central1-a --image IMAGE [--spot] [--keep]
        checks the flags and the spec before any call (data and outputs must be in gs://: the VM's disk goes
        with the VM), then asks the Cloud TPU API for a queued resource NAME (default: the job name). When
        capacity allows, the VM boots and its startup script (runner/cloud/tpu_startup.sh) runs
        `docker run --net=host --privileged -e TPU_NAME=local IMAGE run spec.yaml` on every worker, copies
        the output to RUN_DIR/logs/, and on worker 0 deletes the queued resource when the job ends.
    runner status NAME / runner cancel NAME     the queued resource's state / delete it and its VM
    runner logs RUN_DIR [--summary]             a worker's log, or the summary with its cost (runner/cloud/logs.py)

`--dry-run` prints the request and a bash script sending the same request with gcloud, and sends nothing.
The API client honours gcloud's CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU and CLOUDSDK_AUTH_ACCESS_TOKEN, so both
can be pointed at the same endpoint. google-cloud-tpu is imported only when a request is built or sent.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from runner import storage
from runner.cloud import pricing, tpu_types
from runner.errors import AcceleratorError, RunnerError, SpecError
from runner.spec import JobSpec
from runner.specfile import load_spec

API_HOST = "https://tpu.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
_STARTUP_BODY = Path(__file__).with_name("tpu_startup.sh")
_HEREDOC_END = "RUNNER_STARTUP_SCRIPT"
_CALL_TIMEOUT_S = 60.0
_ZONE = re.compile(r"[a-z]+-[a-z]+\d+-[a-z]")
_REGION = re.compile(r"[a-z]+-[a-z]+\d+")
_RESOURCE_ID = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
# registry[:port]/path[:tag][@digest]; the registry part has a dot or a port, or is localhost.
_IMAGE = re.compile(r"(?P<registry>[a-z0-9.-]+\.[a-z0-9.-]+(:\d+)?|localhost(:\d+)?)/[a-z0-9._/-]+(:[\w.-]+)?(@sha256:[0-9a-f]{64})?")
_IMAGE_EXAMPLE = "us-central1-docker.pkg.dev/PROJECT/runner/runner:tpu"


class TpuApiError(AcceleratorError):
    """The Cloud TPU API could not be reached, refused the credentials, or failed the request (exit 3)."""


@dataclasses.dataclass(frozen=True)
class Submission:
    name: str  # the queued resource and its node
    project: str
    zone: str
    tpu: pricing.TpuType
    image: str
    spot: bool
    keep: bool
    runtime_version: str
    spec: JobSpec

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"


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
        raise SpecError(f"--zone {zone!r} is a region; give one of its zones, e.g. {zone}-a")
    raise SpecError(f"--zone {zone!r} is not a zone name; zones look like us-central1-a or europe-west4-b")


def check_name(name: str) -> str:
    if not _RESOURCE_ID.fullmatch(name):
        raise SpecError(
            f"--name {name!r} cannot name a queued resource: use 1-63 lowercase letters, digits and '-', "
            f"starting with a letter (e.g. {resource_id(name)})"
        )
    return name


def _check_image(image: str | None) -> str:
    if not image:
        raise SpecError(f"missing --image: build and push the TPU image first (README, 'cloud'), e.g. --image {_IMAGE_EXAMPLE}")
    if not _IMAGE.fullmatch(image):
        raise SpecError(
            f"--image {image!r} names no registry the TPU VM can pull from; push the image and give its full name, "
            f"e.g. {_IMAGE_EXAMPLE}"
        )
    return image


def _check_spec(spec: JobSpec) -> list[str]:
    """What a spec needs on a TPU VM: every path it reads or writes in a bucket."""
    problems = []
    if not storage.is_gcs(spec.output.dir):
        problems.append(
            f"output.dir is {spec.output.dir!r}: a TPU VM's disk goes with the VM; write to a bucket, "
            "e.g. --set output.dir=gs://BUCKET/runs"
        )
    if spec.kind == "train":
        for key in ("train", "eval", "validation"):
            path = getattr(spec.data, key)
            if path and not storage.is_gcs(path):
                problems.append(
                    f"data.{key} is {path!r}: the TPU VM cannot see this machine's files; upload the data "
                    f"(`runner prepare ... --out gs://BUCKET/data/...`) and --set data.{key}=gs://..."
                )
    if spec.accelerator.kind in ("cpu", "gpu"):
        problems.append(f"accelerator.kind is {spec.accelerator.kind!r}: a TPU VM job needs 'tpu' (or 'auto')")
    return problems


def prepare_submission(
    spec_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    tpu_type: str,
    zone: str,
    image: str | None,
    project: str | None,
    spot: bool = False,
    keep: bool = False,
    runtime_version: str | None = None,
    name: str | None = None,
) -> Submission:
    """Checks every flag and the spec; raises SpecError listing all problems. Sends nothing."""
    problems: list[str] = []
    checked: dict[str, Any] = {}
    for key, check, value in (
        ("tpu", tpu_types.single_host_type, tpu_type),
        ("zone", check_zone, zone),
        ("image", _check_image, image),
        ("name", check_name, name),
    ):
        if value is None and key == "name":
            continue
        try:
            checked[key] = check(value)
        except SpecError as error:
            problems.append(str(error))
    if not project:
        problems.append("missing --project (or GOOGLE_CLOUD_PROJECT): the Google Cloud project to create the TPU in")
    spec = load_spec(spec_path, overrides)
    if spec.accelerator.kind == "auto":
        # On the VM the TPU must be found: a job that fell back to the CPU would still bill TPU hours.
        spec = load_spec(spec_path, [*overrides, "accelerator.kind=tpu"])
    problems += _check_spec(spec)
    if problems:
        raise SpecError("cannot submit:\n  " + "\n  ".join(problems))
    tpu = checked["tpu"]
    return Submission(
        name=checked.get("name") or resource_id(spec.name),
        project=str(project),
        zone=zone,
        tpu=tpu,
        image=str(image),
        spot=spot,
        keep=keep,
        runtime_version=runtime_version or tpu.runtime_version,
        spec=spec,
    )


# --- the request ---------------------------------------------------------------------------------


def startup_script(sub: Submission) -> str:
    """The job's settings as shell variables, then the fixed body (runner/cloud/tpu_startup.sh)."""
    # What the spec sets (overrides included), not every default: the image's runner fills those in.
    spec_yaml = yaml.safe_dump(json.loads(sub.spec.model_dump_json(exclude_unset=True)), sort_keys=False)
    settings = {
        "RUNNER_NAME": sub.name,
        "RUNNER_PROJECT": sub.project,
        "RUNNER_ZONE": sub.zone,
        "RUNNER_IMAGE": sub.image,
        "RUNNER_RUN_DIR": sub.spec.run_dir,
        "RUNNER_KEEP": "1" if sub.keep else "0",
        "RUNNER_TPU_TYPE": sub.tpu.name,
        "RUNNER_SPOT": "true" if sub.spot else "false",
        "RUNNER_USD_PER_CHIP_HOUR": json.dumps(pricing.price_per_chip_hour(sub.tpu.name, sub.zone, sub.spot).usd),
        "RUNNER_SPEC_B64": base64.b64encode(spec_yaml.encode()).decode(),
    }
    header = ["#!/bin/bash", f"# runner job {sub.spec.name!r}: written by `runner submit`"]
    header += [f"{key}={shlex.quote(value)}" for key, value in settings.items()]
    return "\n".join(header) + "\n" + _STARTUP_BODY.read_text()


def settings_of(script: str) -> dict[str, str]:
    """The RUNNER_* settings at the top of a startup script (how `status` finds a job's run folder)."""
    found = {}
    for line in script.splitlines():
        if re.match(r"RUNNER_[A-Z_0-9]+=", line):
            key, _, value = line.partition("=")
            found[key] = " ".join(shlex.split(value))
    return found


def build_request(sub: Submission):
    """The QueuedResource to create: one node, this job's startup script, the VM's default service account."""
    from google.cloud import tpu_v2

    node = tpu_v2.Node(
        accelerator_type=sub.tpu.name,
        runtime_version=sub.runtime_version,
        network_config=tpu_v2.NetworkConfig(network="default", enable_external_ips=True),
        service_account=tpu_v2.ServiceAccount(scope=[SCOPE]),
        metadata={"startup-script": startup_script(sub)},
        labels={"runner-job": sub.name},
    )
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=sub.parent, node_id=sub.name, node=node)
    request = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    if sub.spot:
        request.spot = tpu_v2.QueuedResource.Spot()
    return request


def request_json(sub: Submission) -> dict[str, Any]:
    from google.cloud import tpu_v2

    return json.loads(tpu_v2.QueuedResource.to_json(build_request(sub), including_default_value_fields=False))


def gcloud_script(sub: Submission) -> str:
    """A bash script that sends the same create request with gcloud; watch/logs/cancel as comments."""
    script = startup_script(sub)
    if f"\n{_HEREDOC_END}\n" in f"\n{script}":
        raise RunnerError(f"the startup script contains the line {_HEREDOC_END}; it cannot be quoted in a heredoc")
    shown = request_json(sub)
    node = shown["tpu"]["nodeSpec"][0]["node"]
    node["metadata"]["startup-script"] = f"<the startup script below, {len(script.encode())} bytes>"
    where = f"--project={sub.project} --zone={sub.zone}"
    flags = [
        f"gcloud compute tpus queued-resources create {sub.name} {where}",
        f"--node-id={sub.name}",
        f"--accelerator-type={sub.tpu.name}",
        f"--runtime-version={sub.runtime_version}",
        *(["--spot"] if sub.spot else []),
        '--metadata-from-file="startup-script=$startup"',
        f"--labels=runner-job={sub.name}",
        f"--scopes={SCOPE}",
        "--async",
    ]
    lines = [
        "#!/bin/bash",
        f"# Job {sub.spec.name!r} on a {sub.tpu.name} in {sub.zone}: this script sends, with gcloud, the request",
        f"# `runner submit` sends to POST {API_HOST}/v2/{sub.parent}/queuedResources?queuedResourceId={sub.name}",
        *("#   " + line for line in json.dumps(shown, indent=2).splitlines()),
        "set -euo pipefail",
        'startup="$(mktemp)"',
        "trap 'rm -f \"$startup\"' EXIT",
        f"cat >\"$startup\" <<'{_HEREDOC_END}'",
        script.rstrip("\n"),
        _HEREDOC_END,
        " \\\n  ".join(flags),
        f"# Watch:   gcloud compute tpus queued-resources describe {sub.name} {where}",
        f"# Logs:    runner logs {sub.spec.run_dir}     (summary and cost: add --summary)",
        f"# Cancel:  gcloud compute tpus queued-resources delete {sub.name} {where} --force --quiet",
    ]
    return "\n".join(lines) + "\n"


# --- the API -------------------------------------------------------------------------------------


def make_client():
    """A Cloud TPU v2 client: ADC credentials, or gcloud's access token and endpoint override when set."""
    import google.auth
    from google.api_core.client_options import ClientOptions
    from google.auth import exceptions as auth_exceptions
    from google.cloud import tpu_v2
    from google.oauth2.credentials import Credentials

    token = os.environ.get("CLOUDSDK_AUTH_ACCESS_TOKEN")
    if token:
        credentials = Credentials(token)
    else:
        try:
            credentials, _ = google.auth.default(scopes=[SCOPE])
        except auth_exceptions.DefaultCredentialsError:
            raise TpuApiError(
                "no Google Cloud credentials found; run `gcloud auth application-default login` "
                "(or use --dry-run to see the request without sending it)"
            ) from None
    endpoint = os.environ.get("CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU", "").rstrip("/")
    options = ClientOptions(api_endpoint=endpoint) if endpoint else None
    return tpu_v2.TpuClient(credentials=credentials, transport="rest", client_options=options)


def _api_error(exc: Exception, action: str, name: str, project: str, zone: str) -> RunnerError:
    from google.api_core import exceptions as api

    where = f"in {zone} (project {project})"
    # The REST transport maps HTTP 409 to Conflict; the body's ALREADY_EXISTS says which conflict it is.
    if isinstance(exc, api.AlreadyExists) or (isinstance(exc, api.Conflict) and "already exists" in str(exc.message)):
        return SpecError(
            f"a queued resource {name!r} already exists {where}: see `runner status {name} --zone {zone}`, "
            f"free the name with `runner cancel {name} --zone {zone}`, or pick another with --name"
        )
    if isinstance(exc, api.NotFound):
        return SpecError(
            f"no queued resource {name!r} {where}: it was never submitted there, or its job ended and it was "
            "deleted (read the job's output with `runner logs RUN_DIR`)"
        )
    if isinstance(exc, (api.PermissionDenied, api.Unauthenticated)):
        return TpuApiError(f"the Cloud TPU API refused to {action} {name!r} {where}: {exc.message}; check the "
                           "credentials and that the TPU API is enabled (gcloud services enable tpu.googleapis.com)")
    if isinstance(exc, api.GoogleAPICallError):
        return TpuApiError(f"the Cloud TPU API failed to {action} {name!r} {where}: {exc.code} {exc.message}")
    return TpuApiError(f"could not reach the Cloud TPU API to {action} {name!r}: {type(exc).__name__}: {exc}")


def create(sub: Submission, client=None) -> dict[str, Any]:
    """Sends the create request; returns what was asked for and the operation that tracks it."""
    client = client or make_client()
    try:
        operation = client.create_queued_resource(
            parent=sub.parent, queued_resource_id=sub.name, queued_resource=build_request(sub),
            retry=None, timeout=_CALL_TIMEOUT_S,
        )
    except Exception as exc:  # every failure of the call becomes an error the CLI can print
        raise _api_error(exc, "create", sub.name, sub.project, sub.zone) from exc
    return {
        "name": sub.name,
        "project": sub.project,
        "zone": sub.zone,
        "accelerator_type": sub.tpu.name,
        "spot": sub.spot,
        "image": sub.image,
        "run_dir": sub.spec.run_dir,
        "operation": operation.operation.name,
    }


def status(name: str, project: str, zone: str, client=None) -> dict[str, Any]:
    """The queued resource's state, its node's state and health, and the job's run folder."""
    client = client or make_client()
    full = f"projects/{project}/locations/{check_zone(zone)}/queuedResources/{name}"
    try:
        resource = client.get_queued_resource(name=full, timeout=_CALL_TIMEOUT_S)
    except Exception as exc:
        raise _api_error(exc, "read", name, project, zone) from exc
    specs = list(resource.tpu.node_spec)
    node_doc = None
    settings: dict[str, str] = {}
    if specs:
        settings = settings_of(specs[0].node.metadata.get("startup-script", ""))
        try:
            node = client.get_node(name=f"{specs[0].parent}/nodes/{specs[0].node_id}", timeout=_CALL_TIMEOUT_S)
            node_doc = {"state": node.state.name, "health": node.health.name, "health_description": node.health_description}
        except Exception:  # no node until the queued resource is provisioned
            node_doc = None
    return {
        "name": name,
        "project": project,
        "zone": zone,
        "state": resource.state.state.name,
        "node": node_doc,
        "accelerator_type": specs[0].node.accelerator_type if specs else None,
        "spot": "spot" in resource,
        "created": resource.create_time.isoformat() if resource.create_time else None,
        "run_dir": settings.get("RUNNER_RUN_DIR"),
    }


def cancel(name: str, project: str, zone: str, client=None) -> dict[str, Any]:
    """Deletes the queued resource and its VM (force: even while the job runs)."""
    client = client or make_client()
    full = f"projects/{project}/locations/{check_zone(zone)}/queuedResources/{name}"
    try:
        operation = client.delete_queued_resource(request={"name": full, "force": True}, timeout=_CALL_TIMEOUT_S)
    except Exception as exc:
        raise _api_error(exc, "delete", name, project, zone) from exc
    return {"name": name, "project": project, "zone": zone, "deleting": True, "operation": operation.operation.name}
