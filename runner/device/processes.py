"""One job as several processes, one per host: joining them (JAX's multi-process runtime) and their word to
each other through its coordination service. The backend seam's multi-host half: the rest of the job sees only
`Processes` (which processes form the job: runner/device/cluster.py).

The join is `jax.distributed.initialize`, which `keras.distribution.initialize` wraps, called directly for the
two bounds Keras's wrapper does not pass: `accelerator.join_timeout_s` for every process to join (a host that
never does ends every process with exit 3, naming the processes that never began to join) and
`accelerator.heartbeat_s`, after which a host that stopped answering ends the others. While it waits, each
process says every 30 s which processes have not begun to join, from the markers each one writes in the run
folder (runner/rundir/joining.py). Right after the join every process's job is compared with process 0's
(`agree`). Keras's wrapper also seeds every process alike; the runner seeds them all with `train.seed` instead.

This module imports JAX only inside `join`, and never TensorFlow.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from runner import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_TIME_LIMIT, AcceleratorError, SpecError
from runner.device.bounded import Bounded
from runner.device.cluster import ADDRESSES, COUNT, INDEX, SINGLE, Processes, asked  # noqa: F401 - the job asks processes.asked()

log = logging.getLogger(__name__)

_joined: Processes = SINGLE
_joining = False  # a join was begun: the process must end by `leave`, not through JAX's exit barrier


# JAX's own initialization_timeout (jax/_src/distributed.py `initialize`): a TPU slice's join never waits less.
JAX_JOIN_S = 300.0


def join_bound(processes: Processes, join_timeout_s: float) -> float:
    """How long the join waits: accelerator.join_timeout_s, raised to JAX's own default on a TPU slice (its
    workers pull the image and check their host each alone). A shorter bound serves processes started by hand."""
    if processes.how == "tpu" and join_timeout_s < JAX_JOIN_S:
        log.warning("accelerator.join_timeout_s (%g s) is shorter than JAX's own join bound on a TPU slice: the "
                    "join waits %g s", join_timeout_s, JAX_JOIN_S)
        return JAX_JOIN_S
    return join_timeout_s


# How often a joining process says who it still waits for: every 30 s, sooner under a short bound (tests).
LOG_EVERY_S = 30.0


def join(processes: Processes, timeout_s: float, heartbeat_s: float, roll: Any = None,
         waiting: Callable[[str], None] | None = None) -> Processes:
    """Joins the job's processes (JAX's distributed runtime) within `timeout_s` (accelerator.join_timeout_s);
    returns them as joined. A process that is missing or late, or a coordinator that cannot start, ends this one
    with AcceleratorError (exit 3). `roll` (runner/rundir/joining.py, or None): the markers in the run folder
    by which the waiting processes name those that have not begun to join. `waiting(line)` is told each line
    said while waiting (train.stall_timeout's guard: a bounded wait for a late host is no stall)."""
    global _joined, _joining
    if not processes.several:
        return SINGLE
    import jax

    _joining = True
    if processes.index == 0:
        _check_port(processes, roll)
    if roll is not None:
        roll.mark()
    # JAX's own deadline, when it passes, aborts the process from a thread of its own (SIGABRT, a stack trace):
    # the runner's bound comes first, so the job ends with its summary and exit 3 instead.
    kwargs = dict(initialization_timeout=int(timeout_s) + 30, heartbeat_timeout_seconds=max(1, int(heartbeat_s)))
    if processes.how == "keras":
        kwargs.update(coordinator_address=processes.coordinator, num_processes=processes.count,
                      process_id=processes.index)
    began = time.monotonic()
    call = Bounded("jax.distributed.initialize", lambda: jax.distributed.initialize(**kwargs))
    try:
        _wait_for_join(call, processes, timeout_s, roll, began, waiting)
    except AcceleratorError:
        if roll is not None:
            roll.clear()
        raise
    except Exception as exc:  # the coordination service's errors: DEADLINE_EXCEEDED, UNAVAILABLE, ...
        if roll is not None:
            roll.clear()
        raise AcceleratorError(_not_joined(processes, exc, timeout_s)) from None
    _joined = Processes(processes.how, jax.process_count(), jax.process_index(), processes.coordinator)
    if roll is not None and _joined.chief:
        roll.clear(everyone=True)  # every process joined: nobody reads the markers again
    log.info("process %d of %d joined the job (%s, coordinator %s) in %.1f s", _joined.index, _joined.count,
             "Keras's variables" if processes.how == "keras" else "the TPU slice",
             processes.coordinator or "found by JAX", time.monotonic() - began)
    return _joined


def _wait_for_join(call: Bounded, processes: Processes, timeout_s: float, roll: Any, began: float,
                   waiting: Callable[[str], None] | None) -> None:
    """Waits for the join, saying every LOG_EVERY_S (a tenth of a shorter bound) which processes have not begun
    to join; a process whose marker says it could not join (its coordinator's port in use) ends this one too."""
    every = min(LOG_EVERY_S, max(0.5, timeout_s / 10))
    while True:
        left = timeout_s - (time.monotonic() - began)
        try:
            call.result(max(0.0, min(every, left)))
            return
        except TimeoutError:
            pass
        waited = time.monotonic() - began
        ready = roll.present() if roll is not None else None
        failed = {i: m for i, m in (ready or {}).items() if m.get("failed")}
        if failed:
            index, marker = min(failed.items())
            raise AcceleratorError(
                f"process {index} could not join the job ({marker.get('host', 'its host')}): {marker['failed']}; "
                f"this is process {processes.index} of {processes.count}"
            )
        if waited >= timeout_s:
            raise TimeoutError(f"still joining after {timeout_s:g} s", _missing(ready, processes.count))
        missing = _missing(ready, processes.count)
        bound = f"after {waited:.0f} s (of at most {timeout_s:g} s, accelerator.join_timeout_s)"
        if missing is None:
            line = f"joining: still waiting {bound}"
        elif missing:
            line = (f"joining: waiting for {_named(missing)} to begin joining ({processes.count - len(missing)} of "
                    f"{processes.count} ready) {bound}")
        else:
            line = (f"joining: every process began to join; still connecting {bound}: check that each host reaches "
                    "the coordinator's port")
        log.info("%s", line)
        if waiting is not None:
            waiting(line)


def _missing(ready: dict[int, dict] | None, count: int) -> list[int] | None:
    """The processes with no marker (None when the markers could not be read)."""
    return None if ready is None else [i for i in range(count) if i not in ready]


def _named(indices: list[int]) -> str:
    return ("process " if len(indices) == 1 else "processes ") + ", ".join(str(i) for i in indices)


def _check_port(processes: Processes, roll: Any) -> None:
    """On process 0: AcceleratorError naming the coordinator's port when another program holds it. JAX's gRPC
    server would fail to add the port and the process die of SIGSEGV with no word of why ("Failed to add port
    to server"); the marker left in the run folder ends the other processes with the same reason."""
    if processes.how == "keras":
        port, where = int(processes.coordinator.rpartition(":")[2]), f"{ADDRESSES} names {processes.coordinator}"
    else:
        from jax._src.clusters import cloud_tpu_cluster

        port, where = int(cloud_tpu_cluster.coordinator_port), "JAX's coordinator port on a TPU slice"
    taken = _port_taken(port)
    if taken is None:
        return
    if taken == errno.EACCES:
        why = (f"the coordinator's port {port} cannot be opened by this user ({where}; ports below 1024 need "
               "root): give every process a port from 1024 up")
    else:
        why = (f"the coordinator's port {port} is in use on this host ({where}): stop the program that holds it "
               f"(`ss -ltnp 'sport = :{port}'` names it) or give every process another port")
    if roll is not None:
        roll.mark(failed=why)
    raise AcceleratorError(f"{why}; this is process 0 of {processes.count}, the coordinator")


def _port_taken(port: int) -> int | None:
    """Why (errno EADDRINUSE or EACCES) `port` cannot be bound on every address as gRPC binds it (SO_REUSEADDR:
    a port in TIME_WAIT is free, a listening one is not); None when it can, or when this host cannot tell (no
    IPv6, no such address)."""
    for family, anywhere in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((anywhere, port))
            return None
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return exc.errno
    return None


def _not_joined(processes: Processes, exc: BaseException, timeout_s: float) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, TimeoutError) or "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
        what = f"not every process joined within accelerator.join_timeout_s ({timeout_s:g} s)"
        if processes.index == 0:
            what += f": this process, the coordinator, waited for the other {processes.count - 1}"
        else:
            what += ": the coordinator, process 0, did not answer, or another process never joined"
    else:
        what = "the processes could not join"
    where = f" (coordinator {processes.coordinator})" if processes.coordinator else ""
    never = exc.args[1] if isinstance(exc, TimeoutError) and len(exc.args) > 1 else None
    missing = f"{_named(never)} never began to join" if never else _missing_tasks(text)
    named = f"; missing: {missing}" if missing else ""
    return (
        f"{what}{where}; this is process {processes.index} of {processes.count}{named}. Start the same job on every "
        f"host with the same {ADDRESSES} and {COUNT}, check that each host reaches the coordinator's port, then run "
        "it again." + ("" if isinstance(exc, TimeoutError) else f" JAX said: {text[:400]}")
    )


