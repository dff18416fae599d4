"""The runner with its defaults vs the classic notebook way (plain Keras on in-memory numpy, float32).

`runner run jobs/mnist_cnn.yaml` (defaults: `train.mixed_precision: auto`, the TFRecord pipeline, a checkpoint
per epoch, the summary) against benchmarks/_plain_keras.py (the Basic CNN fitted on numpy arrays, float32),
same data, batch and epochs, each a fresh process, in alternating order (runner first, then plain first, ...)
so that a busy machine slows both alike. Reported per round: steady examples/s (epochs after the first),
wall time from launch to exit (TensorFlow's import included) and test accuracy.

    speed     runner steady examples/s / plain steady examples/s, median over rounds   goal >= 2.5
    accuracy  plain test accuracy - runner test accuracy, in points (last round)      goal <= 0.5
    wall      runner wall / plain wall, median over rounds                             measured

The CPU model and its bfloat16 flags are printed with the figures (auto's choice depends on them).

    .venv/bin/python benchmarks/runner_vs_keras.py [--quick] [--rounds N] [--epochs N]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BATCH, MNIST, REPO, prepared


def cpu() -> dict[str, str]:
    from runner.device import host

    text = host.read_cpuinfo() or ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 "unknown")
    flags = host.cpu_flags(text)
    shown = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return {"cpu": model, "cpu_flags": " ".join(shown) or "none of avx2/avx512/amx"}


def timed(command: list[str]) -> tuple[float, dict]:
    began = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - began
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:4])}... exited {result.returncode}:\n{result.stderr[-3000:]}")
    return wall, json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 20 steps: start-up dominates")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data", default=str(MNIST))
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for the runner")
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 20) if args.quick else (args.rounds, args.epochs, None)
    data = prepared(Path(args.data))
    out = Path(tempfile.mkdtemp(prefix="runner_vs_keras-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # run folders and models: not kept

    def runner(index: int) -> dict:
        sets = [
            f"name=bench-{index}", f"output.dir={out}", f"data.train={data}/train-*.tfrecord",
            f"data.eval={data}/test-*.tfrecord", f"data.global_batch_size={BATCH}", f"train.epochs={epochs}",
            *([f"train.steps_per_epoch={steps}"] if steps else []), *args.sets,
        ]
        wall, summary = timed([sys.executable, "-m", "runner", "run", "jobs/mnist_cnn.yaml",
                               *(a for s in sets for a in ("--set", s))])
        return {"wall_s": wall, "examples_per_sec": summary["timing"]["examples_per_sec"],
                "accuracy": summary["metrics"]["accuracy"], "summary": summary}

    def plain(index: int) -> dict:
        command = [sys.executable, "benchmarks/_plain_keras.py", str(data), str(out / f"plain-{index}"),
                   "--batch", str(BATCH), "--epochs", str(epochs)]
        command += ["--steps-per-epoch", str(steps)] if steps else []
        wall, doc = timed(command)
        return {"wall_s": wall, "examples_per_sec": doc["steady_examples_per_sec"], "accuracy": doc["accuracy"],
                "doc": doc}

    runs: dict[str, list[dict]] = {"runner": [], "plain": []}
    for round_ in range(rounds):
        order = (("runner", runner), ("plain", plain)) if round_ % 2 == 0 else (("plain", plain), ("runner", runner))
        for name, run in order:
            result = run(round_)
            runs[name].append(result)
            print(f"round {round_ + 1}: {name:6s} {result['examples_per_sec']:9.0f} examples/s  "
                  f"wall {result['wall_s']:6.1f} s"
                  f"  accuracy {result['accuracy']:.4f}", flush=True)

    speed = [r["examples_per_sec"] / p["examples_per_sec"] for r, p in zip(runs["runner"], runs["plain"], strict=True)]
    wall = [r["wall_s"] / p["wall_s"] for r, p in zip(runs["runner"], runs["plain"], strict=True)]
    last = runs["runner"][-1]["summary"]
    precision = last["accelerator"].get("precision", {})
    machine = cpu()
    print(f"\n{'round':>5s} {'runner ex/s':>12s} {'plain ex/s':>11s} {'speed':>6s} {'runner s':>9s} {'plain s':>8s} "
          f"{'runner acc':>11s} {'plain acc':>10s}")
    for index, (r, p) in enumerate(zip(runs["runner"], runs["plain"], strict=True), 1):
        print(f"{index:5d} {r['examples_per_sec']:12.0f} {p['examples_per_sec']:11.0f} "
              f"{r['examples_per_sec'] / p['examples_per_sec']:6.2f}"
              f" {r['wall_s']:9.1f} {p['wall_s']:8.1f} {r['accuracy']:11.4f} {p['accuracy']:10.4f}")
    print(f"runner precision: {precision}; CPU: {machine['cpu']} ({machine['cpu_flags']})")
    timing = last["timing"]
    print("runner phases (last run): " + ", ".join(
        f"{k.removesuffix('_s')} {timing[k]:.1f}"
        for k in ("import_s", "train_s", "checkpoint_s", "eval_s", "export_s")))
    gap = 100 * (statistics.median(p["accuracy"] for p in runs["plain"])
                 - statistics.median(r["accuracy"] for r in runs["runner"]))
    detail = {
        "runner_examples_per_sec": round(statistics.median(r["examples_per_sec"] for r in runs["runner"]), 1),
        "plain_examples_per_sec": round(statistics.median(p["examples_per_sec"] for p in runs["plain"]), 1),
        "round_ratios": " ".join(f"{s:.3f}" for s in speed), "precision": precision.get("policy", "?"),
        "precision_reason": precision.get("reason", "?"), **machine, "batch": BATCH, "epochs": epochs, "rounds": rounds,
        "quick": args.quick, "sets": " ".join(args.sets),
    }
    print(json.dumps({"benchmark": "runner_vs_keras[speed]", "ratio": round(statistics.median(speed), 3),
                      "goal": ">= 2.5", "detail": detail}))
    print(json.dumps({"benchmark": "runner_vs_keras[accuracy_gap_points]", "ratio": round(gap, 3), "goal": "<= 0.5",
                      "detail": {
                          "runner_accuracy": " ".join(f"{r['accuracy']:.4f}" for r in runs["runner"]),
                          "plain_accuracy": " ".join(f"{p['accuracy']:.4f}" for p in runs["plain"])}}))
    print(json.dumps({"benchmark": "runner_vs_keras[wall]", "ratio": round(statistics.median(wall), 3),
                      "goal": "measured", "detail": {
                          "round_ratios": " ".join(f"{w:.3f}" for w in wall),
                          "runner_wall_s": round(statistics.median(r["wall_s"] for r in runs["runner"]), 1),
                          "plain_wall_s": round(statistics.median(p["wall_s"] for p in runs["plain"]), 1)}}))


if __name__ == "__main__":
    main()
