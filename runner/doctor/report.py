"""`runner doctor`: the classic ways a TPU job dies, checked in seconds before the job spends accelerator time.

    versions      Python/TensorFlow/Keras/JAX/libtpu against runner/doctor/known_good.json and jax's `tpu` extra
    devices       /dev/accel*, /dev/vfio/N, /dev/nvidiaN, against what the spec and environment ask for
    lockfile      libtpu's /tmp/libtpu_lockfile: absent, held by a live process, or left by a killed run
    tensorflow_env (only when it fails) TF_PLUGGABLE_DEVICE_LIBRARY_PATH names libtpu, which `runner run` refuses
    jax           (a TPU wanted, or libtpu installed) JAX finds libtpu and a TPU, in a child process of its own;
                  on a slice of several hosts libtpu is found and the TPU left to the job's join
    credentials   where gs:// credentials come from (never printing a secret)
    gcs           whether the storage endpoint answers
    tensorflow    `import tensorflow` in a child process (tf.data runs in it under both engines)
  with a SPEC, also:
    storage_read  each gs:// data folder's manifest.json
    storage_write create, read back and delete a probe object in output.dir
    data_train, data_eval   the glob matches shards listed in the manifest, their sha256 match it
    batch         data.global_batch_size against the replica count the jax/tensorflow checks found

Each check is bounded by `timeout` seconds. The TensorFlow checks run in one child process
(runner/doctor/probe.py), killed by its PID when a step outlives its bound; the steps it had not done yet run in
a fresh child, so an import that hangs or aborts hides nothing else. TensorFlow never starts a TPU: JAX does.
Exit code: 0 when nothing fails; 3 when an infrastructure check fails; 2 when only data/batch checks fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from runner import EXIT_INFRA, EXIT_OK, EXIT_USAGE, SpecError
from runner.data.storage import buckets_in, tensorflow_env
from runner.device import host
from runner.device.bounded import Bounded
from runner.doctor import checks, versions
from runner.doctor.checks import Check
from runner.doctor.jax_tpu import check_jax_tpu
from runner.job import startup
from runner.spec.types import JobSpec

SCHEMA_VERSION = 1
_USAGE_CHECKS = ("data_train", "data_eval", "batch")
_STEP_WHAT = {
    "tensorflow": "import tensorflow",
    "storage": "the storage checks",
    "data": "the data checks",
}
_STEP_CHECKS = {"storage": "storage_write", "data": "data_train"}
_STEP_ACTIONS = {
    "tensorflow": "a TensorFlow that does not import stops every job (tf.data runs in it under both engines): see the "
    "versions check and runner/doctor/known_good.json",
    "storage": "see the gcs and credentials checks",
    "data": "see the storage checks; `runner verify FOLDER` checks every shard",
}


@dataclasses.dataclass
class Report:
    checks: list[Check]
    seconds: float
    spec: str | None = None
    saved_to: str | None = None

    @property
    def status(self) -> str:
        statuses = {c.status for c in self.checks}
        return next((s for s in ("fail", "warn") if s in statuses), "ok")

    @property
    def exit_code(self) -> int:
        failed = [c.name for c in self.checks if c.status == "fail"]
        if not failed:
            return EXIT_OK
        return EXIT_USAGE if all(name in _USAGE_CHECKS for name in failed) else EXIT_INFRA

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "status": self.status,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 2),
            "host": socket.gethostname(),
            "spec": self.spec,
            "saved_to": self.saved_to,
            "checks": [c.to_dict() for c in self.checks],
        }


def _timed(fn: Callable[..., Check], *args: Any, **kwargs: Any) -> Check:
    began = time.monotonic()
    check = fn(*args, **kwargs)
    check.seconds = round(time.monotonic() - began, 3)
    return check


class _Bounded:
    """A host check in a daemon thread: DNS lookups ignore socket timeouts, so the bound is kept out here."""

    def __init__(self, name: str, seconds: float, fn: Callable[..., Check], *args: Any):
        self.check_name, self.seconds = name, seconds
        self._call = Bounded(f"doctor-{name}", lambda: _timed(fn, *args))

    def outcome(self) -> Check:
        try:
            return self._call.result(self.seconds)
        except TimeoutError:
            evidence = f"no answer within {self.seconds:g} s"
            return Check(self.check_name, "fail", evidence, "check DNS and the network", self.seconds)
        except Exception as exc:  # a check that broke is reported, not a doctor that breaks
            return Check(self.check_name, "fail", f"the check itself failed: {type(exc).__name__}: {exc}",
                         "run with --debug")


class _Probe:
    """The child process that runs the TensorFlow steps; restarted (libtpu not loaded) after a kill or crash."""

    def __init__(self, steps: list[str], spec: JobSpec, timeout: float, environ: dict[str, str]):
        self.spec, self.checks = spec, []
        self.bounds = {step: timeout for step in steps}
        self.timeout = timeout
        self.pending = list(steps)
        self.env = dict(environ)
        self.env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # TensorFlow's gs:// retries, as `runner run` sets them, but giving up within half the doctor's bound.
        self.env.update(tensorflow_env(min(timeout / 2, spec.storage.timeout_s)))
        self.proc: subprocess.Popen | None = None
        if self.pending:
            self._start(self.pending)

    def _start(self, steps: list[str]) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runner.doctor.probe"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=self.env, start_new_session=True,
        )
        # Only what was set: a full dump may carry defaults that the spec refuses when written out.
        spec = json.loads(self.spec.model_dump_json(exclude_unset=True))
        request = {"steps": steps, "spec": spec, "bounds": self.bounds}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def _event(self, deadline: float) -> dict[str, Any] | str:
        """The next event from the child, or "timeout", or "exit"."""
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.proc.stdout], [], [], remaining)[0]:
                return "timeout"
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return "exit"
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return self._event(deadline)

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the child leads its own process group
        except ProcessLookupError:
            pass
        self.proc.wait()

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        telling = [line for line in lines if re.search(r"(: F |\] |Error|error|Failed|already in use)", line)]
        picked = list(dict.fromkeys([*telling[-1:], *lines[-1:]]))
        return " | ".join(line[:300] for line in picked) or "nothing on stderr"

    def _lost(self, step: str, how: str, seconds: float) -> None:
        """Records the step that hung or died."""
        name = _STEP_CHECKS.get(step, step)
        self.checks.append(Check(name, "fail", how, _STEP_ACTIONS[step], round(seconds, 3)))
        self.pending.remove(step)
        # What is left runs without loading libtpu (TPU_LOAD_LIBRARY=0): a libtpu named in the environment may be
        # what just hung or crashed.
        self.env["TPU_LOAD_LIBRARY"] = "0"
        if self.pending:
            self._start(self.pending)

    def collect(self) -> list[Check]:
        """Runs the pending steps to the end: every step gives its checks, or a fail saying how it was lost."""
        step, began = None, time.monotonic()
        deadline = began + self.timeout
        while self.pending:
            event = self._event(deadline)
            current = step or self.pending[0]
            during = f"during {_STEP_WHAT[current]}" if step else f"before {_STEP_WHAT[current]}"
            if event == "timeout":
                pid = self.proc.pid
                self._kill()
                bound = self.bounds[current] if step else self.timeout
                how = f"no answer within {bound:g} s {during}; killed the probe (pid {pid})"
                how += f"; stderr: {self._stderr_tail()}"
                self._lost(current, how, time.monotonic() - began)
            elif event == "exit":
                code = self.proc.wait()
                died = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                how = f"the probe (pid {self.proc.pid}) died ({died}) {during}: {self._stderr_tail()}"
                self._lost(current, how, time.monotonic() - began)
            elif "begin" in event:
                # A little grace: the step's own bound (the hashing budget) should speak first.
                bound = self.bounds[event["begin"]]
                step, began = event["begin"], time.monotonic()
                deadline = began + bound + min(5.0, bound / 2)
                continue
            elif "check" in event:
                self.checks.append(Check(**event["check"]))
                continue
            elif "done" in event:
                self.pending.remove(event["done"])
            step, began = None, time.monotonic()
            deadline = began + self.timeout
        return self.checks

    def save(self, path: str, report: dict[str, Any]) -> Check:
        """Writes the report where the job's summary goes, through the same tf.io.gfile the job uses."""
        if self.proc is None or self.proc.poll() is not None:
            self.env["TPU_LOAD_LIBRARY"] = "0"
            self._start([])
        deadline = time.monotonic() + self.timeout
        while (event := self._event(deadline)) not in ("timeout", "exit") and "idle" not in event:
            pass
        if event in ("timeout", "exit"):
            return Check("save", "fail", f"the probe could not start TensorFlow to write {path} ({event})")
        self.proc.stdin.write((json.dumps({"save": path, "report": report}) + "\n").encode())
        self.proc.stdin.flush()
        event = self._event(time.monotonic() + self.timeout)
        if isinstance(event, dict) and "check" in event:
            return Check(**event["check"])
        return Check("save", "fail", f"no answer within {self.timeout:g} s while writing {path}")

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()  # end of input: the child exits
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self._kill()


