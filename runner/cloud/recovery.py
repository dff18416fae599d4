"""Recovery: a watcher that keeps a submitted job going through preemptions, until it is complete.

    runner submit SPEC ... --watch        submit, then watch in the foreground
    runner watch NAME                     watch (again): picks up the job where it is, never a second copy

Each poll (every --interval seconds) the watcher reads the queued resource and its node from the Cloud
TPU API, and the current submission's exit record, the job's summary and newest checkpoint from the run
folder, then does what `decide` says. A multi-host slice is one queued resource and one job: its exit record
is worker 0's, or, once the slice is DELETING or gone (worker 0 lost, another worker deleted it), any
worker's; a restart deletes and creates the whole slice again.

    what it sees                                                  what it does
    ACCEPTED / WAITING_FOR_RESOURCES / PROVISIONING / CREATING    waits (the request is queued)
    ACTIVE, node READY, no exit record                            waits (the job runs); shows the step
    exit 0                                                        done: the summary is complete
    exit 75 (preempted) or 3 (infrastructure: TPU, storage, pull) restarts
    exit 124 (--max-run-duration or --stall-timeout reached)      stops: outcome time_limit or stalled
    exit 1 (training failed), 2 (bad spec or data), any other     stops: running again would fail again
    SUSPENDING, or node PREEMPTED / TERMINATED                    waits up to 90 s: the job saves on the notice
    SUSPENDED, or still SUSPENDING / PREEMPTED after 90 s         restarts (Spot preemption, maintenance)
    FAILED (e.g. the valid-until bound passed before capacity)    restarts
    gone, after `runner cancel`                                   stops (exit 130)
    gone, without an exit record                                  stops (exit 3): deleted outside runner

A restart deletes the queued resource (force: its node too), waits until the API no longer has it, and
creates it again under the same name with a new submission id; the job resumes from its newest
checkpoint. Spot capacity is never re-queued by Google: a preempted queued resource stays SUSPENDED, holding
quota, until deleted. After --max-restarts restarts the watcher stops (exit 75, saying so) and deletes a
SUSPENDED or FAILED queued resource rather than leave it behind.

Every restart is recorded in RUN_DIR/job.json before anything is deleted (time, cause, the submission it
replaces, step reached), completed once the new queued resource exists (its submission id), and given
its time lost once the new job starts. A watcher that is killed and started again reads that record: a
restart in progress is finished, never begun twice, and a queued resource that already exists under the
job's name is adopted (the name is the lock: the API refuses a second one).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable
from typing import Any

from runner import EXIT_TIME_LIMIT, AcceleratorError, RunnerError, SpecError, StorageError
from runner.cloud import durations, jobs, record, tpu_api, tpu_types, usage

# Exit codes a new VM can fix: preempted, and infrastructure (a TPU, a pull, storage that did not answer).
RETRYABLE = {75: "the job was preempted (exit 75)", 3: "an infrastructure failure (exit 3)"}
WAITING = {"CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES", "DELETING", "STATE_UNSPECIFIED"}
LOST_NODE = {"PREEMPTED", "TERMINATED"}
EXIT_CANCELLED, EXIT_GONE, EXIT_GAVE_UP = 130, 3, 75
# EXIT_TIME_LIMIT (124): the job stopped at its wall-clock limit or its stall guard, or the startup script
# killed it at the limit: a limit is the user's decision, never a reason to start another VM.
# A Spot VM gets 30 s between the preemption notice and its end (Compute Engine's preemption process), which
# the job spends saving a checkpoint; deleting the slice meanwhile would cut that save short. The watcher
# waits for SUSPENDED, or an exit record, or this long.
PREEMPTION_GRACE_S = 90.0
# Polls in a row that may fail (the API or the bucket not answering) before the watcher gives up (exit 3).
MAX_FAILURES = 20


@dataclasses.dataclass
class Seen:
    """One poll's view of the job."""

    state: str | None  # the queued resource's state; None: the API has no such queued resource
    initiator: str | None = None
    node_state: str | None = None
    node_health: str | None = None
    submission: str | None = None  # the runner-submission label of the queued resource found
    created_at: str | None = None
    node_created_at: str | None = None
    failure: str | None = None
    exit: dict[str, Any] | None = None
    cancelled: bool = False
    started: dict[str, Any] | None = None
    preempting_for_s: float = 0.0  # how long the watcher has seen this preemption under way


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # wait | done | stop | restart
    reason: str
    exit_code: int = 0


