"""Checkpoint saves that do not stall training: the seconds the training loop is blocked per save, synchronous
vs in the background (runner/train/saver.py), to gs:// on the GCS emulator.

A model of about 100 MB of float32 weights (25.2 M: Dense 4096 -> 4096 -> 2048 -> 10) with Adam (so a
checkpoint holds about 300 MB: weights and two slots) trains on random batches through the runner's own
training loop (`train.fit`: the Checkpointer saving at every epoch end through the run folder's
CheckpointManager), saving every epoch into a gs:// bucket on the emulator (tests/support/gcs.py: the
Python emulator behind the TLS proxy TensorFlow's client talks to). Each round runs both modes, in
alternating order. Blocked = the time `save()` took in the loop (the copy, plus any wait for the write
before it); the final wait for the last write, once at the end of training, is reported apart.

    ratio  median blocked per save, async / sync          goal <= 0.10

    .venv/bin/python benchmarks/async_checkpoint.py [--quick] [--rounds N] [--epochs N] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tests.support.gcs import start_gcs  # noqa: E402


def train_once(url: str, asynchronous: bool, epochs: int, steps: int, batch: int) -> dict:
    import numpy as np
    import tensorflow as tf

    from runner.rundir.outputs import RunFolder
    from runner.train import fit
    from runner.train.preemption import PreemptionNotice
    from runner.train.saver import Saver
    from runner.train.tf_store import TensorFlowStore

    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4096,)), keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    weights_mb = sum(int(np.prod(v.shape)) for v in model.weights) * 4 / 1e6
    x = np.random.default_rng(0).random((batch * 4, 4096), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, batch * 4)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    saver = Saver(TensorFlowStore(RunFolder(url), model, keep=3, asynchronous=asynchronous))
    blocked: list[float] = []

    def save(step: int) -> None:
        began = time.monotonic()
        saver.save(step)
        blocked.append(time.monotonic() - began)

    recorder = fit.Recorder(batch, checkpoint_clock=lambda: sum(blocked))
    checkpointer = fit.Checkpointer(save, None, PreemptionNotice())
    began = time.monotonic()
    fit.fit(model, dataset, fit.Plan(steps, epochs), recorder, checkpointer)
    waited = time.monotonic()
    saver.wait()
    end_wait = time.monotonic() - waited
    loop_s = waited - began
    files = [f for f in tf.io.gfile.listdir(f"{url}/checkpoints") if ".data-" in f]
    size_mb = tf.io.gfile.stat(f"{url}/checkpoints/{sorted(files)[-1]}").length / 1e6
    return {
        "mode": "async" if asynchronous else "sync", "blocked_s": blocked, "end_wait_s": end_wait, "loop_s": loop_s,
        "write_s": saver.write_s, "saves": saver.saves, "weights_mb": weights_mb, "checkpoint_mb": size_mb,
        "epoch_s": [e.seconds for e in recorder.epochs], "index": tf.train.latest_checkpoint(f"{url}/checkpoints"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 5 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch (an epoch should outlast a write)")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 5) if args.quick else (args.rounds, args.epochs, args.steps)
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="async-ckpt-") as scratch, start_gcs(Path(scratch) / "gcs") as gcs:
        os.environ.update(gcs.env)  # before TensorFlow's first gs:// use, in this process only
        for round_ in range(rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for asynchronous in order:
                url = f"gs://{gcs.bucket()}/runs/job"
                result = train_once(url, asynchronous, epochs, steps, args.batch)
                results[result["mode"]].append(result)
                print(f"round {round_ + 1} {result['mode']:5s}: blocked per save "
                      + ", ".join(f"{b:.3f}" for b in result["blocked_s"])
                      + f" s; end wait {result['end_wait_s']:.3f} s; writes {result['write_s']:.2f} s in all;"
                      f" epochs {', '.join(f'{e:.1f}' for e in result['epoch_s'])} s; {result['index']}", flush=True)

    per_save = {mode: statistics.median(b for r in runs for b in r["blocked_s"]) for mode, runs in results.items()}
    end_wait = {mode: statistics.median(r["end_wait_s"] for r in runs) for mode, runs in results.items()}
    # From fit's start to the last checkpoint written: what the saves cost the job in all (the background
    # writes share the CPU with training).
    total = {mode: statistics.median(r["loop_s"] + r["end_wait_s"] for r in runs) for mode, runs in results.items()}
    write_per_save = statistics.median(r["write_s"] / r["saves"] for r in results["async"])
    first = results["sync"][0]
    print(f"\nmodel {first['weights_mb']:.0f} MB of weights, checkpoint {first['checkpoint_mb']:.0f} MB, "
          f"{epochs} epochs of {steps} steps, "
          f"one save per epoch, gs:// on the emulator")
    print(f"{'mode':<6}{'blocked per save (median)':>27}{'end wait':>10}{'training + saves, s':>21}")
    for mode in ("sync", "async"):
        print(f"{mode:<6}{per_save[mode]:>27.3f}{end_wait[mode]:>10.3f}{total[mode]:>21.1f}")
    print(f"async background write per save (median): {write_per_save:.3f} s")
    ratio = per_save["async"] / per_save["sync"]
    print(json.dumps({"benchmark": "async_checkpoint", "ratio": round(ratio, 4), "goal": "<= 0.10", "detail": {
        "sync_blocked_s": round(per_save["sync"], 3), "async_blocked_s": round(per_save["async"], 3),
        "async_write_s": round(write_per_save, 3), "async_end_wait_s": round(end_wait["async"], 3),
        "sync_total_s": round(total["sync"], 1), "async_total_s": round(total["async"], 1),
        "weights_mb": round(first["weights_mb"]), "checkpoint_mb": round(first["checkpoint_mb"]), "epochs": epochs,
        "steps_per_epoch": steps, "rounds": rounds, "quick": args.quick,
    }}))


if __name__ == "__main__":
    main()
