"""Peak TFLOP/s of one device, per dtype: the denominator of MFU (runner/train/flops.py, docs/performance.md).

TPUs and GPUs: the vendor's published figure, one row per generation or model and dtype in `TABLE`, each with its
source. The TPU rows are the TPU table's (runner/device/tpus.json: bf16 per chip, and the devices JAX makes of a
chip). A "device" is one replica as the summary counts them (`accelerator.replicas`), so a chip's figure is divided
by its devices: two on v3 and TPU7x (each TensorCore a device), one on v5e and v6e (one TensorCore per chip) and on
v4 and v5p (two TensorCores run as one "megacore" device). Nothing here ran on a TPU. GPUs: dense (no 2:4 sparsity)
Tensor Core rates; float32 is TensorFloat-32 on Ampere and later, as TensorFlow runs float32 matmuls there by
default (`tf.config.experimental.enable_tensor_float_32_execution`).

CPUs publish no such figure that matches what TensorFlow reaches, so the host measures its own: the best
TFLOP/s of a chain of TensorFlow matmuls (the kernel of runner/job/matmul.py) in the dtype, measured once per
CPU model, core count and dtype and kept in `<cache>/runner/cpu_peak.json` ($XDG_CACHE_HOME, else ~/.cache).
It is what this host's matmul kernels reach, not the silicon's theoretical rate; delete the file to measure
again (a measurement taken while other work shared the cores reads low).

This module imports TensorFlow only to measure a CPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

from runner.device import host, tpus

# NVIDIA's H100 datasheet table as reproduced by a reseller (secondary: NVIDIA's own page was not read here).
H100_SHEET = "NVIDIA H100 datasheet via https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html (secondary)"
A100_SHEET = ("NVIDIA A100 datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
              "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, as cited by "
              "glennklockwood.com/garden/processors/A100)")
DENSE = "dense: half the datasheet's 'with sparsity' figure, as its footnote says"


@dataclasses.dataclass(frozen=True)
class Peak:
    """A published peak: `match` is a TPU generation (runner/device/tpus.py's names) or words of a GPU's name."""

    kind: str
    match: str
    precision: str
    tflops_per_chip: float
    devices_per_chip: int
    source: str

    @property
    def tflops_per_device(self) -> float:
        return self.tflops_per_chip / self.devices_per_chip


TABLE: tuple[Peak, ...] = (
    *(Peak("tpu", g.name, "bfloat16", float(g.peak[0]), g.peak[1], g.peak[2])
      for g in tpus.generations().values() if g.peak),
    Peak("gpu", "H100 PCIe", "bfloat16", 756.5, 1, f"{H100_SHEET}: H100 PCIe BF16 Tensor Core 1,513 TFLOPS with "
         f"sparsity; {DENSE}"),
    Peak("gpu", "H100 PCIe", "float16", 756.5, 1, f"{H100_SHEET}: H100 PCIe FP16 Tensor Core 1,513 TFLOPS with "
         f"sparsity; {DENSE}"),
    Peak("gpu", "H100 PCIe", "float32", 378.0, 1, f"{H100_SHEET}: H100 PCIe TF32 Tensor Core 756 TFLOPS with "
         f"sparsity; {DENSE}; TensorFlow runs float32 matmuls as TF32 by default"),
    Peak("gpu", "H100", "bfloat16", 989.5, 1, f"{H100_SHEET}: H100 SXM BF16 Tensor Core 1,979 TFLOPS with "
         f"sparsity; {DENSE}"),
    Peak("gpu", "H100", "float16", 989.5, 1, f"{H100_SHEET}: H100 SXM FP16 Tensor Core 1,979 TFLOPS with "
         f"sparsity; {DENSE}"),
    Peak("gpu", "H100", "float32", 494.5, 1, f"{H100_SHEET}: H100 SXM TF32 Tensor Core 989 TFLOPS with sparsity; "
         f"{DENSE}; TensorFlow runs float32 matmuls as TF32 by default"),
    Peak("gpu", "A100", "bfloat16", 312.0, 1, f"{A100_SHEET}: A100 BF16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    Peak("gpu", "A100", "float16", 312.0, 1, f"{A100_SHEET}: A100 FP16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    Peak("gpu", "A100", "float32", 156.0, 1, f"{A100_SHEET}: A100 TF32 Tensor Core 156 TFLOPS (312 with sparsity); "
         "TensorFlow runs float32 matmuls as TF32 by default"),
)

# What the CPU measurement multiplies: square matrices of these sizes, a chain of CHAIN products per call.
# Two sizes because the fastest differs by cache size; the best call counts: a peak is what the units reach,
# and other work on the machine only ever slows a call.
CPU_SIZES = (1024, 2048)
CHAIN = 4
WARM_CALLS = 5
CACHE_FILE = "cpu_peak.json"


def peak_tflops(
    kind: str, device_detail: str | None, precision: str, *, cpu_devices: int = 1, cache_dir: str | Path | None = None,
) -> tuple[float | None, str]:
    """(Peak TFLOP/s of one device, where the figure comes from); (None, why) when there is none.

    `kind`: tpu, gpu or cpu (the summary's accelerator.kind); `device_detail`: a TPU's accelerator type or
    generation (`v5litepod-8`, `v5p`: accelerator.tpu), a GPU's name as TensorFlow gives it (`NVIDIA
    H100 80GB HBM3`), ignored for a CPU (this host is measured); `precision`: the policy the job computes in
    (float32, bfloat16, float16: accelerator.precision.policy). `cpu_devices`: logical CPU devices the host's
    cores are split into (the measurement covers the whole host).
    """
    if kind == "cpu":
        value, source = cpu_peak(precision, cache_dir)
        if value is None or cpu_devices <= 1:
            return value, source
        return value / cpu_devices, f"{source}, divided among {cpu_devices} logical CPU devices"
    if kind not in ("tpu", "gpu"):
        return None, f"no peak for a device of kind {kind!r} (tpu, gpu or cpu)"
    if not device_detail:
        return None, f"the {kind.upper()}'s generation or name is unknown"
    row = _row(kind, device_detail, precision)
    if row is None:
        known = sorted({p.precision for p in TABLE if _matches(p, kind, device_detail)})
        if known:
            return None, (f"no published {precision} peak for {kind.upper()} {device_detail!r} in the table "
                          f"(it has {', '.join(known)})")
        return None, f"{kind.upper()} {device_detail!r} is not in runner/device/peak.py's table"
    return row.tflops_per_device, row.source


def _matches(row: Peak, kind: str, detail: str) -> bool:
    if row.kind != kind:
        return False
    if kind == "tpu":
        generation = tpus.generation_of(detail)
        return generation is not None and generation.name == row.match
    return all(word.lower() in detail.lower() for word in row.match.split())


def _row(kind: str, detail: str, precision: str) -> Peak | None:
    # The first match wins: "H100 PCIe" stands before "H100" so a PCIe card is not read as an SXM one.
    return next((p for p in TABLE if p.precision == precision and _matches(p, kind, detail)), None)


def cache_folder(cache_dir: str | Path | None = None) -> Path:
    """Where the measured CPU peaks are kept: `cache_dir`, else $XDG_CACHE_HOME/runner, else ~/.cache/runner."""
    if cache_dir is not None:
        return Path(cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "runner"


def cpu_key(precision: str, cpuinfo: str | None = None) -> str:
    """The cache key: the CPU model, the cores this process may use and the dtype (a 2-core and a 16-core VM of
    one model reach different peaks)."""
    return f"{cpu_model(cpuinfo)} | {len(os.sched_getaffinity(0))} cores | {precision}"


def cpu_model(cpuinfo: str | None = None) -> str:
    """The `model name` line of /proc/cpuinfo ('unknown CPU' where there is none)."""
    text = host.read_cpuinfo() if cpuinfo is None else cpuinfo
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown CPU"


def cpu_peak(
    precision: str, cache_dir: str | Path | None = None, sizes: tuple[int, ...] = CPU_SIZES
) -> tuple[float | None, str]:
    """This host's measured matmul peak in `precision`, from the cache or measured now (and cached); `sizes`: the
    square matrices tried (the default's measurement takes 5-20 s on 2 cores)."""
    folder = cache_folder(cache_dir)
    path = folder / CACHE_FILE
    key = cpu_key(precision)
    cached = _read(path)
    if key in cached:
        entry = cached[key]
        return entry["tflops"], _describe(entry, path, "cached")
    try:
        entry = measure_cpu(precision, sizes)
    except Exception as exc:  # a dtype this TensorFlow cannot multiply on a CPU: no peak, and why
        return None, f"the CPU matmul in {precision} failed ({type(exc).__name__}: {exc})"
    cached = _read(path)  # another process may have written meanwhile: keep its entries
    cached[key] = entry
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(cached, indent=1, sort_keys=True))
        temporary.replace(path)  # atomic: a reader never sees half a file
    except OSError as exc:
        return entry["tflops"], _describe(entry, path, f"not cached: {exc.strerror}")
    return entry["tflops"], _describe(entry, path, "measured now")


def _read(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _describe(entry: dict, path: Path, how: str) -> str:
    return (f"measured on this host: TensorFlow matmul {entry['size']}x{entry['size']} {entry['precision']}, best of "
            f"{entry['calls']} calls, {entry['measured']} ({how}, {path})")


def measure_cpu(precision: str, sizes: tuple[int, ...] = CPU_SIZES) -> dict:
    """The best TFLOP/s of a chain of `CHAIN` square matmuls of each size on this host's CPU in `precision`."""
    import tensorflow as tf

    dtype = tf.dtypes.as_dtype(precision)
    best, best_size, median, calls = 0.0, None, 0.0, 0
    for size in sizes:
        seconds = []
        with tf.device("/CPU:0"):
            a = tf.cast(tf.random.stateless_normal((size, size), seed=(0, 1)), dtype)
            # Scaled by 1/sqrt(size) so the chain's values stay near 1 (float16 would overflow otherwise).
            b = tf.cast(tf.random.stateless_normal((size, size), seed=(0, 2)) / size**0.5, dtype)

            @tf.function
            def chain(a=a, b=b):
                x = a
                for _ in range(CHAIN):
                    x = tf.matmul(x, b)
                return tf.reduce_sum(tf.cast(x, tf.float32))

            chain().numpy()  # tracing and the first run stay out of the figure
            for _ in range(WARM_CALLS):
                began = time.perf_counter()
                chain().numpy()  # .numpy() waits for the result: the sync that makes the time real
                seconds.append(time.perf_counter() - began)
        calls += len(seconds)
        tflops = 2 * size**3 * CHAIN / min(seconds) / 1e12
        if tflops > best:
            best, best_size, median = tflops, size, 2 * size**3 * CHAIN / statistics.median(seconds) / 1e12
    return {
        "tflops": float(f"{best:.4g}"), "median_tflops": float(f"{median:.4g}"), "size": best_size, "calls": calls,
        "precision": precision, "cpu": cpu_model(), "tensorflow": tf.__version__,
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def device_detail(kind: str, tpu: dict | None = None) -> str | None:
    """What `peak_tflops` reads for the device a job ran on: the TPU's generation (from the device kind JAX
    reports) or accelerator type (the summary's accelerator.tpu), the first GPU's name (asks TensorFlow), the
    CPU's model name."""
    if kind == "tpu":
        facts = tpu or {}
        return facts.get("generation") or facts.get("accelerator_type")
    if kind == "gpu":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        return tf.config.experimental.get_device_details(gpus[0]).get("device_name") if gpus else None
    return cpu_model()
