"""`kind: matmul_bench`: the classic CPU/GPU/TPU comparison, an N x N matrix multiplied in a chain, in TFLOPS.

Every replica multiplies its own copy of the operands, so the figure covers the whole accelerator (all
TPU cores, all GPUs). Two numbers, because they answer different questions:
  cold  the first call: tracing, compilation (XLA on a TPU) and the run, as a one-off job pays them;
  warm  the median of the later calls: what the device sustains once compiled.
Each timed call ends by reading its (reduced, scalar) result back to the host: dispatch is asynchronous,
and without that sync a call would return before the device has done the work. In the summary,
`timing.build_s` is making the operands and `timing.train_s` the timed calls.
"""

from __future__ import annotations

import logging
import math
import signal
import statistics
import time

import tensorflow as tf

from runner import Interrupted, Preempted, SpecError
from runner.device.strategy import resolve_accelerator
from runner.rundir.attempt import Attempt, JobResult, error_of
from runner.spec.types import JobSpec, MatmulSpec
from runner.train.preemption import EarlyNotice

log = logging.getLogger(__name__)


def operands(size: int, dtype: str) -> tuple[tf.Tensor, tf.Tensor]:
    """A and B, the same on every run and replica. B is scaled by 1/sqrt(N) so that each product keeps values
    near 1 (a float16 chain would overflow otherwise); a B whose largest eigenvalue exceeds 1 still grows them
    (N=1 draws 1.27), and a long enough chain overflows."""
    shape = (size, size)
    a = tf.random.stateless_normal(shape, seed=(0, 1))
    b = tf.random.stateless_normal(shape, seed=(0, 2)) / math.sqrt(size)
    return tf.cast(a, dtype), tf.cast(b, dtype)


def finite_products(size: int, dtype: str, chain: int) -> int:
    """How many products of the chain stay finite in `dtype` (one replica's, computed eagerly)."""
    x, b = operands(size, dtype)
    for done in range(chain):
        x = tf.matmul(x, b)
        if not bool(tf.reduce_all(tf.math.is_finite(tf.cast(x, tf.float32)))):
            return done
    return chain


def measure(call, matmul: MatmulSpec, replicas: int) -> dict:
    """Times the cold call and `iterations` warm calls; returns the summary's `matmul` block and TFLOPS."""
    flops = 2 * matmul.size**3 * matmul.chain * replicas
    began = time.monotonic()
    checksum = float(call().numpy())  # .numpy() waits for the device: the sync that makes the timing real
    cold_s = time.monotonic() - began
    warm = []
    for _ in range(matmul.iterations):
        began = time.monotonic()
        call().numpy()
        warm.append(time.monotonic() - began)
    if not math.isfinite(checksum):
        raise SpecError(_overflow_advice(matmul, checksum))
    warm_s = statistics.median(warm)
    return {
        "tflops": {"cold": _significant(flops / cold_s / 1e12), "warm": _significant(flops / warm_s / 1e12)},
        "matmul": {
            "size": matmul.size,
            "chain": matmul.chain,
            "dtype": matmul.dtype,
            "replicas": replicas,
            "flops_per_call": flops,
            "cold_s": round(cold_s, 6),
            "warm_s": round(warm_s, 6),
            "warm_calls_s": [round(s, 6) for s in warm],
            "checksum": checksum,
        },
    }


def _overflow_advice(matmul: MatmulSpec, checksum: float) -> str:
    finite = finite_products(matmul.size, matmul.dtype, matmul.chain)
    said = (f"the matmul chain's result is not finite ({checksum}): in {matmul.dtype} its values overflow after "
            f"{finite} of the {matmul.chain} products (matmul.chain) of {matmul.size} x {matmul.size} matrices")
    ways = [f"set matmul.chain to {finite} or less"] if finite else []
    if matmul.dtype != "float32" and finite_products(matmul.size, "float32", matmul.chain) == matmul.chain:
        ways.append("use matmul.dtype float32")
    if not ways:
        ways.append("multiply fewer or larger matrices (matmul.chain, matmul.size)")
    return f"{said}: {', or '.join(ways)}"


def _significant(value: float, digits: int = 4) -> float:
    """Rounded to `digits` significant figures: a CPU's 0.0004 TFLOPS and a TPU's 180 both keep their precision."""
    return float(f"{value:.{digits}g}")


def run_bench(
    spec: JobSpec, *, spec_loaded_at: float | None = None, early_notice: EarlyNotice | None = None
) -> JobResult:
    """Runs a matmul_bench job; returns its summary and the error that ended it, if any.

    A benchmark is measured afresh on every run: each run is a new attempt and replaces summary.json. It has
    no checkpoints to save: a SIGTERM or SIGINT that came while TensorFlow loaded stops it before it starts,
    writing nothing.
    """
    attempt = Attempt.begin(spec, spec_loaded_at)
    if early_notice is not None:
        early_notice.restore()
        if early_notice.at is not None:
            interrupted = early_notice.signal == signal.SIGINT
            error = (Interrupted if interrupted else Preempted)(
                f"{'interrupted' if interrupted else 'preemption notice received'} while starting; nothing was run; "
                "run the job again"
            )
            return JobResult(attempt.summary("interrupted" if interrupted else "preempted", error), error)
    attempt.number = attempt.run.next_attempt()
    attempt.run.write_json("spec.json", spec.to_dict())
    attempt.facts.kind, attempt.facts.attempt, attempt.facts.run_dir = "matmul_bench", attempt.number, attempt.run.path
    status, error = "failed", None
    try:
        with attempt.phases.phase("strategy"):
            attempt.accelerator = accelerator = resolve_accelerator(spec.accelerator)
        with attempt.phases.phase("build"):
            # Every replica multiplies its own copy (runner/device/engine.py `matmul_chain`).
            call = accelerator.engine.matmul_chain(spec.matmul, accelerator.strategy,
                                                   *operands(spec.matmul.size, spec.matmul.dtype))
        with attempt.phases.phase("train"):
            result = measure(call, spec.matmul, accelerator.replicas)
        attempt.facts.bench = result
        log.info(
            "matmul %d x %d, chain %d, %s on %s: %.4g TFLOPS cold, %.4g TFLOPS warm",
            spec.matmul.size, spec.matmul.size, spec.matmul.chain, spec.matmul.dtype, accelerator.kind,
            result["tflops"]["cold"], result["tflops"]["warm"],
        )
        status = "succeeded"
    except Exception as exc:  # the summary must still be written
        error = error_of(exc, spec, "matmul_bench")
    summary = attempt.summary(status, error)  # no batches: a benchmark of the device alone
    return JobResult(attempt.finish(summary, keep_succeeded=False), error)
