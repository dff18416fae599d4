"""`runner submit` end to end: the checks (runner/cloud/submit.py), what the slice costs, then the request, a
TPU VM's queued resource and its RUN_DIR/job.json, or the job handed to an engine (runner/cloud/engines).

The command only gathers the flags: the TPU VM's into `TpuVmOptions`, GKE's into `engines.Options`; a flag the
chosen target does not use is refused (exit 2), never dropped. Before anything is sent (and in a dry run) the
TPU VM path says the TPU VM's software version and its source, what the slice costs per hour, its time limits,
whether a --runtime-version no source names is unverified, and, when the bucket holds a previous run of the job,
what its remaining epochs should cost. Every other target says the price too (TPU7x: that it has none). Every
target says what of the user's code it sends (runner/cloud/codepack.py), and a real submission uploads that
archive after every check, just before the job is sent (runner/cloud/codefetch.py). Every target says the batch
per chip and, on a slice of several hosts, data.train's shards per host (runner/cloud/advice.py).

`preflight` (handed in by the command line: the cloud checks of `runner doctor --cloud`, which this package
does not import) runs after every check that needs no call and before the first call that could create
anything; it raises to stop the submission.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner import RunnerError, SpecError
from runner.cloud import (
    advice,
    codefetch,
    codepack,
    engines,
    gcloud_config,
    jobs,
    pricing,
    record,
    request,
    submit,
    tpu_api,
    tpu_types,
)
from runner.cloud.durations import billed_phases
from runner.data import storage
from runner.rundir.recorded import Recorded


@dataclasses.dataclass(frozen=True)
class TpuVmOptions:
    """The TPU VM's flags (None: not given); engines.FLAG_TARGETS says which other targets take each."""

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
    internal_ips: bool = False

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

    def options(self, max_restarts: int | None = None) -> engines.Options:
        """`max_restarts`: --max-restarts as given (None: not given), so an explicit 0 stays 0 on GKE."""
        return engines.Options(queue=self.queue, namespace=self.namespace or "default", cluster=self.cluster,
                               output_format=self.output_format or "manifest", max_restarts=max_restarts)


@dataclasses.dataclass
class Launched:
    text: str = ""  # printed as it is: a dry run's script or engine document
    doc: dict[str, Any] | None = None  # printed as one JSON line
    job: dict[str, Any] | None = None  # the job record, for --watch


def _check_target(on: str, vm: TpuVmOptions, engine: EngineFlags, project_given: bool,
                  project: str | None = None) -> None:
    engines.check_options(on, {**vm.given(), **engine.given(), "--project": project_given}, engine.options(),
                          project=project)


def bound_line(sub: submit.Submission, usd_per_chip_hour: float | None, watched: bool = False) -> str:
    """The most a TPU VM job can bill: every bounded phase of its startup script at its longest, each named
    (durations.billed_phases), or why there is no bound; with --max-restarts, every attempt a watcher may make
    (`watched`: --watch; else nothing restarts it unless `runner watch` is started later)."""
    join = getattr(sub.spec.accelerator, "join_timeout_s", None)
    phases = billed_phases(sub.max_run_s, sub.tpu.hosts, join)
    if sub.max_run_s is None:
        return ("at most: no bound: the job has no wall-clock limit (--max-run-duration none); before it the slice "
                "bills through " + ", ".join(f"{name} {_span(s)}" for name, s, _ in phases))
    total = sum(seconds for _, seconds, _ in phases)
    usd = None if usd_per_chip_hour is None else sub.tpu.chips * usd_per_chip_hour * total / 3600
    cost = "" if usd is None else f"${usd:.2f} of TPU time, "
    each = (f"{cost}{_span(total)} from the VM's start to its delete, each bounded phase at its longest: "
            + " + ".join(f"{name} {_span(s)} ({how})" for name, s, how in phases)
            + "; the queue before the VM bills nothing, the API's own time to delete the VM is not counted")
    restarts = sub.max_restarts
    if not restarts:
        return f"at most: {each}"
    attempts = restarts + 1
    in_all = (f"{'' if usd is None else f'${attempts * usd:.2f} of TPU time, '}{_span(attempts * total)}")
    if watched:
        return (f"at most: {in_all} in all: {attempts} attempts (--watch restarts a preempted job up to "
                f"--max-restarts {restarts} times, each on a new slice with its own --max-run-duration), each at most "
                + each)
    return (f"at most: {each}. This is one attempt: without --watch nothing restarts the job after a preemption; "
            f"`runner watch {sub.name}` started later restarts it up to --max-restarts {restarts} times, each attempt "
            f"as much again: {in_all} in all for {attempts} attempts")