def run_doctor(
    spec: JobSpec | None = None,
    *,
    spec_path: str | None = None,
    timeout: float = 60.0,
    replicas: int | None = None,
    save: bool = False,
    environ: dict[str, str] | None = None,
    lockfile: str | None = None,
    dev_root: str = "/dev",
    settings: JobSpec | None = None,
) -> Report:
    """Runs every check (the spec's too when given) and returns the report; never raises for a failed check.
    `settings`: without a spec, the defaults with `--set` options (the accelerator and backend to check)."""
    began = time.monotonic()
    environ = dict(os.environ if environ is None else environ)
    job = spec or settings or JobSpec()
    needs_gcs = spec is not None and bool(buckets_in(job.data.train, job.data.eval, job.output.dir))
    tpu_here = bool(host.named_tpu(job.accelerator.tpu, environ) or host.tpu_devices(dev_root))
    tpu_wanted = job.accelerator.kind == "tpu" or (job.accelerator.kind == "auto" and tpu_here)
    lockfile = lockfile or environ.get(checks.LOCKFILE_ENV) or host.LIBTPU_LOCKFILE
    found = [
        _timed(versions.check_versions, tpu_wanted),
        _timed(checks.check_devices, job.accelerator, environ, dev_root),
        _timed(checks.check_allocator),
        # Before the probe starts: a TPU it initialises holds the lockfile itself.
        _timed(checks.check_lockfile, lockfile, tpu_wanted, dev_root),
    ]
    try:  # what `runner run` refuses before TensorFlow loads; the probe's TensorFlow is kept off libtpu too
        startup.refuse_libtpu_for_tensorflow(environ)
    except SpecError as exc:
        found.append(Check("tensorflow_env", "fail", str(exc), "unset TF_PLUGGABLE_DEVICE_LIBRARY_PATH"))
        environ = {k: v for k, v in environ.items() if k != "TF_PLUGGABLE_DEVICE_LIBRARY_PATH"}
    if tpu_wanted or "libtpu" in versions.installed_versions():
        # Before the TensorFlow probe: the TPU is JAX's, and this child lets go of it (and the lockfile) on exit.
        # On a slice of several hosts it is not started: libtpu would wait for the other hosts (jax_tpu.py).
        local = host.tpu_target(job.accelerator.tpu, environ, dev_root) == "local"
        hosts = checks.slice_hosts(environ, local, min(timeout, 10.0)) if tpu_wanted else None
        found.append(check_jax_tpu(tpu_wanted, timeout, environ, hosts))
    probe = _Probe(["tensorflow", *(["storage", "data"] if spec else [])], job, timeout, environ)
    try:
        network = [
            _Bounded("credentials", min(timeout, 5.0), checks.check_credentials, environ, needs_gcs, 2.0),
            _Bounded("gcs", min(timeout, 5.0), checks.check_gcs_endpoint, environ, needs_gcs, 3.0),
        ]
        probed = probe.collect()
        found += [task.outcome() for task in network] + probed
        if spec is not None:
            found.append(_batch(job, found, replicas))
        report = Report(found, time.monotonic() - began, spec_path)
        if save:
            path = f"{job.run_dir}/doctor.json"
            report.saved_to = path
            outcome = probe.save(path, report.to_dict())
            if outcome.status != "ok":
                report.saved_to = None
                report.checks.append(outcome)
    finally:
        probe.close()
    report.seconds = time.monotonic() - began
    return report


