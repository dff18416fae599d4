"""One name for a job: `runner status|logs|cancel|watch NAME` find it by the name `runner submit` printed;
`runner status` without a name lists every runner job in the zone.

A name leads to the job's run folder through, in order:
  1. its queued resource (the Cloud TPU API, while it exists): the startup script's RUNNER_RUN_DIR;
  2. this machine's pointer, written by `runner submit` and `runner watch` (runner/cloud/record.py);
and the run folder's job.json holds the rest. A gs:// or local run folder is accepted in place of a name.
"""

from __future__ import annotations

import base64
from typing import Any

import yaml

from runner import RunnerError, SpecError
from runner.cloud import durations, record, request, submit, tpu_api, tpu_types, usage
from runner.data import storage
from runner.spec.types import JobSpec

# --- the job record: what a watcher needs to create the same request again ---------------------------


def job_record(sub: submit.Submission, operation: str | None = None) -> dict[str, Any]:
    """RUN_DIR/job.json for a new submission (runner/cloud/record.py)."""
    return {
        "schema_version": 1,
        "name": sub.name,
        "project": sub.project,
        "zone": sub.zone,
        "run_dir": sub.spec.run_dir,
        "max_restarts": sub.max_restarts,
        "request": {
            "tpu_type": sub.tpu.name,
            "image": sub.image,
            "spot": sub.spot,
            "keep": sub.keep,
            "runtime_version": sub.runtime_version,
            "network": sub.network,
            "subnetwork": sub.subnetwork,
            "service_account": sub.service_account,
            "internal_ips": sub.internal_ips,
            "reservation": sub.reservation,
            "valid_until": sub.valid_until,
            "max_run_s": sub.max_run_s,
            "stall_timeout_s": sub.stall_timeout_s,
            # a runtime version no source names for JAX on this type; the user allowed it (--allow-unverified)
            "unverified": sub.unverified,
            "allow_unverified": sub.allow_unverified,
            "spec_yaml": request.spec_yaml(sub.spec),
            "code_ref": sub.code_ref,  # the code archive a relaunch hands the container again
        },
        "submissions": [{"id": sub.submission_id, "requested_at": record.now_text(), "operation": operation}],
        "restarts": [],
        "outcome": None,
    }


def submission_from_job(job: dict[str, Any], submission_id: str) -> submit.Submission:
    """The same request as the job's first, under a new submission id."""
    request = job["request"]
    spec = JobSpec.model_validate(yaml.safe_load(request["spec_yaml"]))
    return submit.Submission(
        name=job["name"], project=job["project"], zone=job["zone"], tpu=tpu_types.parse_tpu_type(request["tpu_type"]),
        image=request["image"], spot=bool(request["spot"]), keep=bool(request["keep"]),
        runtime_version=request["runtime_version"], spec=spec, submission_id=submission_id,
        max_restarts=int(job["max_restarts"]), network=request.get("network"), subnetwork=request.get("subnetwork"),
        service_account=request.get("service_account"), internal_ips=bool(request.get("internal_ips")),
        reservation=request.get("reservation"),
        valid_until=request.get("valid_until"), max_run_s=request.get("max_run_s"),
        stall_timeout_s=request.get("stall_timeout_s"), unverified=request.get("unverified"),
        allow_unverified=bool(request.get("allow_unverified")), code_ref=request.get("code_ref"),
    )


def job_from_resource(resource, project: str, zone: str) -> dict[str, Any]:
    """A job record rebuilt from a queued resource's own request (when job.json could not be written)."""
    node_spec = resource.tpu.node_spec[0]
    node = node_spec.node
    settings = request.settings_of(node.metadata.get("startup-script", ""))
    if "RUNNER_RUN_DIR" not in settings:
        raise SpecError(
            f"queued resource {node_spec.node_id!r} was not created by runner submit (no RUNNER_* settings)"
        )
    reservation = None
    if resource.reservation_name:
        reservation = resource.reservation_name.split("/")[1]
    valid_until = None
    if resource.queueing_policy and resource.queueing_policy.valid_until_duration:
        valid_until = f"{int(resource.queueing_policy.valid_until_duration.total_seconds())}s"
    elif resource.queueing_policy and resource.queueing_policy.valid_until_time:
        valid_until = durations.gcloud_time(resource.queueing_policy.valid_until_time)
    network = node.network_config.network or None
    return {
        "schema_version": 1,
        "name": node_spec.node_id,
        "project": project,
        "zone": zone,
        "run_dir": settings["RUNNER_RUN_DIR"],
        "max_restarts": int(settings.get("RUNNER_MAX_RESTARTS", "0")),
        "request": {
            "tpu_type": node.accelerator_type,
            "image": settings["RUNNER_IMAGE"],
            "spot": "spot" in resource,
            "keep": settings.get("RUNNER_KEEP") == "1",
            "runtime_version": node.runtime_version,
            "network": None if network == "default" else network,
            "subnetwork": node.network_config.subnetwork or None,
            "service_account": node.service_account.email or None,
            "internal_ips": not node.network_config.enable_external_ips,
            "reservation": reservation,
            "valid_until": valid_until,
            "max_run_s": int(settings["RUNNER_MAX_RUN_S"]) if settings.get("RUNNER_MAX_RUN_S") else None,
            "stall_timeout_s": int(settings["RUNNER_STALL_TIMEOUT_S"])
            if settings.get("RUNNER_STALL_TIMEOUT_S")
            else None,
            "unverified": tpu_types.unverified_reason(
                tpu_types.parse_tpu_type(node.accelerator_type), node.runtime_version
            ),
            "allow_unverified": True,  # it was created, so it was allowed
            "spec_yaml": base64.b64decode(settings["RUNNER_SPEC_B64"]).decode(),
            "code_ref": settings.get("RUNNER_CODE") or None,
        },
        "submissions": [
            {
                "id": node.labels.get("runner-submission") or settings.get("RUNNER_SUBMISSION", "unknown"),
                "requested_at": None,
                "rebuilt_from_queued_resource": True,
            }
        ],
        "restarts": [],
        "outcome": None,
    }


