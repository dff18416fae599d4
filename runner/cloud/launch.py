"""`runner submit` end to end: the checks (runner/cloud/submit.py), what the slice costs, then the request, a
TPU VM's queued resource and its RUN_DIR/job.json, or the job handed to an engine (runner/cloud/engines).

The command only gathers the flags: the TPU VM's into `TpuVmOptions`, GKE's into `engines.Options`; a flag the
chosen target does not use is refused (exit 2), never dropped. Before anything is sent (and in a dry run) the
TPU VM path says what the slice costs per hour, its time limits, whether TensorFlow on that type and runtime is
verified, and, when the bucket holds a previous run of the job, what its remaining epochs should cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner import RunnerError, SpecError
from runner.cloud import engines, gcloud_config, jobs, record, submit, tpu_api


@dataclasses.dataclass(frozen=True)
class TpuVmOptions:
    """The flags only `--on tpu-vm` takes (None: not given)."""

    keep: bool = False
    watch: bool = False
    runtime_version: str | None = None
    max_restarts: int | None = None
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None
    reservation: str | None = None
    valid_until: str | None = None
    max_run_duration: str | None = None
    stall_timeout: str | None = None
    allow_unverified: bool = False

    def given(self) -> dict[str, bool]:
        """Each flag (as typed) and whether it was given."""
        return {f"--{field.name.replace('_', '-')}": getattr(self, field.name) is not None
                and getattr(self, field.name) is not False for field in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class EngineFlags:
    """The flags only GKE takes (None: not given); engines.Options with the defaults filled in."""

    queue: str | None = None
    namespace: str | None = None
    cluster: str | None = None
    output_format: str | None = None

    def given(self) -> dict[str, bool]:
        return {"--queue": self.queue is not None, "--namespace": self.namespace is not None,
                "--cluster": self.cluster is not None, "--format": self.output_format is not None}

    def options(self) -> engines.Options:
        return engines.Options(queue=self.queue, namespace=self.namespace or "default", cluster=self.cluster,
                               output_format=self.output_format or "manifest")


# The TPU VM's flags the engines' table (engines.FLAG_TARGETS) does not list: they mean nothing elsewhere yet.
_TPU_VM_ONLY = ("--max-run-duration", "--stall-timeout", "--allow-unverified")


@dataclasses.dataclass
class Launched:
    text: str = ""  # printed as it is: a dry run's script or engine document
    doc: dict[str, Any] | None = None  # printed as one JSON line
    job: dict[str, Any] | None = None  # the job record, for --watch


def _check_target(on: str, vm: TpuVmOptions, engine: EngineFlags) -> None:
    given = vm.given()
    known = {flag: used for flag, used in given.items() if flag not in _TPU_VM_ONLY}
    engines.check_options(on, {**known, **engine.given()}, engine.options())
    wrong = [flag for flag in _TPU_VM_ONLY if given[flag] and on != "tpu-vm"]
    if wrong:
        raise SpecError(f"cannot submit --on {on}:\n  " + "\n  ".join(f"{flag} does not apply to --on {on} "
                                                                     "(only to --on tpu-vm)" for flag in wrong))


def _previous_run(sub: submit.Submission, say: Callable[[str], None]) -> dict[str, Any] | None:
    try:
        return record.summary(sub.spec.run_dir)
    except RunnerError as error:
        say(f"previous run: not read ({error}); no estimate of the remaining epochs")
        return None


def launch(spec: Path, overrides: list[str], *, tpu_type: str, zone: str | None, image: str | None,
           project: str | None, spot: bool, name: str | None, on: str, dry_run: bool, submission_id: str | None,
           vm: TpuVmOptions, engine: EngineFlags, say: Callable[[str], None]) -> Launched:
    """Checks everything, says the price, sends (or, with dry_run, prints) the request. Raises RunnerError."""
    _check_target(on, vm, engine)
    sub = submit.prepare_submission(
        spec, overrides, tpu_type=tpu_type, zone=zone or gcloud_config.default_zone(), image=image,
        project=project or gcloud_config.default_project(), spot=spot, keep=vm.keep,
        runtime_version=vm.runtime_version, name=name, max_restarts=vm.max_restarts, network=vm.network,
        subnetwork=vm.subnetwork, service_account=vm.service_account, reservation=vm.reservation,
        valid_until=vm.valid_until, submission_id=submission_id, max_run_duration=vm.max_run_duration,
        stall_timeout=vm.stall_timeout, allow_unverified=vm.allow_unverified,
    )
    if on != "tpu-vm":
        text, sent = engines.submit(on, sub, engine.options(), dry_run=dry_run)
        return Launched(text=text if sent is None else "", doc=sent)
    for line in submit.price_lines(sub, _previous_run(sub, say)):
        say(line)
    submit.check_verified(sub)
    if dry_run:
        return Launched(text=submit.gcloud_script(sub))
    jobs.refuse_a_second_job(sub)
    result = tpu_api.create(sub)
    job = jobs.job_record(sub, result["operation"])
    record.remember(sub.name, sub.project, sub.zone, sub.spec.run_dir)
    try:
        record.save_job(job)
    except RunnerError as error:
        say(f"warning: the job record was not written ({error}); `runner watch {sub.name}` rebuilds it "
            "from the queued resource")
    say(f"queued {sub.name} (submission {sub.submission_id}, {sub.tpu.name}{', spot' if spot else ''}) in {sub.zone}; "
        f"logs: runner logs {sub.name} --follow; status: runner status {sub.name}"
        + ("" if vm.watch else f"; restarts after preemption: runner watch {sub.name}"))
    return Launched(doc=result, job=job if vm.watch else None)
