"""The same job on the engines TPU teams already run: SkyPilot managed jobs, GKE (JobSet, as xpk makes it) and
Vertex AI CustomJob. `runner submit --on ENGINE` checks the spec and flags as for a TPU VM
(runner/cloud/submit.py: `prepare_submission`, the image and TPU type checks), then hands the job to the
engine in the form it takes; the runner schedules and retries nothing itself there.

What every engine runs is the runner image with one command: the spec travels base64-encoded in
RUNNER_SPEC_B64 (as on a TPU VM), is written to a file and run with `runner run`, with the job's time limits
as the TPU VM's startup script passes them (`--set train.max_duration=S --set train.stall_timeout=S`: the job
saves and exits 124 at either; defaults 24h and 30m, runner/cloud/durations.py). Where the engine has its own
deadline (GKE's Job, Vertex AI's CustomJob) it is set at the wall-clock limit plus LIMIT_GRACE_S. The exit
codes decide what the engine does next (docs/engines.md):

    75  preempted, checkpoint saved: run again             -> the engine restarts the job
    3   infrastructure (accelerator, storage)              -> restarted where the engine can bound it (GKE)
    124 a time limit reached (saved)                       -> never restarted: as on a TPU VM, a restart would
                                                              start the clock again and bill the limit again
    1 2 training failed / bad spec or data                 -> never restarted (Vertex AI: see vertex.py)

A multi-host slice (runner/cloud/tpu_types.py: the types the TPU table gives the hosts of) runs one process per
host on every engine that can start them: SkyPilot runs the task on every host of a TPU slice, GKE's JobSet has
one pod per host; Vertex AI documents no multi-host TPU slice for a custom container and refuses it (vertex.py).

Each engine's client library is imported only when a job is sent; none is needed for --dry-run.
"""

from __future__ import annotations

import base64
import dataclasses
import shlex
from collections.abc import Callable
from typing import Any

import yaml

from runner import (
    EXIT_INFRA,
    EXIT_PREEMPTED,
    EXIT_TIME_LIMIT,
    EXIT_TRAINING,
    EXIT_USAGE,
    SpecError,
)
from runner.cloud.durations import LIMIT_GRACE_S, limit_overrides
from runner.cloud.request import spec_yaml
from runner.cloud.submit import Submission, check_verified

TARGETS = ("tpu-vm", "skypilot", "gke", "vertex")
CONTAINER = "runner"  # the container's name where an engine names it (GKE's pod failure policy does)
SPEC_FILE = "/tmp/runner-spec.yaml"
# The one command every engine runs in the image: the spec from the environment to a file, then the job.
# One line, so that xpk can inline it in its own wrapper script.
COMMAND = f'printf %s "$RUNNER_SPEC_B64" | base64 -d >{SPEC_FILE} && exec runner run {SPEC_FILE}'
RETRY_UNBOUNDED = (EXIT_PREEMPTED,)
RETRY_BOUNDED = (EXIT_INFRA, EXIT_PREEMPTED)
# 124 (train.max_duration or train.stall_timeout reached, saved) is never retried, as on a TPU VM
# (runner/cloud/recovery.py): each run starts the clock again, so retries would bill max-restarts x the limit.
NEVER_RETRY = (EXIT_TRAINING, EXIT_USAGE, EXIT_TIME_LIMIT)


# Which targets each flag of `runner submit` means something to; any other target refuses it.
FLAG_TARGETS = {
    "--keep": ("tpu-vm",), "--watch": ("tpu-vm",), "--network": ("tpu-vm",), "--subnetwork": ("tpu-vm",),
    "--service-account": ("tpu-vm",), "--internal-ips": ("tpu-vm",), "--reservation": ("tpu-vm",),
    "--valid-until": ("tpu-vm",),
    "--runtime-version": ("tpu-vm", "skypilot"),
    "--max-restarts": ("tpu-vm", "gke"),
    "--max-run-duration": TARGETS, "--stall-timeout": TARGETS,
    # What --allow-unverified allows is a TPU VM software version no source names (runner/cloud/tpu_types.py):
    # SkyPilot creates a TPU VM with the runtime given (accelerator_args.runtime_version); GKE and Vertex AI
    # choose the host's software themselves.
    "--allow-unverified": ("tpu-vm", "skypilot"),
    "--project": ("tpu-vm", "gke", "vertex"),
    "--queue": ("gke",), "--namespace": ("gke",), "--cluster": ("gke",), "--format": ("gke",),
}
_WHY = {
    "--max-restarts": {"skypilot": "SkyPilot relaunches a preempted job (and exit 75) without limit and never "
                                   "retries exits 1, 2, 3 and 124",
                       "vertex": "Vertex AI restarts a preempted worker itself and has no restart count"},
    # SkyPilot 0.14.1, sky/clouds/gcp.py GCP.get_project_id: the workspace's gcp.project_id (API server config),
    # else google.auth.default()'s project; a task's `config:` may set only the keys of
    # sky/skylet/constants.py OVERRIDEABLE_CONFIG_KEYS_IN_TASK, and neither gcp.project_id nor workspaces is one.
    "--project": {"skypilot": "SkyPilot creates the TPU in the GCP project of its API server: the active "
                              "workspace's gcp.project_id in the API server's ~/.sky/config.yaml, else the project "
                              "of the server's Google credentials (GOOGLE_CLOUD_PROJECT or gcloud's core/project); "
                              "a task cannot name a project. Drop --project and, on the API server's host, run "
                              "`gcloud config set project PROJECT` (or give its workspace gcp.project_id: "
                              "https://docs.skypilot.co/en/latest/admin/workspaces.html), then `sky check gcp`"},
}