def _span(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def price_lines(sub: submit.Submission, previous: dict[str, Any] | None = None, bound: bool = True,
                watched: bool = False) -> list[str]:
    """What the slice costs per hour (chips x the list price, with its source and date), its limits and (`bound`:
    a TPU VM's) the most it can bill (`watched`: --watch restarts it), and, given a previous run's summary, what
    the remaining epochs should cost."""
    price = pricing.price_per_chip_hour(sub.tpu.name, sub.zone, sub.spot)
    kind = "Spot" if sub.spot else "on demand"
    if price.usd is None:
        lines = [f"price: {sub.tpu.name}: {price.note}"]
    else:
        lines = [
            f"price: {sub.tpu.name} = {sub.tpu.chips} chips x ${price.usd:g} per chip-hour {kind} in "
            f"{price.region} = ${sub.tpu.chips * price.usd:.2f} per hour (source: {price.source}; read "
            f"{price.date}){'; ' + price.note if price.note else ''}"
        ]
    limit = "no wall-clock limit" if sub.max_run_s is None else f"stops after {_hours(sub.max_run_s)}"
    lines.append(
        f"limit: {limit}; stall timeout: " + ("none" if sub.stall_timeout_s is None else _hours(sub.stall_timeout_s))
    )
    if bound:
        lines.append(bound_line(sub, price.usd, watched))
        if sub.spot and not sub.max_restarts:
            lines.append("restarts: none (--max-restarts 0): a preemption ends the job with its checkpoint saved, "
                         "and nothing creates it again; `runner submit` the same spec again to resume")
    estimate = remaining_estimate(sub, previous, price.usd)
    if estimate:
        lines.append(estimate)
    return lines


def workers_line(sub: submit.Submission, on: str) -> str | None:
    """What starts the job on a multi-host slice's hosts (one process each; process 0 writes the run folder);
    None for one host."""
    hosts = sub.tpu.hosts
    if hosts == 1:
        return None
    each = {
        "tpu-vm": f"the startup script runs the container on each of the {hosts} TPU VMs (workers 0-{hosts - 1})",
        "skypilot": f"SkyPilot runs the task on each of the slice's {hosts} hosts (one node, num_nodes: 1)",
        "gke": f"the JobSet runs {hosts} pods, one per host (parallelism = completions = {hosts})",
    }[on]
    line = (f"workers: {hosts} hosts of {sub.tpu.chips // hosts} chips: {each}, one JAX process per host, which "
            "finds the slice itself (jax.distributed.initialize); process 0 writes the run folder, every host its "
            "own log")
    if on == "tpu-vm":
        line += "; worker 0 deletes the slice when its job ends, another worker if worker 0 is lost"
    return line


def runtime_line(sub: submit.Submission) -> str:
    """The TPU VM's software version and where it comes from (a --runtime-version: as given)."""
    named, source = tpu_types.runtime_of(sub.tpu)
    if sub.runtime_version == named:
        return f"runtime: {named}, the TPU VM software Google names for JAX on {sub.tpu.generation} (source: {source})"
    return f"runtime: {sub.runtime_version} (--runtime-version)"


def unverified_line(sub: submit.Submission, dry_run: bool) -> str | None:
    """What `submit` prints about a runtime version no source names: always, a dry run included (which shows the
    request and says that the real submission needs --allow-unverified)."""
    if not sub.unverified:
        return None
    if sub.allow_unverified:
        return f"unverified: {sub.unverified}; allowed by --allow-unverified"
    if dry_run:
        return f"unverified: {sub.unverified}; without --dry-run, submit refuses it unless --allow-unverified"
    return None  # check_verified refuses it, in the same words

def permissions_line(sub: submit.Submission, checked: bool, dry_run: bool) -> str:
    """What the TPU VM's service account needs (it deletes its own slice) and whether the preflight checks it."""
    account = sub.service_account or "the project's Compute Engine default service account"
    member = sub.service_account or "PROJECT_NUMBER-compute@developer.gserviceaccount.com"
    when = ("the preflight checks the project's IAM policy for it before anything is created" if checked else
            "not checked now (a dry run reads nothing remote; --preflight checks it)" if dry_run else
            "not checked (--no-preflight)")
    return (f"permissions: the TPU VMs run as {account}, which deletes the slice when the job ends: it needs "
            f"roles/tpu.admin (or Editor, Owner) in {sub.project}; {when}; `gcloud projects add-iam-policy-binding "
            f"{sub.project} --member=serviceAccount:{member} --role=roles/tpu.admin` grants it")


def code_lines(sub: submit.Submission, dry_run: bool) -> list[str]:
    """What is sent of the user's code (files, sizes, the archive's name) and what is left out, and why."""
    lines = codepack.describe(sub.code)
    if sub.spec.kind == "train" and sub.spec.code.requirements:
        from runner.spec import requirements

        lines.append(requirements.describe(sub.spec.code.requirements, container=True))
    if dry_run and sub.code_ref:
        lines.append("code: --dry-run uploads nothing; `runner submit` without it uploads the archive (once per "
                     "content) just before the job is sent")
    return lines


def send_code(sub: submit.Submission, say: Callable[[str], None]) -> None:
    """Uploads the code archive beside the run folder, unless the same bytes are there already."""
    if sub.code is not None and sub.code_ref:
        say(codefetch.upload(sub.code, sub.spec.storage.timeout_s))


def _hours(seconds: int) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds} s"