def _batch(spec: JobSpec, probed: list[Check], replicas: int | None) -> Check:
    """The batch check, for the replica count the job would get here (or the one asked for)."""
    by_name = {c.name: c for c in probed}
    jax, tensorflow = by_name.get("jax"), by_name.get("tensorflow")
    records = {
        key: by_name[f"data_{key}"].data.get("records") if f"data_{key}" in by_name else None
        for key, pattern in (("train", spec.data.train), ("eval", spec.data.eval)) if pattern
    }
    kind = spec.accelerator.kind
    on_tpu = bool(jax and jax.data.get("tpu_devices"))
    if replicas is not None:
        count, source = replicas, "--replicas"
    elif on_tpu:
        count, source = jax.data["tpu_devices"], f"the TPU devices JAX sees ({jax.data['device_kind']})"
    elif jax and jax.data.get("slice_devices"):
        count, on_tpu = jax.data["slice_devices"], True
        source = (f"the TPU devices of {jax.data['accelerator_type']}, a slice of {jax.data['hosts']} hosts "
                  "(the TPU table)")
    elif jax and jax.data.get("hosts"):
        count, source = None, f"the TPU of a slice of {jax.data['hosts']} hosts starts in the job's join"
    elif kind == "tpu":
        count, source = None, "the TPU did not start"
    elif kind in ("auto", "gpu") and tensorflow and tensorflow.data.get("gpus"):
        count, source = tensorflow.data["gpus"], "GPUs TensorFlow sees"
    elif kind == "gpu":
        count, source = None, "TensorFlow sees no GPU"
    else:
        count, source = spec.accelerator.cpu_devices, "accelerator.cpu_devices on the CPU"
    on_tpu = on_tpu or (replicas is not None and kind == "tpu")
    return _timed(check_batch, spec, count, source, records, on_tpu)


