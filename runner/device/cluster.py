"""Which processes form the job (not yet joined: runner/device/processes.py joins them), in this order:
  1. Keras's own variables, for any cluster (CPU, GPU, several processes on one machine, SkyPilot):
     KERAS_DISTRIBUTION_JOB_ADDRESSES (host:port of every process, comma-separated, the first one the
     coordinator; one address is the coordinator alone), KERAS_DISTRIBUTION_NUM_PROCESSES and
     KERAS_DISTRIBUTION_PROCESS_ID, read as `keras.distribution.initialize()` reads them;
  2. a TPU slice, counted as JAX counts it (jax/_src/clusters/cloud_tpu_cluster.py): on GKE, several hosts in
     TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES; on a TPU VM, several workers in the metadata server's
     `worker-network-endpoints` (times MEGASCALE_NUM_SLICES). JAX then finds the slice itself
     (`jax.distributed.initialize()` with no arguments), as its multi_process.md documents for "any Cloud TPU
     deployment". One host (a one-host TPU VM, a single GKE pod, a Vertex AI job) joins nothing: JAX's own
     search would ask the metadata server for keys that only a slice has. Not run here: no TPU.

TF_CONFIG (TensorFlow's MultiWorkerMirroredStrategy) is no longer read: a job that sets it for several workers
is refused, naming the Keras variables that replace it (docs/multihost.md).

Imports neither JAX nor TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Mapping

from runner import SpecError
from runner.device.bounded import Bounded

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
def asked(environ: Mapping[str, str], on_tpu: bool = False) -> Processes:
    """The processes the environment says the job runs as (not yet joined); `on_tpu`: the job computes on a TPU
    with JAX. SpecError names a variable that is missing or wrong; a TF_CONFIG naming several workers is refused."""
    _refuse_tf_config(environ)
    keys = [k for k in (ADDRESSES, COUNT, INDEX) if environ.get(k, "").strip()]
    if keys:
        return _from_keras(environ, keys)
    return _tpu_slice(environ, on_tpu)


def _tpu_slice(environ: Mapping[str, str], on_tpu: bool) -> Processes:
    """Several TPU hosts, found where JAX finds them (GkeTpuCluster, then GceTpuCluster); SINGLE otherwise. The
    index is JAX's: the worker's number in its slice plus its slice's number times the hosts of a slice."""
    slices = _whole(environ.get("MEGASCALE_NUM_SLICES") or "1", "MEGASCALE_NUM_SLICES")
    slice_id = _whole(environ.get("MEGASCALE_SLICE_ID") or "0", "MEGASCALE_SLICE_ID")
    listed = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    hosts = len([h for h in listed.split(",") if h.strip()])
    if hosts:
        worker = _whole(environ.get("TPU_WORKER_ID") or "0", "TPU_WORKER_ID")
    elif not on_tpu or environ.get("TPU_SKIP_MDS_QUERY") is not None:
        return SINGLE
    else:
        workers = _metadata("worker-network-endpoints", environ)
        if workers is None:  # not a TPU VM's metadata (a Vertex AI job, a GKE pod without the webhook's variables)
            return SINGLE
        hosts = len([w for w in workers.split(",") if w.strip()])
        if hosts * slices <= 1:
            return SINGLE
        worker = _whole(_metadata("agent-worker-number", environ) or "0", "agent-worker-number")
    if hosts * slices <= 1:
        return SINGLE
    return Processes("tpu", hosts * slices, worker + slice_id * hosts)


def _whole(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"{name}={value!r} must be a whole number") from None


def _metadata(key: str, environ: Mapping[str, str]) -> str | None:
    """The TPU VM's metadata attribute `key` (as JAX reads it, GCE_METADATA_IP naming another server), None when
    there is no such server or key; bounded, for a host off Google Cloud that cannot even resolve its name."""
    server = environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(f"http://{server}/computeMetadata/v1/instance/attributes/{key}",
                                     headers={"Metadata-Flavor": "Google"})

    def read() -> str | None:
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.read().decode().strip()
        except OSError:  # refused, unknown name, 404 (HTTPError): no such metadata here
            return None

    try:
        return Bounded(f"metadata {key}", read).result(10)
    except TimeoutError:
        return None


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
    if count < 1:
        raise SpecError(f"{COUNT}={count} must be 1 or more: the number of processes that form the job")
    if not 0 <= index < count:
        raise SpecError(f"{INDEX}={index} must be from 0 to {COUNT}-1 ({count - 1})")
    if len(addresses) > 1 and len(addresses) != count:
        raise SpecError(f"{ADDRESSES} lists {len(addresses)} processes but {COUNT} is {count}: make them agree")
    if any(":" not in a for a in addresses):
        raise SpecError(
            f"{ADDRESSES}={environ[ADDRESSES]!r}: every address is host:port (the first is the coordinator)"
        )
    for address in addresses:
        port = address.rpartition(":")[2]
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise SpecError(f"{ADDRESSES}={environ[ADDRESSES]!r}: the port of {address!r} must be from 1 to 65535")
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
