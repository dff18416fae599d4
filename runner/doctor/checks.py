"""The host checks of `runner doctor`: what can be known without importing TensorFlow or JAX.

Neither is imported here. A broken install can abort or hang the process that imports it (libtpu does both),
and the doctor must outlive exactly that; the checks that need TensorFlow run in a child process
(runner/doctor/probe.py), JAX's TPU check in another (runner/doctor/jax_tpu.py); the versions check reads
metadata only (runner/doctor/versions.py). Each check returns a `Check`: a status (ok, warn, fail),
the evidence it saw and what to do about it. No check prints a secret.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import json
import os
import ssl
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from runner import SpecError
from runner.device import cluster, tpus
from runner.device.bounded import Bounded
from runner.device.host import (
    TCMALLOC_PRELOAD,
    allocator_in_use,
    named_tpu,
    tpu_devices,
)
from runner.spec.types import AcceleratorSpec

# The variable points the lockfile check away from host.LIBTPU_LOCKFILE (tests, odd setups only).
LOCKFILE_ENV = "RUNNER_LIBTPU_LOCKFILE"
_STORAGE_SCOPES = ("devstorage", "cloud-platform")


@dataclasses.dataclass
class Check:
    """One line of the doctor's table."""

    name: str
    status: str  # ok | warn | fail
    evidence: str
    action: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- devices -----------------------------------------------------------------------------------


def check_devices(accelerator: AcceleratorSpec, environ: dict[str, str], dev_root: str = "/dev") -> Check:
    """Accelerator device files this process can open, against what the spec and the environment ask for."""
    tpus, gpus = tpu_devices(dev_root), sorted(glob.glob(f"{dev_root}/nvidia[0-9]*"))
    named, kind = named_tpu(accelerator.tpu, environ), accelerator.kind
    data = {"tpu_devices": tpus, "gpu_devices": gpus, "tpu_named": named}
    shown = ", ".join(tpus + gpus) or f"no {dev_root}/accel*, {dev_root}/vfio/N or {dev_root}/nvidiaN"
    closed = [d for d in tpus + gpus if not os.access(d, os.R_OK | os.W_OK)]
    if closed:
        return Check(
            "devices", "fail", f"{', '.join(closed)} exist but uid {os.getuid()} cannot open them",
            "run the container with --privileged (TPU) or --gpus all (GPU), or as a user in the device's group",
            data=data,
        )
    local_tpu_needed = named == "local" or (kind == "tpu" and named is None)
    if local_tpu_needed and not tpus:
        why = "accelerator.kind is 'tpu' and no TPU is named"
        if named == "local":
            why = "accelerator.tpu/TPU_NAME is 'local'"
        return Check(
            "devices", "fail", f"{why}, but there is {shown}",
            "run on a TPU VM, and start the container with --privileged --net=host so it sees /dev/accel* "
            "(or /dev/vfio)",
            data=data,
        )
    if kind == "gpu" and not gpus:
        evidence = f"accelerator.kind is 'gpu', but there is {shown}"
        return Check("devices", "fail", evidence, "start the container with --gpus all", data=data)
    if tpus or gpus:
        return Check("devices", "ok", shown, data=data)
    if named:
        evidence = f"no local accelerator devices; the TPU {named!r} is reached over the network"
        return Check("devices", "ok", evidence, data=data)
    evidence = f"{shown}: a job here runs on the CPU"
    return Check("devices", "warn", evidence, "nothing, unless this should be a TPU VM", data=data)


# --- the hosts of a TPU slice -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SliceHosts:
    """The hosts of the TPU slice this machine belongs to (1: a TPU of one host, or nothing says otherwise)."""

    hosts: int
    found_by: str  # what said so
    accelerator_type: str | None = None

    @property
    def devices(self) -> int | None:
        """The TPU devices JAX makes of the whole slice (its chips times the devices of a chip, from the TPU
        table); None when the type or the table's figure is unknown."""
        generation = tpus.generation_of(self.accelerator_type or "")
        size = (self.accelerator_type or "").rpartition("-")[2]
        if generation is None or generation.peak is None or not size.isdigit():
            return None
        return generation.chips(int(size)) * generation.peak[1]