def _missing_tasks(text: str) -> str | None:
    """The processes the coordination service says never connected, as it lists them (/job:jax_worker/task:N)."""
    tasks = sorted({int(n) for n in re.findall(r"task:(\d+)", text)})
    return ", ".join(f"process {n}" for n in tasks) or None


def in_job() -> bool:
    """Whether this process began joining others (it then ends by `leave`)."""
    return _joining


def joined() -> Processes:
    """The processes this job joined (SINGLE before `join`, or when it runs alone)."""
    return _joined


def barrier(name: str, timeout_s: float) -> None:
    """Every process waits here until all arrive (JAX's coordination service): AcceleratorError after timeout_s."""
    if not _joined.several:
        return
    client = _client()
    try:
        client.wait_at_barrier(f"runner_{name}", int(timeout_s * 1000))
    except Exception as exc:  # noqa: BLE001 - the coordination service's error names who did not arrive
        raise AcceleratorError(
            f"not every process reached {name!r} within {timeout_s:g} s: a host stopped or fell behind "
            f"({' '.join(str(exc).split())[:300]})"
        ) from None


def tell(key: str, value: str) -> None:
    """Process 0 tells every process `value` under `key` (read with `hear`)."""
    if _joined.several:
        _client().key_value_set(f"runner/{key}", value)


