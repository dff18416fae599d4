"""The doctor's `jax` check: whether JAX finds libtpu and a TPU, asked in a child process of its own.

On a TPU the engine is Keras on JAX (the TPU image, docs/image.md). JAX looks for libtpu at TPU_LIBRARY_PATH,
else through the `libtpu` package, loads it as its PJRT plugin and asks it for TPU chips. Without a TPU it
falls back to the CPU after a page of libtpu warnings, which says nothing a user can act on; with a TPU held
by another process libtpu can hang. So the child does exactly that (`python -m runner.doctor.jax_tpu`: the probe
of the engine a TPU job computes with, runner/device/engine.py `Jax.probe`), bounded and killed when it outlives
the bound, and what it saw becomes one line naming the cause and the fix.

On a slice of several hosts the TPU is not started: libtpu waits there until every host has started it
(jax-ml/jax#12456, #19971), which `jax.distributed` arranges in the job's own join, not a doctor run on one
host. The child then only finds libtpu and imports jax (`--no-start`): the job's join checks the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from runner.device import engine
from runner.doctor.checks import Check, SliceHosts
from runner.spec.types import AcceleratorSpec

_NO_TPU_FIX = ("run on a TPU VM (v5e, v5p, v6e) and start the container with --privileged --net=host, so that it "
               "sees /dev/accel* or /dev/vfio; on a machine without a TPU, the CPU image")


def look(start: bool = True) -> dict[str, object]:
    """What the engine a TPU job computes with finds of its runtime (runner/device/engine.py `Engine.probe`: under
    JAX libtpu's path, jax's version and with `start` the TPU devices), run in this child."""
    return engine.choose(AcceleratorSpec(kind="tpu"), {}).probe(start)


def _stderr_tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(line[:300] for line in lines[-2:]) or "nothing on stderr"


def check_jax_tpu(tpu_wanted: bool, timeout: float, environ: dict[str, str], hosts: SliceHosts | None = None) -> Check:
    """JAX's TPU start, as a job would meet it: ok with a TPU; without one a fail when a TPU is wanted, else a warn.
    On a slice of several `hosts` the TPU is not started (see the module's docstring): libtpu and jax are looked
    up, and the check says why it went no further."""
    began = time.monotonic()
    several = hosts is not None and hosts.hosts > 1
    command = [sys.executable, "-m", "runner.doctor.jax_tpu", *(["--no-start"] if several else [])]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
    except subprocess.TimeoutExpired as expired:  # subprocess.run killed the child by its PID
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr or ""
        return Check("jax", "fail", f"no answer within {timeout:g} s while JAX started its TPU backend; the child was "
                     f"killed; stderr: {_stderr_tail(stderr)}",
                     "see the lockfile check (a TPU held by another process stalls libtpu) and the devices check",
                     round(time.monotonic() - began, 3))
    seconds = round(time.monotonic() - began, 3)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        code = child.returncode
        died = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        evidence = f"`import jax` and its TPU backend died ({died}): {_stderr_tail(child.stderr)}"
        action = "see the versions check (jax, jaxlib, libtpu must agree with jax's `tpu` extra) and the lockfile check"
        return Check("jax", "fail", evidence, action, seconds)
    seen = json.loads(lines[-1])
    path, library = seen["jax_library_path"], seen["libtpu_path"]
    elsewhere = bool(path and library and os.path.realpath(path) != os.path.realpath(library))
    if several and path is not None and not elsewhere:
        seen.update(hosts=hosts.hosts, hosts_found_by=hosts.found_by, accelerator_type=hosts.accelerator_type,
                    slice_devices=hosts.devices)
        evidence = (f"not started: the TPU of a slice of {hosts.hosts} hosts starts only when every host joins: the "
                    f"job's own join checks it ({hosts.found_by}); JAX {seen['jax']} finds libtpu at {path}")
        return Check("jax", "ok", evidence, seconds=seconds, data=seen)
    if seen.get("tpu_devices"):
        return Check("jax", "ok", f"JAX {seen['jax']} sees {seen['tpu_devices']} TPU devices ({seen['device_kind']}) "
                     f"through libtpu at {path}", seconds=seconds, data=seen)
    status = "fail" if tpu_wanted else "warn"
    if path is None:
        evidence = (f"JAX {seen['jax']} finds no libtpu (the `libtpu` package is not installed and TPU_LIBRARY_PATH "
                    "is unset), so it has no TPU backend and runs on the CPU")
        action = f'pip install "jax[tpu]=={seen["jax"]}" (its `tpu` extra pins the matching libtpu), or the TPU image'
        return Check("jax", status, evidence, action, seconds, seen)
    if elsewhere:
        evidence = f"JAX loads {path} (TPU_LIBRARY_PATH), not the libtpu package's {library}"
        evidence += f": {seen['error']}" if "error" in seen else " (the TPU was not started: a slice of several hosts)"
        return Check("jax", status, evidence, "unset TPU_LIBRARY_PATH: the libtpu package is the one jax's extra pins",
                     seconds, seen)
    reason = str(seen["error"]).splitlines()[0]
    if "NOT_FOUND" not in reason:  # libtpu did not load or start: not the absence of a TPU
        evidence = f"JAX {seen['jax']} could not start libtpu from {path}: {reason}"
        return Check("jax", "fail", evidence, "see the versions check: jax, jaxlib and libtpu must agree with jax's "
                     "`tpu` extra (the TPU image has them)", seconds, seen)
    evidence = (f"no TPU here: JAX {seen['jax']} loads libtpu from {path}, which finds no TPU device ({reason}); "
                "JAX alone falls back to the CPU")
    return Check("jax", status, evidence, _NO_TPU_FIX, seconds, seen)


if __name__ == "__main__":
    print(json.dumps(look(start="--no-start" not in sys.argv[1:])), flush=True)
