"""The job as a Vertex AI CustomJob: one worker pool of one TPU VM running the runner image, the run folder as
the job's base output directory, Spot scheduling with --spot. Sent with google-cloud-aiplatform's JobService
(`pip install 'tpu-job-runner[vertex]'`); --dry-run prints the request as JSON (what `POST .../customJobs` takes).

Restarts are Vertex's own, and it has no setting for exit codes. Its page "Understand the Vertex AI serverless
training service" (https://cloud.google.com/vertex-ai/docs/training/understanding-training-service) says a
worker that exits non-zero is restarted in the same VM; an error of its "common errors" is permanent and ends
the job; any other may restart the worker up to five times and then the whole job up to three times. So an
exit 1 or 2 may run again (docs/engines.md says what that costs). What the job can set, it sets:
`scheduling.disableRetries: true` (aiplatform_v1 Scheduling: "if the job should retry for internal errors
after the job starts running. If true, overrides restart_job_on_worker_restart to false"), and no
`restartJobOnWorkerRestart` (it restarts the whole job when a worker restarts, which for one worker only adds
a restart).

Time limits: the job's own (`runner run ... --set train.max_duration=S --set train.stall_timeout=S`), and
`scheduling.timeout` at --max-run-duration plus LIMIT_GRACE_S (Scheduling.timeout: "The maximum job running
time. The default is 7 days.", aiplatform_v1 types/custom_job.py); with `--max-run-duration none` it is left
out and Vertex's 7 days apply. Whether Vertex restarts a worker that exits 124 is Vertex's to decide (above).

The machine types are Vertex AI's for training on TPU VMs, read from the TPU table (runner/device/tpus.json:
https://cloud.google.com/vertex-ai/docs/training/configure-compute, "TPUs"; v2-8 and v3-8 are the legacy
`cloud-tpu` machine with 8 TPU cores). A generation the table gives no Vertex machine (v6e, v5p, v4, TPU7x)
is refused with the table's reason, and so is every multi-host slice: no Vertex AI page read here documents a TPU
slice of more than one VM for a custom container (the v5e row's `vertex.multi_host`, with its source). The
container runs as the image's user: the TPU image's is root (Dockerfile), since libtpu opens the TPU devices and
Vertex's ContainerSpec has no user setting. None of this has run on Vertex from this project.
"""

from __future__ import annotations

import json
import os
from typing import Any

from runner import AcceleratorError, SpecError
from runner.cloud import pricing, tpu_types
from runner.cloud.engines import command, container_env, deadline_s
from runner.cloud.submit import Submission
from runner.device import tpus

API = "aiplatform.googleapis.com"
ENDPOINT_OVERRIDE = "CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM"  # gcloud's, honoured here too
INSTALL = "pip install 'tpu-job-runner[vertex]'   (or: pip install google-cloud-aiplatform)"
_CALL_TIMEOUT_S = 60.0

# TPU type -> {machine_type, topology (TPU VM machines), accelerator: [type, count] (the legacy machine)}
MACHINES: dict[str, dict[str, Any]] = {
    name: machine for generation in tpus.generations().values()
    for name, machine in generation.row["vertex"].get("machines", {}).items()
}


class VertexApiError(AcceleratorError):
    """Vertex AI could not be reached, refused the credentials, or failed the request (exit 3)."""


def machine_spec(sub: Submission) -> dict[str, Any]:
    try:
        tpu_types.refuse_on(sub.tpu, "vertex")
    except SpecError as error:
        raise SpecError(f"{error}; run {sub.tpu.generation} with another --on, or pick one of "
                        f"{', '.join(MACHINES)}") from None
    if not sub.tpu.single_host:
        why = sub.tpu.facts.row["vertex"].get("multi_host") or {"refused": "no Vertex AI machine for it"}
        source = f" ({tpus.source(why['source'])})" if why.get("source") else ""
        raise SpecError(f"--on vertex --tpu-type {sub.tpu.name}: a slice of {sub.tpu.hosts} hosts: {why['refused']}"
                        f"{source}; run it with --on tpu-vm, skypilot or gke ({tpu_types.DOCS})")
    if sub.tpu.name not in MACHINES:
        raise SpecError(f"--on vertex --tpu-type {sub.tpu.name}: no Vertex AI training machine for it; Vertex runs "
                        f"{', '.join(MACHINES)}")
    machine = MACHINES[sub.tpu.name]
    spec: dict[str, Any] = {"machineType": machine["machine_type"]}
    if machine.get("topology"):
        spec["tpuTopology"] = machine["topology"]
    if machine.get("accelerator"):
        spec["acceleratorType"], spec["acceleratorCount"] = machine["accelerator"]
    return spec


