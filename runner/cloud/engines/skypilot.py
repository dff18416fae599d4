"""The job as a SkyPilot managed job: a task YAML (`sky jobs launch task.yaml`), or sent with SkyPilot's
Python API (`sky.jobs.launch`) when SkyPilot is installed (`pip install 'tpu-job-runner[skypilot]'`).

The task runs the runner image on a TPU VM of the chosen type (`image_id: docker:IMAGE`; SkyPilot starts the
container with --privileged on TPU VMs and runs `run:` inside it). Recovery is SkyPilot's:
  - a preempted spot TPU is relaunched by the managed-jobs controller (always, without limit);
  - `job_recovery.recover_on_exit_codes: [75]`: the runner's own preemption exit relaunches it too, and
    SkyPilot counts these apart from `max_restarts_on_errors`, so there is no limit to them either;
  - `max_restarts_on_errors: 0`: any other failure (1 training failed, 2 bad spec or data, 3 infrastructure)
    ends the job. Exit 3 is not retried here because SkyPilot can only retry it together with 1 and 2.
The schema these keys follow is SkyPilot's own (sky/utils/schemas.py, `job_recovery`), checked in
tests/test_engines.py with SkyPilot's task loader.
"""

from __future__ import annotations

from typing import Any

from runner import AcceleratorError, SpecError
from runner.cloud import pricing
from runner.cloud.engines import COMMAND, RETRY_UNBOUNDED, container_env, dump_yaml
from runner.cloud.submit import Submission

INSTALL = "pip install 'tpu-job-runner[skypilot]' (the client; its API server needs skypilot[gcp])"


def task(sub: Submission) -> dict[str, Any]:
    """The task as SkyPilot's YAML schema has it."""
    region = pricing.region_of(sub.zone)
    return {
        "name": sub.name,
        "resources": {
            "infra": f"gcp/{region}/{sub.zone}",
            "accelerators": f"tpu-{sub.tpu.name}",
            "accelerator_args": {"runtime_version": sub.runtime_version, "tpu_vm": True},
            "use_spot": sub.spot,
            "image_id": f"docker:{sub.image}",
            "job_recovery": {"max_restarts_on_errors": 0, "recover_on_exit_codes": list(RETRY_UNBOUNDED)},
        },
        "envs": container_env(sub),
        # The image runs as uid 1000; SkyPilot installs its own tools in the container with apt, and libtpu
        # opens the TPU devices as root (as on a TPU VM: runner/cloud/tpu_startup.sh).
        "config": {"docker": {"run_options": ["--user", "0:0"]}},
        "run": COMMAND + "\n",
    }


def task_yaml(doc: dict[str, Any]) -> str:
    header = [
        f"# SkyPilot managed job for runner job {doc['name']!r}: sky jobs launch THIS_FILE",
        "# Recovery: preempted spot TPUs and exit 75 (preempted, checkpoint saved) relaunch the job;",
        "# exits 1, 2 and 3 end it. The spec is base64 in envs.RUNNER_SPEC_B64.",
    ]
    return "\n".join(header) + "\n" + dump_yaml(doc)


def launch(sub: Submission, doc: dict[str, Any]) -> dict[str, Any]:
    """Sends the task to SkyPilot's API server (`sky jobs launch`); returns the request to follow."""
    try:
        import sky
    except ImportError:
        raise SpecError(f"SkyPilot is not installed: {INSTALL}; or print the task with --dry-run and run "
                        "`sky jobs launch` on it") from None
    try:
        sky_task = sky.Task.from_yaml_config(dict(doc))
        request_id = sky.jobs.launch(sky_task, name=sub.name)
    except Exception as exc:  # SkyPilot's own errors name the cause; the CLI prints them
        raise AcceleratorError(f"SkyPilot did not take the job: {type(exc).__name__}: {exc}") from exc
    return {
        "on": "skypilot",
        "name": sub.name,
        "request_id": str(request_id),
        "run_dir": sub.spec.run_dir,
        "follow": f"sky api logs {request_id}; sky jobs queue; sky jobs logs --name {sub.name}",
    }