def hear(key: str, timeout_s: float) -> str:
    """What process 0 told under `key`, waited for at most timeout_s (AcceleratorError after)."""
    try:
        return _client().blocking_key_value_get(f"runner/{key}", int(timeout_s * 1000))
    except Exception as exc:  # noqa: BLE001 - process 0 stopped before telling
        raise AcceleratorError(
            f"process 0 said nothing about {key!r} within {timeout_s:g} s: it stopped or is stuck (see its log)"
            f" ({' '.join(str(exc).split())[:200]})"
        ) from None


def agree(key: str, mine: dict, timeout_s: float) -> None:
    """Every process's `mine` (runner/job/fingerprint.py) compared with process 0's, right after the join:
    SpecError (exit 2) on every process when one differs, naming the keys and the processes; AcceleratorError
    when a process says nothing within timeout_s."""
    if not _joined.several:
        return
    client = _client()
    client.key_value_set(f"runner/{key}/{_joined.index}", json.dumps(mine, sort_keys=True))
    if _joined.chief:
        deadline, found = time.monotonic() + timeout_s, []
        for index in range(1, _joined.count):
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                theirs = json.loads(client.blocking_key_value_get(f"runner/{key}/{index}", wait_ms))
            except Exception as exc:  # noqa: BLE001 - a process that stopped after joining
                raise AcceleratorError(
                    f"process {index} did not say which job it runs within {timeout_s:g} s after the join: it "
                    f"stopped or is stuck (see its log) ({' '.join(str(exc).split())[:200]})"
                ) from None
            if differ := differences(theirs, mine):
                found.append(f"process {index} has {', '.join(differ)}")
        verdict = "; ".join(found)
        client.key_value_set(f"runner/{key}/verdict", verdict or "same")
    else:
        verdict = hear(f"{key}/verdict", timeout_s)
        verdict = "" if verdict == "same" else verdict
    if verdict:
        raise SpecError(
            f"the processes of this job were not given the same job: {verdict}. Start every process with the same "
            f"spec, --set overrides, code and image, then run it again (this is process {_joined.index} of "
            f"{_joined.count})"
        )


def differences(theirs: dict, mine: dict, limit: int = 8) -> list[str]:
    """`key theirs where process 0 has mine` for each dotted key whose value differs, at most `limit`."""
    a, b = _flat(theirs), _flat(mine)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, _ABSENT) != b.get(k, _ABSENT))
    said = [f"{k} {_shown(a.get(k, _ABSENT))} where process 0 has {_shown(b.get(k, _ABSENT))}" for k in keys[:limit]]
    return said + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


_ABSENT = "<absent>"


