"""Facts about this host that need no TensorFlow: which TPU a job points at, TPU device files, libtpu's
lockfile, the malloc in use. Read by runner/strategy.py (to choose a device) and runner/doctor (to check it).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Mapping

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