def decide(seen: Seen) -> Decision:
    """What to do about what one poll saw (the table in the module docstring)."""
    if seen.cancelled:
        return Decision("stop", "the job was cancelled (runner cancel)", EXIT_CANCELLED)
    if seen.exit is not None:
        code = int(seen.exit.get("exit_code", 1))
        said = seen.exit.get("reason") or f"exit {code}"
        if code == 0:
            return Decision("done", said)
        if code in RETRYABLE:
            return Decision("restart", f"{RETRYABLE[code]}: {said}", code)
        if code == EXIT_TIME_LIMIT:
            return Decision("stop", f"{said}: the job reached its --max-run-duration or --stall-timeout; not restarted",
                            code)
        return Decision("stop", f"{said}: exit {code} is not retryable (1: training failed, 2: bad spec or data); "
                                "a new VM would fail the same way", code)
    if seen.state is None:
        return Decision("stop", "the queued resource is gone and the job left no exit record: it was deleted outside "
                                "runner, or its VM was lost before it could write one", EXIT_GONE)
    if seen.state == "FAILED":
        return Decision(
            "restart", f"the queued resource FAILED{': ' + seen.failure if seen.failure else ''}", EXIT_GONE
        )
    if seen.state in ("SUSPENDING", "SUSPENDED") or (seen.state == "ACTIVE" and seen.node_state in LOST_NODE):
        what = f"the queued resource is {seen.state}" + (f" (initiated by {seen.initiator})" if seen.initiator else "")
        if seen.state == "ACTIVE":
            what = f"the node is {seen.node_state}"
        if seen.state != "SUSPENDED" and seen.preempting_for_s < PREEMPTION_GRACE_S:
            return Decision("wait", f"{what}: preempted; waiting for the job to save and stop")
        return Decision("restart", f"{what}: preempted", EXIT_GAVE_UP)
    return Decision("wait", seen.state)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _stamp(when: datetime.datetime | None = None) -> str:
    return (when or _now()).strftime("%Y-%m-%dT%H:%M:%SZ")