def _flat(doc: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(doc, dict) and doc:
        out: dict[str, Any] = {}
        for key, value in doc.items():
            # The fingerprint's own sections are not spec keys: "spec.data.x" is said as "data.x".
            name = key if not prefix or prefix == "spec" else f"{prefix}.{key}"
            out.update(_flat(value, name))
        return out
    return {prefix: doc}


def _shown(value: Any) -> str:
    text = value if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


# What JAX and its collectives say when another process of the job is gone: a collective's peer that reset its
# connection (gloo on CPUs), or the coordination service's word that a task stopped sending heartbeats.
_LOST = ("Connection reset by peer", "Connection closed by peer", "heartbeat timeout", "stopped sending heartbeats",
         "Gloo", "CoordinationService", "coordination service")


def lost_peer(exc: BaseException) -> AcceleratorError | None:
    """The error to end this process with when `exc` says another process of the job stopped, else None."""
    if not _joined.several:
        return None
    text, seen = "", exc
    for _ in range(8):
        text += " " + str(seen)
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            break
    if not any(sign in text for sign in _LOST):
        return None
    global _lost
    _lost = True
    said = " ".join(str(exc).split())[:300]
    return AcceleratorError(
        f"another process of the job stopped (process {_joined.index} of {_joined.count} here; JAX said: {said}): "
        "every process stops with it. Run the same job again on every host: it continues from the newest complete "
        "checkpoint"
    )


# How long process 0, leaving, waits for the others to have left first (their summaries written and printed):
# a stop that every process makes together (a preemption, Ctrl-C, the time limit: each saves, then writes), and
# a failure, which may be process 0's alone while the others wait in a collective that only its exit ends.
LEAVE_S = {EXIT_PREEMPTED: 60.0, EXIT_INTERRUPTED: 60.0, EXIT_TIME_LIMIT: 60.0}
LEAVE_FAILED_S = 10.0
_lost = False  # another process of the job is gone: nobody waits for it


def leave(code: int) -> None:
    """Ends this process of a job of several now, with `code`: output flushed, JAX's shutdown barrier (which
    waits for every process, gone ones too, until accelerator.heartbeat_s) not waited for. Process 0, whose
    coordination service every other process's JAX watches (and aborts when it is gone), leaves last: after
    each other process said it was leaving, or after LEAVE_S (none when one is known gone)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _joined.several and not _lost:
        timeout_s = LEAVE_S.get(code, LEAVE_FAILED_S)
        try:
            Bounded("leave", lambda: _last_out(timeout_s)).result(timeout_s + 5)
        except Exception as exc:  # noqa: BLE001 - leaving anyway: the code is what the process ends with
            log.debug("leaving without the others: %s", exc)
        sys.stderr.flush()
    os._exit(code)


def _last_out(timeout_s: float) -> None:
    client = _client()
    if not _joined.chief:
        client.key_value_set(f"runner/left/{_joined.index}", "left")
        return
    deadline = time.monotonic() + timeout_s
    for index in range(1, _joined.count):
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            client.blocking_key_value_get(f"runner/left/{index}", wait_ms)
        except Exception:  # noqa: BLE001 - a process that stopped, or is stuck: process 0 leaves without it
            log.warning("process %d did not leave within %g s of process 0: process 0 leaves without it", index,
                        timeout_s)
            return
    time.sleep(0.2)  # the last one's os._exit, a few instructions after its word, runs before the service goes


def gather(key: str, mine: dict, timeout_s: float) -> list[dict | None] | None:
    """Every process's `mine`, in process order, on process 0 (None on the others); a process that said nothing
    within timeout_s is None in the list."""
    if not _joined.several:
        return [mine]
    client = _client()
    client.key_value_set(f"runner/{key}/{_joined.index}", json.dumps(mine))
    if not _joined.chief:
        return None
    found: list[dict | None] = [mine]
    deadline = time.monotonic() + timeout_s
    for index in range(1, _joined.count):
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            found.append(json.loads(client.blocking_key_value_get(f"runner/{key}/{index}", wait_ms)))
        except Exception:  # noqa: BLE001 - a process that stopped: its figures are missing, not the summary
            found.append(None)
    return found


def finished(key: str, timeout_s: float) -> None:
    """Process 0 says it is done (its summary and exports written); the others wait for that, at most timeout_s
    (JAX's heartbeat still ends them sooner if process 0 is gone)."""
    if not _joined.several:
        return
    if _joined.chief:
        tell(key, "done")
        return
    try:
        _client().blocking_key_value_get(f"runner/{key}", int(timeout_s * 1000))
    except Exception as exc:  # noqa: BLE001 - process 0 is gone or late: this one ends anyway
        log.warning("process 0 did not say it finished within %g s: %s", timeout_s, " ".join(str(exc).split())[:200])


def _client():
    # The coordination service's client that jax.distributed.initialize connected: its key-value store and
    # barriers need no device and no compiled program (jax.experimental.multihost_utils's do).
    from jax._src import distributed

    return distributed.global_state.client


def reached_preemption_sync_point(step: int) -> bool:
    """Whether every process of the job stops at `step`: JAX's preemption sync point, which all processes agree on
    once any was noticed (runner/train/preemption.py asks it at every step, with the same steps on every process)."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))
