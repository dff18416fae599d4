"""One job as 1, 2 and 4 processes on this machine (JAX's multi-process runtime, gloo collectives on the CPU),
on the same global batch: what the processes cost, and how much of a step the all-reduce takes.

Arms, each measured in fresh processes on 127.0.0.1 (docs/multihost.md):
    processes_N    `runner run jobs/mnist_cnn.yaml` (accelerator.backend jax, float32) as N processes with one CPU
                   device each, the global batch unchanged: steady examples/s of the whole job (the median
                   epoch after the first, which holds the compile) and the step time
    allreduce_N    N processes each all-reducing (jax psum, jit) an array as large as the model's trainable
                   weights, as DataParallel does with the gradients every step: milliseconds per all-reduce
Printed: each arm, the ratio of each process count's examples/s to one process's, and the all-reduce's share of
a step. On this 2-core machine 2 and 4 processes share two cores: this is a CPU figure of the runtime's overhead,
not a speed-up; on a TPU slice the interconnect carries the all-reduce (docs/multihost.md).

    .venv/bin/python benchmarks/multihost.py [--quick] [--epochs N] [--steps N] [--batch N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MNIST, REPO, prepared
from runner_vs_keras import cpu

_ALLREDUCE = """
import sys, time, json
import jax, jax.numpy as jnp, numpy as np
address, count, index, size, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if count > 1:
    jax.distributed.initialize(address, count, index, initialization_timeout=120)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
local = np.ones((1, size), np.float32)
grads = jax.make_array_from_process_local_data(sharded, local, (count, size))
total = jax.jit(lambda g: g.sum(axis=0), out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
total(grads).block_until_ready()
began = time.perf_counter()
for _ in range(calls):
    out = total(grads)
out.block_until_ready()
print(json.dumps({"ms": (time.perf_counter() - began) / calls * 1000}))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def together(command: list[str], count: int, env: dict[str, str] | None = None) -> list[str]:
    """Runs `command` as `count` processes of one job; their stdouts."""
    port, procs = free_port(), []
    for index in range(count):
        extra = {} if count == 1 else {
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}", "KERAS_DISTRIBUTION_NUM_PROCESSES": str(count),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(index)}
        procs.append(subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, **(env or {}), **extra}))
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"{' '.join(command[:5])}... exited {proc.returncode}:\n{err[-3000:]}")
        outs.append(out)
    return outs


def job(count: int, data: Path, out: Path, epochs: int, steps: int, batch: int) -> dict:
    command = [sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml", "--set", "accelerator.backend=jax",
               "--set", "accelerator.kind=cpu", "--set", "train.mixed_precision=float32",
               "--set", f"data.train={data}/train-*.tfrecord", "--set", f"data.eval={data}/test-*.tfrecord",
               "--set", f"data.global_batch_size={batch}", "--set", f"train.epochs={epochs}",
               "--set", f"train.steps_per_epoch={steps}", "--set", f"output.dir={out}/{count}",
               "--set", "output.tensorboard=false", "--set", "data.in_memory=false"]
    summary = json.loads(together(command, count)[0].strip().splitlines()[-1])
    steady = [e["examples_per_sec"] for e in summary["epochs"][1:]]
    return {"examples_per_sec": statistics.median(steady), "step_s": batch / statistics.median(steady)}


def allreduce(count: int, size: int, calls: int) -> float:
    """Milliseconds per all-reduce of `size` float32 among `count` processes (the slowest process's)."""
    port, procs = free_port(), []
    for index in range(count):
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _ALLREDUCE, f"127.0.0.1:{port}", str(count), str(index), str(size), str(calls)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"}))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return max(json.loads(o.strip().splitlines()[-1])["ms"] for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs of 10 steps, processes 1 and 2 only")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--data", default=str(MNIST))
    args = parser.parse_args()
    epochs, steps, counts = (2, 10, (1, 2)) if args.quick else (args.epochs, args.steps, (1, 2, 4))
    data = prepared(Path(args.data))
    out = Path(tempfile.mkdtemp(prefix="multihost-"))
    # The model's trainable weights: the size DataParallel all-reduces every step.
    from runner.data import pipeline
    from runner.spec.load import load_spec
    from runner.train import build

    spec = load_spec(REPO / "jobs" / "mnist_cnn.yaml", [])
    model = build.build_model(spec, pipeline.find_shards(f"{data}/train-*.tfrecord").features)
    size = int(sum(w.numpy().size for w in model.trainable_weights))
    results: dict = {**cpu(), "trainable_params": size, "global_batch": args.batch}
    for count in counts:
        measured = job(count, data, out, epochs, steps, args.batch)
        results[f"processes_{count}"] = {k: round(v, 4) for k, v in measured.items()}
        results[f"allreduce_{count}_ms"] = round(allreduce(count, size, 20), 3) if count > 1 else 0.0
        time.sleep(1)
    one = results["processes_1"]["examples_per_sec"]
    for count in counts[1:]:
        mine = results[f"processes_{count}"]
        results[f"ratio_{count}_to_1"] = round(mine["examples_per_sec"] / one, 3)
        results[f"allreduce_share_{count}"] = round(results[f"allreduce_{count}_ms"] / 1000 / mine["step_s"], 3)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