@dataclasses.dataclass(frozen=True)
class Options:
    """The flags that only some engines take (FLAG_TARGETS says which)."""

    queue: str | None = None  # gke: the Kueue LocalQueue
    namespace: str = "default"  # gke
    cluster: str | None = None  # gke --format xpk: the xpk cluster
    output_format: str = "manifest"  # gke: manifest | xpk
    # --max-restarts as given (None: not given). The Submission's own count defaults to 0 without --spot,
    # which is the TPU VM's rule; GKE restarts a preempted or timed-out job either way (gke.max_restarts).
    max_restarts: int | None = None


def check_options(on: str, given: dict[str, bool], options: Options, project: str | None = None) -> None:
    """A flag the chosen target would not use is an error, never silently dropped. `project`: --project's value,
    named in the advice where one is given."""
    if on not in TARGETS:
        raise SpecError(f"--on {on!r}: choose one of {', '.join(TARGETS)}")
    problems = []
    for flag, used in given.items():
        if used and on not in FLAG_TARGETS[flag]:
            why = _WHY.get(flag, {}).get(on)
            if why and project:
                why = why.replace("set project PROJECT", f"set project {project}")
            problems.append(f"{flag} does not apply to --on {on}" + (
                f": {why}" + ("" if f"Drop {flag}" in why else f"; drop {flag}") if why else
                f" (only to --on {' or '.join(FLAG_TARGETS[flag])}): drop {flag}"))
    if options.output_format not in ("manifest", "xpk"):
        problems.append(f"--format {options.output_format!r}: choose manifest or xpk")
    if problems:
        raise SpecError(f"cannot submit --on {on}:\n  " + "\n  ".join(problems))


def command(sub: Submission) -> str:
    """COMMAND with the job's time limits on its `runner run` line, as the TPU VM's startup script adds them."""
    limits = limit_overrides(sub.max_run_s, sub.stall_timeout_s)
    return " ".join([COMMAND, *(f"--set {shlex.quote(limit)}" for limit in limits)])


def deadline_s(sub: Submission) -> int | None:
    """The engine's own deadline: the wall-clock limit plus the grace the job has to save and exit by itself
    (None: no limit)."""
    return None if sub.max_run_s is None else sub.max_run_s + LIMIT_GRACE_S


def container_env(sub: Submission) -> dict[str, str]:
    """The environment of the job's container: the spec, the TPU as this host's own, and the code sent with
    the job (RUNNER_CODE, which `runner run` reads: runner/cloud/codefetch.py)."""
    return {
        "TPU_NAME": "local",
        "RUNNER_SPEC_B64": base64.b64encode(spec_yaml(sub.spec).encode()).decode(),
        **({"RUNNER_CODE": sub.code_ref} if sub.code_ref else {}),
    }


class _Dumper(yaml.SafeDumper):
    """Scripts as `|` literals, lists of numbers or short words on one line, no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


def _list(dumper: yaml.SafeDumper, value: list) -> yaml.Node:
    short = all(isinstance(v, (int, float)) or (isinstance(v, str) and len(v) < 24) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=short)


_Dumper.add_representer(str, _text)
_Dumper.add_representer(list, _list)


def dump_yaml(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def submit(on: str, sub: Submission, options: Options, *, dry_run: bool,
           preflight: Callable[[], None] | None = None) -> tuple[str, dict | None]:
    """What to print (the engine's own document with --dry-run) and, when sent, the engine's answer.

    `preflight` runs once the engine's document is made (every check without a call has passed) and before
    anything is sent; it raises to stop the submission."""
    if not dry_run:
        check_verified(sub)  # SkyPilot's TPU VM runtime
    check = preflight or (lambda: None)
    if on == "skypilot":
        from runner.cloud.engines import skypilot

        task = skypilot.task(sub, dry_run=dry_run)
        check()
        return (skypilot.task_yaml(task), None) if dry_run else ("", skypilot.launch(sub, task))
    if on == "gke":
        from runner.cloud.engines import gke

        if options.output_format == "xpk":
            text = gke.xpk_command(sub, options) + "\n"
            check()
            return text, None
        manifest = gke.jobset(sub, options)
        check()
        return (gke.manifest_yaml(manifest), None) if dry_run else ("", gke.apply(sub, manifest))
    if on == "vertex":
        from runner.cloud.engines import vertex

        text = vertex.request_text(sub)
        check()
        return (text, None) if dry_run else ("", vertex.create(sub))
    raise SpecError(f"--on {on!r}: choose one of {', '.join(TARGETS)}")