class Watcher:
    """Watches one job (its job.json) until it is complete, stops for good, or the restarts are spent."""

    def __init__(
        self,
        job: dict[str, Any],
        client,
        *,
        interval_s: float = 30.0,
        emit: Callable[[str], None] = lambda line: None,
        delete_timeout_s: float = 900.0,
    ):
        self.job, self.client, self.interval_s, self.emit = job, client, interval_s, emit
        self.delete_timeout_s = delete_timeout_s
        self.shown: str | None = None
        self.preempting_since: tuple[str, float] | None = None  # (submission, monotonic time first seen)

    # --- the job record ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.job["name"]

    @property
    def current(self) -> dict[str, Any]:
        return self.job["submissions"][-1]

    def save(self) -> None:
        record.save_job(self.job)

    def restarts_used(self) -> int:
        return sum(1 for r in self.job.get("restarts", []) if r.get("to"))

    # --- observing --------------------------------------------------------------------------------

    def observe(self) -> Seen:
        run_dir, sub = self.job["run_dir"], self.current["id"]
        resource = tpu_api.get_queued_resource(self.name, self.job["project"], self.job["zone"], self.client)
        seen = Seen(state=None)
        if resource is not None:
            seen = Seen(**tpu_api.describe(resource, self.client))
        seen.cancelled = record.read_text(record.cancelled_path(run_dir, sub)) is not None
        # A slice is one resource: its job's end is worker 0's record, or, once the slice is going, any worker's.
        hosts = tpu_types.parse_tpu_type(self.job["request"]["tpu_type"]).hosts
        seen.exit = record.slice_exit_record(run_dir, sub, hosts, settled=seen.state in (None, "DELETING"))
        seen.started = record.started_record(run_dir, sub, 0)
        preempting = seen.state == "SUSPENDING" or (seen.state == "ACTIVE" and seen.node_state in LOST_NODE)
        if not preempting:
            self.preempting_since = None
        elif self.preempting_since is None or self.preempting_since[0] != sub:
            self.preempting_since = (sub, time.monotonic())
        if self.preempting_since:
            seen.preempting_for_s = time.monotonic() - self.preempting_since[1]
        return seen

    def note(self, seen: Seen) -> None:
        """Keeps the API's timestamps of the current submission (the cost is computed from them)."""
        changed = False
        window = self.current
        if seen.submission in (None, window["id"]):
            for key in ("created_at", "node_created_at"):
                value = getattr(seen, key)
                if value and window.get(key) != value:
                    window[key] = value
                    changed = True
        if seen.state is None and not window.get("gone_at") and not window.get("deleted_at"):
            window["deleted_at"] = tpu_api.deletion_time(
                self.name, self.job["project"], self.job["zone"], self.client, after=window.get("created_at")
            )
            window["gone_at"] = _stamp()
            changed = True
        pending = next(
            (r for r in self.job.get("restarts", []) if r.get("to") == window["id"] and r.get("time_lost_s") is None),
            None,
        )
        if pending and seen.started:
            resumed = record.parse_time(seen.started.get("started_at"))
            lost_from = record.parse_time(pending.get("interrupted_at") or pending.get("at"))
            if resumed and lost_from:
                pending["time_lost_s"] = round(max((resumed - lost_from).total_seconds(), 0.0), 1)
                pending["resumed_at"] = seen.started.get("started_at")
                changed = True
        if changed:
            self.save()

    def show(self, seen: Seen) -> None:
        parts = [seen.state or "gone"]
        if seen.node_state:
            parts.append(f"node {seen.node_state}{' ' + seen.node_health if seen.node_health else ''}")
        if seen.started and seen.exit is None:
            step = record.checkpoint_step(self.job["run_dir"])
            parts.append("job running" + (f", checkpoint at step {step}" if step is not None else ""))
        line = ", ".join(parts)
        if line != self.shown:
            self.emit(f"{self.name} [{self.current['id']}]: {line}")
            self.shown = line

    # --- acting -----------------------------------------------------------------------------------

    def delete_and_wait(self, why: str) -> None:
        """Deletes the queued resource (force) and waits until the API no longer has it."""
        project, zone = self.job["project"], self.job["zone"]
        if tpu_api.get_queued_resource(self.name, project, zone, self.client) is not None:
            self.emit(f"{self.name}: deleting the queued resource ({why})")
            try:
                done = tpu_api.cancel(self.name, project, zone, self.client)
                if done.get("deleted_at") and not self.current.get("deleted_at"):
                    self.current["deleted_at"] = done["deleted_at"]
            except SpecError:  # gone in the meantime
                pass
        deadline = time.monotonic() + self.delete_timeout_s
        while tpu_api.get_queued_resource(self.name, project, zone, self.client) is not None:
            if time.monotonic() > deadline:
                raise tpu_api.TpuApiError(
                    f"queued resource {self.name!r} was still there {self.delete_timeout_s:.0f} s after "
                    f"its delete: see `runner status {self.name}`, then `runner watch {self.name}` again"
                )
            time.sleep(min(self.interval_s, 5.0))
        self.current.setdefault("gone_at", _stamp())
        self.save()

    def create_next(self, restart: dict[str, Any]) -> None:
        """Creates the queued resource again under a new submission id; adopts one a crashed watcher made."""
        project, zone = self.job["project"], self.job["zone"]
        existing = tpu_api.get_queued_resource(self.name, project, zone, self.client)
        if existing is not None:
            label = tpu_api.describe(existing, self.client)["submission"]
            if label == restart["from"]:
                self.delete_and_wait(restart["cause"])
            else:
                self.adopt(restart, label)
                return
        sub = jobs.submission_from_job(self.job, record.new_submission_id())
        try:
            created = tpu_api.create(sub, self.client)
        except SpecError:  # ALREADY_EXISTS: another watcher got there first; follow its queued resource
            existing = tpu_api.get_queued_resource(self.name, project, zone, self.client)
            if existing is None:
                raise
            self.adopt(restart, tpu_api.describe(existing, self.client)["submission"])
            return
        self.job["submissions"].append(
            {"id": sub.submission_id, "requested_at": _stamp(), "operation": created["operation"]}
        )
        restart["to"] = sub.submission_id
        self.save()
        self.emit(
            f"{self.name}: created again as submission {sub.submission_id} "
            f"(restart {self.restarts_used()} of {self.job['max_restarts']})"
        )

    def adopt(self, restart: dict[str, Any], label: str | None) -> None:
        label = label or record.new_submission_id()
        if self.current["id"] != label:
            self.job["submissions"].append({"id": label, "requested_at": _stamp(), "adopted": True})
        restart["to"] = label
        self.save()
        self.emit(f"{self.name}: the queued resource already exists (submission {label}); following it")

    def restart(self, decision: Decision, seen: Seen) -> None:
        restart = {
            "at": _stamp(),
            "cause": decision.reason,
            "from": self.current["id"],
            "to": None,
            "interrupted_at": (seen.exit or {}).get("finished_at") or _stamp(),
            "step_reached": record.checkpoint_step(self.job["run_dir"]),
            "time_lost_s": None,
        }
        self.job.setdefault("restarts", []).append(restart)
        self.save()  # first the record, then the delete: a watcher started again finishes this restart
        self.emit(f"{self.name}: restarting: {decision.reason}; newest checkpoint at step {restart['step_reached']}")
        self.delete_and_wait(decision.reason)
        self.create_next(restart)

    def finish_pending_restart(self) -> None:
        pending = next((r for r in self.job.get("restarts", []) if not r.get("to")), None)
        if pending is not None:
            self.emit(f"{self.name}: finishing the restart begun at {pending['at']} ({pending['cause']})")
            self.delete_and_wait(pending["cause"])
            self.create_next(pending)

    def clean_up(self, seen: Seen) -> None:
        """After the last word: never leave a queued resource that holds quota and runs nothing."""
        if seen.state is None:
            return
        holding = seen.state in ("SUSPENDING", "SUSPENDED", "FAILED") or seen.node_state in LOST_NODE
        if holding or not self.job["request"].get("keep"):
            self.delete_and_wait("the job is over")
        else:
            self.emit(f"{self.name}: keeping the queued resource (--keep): it bills until `runner cancel {self.name}`")

    def result(self, outcome: str, decision: Decision) -> dict[str, Any]:
        self.job["outcome"] = {
            "outcome": outcome,
            "exit_code": decision.exit_code,
            "reason": decision.reason,
            "at": _stamp(),
        }
        self.save()
        return final_summary(self.job)

    def run(self) -> dict[str, Any]:
        """Polls until the job is over; returns the final summary. An API or bucket that does not answer is
        tried again (MAX_FAILURES polls in a row), since a watcher lives as long as its job."""
        if self.job.get("outcome"):
            self.emit(f"{self.name}: already over ({self.job['outcome']['outcome']}: {self.job['outcome']['reason']})")
            return final_summary(self.job)
        failures = 0
        while True:
            try:
                ended = self.poll()
            except (AcceleratorError, StorageError) as error:
                failures += 1
                if failures >= MAX_FAILURES:
                    raise
                self.emit(f"{self.name}: {error} ({failures} of {MAX_FAILURES} failures in a row; trying again)")
                time.sleep(self.interval_s)
                continue
            failures = 0
            if ended is not None:
                return ended

    def poll(self) -> dict[str, Any] | None:
        """One look at the job and what follows from it; the final summary once the job is over, else None."""
        self.finish_pending_restart()
        seen = self.observe()
        self.adopt_newer(seen)
        self.note(seen)
        self.show(seen)
        decision = decide(seen)
        if decision.action == "done":
            self.clean_up(seen)
            return self.result("complete", decision)
        if decision.action == "stop":
            self.clean_up(seen)
            outcome = {EXIT_CANCELLED: "cancelled", EXIT_GONE: "lost", EXIT_TIME_LIMIT: "time_limit"}.get(
                decision.exit_code, "failed"
            )
            if decision.exit_code == EXIT_TIME_LIMIT and record.stall_mark(self.job["run_dir"]) is not None:
                outcome = "stalled"  # the guard's mark: a stalled job writes no summary
            self.emit(f"{self.name}: stopped: {decision.reason}")
            return self.result(outcome, decision)
        if decision.action == "restart":
            used, allowed = self.restarts_used(), int(self.job["max_restarts"])
            expired = durations.valid_until_passed(self.job["request"])
            if used >= allowed or expired:
                why = (
                    f"the valid-until bound ({self.job['request'].get('valid_until')}) has passed"
                    if expired
                    else f"{used} of {allowed} restarts spent (--max-restarts {allowed})"
                )
                self.clean_up(seen)
                gave_up = Decision("stop", f"{decision.reason}; not restarting: {why}", decision.exit_code)
                self.emit(f"{self.name}: gave up: {gave_up.reason}")
                return self.result("gave_up", gave_up)
            self.restart(decision, seen)
            self.shown = None
            return None
        time.sleep(self.interval_s)
        return None

    def adopt_newer(self, seen: Seen) -> None:
        """A queued resource of this name made by another submission (another watcher, a new `runner submit`)
        is the job's current one from now on."""
        known = {w["id"] for w in self.job.get("submissions", [])}
        if seen.state is not None and seen.submission and seen.submission not in known:
            self.job["submissions"].append({"id": seen.submission, "requested_at": _stamp(), "adopted": True})
            self.save()
            self.emit(f"{self.name}: following submission {seen.submission}, made elsewhere")


def final_summary(job: dict[str, Any]) -> dict[str, Any]:
    """The job's summary.json with what the watcher adds: how it ended, its restarts, and its cost."""
    try:
        found = record.summary(job["run_dir"]) or {}
    except RunnerError:
        found = {}
    doc = dict(found)
    doc.update(
        {
            "name": job["name"],
            "outcome": job.get("outcome"),
            "restarts": job.get("restarts", []),
            "submissions": [w["id"] for w in job.get("submissions", [])],
            "cost": usage.job_cost(job),
        }
    )
    return doc
