"""The job as a SkyPilot managed job: a task YAML (`sky jobs launch task.yaml`), or sent with SkyPilot's
Python API (`sky.jobs.launch`, then `sky.get` on its request) when SkyPilot is installed
(`pip install 'tpu-job-runner[skypilot]'`).

The task runs the runner image on a TPU VM of the chosen type (`image_id: docker:IMAGE`; SkyPilot starts the
container with --privileged on TPU VMs and runs `run:` inside it). Recovery is SkyPilot's:
  - a preempted spot TPU is relaunched by the managed-jobs controller (always, without limit);
  - `job_recovery.recover_on_exit_codes: [75]`: the runner's own preemption exit relaunches it too, and
    SkyPilot counts these apart from `max_restarts_on_errors`, so there is no limit to them either;
  - `max_restarts_on_errors: 0`: any other failure (1 training failed, 2 bad spec or data, 3 infrastructure)
    ends the job. Exit 3 is not retried here because SkyPilot can only retry it together with 1 and 2.
`recover_on_exit_codes` is in SkyPilot's schema from 0.11.2 on (sky/utils/schemas.py; 0.11.0 and 0.11.1 lack
it and their schema refuses unknown job_recovery keys), hence MIN_VERSION. Exit 124 (a time limit reached) is
not in it, so it ends the job, as on a TPU VM.

A multi-host TPU slice (v6e-16, ...) is one SkyPilot node, `num_nodes: 1`, whose hosts each run `run:`: SkyPilot's
"Multi-Host TPU Pods" docs (docs/source/reference/tpu.rst: it will "execute the setup/run commands on every host of
the pod") and its code (SkyPilot 0.14.1: sky/clouds/utils/gcp_utils.py `is_tpu_vm_pod`, a TPU VM type not ending
in -8; sky/backends/cloud_vm_ray_backend.py: "If TPU VM Pods is used, #num_nodes should be num_nodes *
num_node_ips"). `num_nodes: HOSTS` would ask for HOSTS slices. Each host's container starts `runner run`, and
`jax.distributed.initialize()` finds the slice from the TPU VM's metadata server, which SkyPilot's `--net=host`
container reaches (sky/provision/docker_utils.py), as on a TPU VM: no KERAS_DISTRIBUTION_* is set.

Time limits: only the job's own (`runner run ... --set train.max_duration=S --set train.stall_timeout=S`).
SkyPilot has no deadline for a managed job on a TPU VM: its one run duration, `gcp.managed_instance_group.
run_duration`, belongs to nodes it creates through a managed instance group, and a TPU VM is a node of its
own kind (sky/provision/gcp/instance.py: GCPNodeType COMPUTE, MIG or TPU; SkyPilot 0.14.1, read, not run).

The project: SkyPilot creates the TPU in its API server's GCP project (the active workspace's gcp.project_id,
else its Google credentials' project: sky/clouds/gcp.py GCP.get_project_id), which no task can change, so
`--project` is refused (runner/cloud/engines/__init__.py says how to set it).

The image is pulled the way SkyPilot's "Private registries" docs say (docs/source/examples/docker-containers.rst):
  - Artifact Registry (REGION-docker.pkg.dev): SKYPILOT_DOCKER_USERNAME and _PASSWORD empty and
    SKYPILOT_DOCKER_SERVER the registry, in `envs`; SkyPilot then runs `gcloud auth configure-docker SERVER`
    on the VM, whose service account needs read access (sky/provision/docker_utils.py);
  - gcr.io: SkyPilot has no keyless login for it, only a service-account key (username `_json_key`, the key
    as password), sent as `secrets` so SkyPilot redacts it; the key comes from SKYPILOT_DOCKER_PASSWORD in
    the environment of `runner submit`, as SkyPilot's docs pass it (`--env SKYPILOT_DOCKER_PASSWORD="$(cat
    key.json)"`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from runner import AcceleratorError, SpecError
from runner.cloud import pricing
from runner.cloud.engines import RETRY_UNBOUNDED, command, container_env, dump_yaml
from runner.cloud.submit import Submission
from runner.device.tpus import parse_tpu_type

INSTALL = "pip install 'tpu-job-runner[skypilot]' (the client; its API server needs skypilot[gcp])"
MIN_VERSION = "0.11.2"  # the first SkyPilot whose schema has job_recovery.recover_on_exit_codes
USERNAME, PASSWORD, SERVER = "SKYPILOT_DOCKER_USERNAME", "SKYPILOT_DOCKER_PASSWORD", "SKYPILOT_DOCKER_SERVER"
KEY_PLACEHOLDER = "<service-account key: sky jobs launch --secret SKYPILOT_DOCKER_PASSWORD=\"$(cat KEY.json)\">"


def registry_of(image: str) -> str:
    """The registry host of an image reference (Docker's rule: the first part, if it looks like a host)."""
    first, _, rest = image.partition("/")
    return first if rest and ("." in first or ":" in first or first == "localhost") else "docker.io"


def registry_login(image: str, *, dry_run: bool) -> tuple[str, dict[str, str]]:
    """Where SkyPilot's registry login goes (`envs` or `secrets`) and what it holds; ("", {}) for none."""
    server = registry_of(image)
    if server.endswith("-docker.pkg.dev"):
        return "envs", {USERNAME: "", PASSWORD: "", SERVER: server}
    if server == "gcr.io" or server.endswith(".gcr.io"):
        key = os.environ.get(PASSWORD)
        if not key and not dry_run:
            raise SpecError(f"--image {image}: SkyPilot logs in to {server} only with a service-account key "
                            f"(its 'Private registries' docs): export {PASSWORD}=\"$(cat KEY.json)\" before "
                            "`runner submit`, or push the image to Artifact Registry (REGION-docker.pkg.dev), "
                            "which SkyPilot reaches with the TPU VM's own service account")
        return "secrets", {USERNAME: "_json_key", PASSWORD: KEY_PLACEHOLDER if dry_run else key, SERVER: server}
    return "", {}


def task(sub: Submission, *, dry_run: bool = True) -> dict[str, Any]:
    """The task as SkyPilot's YAML schema has it."""
    region = pricing.region_of(sub.zone)
    doc: dict[str, Any] = {
        "name": sub.name,
        **({"num_nodes": 1} if sub.tpu.hosts > 1 else {}),  # one slice; SkyPilot runs `run` on each of its hosts
        "resources": {
            "infra": f"gcp/{region}/{sub.zone}",
            "accelerators": f"tpu-{sub.tpu.name}",
            "accelerator_args": {"runtime_version": sub.runtime_version, "tpu_vm": True},
            "use_spot": sub.spot,
            "image_id": f"docker:{sub.image}",
            "job_recovery": {"max_restarts_on_errors": 0, "recover_on_exit_codes": list(RETRY_UNBOUNDED)},
        },
        "envs": container_env(sub),
        # SkyPilot installs its own tools in the container with apt, and libtpu opens the TPU devices as root
        # (as on a TPU VM: runner/cloud/tpu_startup.sh); the TPU image already runs as root, this keeps it so
        # for an image built FROM it with another USER.
        "config": {"docker": {"run_options": ["--user", "0:0"]}},
        "run": command(sub) + "\n",
    }
    where, login = registry_login(sub.image, dry_run=dry_run)
    if where == "envs":
        doc["envs"].update(login)
    elif where == "secrets":
        doc["secrets"] = login
    return doc


def task_yaml(doc: dict[str, Any]) -> str:
    header = [
        f"# SkyPilot managed job for runner job {doc['name']!r}: sky jobs launch THIS_FILE (SkyPilot >= {MIN_VERSION})",
        "# Recovery: preempted spot TPUs and exit 75 (preempted, checkpoint saved) relaunch the job;",
        "# exits 1, 2, 3 and 124 (a time limit, enforced by the job itself) end it. The spec is base64 in",
        "# envs.RUNNER_SPEC_B64. The TPU is created in the GCP project of SkyPilot's API server (sky check gcp).",
    ]
    hosts = parse_tpu_type(doc["resources"]["accelerators"].removeprefix("tpu-")).hosts
    if hosts > 1:
        header.append(f"# The slice's {hosts} hosts are one SkyPilot node (num_nodes: 1): SkyPilot runs `run` on each "
                      "host, one JAX process per host.")
    if "secrets" in doc:
        header.append(f"# The registry key: sky jobs launch THIS_FILE --secret {PASSWORD}=\"$(cat KEY.json)\"")
    return "\n".join(header) + "\n" + dump_yaml(doc)


def check_version(installed: str) -> None:
    """SkyPilot older than MIN_VERSION refuses the task's `recover_on_exit_codes` (or, on its server, fails it)."""
    from packaging.version import InvalidVersion, Version

    try:
        too_old = Version(installed) < Version(MIN_VERSION)
    except InvalidVersion:  # a development build: its schema is what it is, let SkyPilot judge the task
        return
    if too_old:
        raise SpecError(f"SkyPilot {installed} is installed; the task needs SkyPilot >= {MIN_VERSION} "
                        "(job_recovery.recover_on_exit_codes first appears in its schema there): "
                        f"pip install 'skypilot>={MIN_VERSION}', and the same on its API server")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def launch(sub: Submission, doc: dict[str, Any], emit: Callable[[str], None] = _say) -> dict[str, Any]:
    """Sends the task to SkyPilot's API server (`sky jobs launch`) and waits for its answer: the managed job's
    id once the jobs controller has taken it, or SkyPilot's own error when it refused it."""
    try:
        import sky
    except ImportError:
        raise SpecError(f"SkyPilot is not installed: {INSTALL}; or print the task with --dry-run and run "
                        "`sky jobs launch` on it") from None
    check_version(getattr(sky, "__version__", "0"))
    try:
        sky_task = sky.Task.from_yaml_config(dict(doc))
    except ValueError as exc:  # SkyPilot's schema or its docker-login rules refused the task
        raise SpecError(f"SkyPilot refused the task for {sub.name!r}: {exc}") from None
    try:
        request_id = sky.jobs.launch(sky_task, name=sub.name)
    except Exception as exc:  # SkyPilot's own errors name the cause
        raise AcceleratorError(f"SkyPilot did not take the job {sub.name!r}: {type(exc).__name__}: {exc}") from exc
    # `launch` returns as soon as the API server has queued the request; the server may still refuse it
    # (no GCP credentials, no capacity in the catalog, a controller that cannot start), so wait for it.
    # SkyPilot has no per-task project (an explicit --project is refused before this): say where it goes.
    emit("SkyPilot creates the TPU in the GCP project of its API server's workspace or credentials "
         "(sky check gcp shows it)")
    emit(f"SkyPilot request {request_id} (sky jobs launch {sub.name}): waiting for the jobs controller to take "
         f"it; its log: sky api logs {request_id}")
    try:
        job_ids, _handle = sky.get(request_id)
    except Exception as exc:
        raise AcceleratorError(f"SkyPilot refused the job {sub.name!r} (request {request_id}): "
                               f"{type(exc).__name__}: {exc}; its log: sky api logs {request_id}") from exc
    job_id = job_ids[0] if job_ids else None
    return {
        "on": "skypilot",
        "name": sub.name,
        "request_id": str(request_id),
        "job_id": job_id,
        "run_dir": sub.spec.run_dir,
        "follow": (f"sky jobs logs {job_id}; sky jobs queue" if job_id is not None else
                   f"sky api logs {request_id}; sky jobs queue"),
    }