def is_run_dir(text: str) -> bool:
    return storage.is_gcs(text) or "/" in text or text.startswith(".")


def locate(name: str, project: str | None, zone: str | None, client=None) -> dict[str, Any]:
    """The job.json of a job given by name (or run folder); rebuilt from its queued resource when missing."""
    if is_run_dir(name):
        job = record.load_job(name)
        if job is None:
            raise SpecError(f"{name} holds no job.json: not the run folder of a job `runner submit` started")
        return job
    tried = []
    if project and zone:
        resource = tpu_api.get_queued_resource(name, project, zone, client)
        if resource is not None:
            run_dir = tpu_api.run_dir_of(resource)
            try:
                job = record.load_job(run_dir) if run_dir else None
            except RunnerError:  # the bucket does not answer: the queued resource still says what the job is
                job = None
            if job is None:
                job = job_from_resource(resource, project, zone)
            record.remember(name, project, zone, job["run_dir"])
            return job
        tried.append(f"no queued resource in {zone} (project {project})")
    pointer = record.recall(name)
    if pointer is not None:
        job = record.load_job(pointer["run_dir"])
        if job is not None:
            return job
        tried.append(f"this machine's pointer leads to {pointer['run_dir']}, which holds no job.json")
    else:
        tried.append("this machine has not submitted or watched a job of that name")
    # Said without asking the bucket: a name with neither a queued resource nor a pointer leads nowhere.
    raise SpecError(
        f"no such job: cannot find job {name!r}: "
        + "; ".join(tried)
        + ". Give its run folder instead (e.g. gs://BUCKET/runs/JOB), or the --zone and --project it runs in"
    )


def refuse_a_second_job(sub: submit.Submission, client=None) -> None:
    """One run folder, one live job: a new name for a folder whose job still has its queued resource would
    run two jobs into the same checkpoints (the job's lease would stop the second, with the TPU billed)."""
    try:
        previous = record.load_job(sub.spec.run_dir)
    except RunnerError:
        return  # the bucket does not answer here; the job itself checks its folder
    if not previous or previous["name"] == sub.name:
        return  # the same name: the API refuses a second queued resource itself
    if tpu_api.get_queued_resource(previous["name"], previous["project"], previous["zone"], client) is not None:
        raise SpecError(
            f"run folder {sub.spec.run_dir} belongs to job {previous['name']!r}, whose queued resource still exists "
            f"in {previous['zone']}: wait for it, `runner cancel {previous['name']} --zone {previous['zone']} "
            f"--project {previous['project']}`, or give this job another name (`--set name={sub.spec.name}-2`)"
        )


def with_live_times(job: dict[str, Any], seen: dict[str, Any] | None) -> dict[str, Any]:
    """The job with the API's timestamps of its current queued resource filled in (for the cost so far; a
    watcher keeps them in job.json, a job without one has only what the API says now)."""
    if not seen or not job.get("submissions"):
        return job
    current = dict(job["submissions"][-1])
    if seen.get("submission") in (None, current["id"]):
        for key in ("created_at", "node_created_at"):
            current[key] = current.get(key) or seen.get(key)
    return {**job, "submissions": [*job["submissions"][:-1], current]}


def row(job: dict[str, Any], state: str | None) -> dict[str, Any]:
    """One line of `runner status`: state, restarts, step, cost so far."""
    try:
        step = record.checkpoint_step(job["run_dir"])
    except RunnerError:
        step = None
    cost = usage.job_cost(job)
    outcome = job.get("outcome") or {}
    return {
        "name": job["name"],
        "state": state or (outcome.get("outcome") or "gone"),
        "submission": record.current_submission(job),
        "restarts": sum(1 for r in job.get("restarts", []) if r.get("to")),
        "max_restarts": job.get("max_restarts"),
        "step": step,
        "usd": cost["usd"],
        "accelerator_type": job["request"]["tpu_type"],
        "spot": bool(job["request"].get("spot")),
        "run_dir": job["run_dir"],
    }


