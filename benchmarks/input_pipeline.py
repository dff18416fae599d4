"""The training input pipeline's own speed: records handed over one by one vs in blocks, glibc vs tcmalloc.

The runner's pipeline (`data.make_dataset`, training=True, batch 1024, the job's default shuffle buffer of
10,000) streams the MNIST TFRecords for EPOCHS epochs per pass, decoding every batch, with no model: what
a TPU host must sustain. Four arms, each pass in a fresh process so the allocator can be swapped in with
LD_PRELOAD (the runner image preloads tcmalloc, see the Dockerfile):

    one by one   each shard reader hands the interleave one record at a time (block=1, the former pipeline)
    blocks       blocks of data.block_for(batch, shards) records (the runner's default)

each with glibc's malloc and with tcmalloc (Debian's libtcmalloc-minimal4). Arms alternate within each
round so a busy machine slows all alike; every process runs one warm-up pass (tracing, page cache) before
the counted ones. Also timed: steady examples/s of the MNIST Basic CNN training on the pipeline (first
epoch left out) with each allocator, to see what the allocator does to a whole job on this CPU.

Ratios (medians of records/s or examples/s; measured, no goal):
    blocks / one by one (glibc), tcmalloc / glibc (blocks), tcmalloc / glibc (training)

    .venv/bin/python benchmarks/input_pipeline.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import BATCH, MNIST, prepared

EPOCHS = 5
TCMALLOC = "libtcmalloc_minimal.so.4"
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def tcmalloc_path() -> str:
    for folder in _LIBRARY_DIRS:
        if (path := Path(folder) / TCMALLOC).exists():
            return str(path)
    sys.exit(f"{TCMALLOC} not found: install it with `apt-get install -y libtcmalloc-minimal4`")


def worker_pipeline(folder: str, block: int, passes: int) -> list[dict]:
    from runner.data import pipeline

    shards = pipeline.find_shards(f"{folder}/train-*.tfrecord")
    steps = shards.records // BATCH * EPOCHS
    results = []
    for index in range(passes + 1):
        dataset = pipeline.make_dataset(
            shards, BATCH, ("image",), "label", training=True, shuffle_buffer=10_000, seed=index, block=block
        ).take(steps)
        began, cpu = time.monotonic(), time.process_time()
        batches = sum(1 for _ in dataset)
        if index:  # pass 0 warms up
            seconds = time.monotonic() - began
            results.append({"records_per_s": batches * BATCH / seconds, "cpu_s": time.process_time() - cpu})
    return results


def worker_fit(folder: str, epochs: int, steps: int) -> list[dict]:
    from _common import epoch_clock, fresh_model

    from runner.data import pipeline

    shards = pipeline.find_shards(f"{folder}/train-*.tfrecord")
    model = fresh_model(shards.features)
    dataset = pipeline.make_dataset(shards, BATCH, ("image",), "label", training=True, shuffle_buffer=10_000, seed=0)
    clock = epoch_clock()
    model.fit(dataset, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=[clock])
    return [{"examples_per_s": steps * BATCH / seconds} for seconds in clock.seconds[1:]]


def run_arm(args: argparse.Namespace, folder: Path, preload: str | None, *worker: str) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    command = [sys.executable, __file__, "--data", str(folder), "--worker", *worker]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 1 pass per arm, a short fit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", default=str(MNIST))
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *numbers = args.worker
        function = worker_pipeline if kind == "pipeline" else worker_fit
        print(json.dumps(function(args.data, *map(int, numbers))))
        return

    folder = prepared(args.data)
    tcmalloc = tcmalloc_path()
    rounds, passes, epochs, steps = (1, 1, 2, 10) if args.quick else (args.rounds, 2, 3, 30)
    from runner.data import pipeline as _  # noqa: F401  (fails here, not in every child, if the runner is missing)

    manifest = json.loads((folder / "manifest.json").read_text())
    shard_count = len(manifest["splits"]["train"]["shards"])
    from runner.data.pipeline import MAX_OPEN_SHARDS, block_for

    block = block_for(BATCH, min(shard_count, MAX_OPEN_SHARDS))
    arms = {
        ("one by one", "glibc"): (None, "pipeline", "1"),
        ("blocks", "glibc"): (None, "pipeline", str(block)),
        ("one by one", "tcmalloc"): (tcmalloc, "pipeline", "1"),
        ("blocks", "tcmalloc"): (tcmalloc, "pipeline", str(block)),
    }
    fits = {"glibc": (None, "fit", str(epochs), str(steps)), "tcmalloc": (tcmalloc, "fit", str(epochs), str(steps))}
    rates: dict = {arm: [] for arm in arms}
    cpu: dict = {arm: [] for arm in arms}
    training: dict = {name: [] for name in fits}
    for round_index in range(rounds):
        order = list(arms) if round_index % 2 == 0 else list(reversed(arms))
        for arm in order:
            preload, *worker = arms[arm]
            for result in run_arm(args, folder, preload, *worker, str(passes)):
                rates[arm].append(result["records_per_s"])
                cpu[arm].append(result["cpu_s"])
        for name in fits if round_index % 2 == 0 else reversed(fits):
            preload, *worker = fits[name]
            training[name].extend(r["examples_per_s"] for r in run_arm(args, folder, preload, *worker))

    median = {arm: statistics.median(values) for arm, values in rates.items()}
    print(
        f"{manifest['splits']['train']['records']} records in {shard_count} shards, batch {BATCH}, block {block}, "
        f"{EPOCHS} epochs per pass, {rounds} rounds x {passes} passes per arm"
    )
    print(f"{'pipeline':<26}{'median':>12}{'min':>12}{'max':>12}{'CPU-s/pass':>12}")
    for arm, values in rates.items():
        label = f"{arm[0]}, {arm[1]}"
        print(
            f"{label:<26}{median[arm]:>12,.0f}{min(values):>12,.0f}{max(values):>12,.0f}"
            f"{statistics.median(cpu[arm]):>12.2f}  records/s"
        )
    steady = {name: statistics.median(values) for name, values in training.items()}
    for name, values in training.items():
        label = f"training, {name}"
        print(f"{label:<26}{steady[name]:>12,.0f}{min(values):>12,.0f}{max(values):>12,.0f}{'':>12}  examples/s")
    ratios = {
        "input_pipeline_blocks": (median[("blocks", "glibc")] / median[("one by one", "glibc")],
                                  "blocks / one by one, glibc"),
        "input_pipeline_tcmalloc": (median[("blocks", "tcmalloc")] / median[("blocks", "glibc")],
                                    "tcmalloc / glibc, blocks"),
        "training_tcmalloc": (steady["tcmalloc"] / steady["glibc"], "tcmalloc / glibc, MNIST CNN training"),
    }
    for _name, (ratio, what) in ratios.items():
        print(f"{what}: {ratio:.3f}")
    detail = {
        f"records_per_s_{arm[0].replace(' ', '_')}_{arm[1]}": round(value) for arm, value in median.items()
    } | {f"examples_per_s_{name}": round(value) for name, value in steady.items()} | {
        "block": block,
        "rounds": rounds,
        "passes_per_arm_and_round": passes,
    }
    for name, (ratio, _what) in ratios.items():
        print(json.dumps({"benchmark": name, "ratio": round(ratio, 3), "goal": "measured", "detail": detail}))


if __name__ == "__main__":
    main()