def remaining_estimate(sub: submit.Submission, previous: dict[str, Any] | None,
                       usd_per_chip_hour: float | None) -> str | None:
    """The cost of the epochs a previous run of the job left (its summary.json: steps reached and its steady
    epoch time), or None when there is no such run or it says nothing about time."""
    if not previous or sub.spec.kind != "train":
        return None
    said = Recorded.of(previous) or Recorded()
    timing, accelerator = said.times, said.accelerator
    per_epoch = timing.steady_epoch_s or timing.first_epoch_s  # steady: compilation kept out
    steps = said.steps_per_epoch
    # final_step, not train_epochs: train_epochs is what the run was asked for, the step is how far it got
    done = (said.final_step or 0) // steps if steps else None
    if not per_epoch or done is None:
        return None
    left = max(sub.spec.train.epochs - done, 0)
    where = accelerator.detail or accelerator.kind or "unknown hardware"
    text = (
        f"previous run: {done} of {sub.spec.train.epochs} epochs done ({said.status}); "
        f"{left} left x {per_epoch:g} s per epoch as measured on {where}"
    )
    if left == 0:
        return text + ": nothing left to train"
    if usd_per_chip_hour is None:
        return text + "; no price, no estimate"
    hours = left * per_epoch / 3600
    return (
        text + f" = {hours:.2f} h, about ${sub.tpu.chips * usd_per_chip_hour * hours:.2f} (excluding queueing, "
        "boot, image pull and compilation; an epoch timed on other hardware says little about this one)"
    )


def _previous_run(sub: submit.Submission, say: Callable[[str], None], remote: bool = True) -> dict[str, Any] | None:
    """The previous run's summary.json, for the estimate of its remaining epochs; `remote` False (a dry run
    without --preflight): not read, and said so, since a read of a bucket also asks for credentials (the metadata
    server, a token endpoint)."""
    if not remote and storage.is_gcs(sub.spec.run_dir):
        say(f"previous run: not read (a dry run reads nothing remote; with --preflight it reads "
            f"{record.join(sub.spec.run_dir, 'summary.json')} to estimate the remaining epochs)")
        return None
    try:
        return record.summary(sub.spec.run_dir, patient=False)  # a price should not wait minutes for it
    except RunnerError as error:
        say(f"previous run: not read ({error}); no estimate of the remaining epochs")
        return None