def list_jobs(project: str, zone: str, client=None) -> list[dict[str, Any]]:
    """Every runner job in the zone: queued resources labelled runner-job, and jobs this machine remembers."""
    rows, names = [], set()
    for resource in tpu_api.list_queued_resources(project, zone, client):
        name = tpu_api.job_name_of(resource)
        if name is None:
            continue  # not a runner job
        names.add(name)
        seen = tpu_api.describe(resource, client)
        run_dir = tpu_api.run_dir_of(resource)
        try:
            job = (record.load_job(run_dir) if run_dir else None) or job_from_resource(resource, project, zone)
        except RunnerError as error:
            rows.append({"name": name, "state": seen["state"], "error": str(error)})
            continue
        rows.append(row(with_live_times(job, seen), seen["state"]))
    for pointer in record.remembered():
        if pointer["name"] in names or pointer.get("project") != project or pointer.get("zone") != zone:
            continue
        try:
            job = record.load_job(pointer["run_dir"])
        except RunnerError as error:
            rows.append({"name": pointer["name"], "state": None, "error": str(error)})
            continue
        if job is not None:
            rows.append(row(job, None))
    return sorted(rows, key=lambda r: r["name"])


def status(name: str, project: str | None, zone: str | None, client=None) -> dict[str, Any]:
    """One job: its queued resource and node as the API has them now, and its record: restarts, step, cost."""
    job = locate(name, project, zone, client)
    resource = tpu_api.get_queued_resource(job["name"], job["project"], job["zone"], client)
    seen = tpu_api.describe(resource, client) if resource is not None else None
    state = seen["state"] if seen else _ended_state(job)
    job = with_live_times(job, seen)
    doc = row(job, state)
    doc.update(
        {
            "project": job["project"],
            "zone": job["zone"],
            "queued_resource": None
            if seen is None
            else {
                "state": seen["state"],
                "initiator": seen["initiator"],
                "submission": seen["submission"],
                "created": seen["created_at"],
            },
            "node": None
            if not seen or seen["node_state"] is None
            else {"state": seen["node_state"], "health": seen["node_health"]},
            "restarts": job.get("restarts", []),
            "outcome": job.get("outcome"),
            "cost": usage.job_cost(job),
        }
    )
    warning = _delete_failed(job, seen)
    if warning:
        doc["warning"] = warning
    return doc


def _delete_failed(job: dict[str, Any], seen: dict[str, Any] | None) -> str | None:
    """What to say when the worker that deleted the slice gave up (its exit record says so) and it still exists."""
    if seen is None:
        return None  # gone: nothing bills
    current = record.current_submission(job)
    try:  # on a multi-host slice the worker that tried may not be worker 0
        tried = [record.exit_record(job["run_dir"], current, w) for w in range(_hosts(job))]
    except RunnerError:
        return None
    ended = next((r for r in tried if r and str(r.get("delete", "")).startswith("failed")), None)
    if not ended:
        return None
    return (
        f"delete failed: still billing, run `runner cancel {job['name']}` (the VM tried "
        f"{ended.get('delete_attempts')} times after the job ended: {ended.get('reason')})"
    )


def _ended_state(job: dict[str, Any]) -> str:
    """What a job whose queued resource is gone left behind: the watcher's outcome, a cancel, or an exit."""
    if job.get("outcome"):
        return job["outcome"]["outcome"]
    current = record.current_submission(job)
    try:
        if record.read_text(record.cancelled_path(job["run_dir"], current)) is not None:
            return "cancelled"
        ended = record.slice_exit_record(job["run_dir"], current, _hosts(job), settled=True)
    except RunnerError:
        return "gone"
    return f"exited {ended['exit_code']}" if ended else "gone"


def _hosts(job: dict[str, Any]) -> int:
    return tpu_types.parse_tpu_type(job["request"]["tpu_type"]).hosts


def cancel(name: str, project: str | None, zone: str | None, client=None) -> dict[str, Any]:
    """Marks the current submission cancelled (a watcher stops instead of restarting), then deletes the
    queued resource and its VM (force)."""
    job = locate(name, project, zone, client)
    note = None
    current = record.current_submission(job)
    try:
        record.write_text(
            record.cancelled_path(job["run_dir"], current),
            f'{{"submission": "{current}", "at": "{record.now_text()}"}}\n',
        )
    except RunnerError as error:
        note = f"the cancel was not recorded in the run folder ({error}): a running watcher would restart the job"
    try:
        result = tpu_api.cancel(job["name"], job["project"], job["zone"], client)
    except SpecError:  # no queued resource: nothing bills; the mark still stops a watcher
        result = {
            "name": job["name"],
            "project": job["project"],
            "zone": job["zone"],
            "deleting": False,
            "note": "no queued resource to delete (the job had ended or was never created)",
        }
    result["submission"] = current
    if note:
        result["warning"] = note
    return result