def _hosts_of_type(accelerator_type: str) -> tuple[int, str] | None:
    """(hosts, how) of an accelerator type from the TPU table; None for a type the table does not know."""
    generation = tpus.generation_of(accelerator_type)
    size = accelerator_type.strip().rpartition("-")[2]
    if generation is None or not size.isdigit():
        return None
    chips = generation.chips(int(size))
    hosts = generation.hosts(chips)
    return hosts, f"{chips} chips on {hosts} hosts (the TPU table)"


def _found_by(processes: cluster.Processes, environ: dict[str, str]) -> str:
    if processes.how == "keras":
        return f"Keras's KERAS_DISTRIBUTION_* variables name {processes.count} processes"
    listed = next((name for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES") if environ.get(name)), None)
    where = listed or "the metadata server's worker-network-endpoints"
    return f"{where} lists {processes.count} hosts"


def slice_hosts(environ: dict[str, str], local_tpu: bool, timeout: float = 10.0) -> SliceHosts:
    """How many hosts the job here runs on: counted as the job counts them before its join
    (runner/device/cluster.py, as JAX does: Keras's variables; GKE's TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES;
    on a TPU VM (`local_tpu`, TPU_SKIP_MDS_QUERY unset) the metadata server's worker-network-endpoints), else from
    the accelerator type (TPU_ACCELERATOR_TYPE, else the metadata's accelerator-type) against the TPU table. Within
    `timeout`; silence, or a variable the job itself refuses (it says so when it runs), counts as one host."""
    try:
        processes = Bounded("doctor-slice", lambda: cluster.asked(environ, on_tpu=local_tpu)).result(timeout)
    except (TimeoutError, SpecError):
        processes = cluster.SINGLE
    accelerator_type, source = environ.get("TPU_ACCELERATOR_TYPE") or None, "TPU_ACCELERATOR_TYPE"
    if accelerator_type is None and local_tpu and environ.get("TPU_SKIP_MDS_QUERY") is None:
        # The server JAX asks (GCE_METADATA_IP), else the one Google's clients ask (GCE_METADATA_HOST).
        asked = {**environ, "GCE_METADATA_HOST": environ.get("GCE_METADATA_IP") or environ.get("GCE_METADATA_HOST", "")}
        read = Bounded("doctor-accelerator-type",
                       lambda: _metadata(asked, "instance/attributes/accelerator-type", timeout).strip())
        try:
            accelerator_type, source = read.result(timeout) or None, "the metadata server"
        except (TimeoutError, OSError, urllib.error.URLError, ValueError):
            pass
    if processes.several:
        return SliceHosts(processes.count, _found_by(processes, environ), accelerator_type)
    if accelerator_type and (counted := _hosts_of_type(accelerator_type)) and counted[0] > 1:
        return SliceHosts(counted[0], f"{accelerator_type} ({source}) is {counted[1]}", accelerator_type)
    return SliceHosts(1, "one host: nothing lists several", accelerator_type)


# --- memory allocator --------------------------------------------------------------------------

def check_allocator(maps: str = "/proc/self/maps") -> Check:
    """Which malloc this process (and so a `runner run` started the same way) uses: tcmalloc is faster here.

    The input pipeline ran 1.33-1.38x faster with tcmalloc than with glibc's malloc (benchmarks/input_pipeline.py);
    the runner image preloads it.
    """
    name, library = allocator_in_use(maps)
    if library:
        return Check("allocator", "ok", f"{name} ({library})", data={"allocator": name, "library": library})
    return Check(
        "allocator", "warn",
        "glibc's malloc: TensorFlow's input pipeline ran 1.33-1.38x faster with tcmalloc "
        "(benchmarks/input_pipeline.py)",
        f"apt-get install libtcmalloc-minimal4, then export LD_PRELOAD={TCMALLOC_PRELOAD} (the runner image does)",
        data={"allocator": "glibc", "library": None},
    )


# --- libtpu lockfile ---------------------------------------------------------------------------


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return text if len(text) <= 80 else text[:77] + "..."


def lock_holder(path: str) -> int | None:
    """The pid holding a lock on `path`: lockf/fcntl (what libtpu takes) asked directly, flock via /proc/locks."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            # struct flock on Linux: type, whence, start, len, pid (with the C padding). F_GETLK takes no lock.
            query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            kind, _, _, _, pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, query))
            if kind != fcntl.F_UNLCK:
                return pid
        finally:
            os.close(fd)
    stat = os.stat(path)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "->" not in fields and len(fields) >= 6 and fields[5] == device:
            return int(fields[4])
    return None


def device_users(dev_root: str = "/dev") -> dict[int, list[str]]:
    """Processes with a TPU device file open: how libtpu itself names the process that owns the TPU."""
    devices = {os.path.realpath(d) for d in tpu_devices(dev_root)}
    users: dict[int, list[str]] = {}
    if not devices:
        return users
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            targets = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:
            continue  # gone, or another user's process
        if opened := sorted(targets & devices):
            users[int(entry.name)] = opened
    return users


def check_lockfile(path: str, tpu_wanted: bool = True, dev_root: str = "/dev") -> Check:
    """libtpu's lockfile: absent, held by a live process, or left behind by a killed run.

    A live holder fails the check only when this machine's TPU is wanted: elsewhere it blocks nothing.
    """
    users = device_users(dev_root)
    exists = os.path.exists(path)
    holder = lock_holder(path) if exists else None
    data: dict[str, Any] = {"path": path, "holder": holder, "device_users": {str(p): d for p, d in users.items()}}
    busy = "fail" if tpu_wanted else "warn"
    if holder is not None:
        who = f"pid {holder} ({_command_line(holder)})" if holder > 0 else "a process whose pid is not visible here"
        action = f"stop that process (kill {holder}) or wait for it to finish; one process at a time owns the TPU"
        if holder <= 0:
            action = f"find the owner with `sudo lsof -w {path}` and stop it"
        return Check("lockfile", busy, f"{path} is locked by {who}: the TPU belongs to it", action, data=data)
    if users:
        in_use = "; ".join(f"pid {pid} ({_command_line(pid)}) has {', '.join(d)} open" for pid, d in users.items())
        action = f"stop that process (kill {' '.join(map(str, users))}); one process at a time owns the TPU"
        return Check("lockfile", busy, f"the TPU is in use without the lockfile: {in_use}", action, data=data)
    if not exists:
        return Check("lockfile", "ok", f"no {path}: no process has claimed the TPU", data=data)
    stat = os.stat(path)
    data.update(owner_uid=stat.st_uid, age_s=round(time.time() - stat.st_mtime, 1))
    if not os.access(path, os.R_OK | os.W_OK):
        return Check(
            "lockfile", "fail",
            f"{path} (uid {stat.st_uid}, mode {stat.st_mode & 0o777:o}) was left by another user's killed run; uid "
            f"{os.getuid()} cannot open it, so libtpu refuses to start ('already in use by another process')",
            f"sudo rm {path}", data=data,
        )
    return Check(
        "lockfile", "warn",
        f"{path} was left by a run that was killed {data['age_s'] / 60:.0f} min ago (libtpu deletes it on a clean "
        "exit); no process holds it, so the next start can take it",
        f"nothing needed; `rm {path}` to tidy up", data=data,
    )


# --- credentials and GCS -----------------------------------------------------------------------


def _credential_file(path: str) -> tuple[bool, str]:
    """(usable by TensorFlow's gs:// client, a description without secrets)."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return False, f"{path} does not exist"
    except (OSError, ValueError) as exc:
        return False, f"{path} cannot be read as JSON ({type(exc).__name__})"
    if not isinstance(doc, dict):
        return False, f"{path} is not a JSON object"
    kind = doc.get("type", "?")
    who = doc.get("client_email") or doc.get("account") or doc.get("quota_project_id") or ""
    described = f"{path}: {kind}" + (f" {who}" if who else "")
    # TensorFlow's GoogleAuthProvider reads only these two kinds of file.
    if "private_key" in doc or "refresh_token" in doc:
        return True, described
    return False, f"{described} (TensorFlow's gs:// client reads only service_account and authorized_user files)"


def _metadata(environ: dict[str, str], path: str, timeout: float) -> str:
    host = environ.get("GCE_METADATA_HOST") or "metadata.google.internal"
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the metadata server is never proxied
    with opener.open(request, timeout=timeout) as response:
        if response.headers.get("Metadata-Flavor") != "Google":  # some other server answering that name
            raise ValueError(f"http://{host} answers without Metadata-Flavor: Google")
        return response.read().decode()


def check_credentials(environ: dict[str, str], needs_gcs: bool, timeout: float = 2.0) -> Check:
    """Where gs:// credentials come from, in the order TensorFlow's client tries them."""
    found, notes = [], []
    if environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        found.append("a fixed token in GOOGLE_AUTH_TOKEN_FOR_TESTING (test and emulator setups)")
    files = []
    if environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        files.append(("GOOGLE_APPLICATION_CREDENTIALS", environ["GOOGLE_APPLICATION_CREDENTIALS"]))
    config = environ.get("CLOUDSDK_CONFIG") or os.path.join(environ.get("HOME", "~"), ".config", "gcloud")
    adc = os.path.join(config, "application_default_credentials.json")
    if os.path.exists(adc):
        files.append(("gcloud ADC", adc))
    for source, path in files:
        usable, described = _credential_file(path)
        (found if usable else notes).append(f"{source} {described}")
    narrow_scopes = ""
    if environ.get("NO_GCE_CHECK", "").lower() != "true":
        try:
            email = _metadata(environ, "instance/service-accounts/default/email", timeout).strip()
            scopes = _metadata(environ, "instance/service-accounts/default/scopes", timeout).split()
            if not any(s in scope for scope in scopes for s in _STORAGE_SCOPES):
                narrow_scopes = email
            short = ", ".join(scope.rsplit("/", 1)[-1] for scope in scopes)
            found.append(f"metadata server: service account {email}, scopes {short}")
        except (OSError, urllib.error.URLError, ValueError) as exc:
            notes.append(f"no metadata server ({getattr(exc, 'reason', exc)})")
    if environ.get("STORAGE_EMULATOR_HOST"):
        notes.append(f"STORAGE_EMULATOR_HOST={environ['STORAGE_EMULATOR_HOST']} (google-cloud-storage only)")
    evidence = "; ".join(found + notes)
    data = {"sources": found}
    if narrow_scopes and len(found) == 1:  # the VM's account is the only source, and it may not use GCS
        return Check(
            "credentials", "fail" if needs_gcs else "warn", f"{evidence}: the VM's scopes do not include storage",
            "recreate the VM (or TPU) with --scopes=cloud-platform, or set GOOGLE_APPLICATION_CREDENTIALS", data=data,
        )
    if found:
        bad = [n for n in notes if n.startswith(("GOOGLE_APPLICATION_CREDENTIALS", "gcloud ADC"))]
        if bad:
            action = f"fix or unset the unusable file: {bad[0].split(': ')[0]}"
            return Check("credentials", "warn", evidence, action, data=data)
        return Check("credentials", "ok", evidence, data=data)
    return Check(
        "credentials", "fail" if needs_gcs else "warn",
        f"no credentials found ({evidence}): gs:// requests would go out anonymous (public buckets only)",
        "on a VM: give it a service account with storage scope; elsewhere: `gcloud auth application-default login` "
        "or GOOGLE_APPLICATION_CREDENTIALS=key.json",
        data=data,
    )


def _without_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{parts.hostname}:{parts.port}"))


def check_gcs_endpoint(environ: dict[str, str], needs_gcs: bool, timeout: float = 3.0) -> Check:
    """Can this machine reach the endpoint TensorFlow reads gs:// objects from (through https_proxy if set)?"""
    url = "https://storage.googleapis.com/"
    proxy = environ.get("https_proxy") or environ.get("HTTPS_PROXY")
    # TensorFlow's curl trusts CURL_CA_BUNDLE; so does this check, so both see the same certificates.
    context = ssl.create_default_context(cafile=environ.get("CURL_CA_BUNDLE") or None)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"https": proxy} if proxy else {}), urllib.request.HTTPSHandler(context=context)
    )
    via = f" through {_without_password(proxy)}" if proxy else ""
    began = time.monotonic()
    try:
        with opener.open(urllib.request.Request(url, method="HEAD"), timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code  # any HTTP answer proves the endpoint is reachable
    except (OSError, urllib.error.URLError, ssl.SSLError) as exc:
        return Check(
            "gcs", "fail" if needs_gcs else "warn", f"{url}{via} unreachable: {getattr(exc, 'reason', exc)}",
            "check DNS, the VPC's egress (Private Google Access on a VM without an external IP) and https_proxy",
        )
    return Check("gcs", "ok", f"{url}{via} answered HTTP {status} in {time.monotonic() - began:.2f} s")
