"""Facts about this host that need no TensorFlow: which TPU a job points at, TPU device files, libtpu's
lockfile, the malloc in use, whether the CPU computes bfloat16 natively (or $RUNNER_CPU_BF16 says to act as if),
the memory a job may use. Read by runner/device/strategy.py (to choose a device), runner/device/precision.py (to
choose what it computes in), runner/data/in_memory.py (whether training data fits in memory) and runner/doctor
(to check it).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from pathlib import Path

# libtpu's own path (xla/stream_executor/tpu/tpu_initialize_util.cc): a process holding it owns the TPU.
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"

# Libraries that replace glibc's malloc when preloaded, by the file name they are mapped under.
_ALLOCATORS = {"libtcmalloc": "tcmalloc", "libjemalloc": "jemalloc"}
TCMALLOC_PRELOAD = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def named_tpu(tpu: str | None, environ: Mapping[str, str]) -> str | None:
    """The TPU a spec (`accelerator.tpu`) or the environment names, in this order:
    `accelerator.tpu`, $TPU_NAME, $COLAB_TPU_ADDR (as grpc://). None when nothing names one."""
    if tpu:
        return tpu
    if environ.get("TPU_NAME"):
        return environ["TPU_NAME"]
    if environ.get("COLAB_TPU_ADDR"):
        return f"grpc://{environ['COLAB_TPU_ADDR']}"
    return None


def tpu_devices(dev_root: str = "/dev") -> list[str]:
    """TPU device files: /dev/accel* (v4 and earlier, v6e) or /dev/vfio/N (v5e, v5p)."""
    return sorted(glob.glob(f"{dev_root}/accel*")) + sorted(glob.glob(f"{dev_root}/vfio/[0-9]*"))


def tpu_target(tpu: str | None, environ: Mapping[str, str] | None = None, dev_root: str = "/dev") -> str | None:
    """The TPU to try: the named one, else `local` when this host has TPU device files, else None (no TPU
    attempt, so a CPU-only run does not wait for a TPU that is not there)."""
    environ = os.environ if environ is None else environ
    return named_tpu(tpu, environ) or ("local" if tpu_devices(dev_root) else None)


def allocator_in_use(maps: str = "/proc/self/maps") -> tuple[str, str | None]:
    """(tcmalloc | jemalloc | glibc, the library mapped for it): the malloc this process runs on."""
    mapped = {line.split()[-1] for line in Path(maps).read_text().splitlines() if len(line.split()) >= 6}
    for path in sorted(mapped):
        for prefix, name in _ALLOCATORS.items():
            if Path(path).name.startswith(prefix):
                return name, path
    return "glibc", None


# CPU flags (as Linux names them in /proc/cpuinfo) that mean the CPU computes bfloat16 natively: AVX512_BF16
# (Intel Cooper Lake and later, AMD Zen 4 and later) and AMX's bfloat16 tiles (Intel Sapphire Rapids and later).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = "/proc/cpuinfo"
# GPUs compute bfloat16 natively from compute capability 8.0 (NVIDIA Ampere) on.
BF16_GPU_CAPABILITY = (8, 0)


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor listed in a /proc/cpuinfo text (empty when it lists none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


# Set to 1 or 0, `train.mixed_precision: auto` acts on a CPU as if /proc/cpuinfo listed avx512_bf16, or no bf16
# flag: a machine without the flag runs the suite as one with it does (TensorFlow emulates bfloat16 there:
# slower, rounded to bfloat16 all the same), and one with the flag as one without. Unset or empty: the flags decide.
CPU_BF16_ENV = "RUNNER_CPU_BF16"


def cpu_bf16_override(environ: Mapping[str, str] | None = None) -> bool | None:
    """What $RUNNER_CPU_BF16 says of this CPU: True (act as a CPU with avx512_bf16), False (as one without
    a bf16 flag), None (unset or empty: read /proc/cpuinfo). Any other value is refused (SpecError)."""
    environ = os.environ if environ is None else environ
    value = environ.get(CPU_BF16_ENV, "").strip()
    if value in ("", "1", "0"):
        return None if not value else value == "1"
    from runner import SpecError

    raise SpecError(
        f"{CPU_BF16_ENV} is {value!r}: set it to 1 (train.mixed_precision: auto acts as on a CPU with "
        f"avx512_bf16), 0 (as on a CPU without a bf16 flag), or unset it (the flags in {CPUINFO} decide)"
    )


def native_precision(
    kind: str, cpuinfo: str | None = None, gpus: list[tuple[str, tuple[int, int] | None]] = (),
    cpu_bf16: bool | None = None,
) -> tuple[str, str]:
    """(bfloat16 | float32, why) for `train.mixed_precision: auto` on a device of this `kind` (tpu, gpu, cpu):
    bfloat16 where the device computes it natively, float32 elsewhere.

    `cpuinfo`: the text of /proc/cpuinfo (None: it could not be read); `gpus`: (name, compute capability or
    None when unknown) of each GPU the job trains on: all of them must compute bfloat16 natively; `cpu_bf16`:
    $RUNNER_CPU_BF16 read by cpu_bf16_override(), which on a CPU decides in place of the flags when not None.
    """
    if kind == "tpu":
        return "bfloat16", "TPU"
    if kind == "gpu":
        if not gpus:
            return "float32", "no GPU details from TensorFlow: float32"
        slow = [(name, cap) for name, cap in gpus if cap is None or tuple(cap) < BF16_GPU_CAPABILITY]
        if slow:
            name, cap = slow[0]
            shown = "unknown" if cap is None else ".".join(map(str, cap))
            return "float32", f"GPU {name} compute capability {shown} (below 8.0): float32"
        name, cap = min(gpus, key=lambda g: tuple(g[1]))
        return "bfloat16", f"GPU {name} compute capability {'.'.join(map(str, cap))}"
    if cpu_bf16 is not None:
        if cpu_bf16:
            return "bfloat16", f"{CPU_BF16_ENV}=1: as on a CPU with avx512_bf16"
        return "float32", f"{CPU_BF16_ENV}=0: as on a CPU without a bf16 flag: float32"
    if cpuinfo is None:
        return "float32", f"could not read {CPUINFO}: float32"
    flags = cpu_flags(cpuinfo)
    found = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if found:
        return "bfloat16", f"cpu flag {found[0]}"
    return "float32", f"no bf16 flag in {CPUINFO}: float32"


def cpu_precision(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """native_precision() of this host's CPU: $RUNNER_CPU_BF16 when set, else its /proc/cpuinfo flags."""
    override = cpu_bf16_override(environ)
    return native_precision("cpu", None if override is not None else read_cpuinfo(), cpu_bf16=override)


def read_cpuinfo(path: str = CPUINFO) -> str | None:
    """The text of /proc/cpuinfo, None where there is none (not Linux) or it cannot be read."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


# cgroup v2's and v1's memory limits: a container started with `docker run --memory` sees its limit there.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_bytes(limits: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int | None:
    """The memory this process may use: the machine's, or its container's limit when that is lower; None
    when neither can be read."""
    try:
        found = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (ValueError, OSError, AttributeError):
        found = []
    for path in limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (cgroup v2) means no limit
            found.append(int(text))
    return min(found) if found else None
