"""Input never the bottleneck: the summary's `input_wait_fraction` for each of the six jobs at its default batch.

Each job's own spec (jobs/*.yaml, and the own-model example examples/fashion/job.yaml) runs through
`runner run` for a few hundred steps (`--epochs` x at most `--steps` steps per epoch) on its real offline
data, prepared into benchmarks/out/<dataset> the first time. CIFAR-10 offline holds 20 real images: they are
repeated into 10,240 training records (same format and decode cost as the real set). Reported per job: the
training's steady examples/s, how data.train fed it (`input`: in_memory or streamed, the summary's train_input),
the share of training time the loop waited for its input (goal <= 0.02), and the input pipeline alone (the one
the run trained from, held or streamed; no model, same batch), as examples/s and as the
headroom over training: the factor by which training could speed up (bfloat16: about 2x where the CPU has
it) before the pipeline, as measured alone, would fall behind.

    .venv/bin/python benchmarks/input_wait.py [--quick] [JOB ...] [--epochs N] [--steps N] [--set KEY=VALUE]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "benchmarks" / "out"
EXAMPLE = REPO / "examples" / "fashion"

# job -> (spec, dataset folder, splits to point at)
JOBS = {
    "mnist_cnn": ("jobs/mnist_cnn.yaml", "mnist", {"train": "train", "eval": "test"}),
    "fashion_mnist_cnn": ("jobs/fashion_mnist_cnn.yaml", "fashion_mnist", {"train": "train", "eval": "test"}),
    "cifar10_cnn": ("jobs/cifar10_cnn.yaml", "cifar10_repeated", {"train": "train", "eval": "test"}),
    "imdb_lstm": ("jobs/imdb_lstm.yaml", "imdb", {"train": "train", "eval": "test"}),
    "weather_rnn": ("jobs/weather_rnn.yaml", "weather", {"train": "train", "eval": "test", "validation": "validation"}),
    "fashionnet": ("examples/fashion/job.yaml", "fashion_png", {"train": "train", "eval": "eval"}),
}


def env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(EXAMPLE / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": path}


def run(*command: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env(), timeout=timeout)
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:6])} ... exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def prepared(job: str) -> Path:
    spec, name, _ = JOBS[job]
    folder = OUT / name
    if (folder / "manifest.json").exists():
        return folder
    if name == "cifar10_repeated":
        repeat_cifar(folder)
    elif name == "fashion_png":
        run(sys.executable, "-m", "fashionnet.prepare", "--out", str(folder))
        run(sys.executable, "-m", "runner", "manifest", spec, "--set", f"data.train={folder}/train-*.tfrecord",
            "--set", f"data.eval={folder}/eval-*.tfrecord")
    else:
        run(sys.executable, "-m", "runner", "prepare", name, "--out", str(folder))
    return folder


def repeat_cifar(folder: Path) -> None:
    import numpy as np

    from runner.prepare import shards
    from runner.prepare.datasets import Dataset, load_dataset

    real = load_dataset("cifar10")
    pool = {k: np.concatenate([v for v in real.splits.values()][0:0] + [s[k] for s in real.splits.values()])
            for k in real.splits["train"]}
    count = len(pool["label"])
    picks = {"train": np.arange(10_240) % count, "test": np.arange(2_048) % count}
    splits = {split: {k: v[index] for k, v in pool.items()} for split, index in picks.items()}
    repeated = Dataset(real.name, splits, real.features, real.inputs, real.label,
                       real.source + " (20 real images, repeated)", real.license)
    folder.mkdir(parents=True, exist_ok=True)
    entries = {split: shards.write_split(repeated, split, str(folder), 4 if split == "train" else 1)
               for split in splits}
    shards.write_manifest(str(folder), shards.manifest_for(repeated, entries))


def overrides(job: str, folder: Path, epochs: int, steps: int | None, extra: list[str]) -> list[str]:
    _, _, splits = JOBS[job]
    sets = [f"data.{key}={folder}/{split}-*.tfrecord" for key, split in splits.items()]
    sets += [f"train.epochs={epochs}", f"output.dir={OUT / 'input_wait_runs'}", f"name={job}-{time.strftime('%H%M%S')}",
             "output.tensorboard=false", "train.early_stopping_patience=null", "train.reduce_lr_patience=null", *extra]
    if steps:
        sets.append(f"train.steps_per_epoch={steps}")
    return [a for s in sets for a in ("--set", s)]


PIPELINE_ALONE = """
import json, sys, time
from runner.data import pipeline
from runner.spec import usercode
from runner.spec.load import load_spec
spec = load_spec(sys.argv[1], json.loads(sys.argv[2]))
d = spec.data
preprocess = (usercode.load_callable(d.preprocess, "data.preprocess", ("features",), spec.code_roots)
              if d.preprocess else None)