def custom_job(sub: Submission) -> dict[str, Any]:
    """The CustomJob in the API's JSON form (proto3 JSON, camelCase)."""
    # No retries after the job has started: a failed run is not billed again for Vertex's own errors.
    scheduling: dict[str, Any] = {"disableRetries": True}
    if sub.spot:
        scheduling["strategy"] = "SPOT"
    deadline = deadline_s(sub)
    if deadline is not None:  # aiplatform_v1 Scheduling.timeout: "The maximum job running time" (default 7 days)
        scheduling["timeout"] = f"{deadline}s"
    return {
        "displayName": sub.name,
        "labels": {"runner-job": sub.name},
        "jobSpec": {
            "workerPoolSpecs": [{
                "machineSpec": machine_spec(sub),
                "replicaCount": "1",
                "containerSpec": {
                    "imageUri": sub.image,
                    "command": ["bash", "-c"],
                    "args": [command(sub)],
                    "env": [{"name": key, "value": value} for key, value in container_env(sub).items()],
                },
            }],
            "scheduling": scheduling,
            "baseOutputDirectory": {"outputUriPrefix": sub.spec.run_dir},
        },
    }


def parent(sub: Submission) -> str:
    return f"projects/{sub.project}/locations/{pricing.region_of(sub.zone)}"


def request_text(sub: Submission) -> str:
    """What --dry-run prints: the create request, as JSON a reader can send as it is."""
    doc = {"parent": parent(sub), "customJob": custom_job(sub)}
    return json.dumps(doc, indent=2) + "\n"


def build_job(sub: Submission):
    """The request as aiplatform_v1's CustomJob; unknown fields or wrong values are refused here."""
    from google.cloud import aiplatform_v1
    from google.protobuf import json_format

    message = json_format.ParseDict(custom_job(sub), aiplatform_v1.CustomJob.pb(aiplatform_v1.CustomJob()))
    return aiplatform_v1.CustomJob.wrap(message)


def make_client(region: str):
    """A JobService client for the job's region: gcloud's access token and endpoint override when set."""
    from google.api_core.client_options import ClientOptions
    from google.cloud import aiplatform_v1

    from runner.cloud.tpu_api import credentials

    endpoint = os.environ.get(ENDPOINT_OVERRIDE, "").rstrip("/") or f"{region}-{API}"
    return aiplatform_v1.JobServiceClient(credentials=credentials(), transport="rest",
                                          client_options=ClientOptions(api_endpoint=endpoint))


def create(sub: Submission, client=None) -> dict[str, Any]:
    """Sends the CustomJob; returns its name and state as Vertex answered."""
    try:
        from google.api_core import exceptions as api
    except ImportError:
        raise SpecError(f"google-cloud-aiplatform is not installed: {INSTALL}; or print the request with "
                        "--dry-run") from None
    try:
        job = build_job(sub)
        client = client or make_client(pricing.region_of(sub.zone))
    except ImportError:
        raise SpecError(f"google-cloud-aiplatform is not installed: {INSTALL}; or print the request with "
                        "--dry-run") from None
    where = f"in {parent(sub)}"
    try:
        created = client.create_custom_job(parent=parent(sub), custom_job=job, retry=None, timeout=_CALL_TIMEOUT_S)
    except api.InvalidArgument as exc:
        raise SpecError(f"Vertex AI refused the CustomJob {sub.name!r} {where}: {exc.message}") from None
    except (api.PermissionDenied, api.Unauthenticated, api.Forbidden, api.Unauthorized) as exc:  # gRPC, REST
        raise VertexApiError(f"Vertex AI refused to create {sub.name!r} {where}: {exc.message}; check the "
                             "credentials (`runner doctor --cloud --on vertex` names the fix) and that the API is "
                             f"enabled (`gcloud services enable {API} --project {sub.project}`)") from None
    except api.GoogleAPICallError as exc:
        raise VertexApiError(f"Vertex AI failed to create {sub.name!r} {where}: {exc.code} {exc.message}") from None
    except Exception as exc:
        raise VertexApiError(f"could not reach Vertex AI to create {sub.name!r}: {type(exc).__name__}: {exc}") from exc
    return {
        "on": "vertex",
        "name": sub.name,
        "job": created.name,
        "state": created.state.name,
        "run_dir": sub.spec.run_dir,
        "follow": f"gcloud ai custom-jobs describe {created.name}; gcloud ai custom-jobs stream-logs {created.name}",
    }