def _refuse(problems: list[str]) -> None:
    if problems:
        raise SpecError("cannot submit:\n  " + "\n  ".join(problems))


Preflight = Callable[[submit.Submission, str], None]  # (the submission, --on): raises RunnerError to stop it


def launch(spec: Path, overrides: list[str], *, tpu_type: str, zone: str | None, image: str | None,
           project: str | None, spot: bool, name: str | None, on: str, dry_run: bool, submission_id: str | None,
           vm: TpuVmOptions, engine: EngineFlags, say: Callable[[str], None], project_given: bool = False,
           preflight: Preflight | None = None) -> Launched:
    """Checks everything, says the price, runs `preflight` (None: no cloud checks), sends (or, with dry_run,
    prints) the request. `project_given`: --project was typed (not read from the environment). Raises
    RunnerError."""
    _check_target(on, vm, engine, project_given, project)
    sub = submit.prepare_submission(
        spec, overrides, tpu_type=tpu_type, zone=zone or gcloud_config.default_zone(), image=image,
        project=project or gcloud_config.default_project(), spot=spot, keep=vm.keep,
        need_project=on != "skypilot",  # SkyPilot's API server picks the project (engines.FLAG_TARGETS)
        creates_vm=on in ("tpu-vm", "skypilot"),  # GKE and Vertex AI choose the host's software
        runtime_version=vm.runtime_version, name=name, max_restarts=vm.max_restarts, network=vm.network,
        subnetwork=vm.subnetwork, service_account=vm.service_account, internal_ips=vm.internal_ips,
        reservation=vm.reservation,
        valid_until=vm.valid_until, submission_id=submission_id, max_run_duration=vm.max_run_duration,
        stall_timeout=vm.stall_timeout, allow_unverified=vm.allow_unverified,
    )
    check = None if preflight is None else (lambda: preflight(sub, on))
    unverified = unverified_line(sub, dry_run)
    code = code_lines(sub, dry_run)
    # The batch per chip and (a multi-host slice) data.train's shards per host, read where submit reads remote files.
    shards, refused = advice.shard_advice(sub.spec, sub.tpu, remote=not dry_run or check is not None)
    batch = advice.batch_line(sub.spec, sub.tpu)
    data = [*([batch] if batch else []), *shards]
    if on != "tpu-vm":
        vm_runtime = [runtime_line(sub)] if on == "skypilot" else []  # SkyPilot creates a TPU VM with it
        workers = workers_line(sub, on) if on != "vertex" else None  # Vertex AI refuses a multi-host slice
        for line in [*vm_runtime, *price_lines(sub, bound=False)[:1], *([workers] if workers else []), *data,
                     *([unverified] if unverified else []), *code]:
            say(line)
        _refuse(refused)

        def before_sending() -> None:  # every check has passed: the code goes up just before the job does
            if check is not None:
                check()
            if not dry_run:
                send_code(sub, say)

        text, sent = engines.submit(on, sub, engine.options(vm.max_restarts), dry_run=dry_run,
                                    preflight=before_sending)
        return Launched(text=text if sent is None else "", doc=sent)
    workers = workers_line(sub, on)
    previous = _previous_run(sub, say, remote=not dry_run or check is not None)
    for line in [runtime_line(sub), *price_lines(sub, previous, watched=vm.watch), *([workers] if workers else []),
                 *data, permissions_line(sub, check is not None, dry_run), *([unverified] if unverified else []),
                 *code]:
        say(line)
    _refuse(refused)
    if not dry_run:
        submit.check_verified(sub)
    if check is not None:
        check()
    if dry_run:
        return Launched(text=request.gcloud_script(sub))
    jobs.refuse_a_second_job(sub)
    send_code(sub, say)
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
