"""The runner with its defaults vs the classic notebook way and vs a Keras expert's version of it.

`runner run jobs/mnist_cnn.yaml` (defaults: `train.mixed_precision: auto`, the data held in memory, a checkpoint
per epoch, the summary) against benchmarks/_plain_keras.py twice: as the notebook writes it (the Basic CNN fitted
on numpy arrays, float32) and as a Keras expert would (the same script with
`keras.mixed_precision.set_global_policy("mixed_bfloat16")` set by hand, softmax in float32). Same data, batch
and epochs, each a fresh process; the order of the three turns by one every round so that a busy machine slows
them alike. Reported per round: steady examples/s (epochs after the first), the steady epochs' seconds (their
spread says how noisy the machine was), wall time from launch to exit and test accuracy; then MFU: the model's
FLOPs (runner/train/flops.py) x examples/s / this CPU's measured matmul peak in the arm's dtype
(runner/device/peak.py).

    speed     runner steady examples/s / plain steady examples/s, median over rounds   goal >= 2.5
    expert    runner steady examples/s / expert steady examples/s, median over rounds  goal >= 1.25
    accuracy  plain test accuracy - runner test accuracy, in points (medians)          goal <= 0.5
    wall      runner wall / plain wall, median over rounds                             measured
    mfu       each arm's achieved TFLOP/s / the CPU's peak in its dtype                measured

The CPU model and its bfloat16 flags are printed with the figures (auto's choice depends on them).

    .venv/bin/python benchmarks/runner_vs_keras.py [--quick] [--rounds N] [--epochs N] [--no-expert]
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
    parser.add_argument("--no-expert", action="store_true", help="leave out the mixed_bfloat16 Keras arm")
    parser.add_argument("--peak-cache", default=None, help="cache folder of the CPU peak (runner/device/peak.py)")
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
                "accuracy": summary["metrics"]["accuracy"], "summary": summary,
                "policy": summary["accelerator"].get("precision", {}).get("policy", "?"),
                "epoch_s": [e["seconds"] for e in summary["epochs"]]}

    def keras_script(policy: str):
        def run(index: int) -> dict:
            command = [sys.executable, "benchmarks/_plain_keras.py", str(data), str(out / f"{policy}-{index}"),
                       "--batch", str(BATCH), "--epochs", str(epochs), "--policy", policy]
            command += ["--steps-per-epoch", str(steps)] if steps else []
            wall, doc = timed(command)
            return {"wall_s": wall, "examples_per_sec": doc["steady_examples_per_sec"], "accuracy": doc["accuracy"],
                    "doc": doc, "policy": "bfloat16" if "bfloat16" in policy else "float32", "epoch_s": doc["epoch_s"]}
        return run

    arms = {"runner": runner, "plain": keras_script("float32")}
    if not args.no_expert:
        arms["expert"] = keras_script("mixed_bfloat16")
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    names = list(arms)
    for round_ in range(rounds):
        shift = round_ % len(names)  # each arm goes first, middle and last in turn
        for name in names[shift:] + names[:shift]:
            result = arms[name](round_)
            runs[name].append(result)
            print(f"round {round_ + 1}: {name:6s} {result['examples_per_sec']:9.0f} examples/s  "
                  f"wall {result['wall_s']:6.1f} s  steady epochs {_seconds(result['epoch_s'][1:])}"
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
    if "expert" in runs:
        expert = [r["examples_per_sec"] / e["examples_per_sec"]
                  for r, e in zip(runs["runner"], runs["expert"], strict=True)]
        print(json.dumps({"benchmark": "runner_vs_keras[expert]", "ratio": round(statistics.median(expert), 3),
                          "goal": ">= 1.25", "detail": {
                              "runner_examples_per_sec": detail["runner_examples_per_sec"],
                              "expert_examples_per_sec": round(statistics.median(
                                  e["examples_per_sec"] for e in runs["expert"]), 1),
                              "round_ratios": " ".join(f"{x:.3f}" for x in expert),
                              "expert_accuracy": " ".join(f"{e['accuracy']:.4f}" for e in runs["expert"]),
                              "cpu": machine["cpu"], "rounds": rounds}}))
    mfu = measure_mfu(args.peak_cache)
    spreads = {}
    for name, results in runs.items():
        steady = [s for r in results for s in r["epoch_s"][1:]]
        rates = [r["examples_per_sec"] for r in results]
        policy = results[-1]["policy"]
        peak = mfu["peaks"].get(policy, {}).get("tflops")
        achieved = [mfu["flops_per_example"] * x / 1e12 for x in rates]
        spreads[name] = {
            "policy": policy, "steady_epoch_s": _seconds(steady),
            "examples_per_sec": " ".join(f"{x:.0f}" for x in rates),
            "tflops": round(statistics.median(achieved), 4),
            "mfu": None if not peak else round(statistics.median(achieved) / peak, 3),
        }
        print(f"{name:6s} {policy:9s} steady epochs {spreads[name]['steady_epoch_s']} s; "
              f"{spreads[name]['tflops']} TFLOP/s, MFU {spreads[name]['mfu']} (peak {peak} TFLOP/s)")
    print(json.dumps({"benchmark": "runner_vs_keras[mfu]", "ratio": spreads["runner"]["mfu"], "goal": "measured",
                      "detail": {"arms": spreads, "flops_per_example": round(mfu["flops_per_example"]),
                                 "flops_method": mfu["flops_method"],
                                 "step_flops_per_example": round(mfu["step_flops_per_example"] or 0),
                                 "peaks": mfu["peaks"], "cpu": mfu["cpu"]}}))


def measure_mfu(cache: str | None) -> dict:
    """The model's FLOPs and the CPU's peaks, from benchmarks/_mfu.py in a child process (TensorFlow stays out of
    this one)."""
    command = [sys.executable, "benchmarks/_mfu.py", "--batch", str(BATCH), *(["--cache-dir", cache] if cache else [])]
    return timed(command)[1]


def _seconds(values: list[float]) -> str:
    """Epoch seconds as 'min-max (n)': the spread of the steady epochs."""
    return f"{min(values):.1f}-{max(values):.1f} ({len(values)})" if values else "none"


if __name__ == "__main__":
    main()
