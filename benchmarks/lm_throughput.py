"""Tokens per second of a `model.hub` job against plain KerasHub `fit` of the same model on the same records.

The tiny Gemma preset of the tests (tests/support/hub_preset.py: 2 layers, hidden 128, vocabulary 512, random
weights) with LoRA rank 4, on prompt/response records of 24 tokens made by `runner prepare text`, batch 32, under
Keras on JAX on this CPU's one device. The runner arm is `runner run` with its defaults (the job's precision,
a checkpoint per epoch, the summary; no per-epoch validation, which the plain arm does not do either) and reads
the summary's `throughput.tokens_per_sec`; the plain arm is benchmarks/_plain_keras_lm.py in the same precision
(numpy arrays, `model.fit`). Each a fresh process; the order turns every round. Steady epochs only (the first,
which compiles, left out).

    speed   runner tokens/s / plain tokens/s, median over rounds   goal >= 0.95

--mesh BxM trains the same model sharded over B x M of JAX's CPU devices in both arms: the runner with
accelerator.mesh {batch: B, model: M} and model.sharding hub, the plain script with the same DeviceMesh, the
backbone's get_layout_map and ModelParallel (the Gemma distributed-tuning guide's recipe).

    .venv/bin/python benchmarks/lm_throughput.py [--quick] [--rounds N] [--epochs N] [--records N] [--batch N]
        [--mesh BxM]
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

from _common import REPO

OUT = REPO / "benchmarks" / "out" / "lm"


def run(command: list[str], env: dict | None = None) -> tuple[float, dict]:
    began = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:5])}... exited {result.returncode}:\n{result.stderr[-3000:]}")
    return time.monotonic() - began, json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--records", type=int, default=3200, help="prompt/response pairs (80% train)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 epochs of 800 records at batch 8")
    parser.add_argument("--mesh", default=None, help="BxM: both arms sharded over B x M CPU devices")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.epochs, args.records, args.batch = 1, 3, 800, 8
    preset, data = OUT / "preset", OUT / f"data-{args.records}"
    if not (preset / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tests.support.hub_preset", str(preset)], cwd=REPO, check=True,
                       env={**os.environ, "KERAS_BACKEND": "jax"}, capture_output=True)
    if not (data / "manifest.json").exists():
        from tests.support.hub_preset import SEQUENCE_LENGTH, write_chats

        chats = write_chats(OUT / f"chats-{args.records}.jsonl", args.records)
        subprocess.run([sys.executable, "-m", "runner", "prepare", "text", str(chats), "--preset", str(preset),
                        "--sequence-length", str(SEQUENCE_LENGTH), "--out", str(data)], cwd=REPO, check=True,
                       capture_output=True)
    spec = OUT / "lm_bench.yaml"
    rows, columns = (int(n) for n in args.mesh.split("x")) if args.mesh else (1, 1)
    sharded = {"kind": "cpu", "cpu_devices": rows * columns, "mesh": {"batch": rows, "model": columns}}
    spec.write_text(json.dumps({
        "name": "lm_bench", "model": {"hub": str(preset), "lora_rank": 4, **({"sharding": "hub"} if args.mesh else {})},
        "accelerator": {"backend": "jax", **(sharded if args.mesh else {})},
        "data": {"train": f"{data}/train-*.tfrecord", "global_batch_size": args.batch},
        "train": {"epochs": args.epochs, "learning_rate": 0.01, "validation_every": "never"},
        "output": {"dir": str(OUT / "runs")},
    }))
    policy = None

    def runner(index: int) -> dict:
        nonlocal policy
        wall, summary = run([sys.executable, "-m", "runner", "run", str(spec), "--fresh",
                             "--set", f"name=lm_bench-{index}"])
        policy = summary["accelerator"]["precision"]["policy"]
        return {"tokens_per_sec": summary["throughput"]["tokens_per_sec"], "wall_s": wall,
                "epoch_s": [e["seconds"] for e in summary["epochs"]], "mfu": summary["throughput"]["mfu"],
                "flops_method": summary["throughput"]["flops_method"]}

    def plain(index: int) -> dict:
        keras_policy = "mixed_bfloat16" if policy == "bfloat16" else "float32"
        wall, doc = run([sys.executable, "benchmarks/_plain_keras_lm.py", str(preset), str(data), "--batch",
                         str(args.batch), "--epochs", str(args.epochs), "--policy", keras_policy,
                         *(["--mesh", args.mesh] if args.mesh else [])],
                        env={"KERAS_BACKEND": "jax", **({"JAX_NUM_CPU_DEVICES": str(rows * columns)} if args.mesh
                                                        else {})})
        return {"tokens_per_sec": doc["steady_tokens_per_sec"], "wall_s": wall, "epoch_s": doc["epoch_s"]}

    runs: dict[str, list[dict]] = {"runner": [], "plain": []}
    arms = {"runner": runner, "plain": plain}
    for round_ in range(args.rounds):
        order = ["runner", "plain"] if round_ % 2 == 0 else ["plain", "runner"]
        if policy is None:
            order = ["runner", "plain"]  # the plain arm computes in the precision the runner chose
        for name in order:
            result = arms[name](round_)
            runs[name].append(result)
            steady = " ".join(f"{s:.2f}" for s in result["epoch_s"][1:])
            print(f"round {round_ + 1}: {name:6s} {result['tokens_per_sec']:9.0f} tokens/s  wall "
                  f"{result['wall_s']:5.1f} s  steady epochs {steady} s", flush=True)
    ratios = [r["tokens_per_sec"] / p["tokens_per_sec"] for r, p in zip(runs["runner"], runs["plain"], strict=True)]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    detail = {
        "runner_tokens_per_sec": round(statistics.median(r["tokens_per_sec"] for r in runs["runner"]), 1),
        "plain_tokens_per_sec": round(statistics.median(p["tokens_per_sec"] for p in runs["plain"]), 1),
        "round_ratios": " ".join(f"{r:.3f}" for r in ratios), "precision": policy, "cpu": cpu,
        "runner_mfu": runs["runner"][-1]["mfu"], "flops_method": runs["runner"][-1]["flops_method"],
        "batch": args.batch, "epochs": args.epochs, "records": args.records, "rounds": args.rounds,
        "mesh": args.mesh or "one device",
    }
    print(json.dumps({"benchmark": "lm_throughput[speed]", "ratio": round(statistics.median(ratios), 3),
                      "goal": ">= 0.95", "detail": detail}))


if __name__ == "__main__":
    main()