shards = pipeline.find_shards(d.train)
if sys.argv[4] == "in_memory":  # what the run trained from: the split held in memory (loading not timed)
    from runner.data import in_memory
    held = in_memory.load(shards, (*d.inputs, d.label), "data.train")
    dataset = in_memory.make_dataset(held, shards.features, d.global_batch_size, d.inputs, d.label,
                                     shuffle=d.shuffle_buffer > 1, seed=0, preprocess=preprocess)
else:
    dataset = pipeline.make_dataset(shards, d.global_batch_size, d.inputs, d.label, training=True,
                                    shuffle_buffer=d.shuffle_buffer, seed=0, preprocess=preprocess, autotune=d.autotune)
batches = iter(dataset)
for _ in range(5):
    next(batches)
began, count = time.monotonic(), 0
while time.monotonic() - began < float(sys.argv[3]):
    next(batches)
    count += 1
print(json.dumps({"examples_per_sec": count * d.global_batch_size / (time.monotonic() - began)}))
"""


def pipeline_alone(job: str, folder: Path, extra: list[str], seconds: float, mode: str) -> float:
    spec, _, _ = JOBS[job]
    sets = [s for s in overrides(job, folder, 1, None, extra)[1::2]]
    result = run(sys.executable, "-c", PIPELINE_ALONE, spec, json.dumps(sets), str(seconds), mode)
    return json.loads(result.stdout.strip().splitlines()[-1])["examples_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Checked below, not with `choices`: argparse tests an empty nargs="*" against them as one value, [].
    parser.add_argument("jobs", nargs="*", metavar="JOB", help=f"one of {', '.join(JOBS)} (default: every one)")
    parser.add_argument("--quick", action="store_true", help="2 epochs of 10 steps per job")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="at most this many steps per epoch")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for every job")
    args = parser.parse_args()
    unknown = [job for job in args.jobs if job not in JOBS]
    if unknown:
        parser.error(f"no job {', '.join(unknown)}: choose from {', '.join(JOBS)}")
    args.jobs = args.jobs or list(JOBS)
    epochs, cap = (2, 10) if args.quick else (args.epochs, args.steps)
    rows = []
    for job in args.jobs:
        folder = prepared(job)
        manifest = json.loads((folder / "manifest.json").read_text())
        spec = JOBS[job][0]
        import yaml

        batch = yaml.safe_load((REPO / spec).read_text())["data"]["global_batch_size"]
        steps = min(manifest["splits"]["train"]["records"] // batch, cap)
        result = run(sys.executable, "-m", "runner", "run", spec, *overrides(job, folder, epochs, steps, args.sets))
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        timing = summary["timing"]
        mode = summary["train_input"]["mode"]
        alone = pipeline_alone(job, folder, args.sets, 5.0 if args.quick else 15.0, mode)
        row = {
            "job": job, "batch": batch, "steps": epochs * steps, "examples_per_sec": timing["examples_per_sec"],
            "input_wait_fraction": timing["input_wait_fraction"], "input_wait_method": timing["input_wait_method"],
            "pipeline_alone_examples_per_sec": round(alone), "headroom": round(alone / timing["examples_per_sec"], 2),
            "precision": summary["accelerator"]["precision"]["policy"], "input": mode,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'job':<20}{'batch':>6}{'steps':>6}{'input':>11}{'train ex/s':>12}{'input wait':>12}"
          f"{'pipeline ex/s':>15}{'headroom':>10}")
    for r in rows:
        print(f"{r['job']:<20}{r['batch']:>6}{r['steps']:>6}{r['input']:>11}{r['examples_per_sec']:>12,.0f}"
              f"{r['input_wait_fraction']:>12.4f}{r['pipeline_alone_examples_per_sec']:>15,}{r['headroom']:>10.1f}")
    for r in rows:
        detail = {k: v for k, v in r.items() if k not in ("job", "input_wait_method")} | {"quick": args.quick}
        print(json.dumps({"benchmark": f"input_wait[{r['job']}]", "ratio": r["input_wait_fraction"], "goal": "<= 0.02",
                          "detail": detail}))
    print(f"median input wait: {statistics.median(r['input_wait_fraction'] for r in rows):.4f}")


if __name__ == "__main__":
    main()