def check_batch(
    spec: JobSpec, replicas: int | None, source: str, records: dict[str, int | None], on_tpu: bool = False
) -> Check:
    """global_batch_size against the replica count, and full batches in each split (TPUs drop remainders)."""
    batch = spec.data.global_batch_size
    data = {"global_batch_size": batch, "replicas": replicas, "replicas_from": source}
    if replicas is None:
        action = "fix the jax check, or pass --replicas N (a slice: its TPU devices)"
        return Check("batch", "warn", f"replica count unknown ({source})", action, data=data)
    if batch % replicas:
        lower, upper = max(replicas, batch // replicas * replicas), (batch // replicas + 1) * replicas
        return Check(
            "batch", "fail", f"data.global_batch_size ({batch}) is not divisible by the {replicas} replicas ({source})",
            f"set data.global_batch_size to {lower} or {upper}", data=data,
        )
    per_replica = batch // replicas
    evidence = [f"{batch} = {replicas} replica{'s' if replicas > 1 else ''} x {per_replica} ({source})"]
    for split, count in records.items():
        if count is not None and count // batch == 0:
            return Check(
                "batch", "fail", f"data.{split}: {count} records make no full batch of {batch}",
                "lower data.global_batch_size or add data", data=data,
            )
        if count is not None:
            evidence.append(f"{split}: {count // batch} steps of {batch} from {count} records")
    if on_tpu and per_replica % 8:
        return Check(
            "batch", "warn", "; ".join(evidence) + f"; {per_replica} per core is not a multiple of 8",
            "TPU cores pad the batch: use a multiple of 8 per core (128 is best)", data=data,
        )
    return Check("batch", "ok", "; ".join(evidence), data=data)
