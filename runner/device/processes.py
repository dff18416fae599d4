"""One job as several processes, one per host: which processes form the job, and joining them (JAX's
multi-process runtime). The backend seam's multi-host half: the rest of the job sees only `Processes`.

Where a job learns it is one of several processes, in this order:
  1. Keras's own variables, for any cluster (CPU, GPU, several processes on one machine, SkyPilot):
     KERAS_DISTRIBUTION_JOB_ADDRESSES (host:port of every process, comma-separated, the first one the
     coordinator; one address is the coordinator alone), KERAS_DISTRIBUTION_NUM_PROCESSES and
     KERAS_DISTRIBUTION_PROCESS_ID, read as `keras.distribution.initialize()` reads them;
  2. a Cloud TPU VM (TPU device files) or a GKE TPU pod (TPU_WORKER_HOSTNAMES naming several hosts): JAX finds
     the slice itself (`jax.distributed.initialize()` with no arguments: the TPU VM's metadata, or GKE's
     variables), as JAX's multi_process.md documents for "any Cloud TPU deployment". Not run here: no TPU.
The join is `jax.distributed.initialize`, which `keras.distribution.initialize` wraps, called directly for the
two bounds Keras's wrapper does not pass: `accelerator.timeout_s` for every process to join (a host that never
does ends every process with exit 3, naming it where the coordinator says) and `accelerator.heartbeat_s`, after
which a host that stopped answering ends the others. Keras's wrapper also seeds every process alike; the
runner seeds them all with `train.seed` instead.

TF_CONFIG (TensorFlow's MultiWorkerMirroredStrategy) is no longer read: a job that sets it for several workers
is refused, naming the Keras variables that replace it (docs/multihost.md).

This module imports JAX only inside `join`, and never TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping

from runner import AcceleratorError, SpecError
from runner.device import host
from runner.device.bounded import Bounded

log = logging.getLogger(__name__)

ADDRESSES, COUNT, INDEX = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID"
)


@dataclasses.dataclass(frozen=True)
class Processes:
    """The processes that form the job. `how`: keras (Keras's variables), tpu (JAX finds the slice), or
    single (one process: nothing to join)."""

    how: str = "single"
    count: int = 1
    index: int = 0
    coordinator: str | None = None

    @property
    def several(self) -> bool:
        return self.how != "single"

    @property
    def chief(self) -> bool:
        return self.index == 0

    def to_dict(self) -> dict:
        return {"count": self.count, "index": self.index, "found_by": self.how, "coordinator": self.coordinator}


SINGLE = Processes()
_joined: Processes = SINGLE
_joining = False  # a join was begun: the process must end by `leave`, not through JAX's exit barrier


def asked(environ: Mapping[str, str], on_tpu: bool = False) -> Processes:
    """The processes the environment says the job runs as (not yet joined); `on_tpu`: the job computes on a TPU
    with JAX. SpecError names a variable that is missing or wrong; a TF_CONFIG naming several workers is refused."""
    _refuse_tf_config(environ)
    keys = [k for k in (ADDRESSES, COUNT, INDEX) if environ.get(k, "").strip()]
    if keys:
        return _from_keras(environ, keys)
    hostnames = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hostnames) > 1 or (on_tpu and host.tpu_devices()):
        # The count and place are JAX's to find (the TPU VM's metadata or GKE's variables): these are guesses.
        return Processes("tpu", count=max(len(hostnames), 1), index=int(environ.get("TPU_WORKER_ID", "0") or 0))
    return SINGLE


def _from_keras(environ: Mapping[str, str], keys: list[str]) -> Processes:
    missing = [k for k in (ADDRESSES, COUNT, INDEX) if k not in keys]
    if missing:
        raise SpecError(
            f"{', '.join(keys)} set but {', '.join(missing)} not: a job of several processes needs all three "
            f"({ADDRESSES}=host:port[,host:port...], {COUNT}=N, {INDEX}=0..N-1 on each process)"
        )
    addresses = [a.strip() for a in environ[ADDRESSES].split(",") if a.strip()]
    try:
        count, index = int(environ[COUNT]), int(environ[INDEX])
    except ValueError:
        raise SpecError(
            f"{COUNT}={environ[COUNT]!r} and {INDEX}={environ[INDEX]!r} must be whole numbers"
        ) from None
    if count < 1 or not 0 <= index < count:
        raise SpecError(f"{INDEX}={index} must be from 0 to {COUNT}-1 ({count - 1})")
    if len(addresses) > 1 and len(addresses) != count:
        raise SpecError(f"{ADDRESSES} lists {len(addresses)} processes but {COUNT} is {count}: make them agree")
    if any(":" not in a for a in addresses):
        raise SpecError(
            f"{ADDRESSES}={environ[ADDRESSES]!r}: every address is host:port (the first is the coordinator)"
        )
    if count == 1:
        return SINGLE
    return Processes("keras", count, index, addresses[0])


def _refuse_tf_config(environ: Mapping[str, str]) -> None:
    raw = environ.get("TF_CONFIG", "").strip()
    if not raw:
        return
    try:
        cluster = json.loads(raw).get("cluster", {})
    except (json.JSONDecodeError, AttributeError):
        cluster = {"worker": ["?", "?"]}
    if len(cluster.get("worker", [])) + len(cluster.get("chief", [])) > 1:
        raise SpecError(
            "TF_CONFIG names several workers, but TensorFlow's multi-worker training is no longer run: a job of "
            f"several processes runs on JAX's runtime. Set {ADDRESSES} (the TF_CONFIG worker list, chief first), "
            f"{COUNT} and {INDEX} (the task's place in that list) instead, and unset TF_CONFIG (docs/multihost.md)"
        )


def join(processes: Processes, timeout_s: float, heartbeat_s: float) -> Processes:
    """Joins the job's processes (JAX's distributed runtime) within `timeout_s`; returns them as joined. A process
    that is missing or late ends this one with AcceleratorError (exit 3)."""
    global _joined, _joining
    if not processes.several:
        return SINGLE
    import jax

    _joining = True
    # JAX's own deadline, when it passes, aborts the process from a thread of its own (SIGABRT, a stack trace):
    # the runner's bound comes first, so the job ends with its summary and exit 3 instead.
    kwargs = dict(initialization_timeout=int(timeout_s) + 30, heartbeat_timeout_seconds=max(1, int(heartbeat_s)))
    if processes.how == "keras":
        kwargs.update(coordinator_address=processes.coordinator, num_processes=processes.count,
                      process_id=processes.index)
    began = time.monotonic()
    try:
        Bounded("jax.distributed.initialize", lambda: jax.distributed.initialize(**kwargs)).result(timeout_s)
    except Exception as exc:  # the coordination service's errors: DEADLINE_EXCEEDED, UNAVAILABLE, ...
        raise AcceleratorError(_not_joined(processes, exc, timeout_s)) from None
    _joined = Processes(processes.how, jax.process_count(), jax.process_index(), processes.coordinator)
    log.info("process %d of %d joined the job (%s, coordinator %s) in %.1f s", _joined.index, _joined.count,
             "Keras's variables" if processes.how == "keras" else "the TPU slice",
             processes.coordinator or "found by JAX", time.monotonic() - began)
    return _joined


def _not_joined(processes: Processes, exc: BaseException, timeout_s: float) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, TimeoutError) or "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
        what = f"not every process joined within accelerator.timeout_s ({timeout_s:g} s)"
        if processes.index == 0:
            what += f": this process, the coordinator, waited for the other {processes.count - 1}"
        else:
            what += ": the coordinator, process 0, did not answer, or another process never joined"
    else:
        what = "the processes could not join"
    where = f" (coordinator {processes.coordinator})" if processes.coordinator else ""
    missing = _missing_tasks(text)
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
    said = " ".join(str(exc).split())[:300]
    return AcceleratorError(
        f"another process of the job stopped (process {_joined.index} of {_joined.count} here; JAX said: {said}): "
        "every process stops with it. Run the same job again on every host: it continues from the newest complete "
        "checkpoint"
    )


def leave(code: int) -> None:
    """Ends this process of a job of several now, with `code`: output flushed, JAX's shutdown barrier (which
    waits for every process, gone ones too, until accelerator.heartbeat_s) not waited for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
