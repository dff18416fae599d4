"""Checkpoint saves that do not stall training: the seconds the training loop is blocked per save, synchronous
vs in the background (runner/train/saver.py over runner/train/tf_store.py), and a TensorFlow job saving through
Orbax instead (`model.get_state_tree()` handed to Orbax's asynchronous CheckpointManager, the store a JAX job
uses), to gs:// on the GCS emulator.

A model of about 100 MB of float32 weights (25.2 M: Dense 4096 -> 4096 -> 2048 -> 10) with Adam (so a
checkpoint holds about 300 MB: weights and two slots) trains on random batches through the runner's own
training loop (`train.fit`: the Checkpointer saving at every epoch end through the run folder's
CheckpointManager), saving every epoch into a gs:// bucket on the emulator (tests/support/gcs.py: the
Python emulator behind the TLS proxy TensorFlow's client talks to). Each round runs both modes, in
alternating order. Blocked = the time `save()` took in the loop (the copy, plus any wait for the write
before it); the final wait for the last write, once at the end of training, is reported apart. The Orbax arm
(`orbax`) goes through the same Saver; Orbax reaches the emulator through tensorstore (TENSORSTORE_GCS_HTTP_URL).

    ratio        median blocked per save, async / sync          goal <= 0.10
    orbax_ratio  median blocked per save, orbax / async         one format for both engines if <= 1.0

    .venv/bin/python benchmarks/async_checkpoint.py [--quick] [--rounds N] [--epochs N] [--steps N] [--no-orbax]
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


class OrbaxTreeStore:
    """A `Store` (runner/rundir/checkpoints.py) that saves a TensorFlow job's `model.get_state_tree()` through
    Orbax's asynchronous CheckpointManager: what one format for both engines would do. Saves only."""

    name, asynchronous, why_sync = "orbax", True, None

    def __init__(self, directory: str, model, keep: int):
        import orbax.checkpoint as ocp

        self._ocp, self._model = ocp, model
        self.directory = directory.rstrip("/")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, step_prefix="ckpt", enable_async_checkpointing=True,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest(self) -> str | None:
        step = self._manager.latest_step()
        return None if step is None else f"{self.directory}/ckpt_{step}"

    def save(self, step: int) -> str:
        tree = self._model.get_state_tree(value_format="numpy_array")  # the host copy, made here
        self._manager.save(step, args=self._ocp.args.StandardSave(tree), force=True)
        return f"{self.directory}/ckpt_{step}"

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def train_once(url: str, mode: str, epochs: int, steps: int, batch: int) -> dict:
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
    if mode == "orbax":
        store = OrbaxTreeStore(f"{url}/checkpoints", model, keep=3)
    else:
        store = TensorFlowStore(RunFolder(url), model, keep=3, asynchronous=mode == "async")
    saver = Saver(store)
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
    newest = store.latest()
    if mode == "orbax":
        store.close()
        size_mb = sum(tf.io.gfile.stat(f"{folder.rstrip('/')}/{name}").length
                      for folder, _, names in tf.io.gfile.walk(newest) for name in names) / 1e6
    else:
        files = [f for f in tf.io.gfile.listdir(f"{url}/checkpoints") if ".data-" in f]
        size_mb = tf.io.gfile.stat(f"{url}/checkpoints/{sorted(files)[-1]}").length / 1e6
    return {
        "mode": mode, "blocked_s": blocked, "end_wait_s": end_wait, "loop_s": loop_s,
        "write_s": saver.write_s, "saves": saver.saves, "weights_mb": weights_mb, "checkpoint_mb": size_mb,
        "epoch_s": [e.seconds for e in recorder.epochs], "index": newest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 5 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch (an epoch should outlast a write)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--no-orbax", action="store_true", help="TensorFlow's saves only")
    args = parser.parse_args()
    rounds, epochs, steps = (1, 2, 5) if args.quick else (args.rounds, args.epochs, args.steps)
    modes = ["sync", "async"] + ([] if args.no_orbax else ["orbax"])
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="async-ckpt-") as scratch, start_gcs(Path(scratch) / "gcs") as gcs:
        os.environ.update(gcs.env)  # before TensorFlow's first gs:// use, in this process only
        for round_ in range(rounds):
            order = modes if round_ % 2 == 0 else modes[::-1]
            for mode in order:
                url = f"gs://{gcs.bucket()}/runs/job"
                result = train_once(url, mode, epochs, steps, args.batch)
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
    write_per_save = {mode: statistics.median(r["write_s"] / r["saves"] for r in results[mode])
                      for mode in modes if mode != "sync"}
    first = results["sync"][0]
    print(f"\nmodel {first['weights_mb']:.0f} MB of weights, checkpoint {first['checkpoint_mb']:.0f} MB, "
          f"{epochs} epochs of {steps} steps, "
          f"one save per epoch, gs:// on the emulator")
    print(f"{'mode':<6}{'blocked per save (median)':>27}{'end wait':>10}{'training + saves, s':>21}")
    for mode in modes:
        print(f"{mode:<6}{per_save[mode]:>27.3f}{end_wait[mode]:>10.3f}{total[mode]:>21.1f}")
    for mode, seconds in write_per_save.items():
        print(f"{mode} background write per save (median): {seconds:.3f} s")
    ratio = per_save["async"] / per_save["sync"]
    detail = {
        "sync_blocked_s": round(per_save["sync"], 3), "async_blocked_s": round(per_save["async"], 3),
        "async_write_s": round(write_per_save["async"], 3), "async_end_wait_s": round(end_wait["async"], 3),
        "sync_total_s": round(total["sync"], 1), "async_total_s": round(total["async"], 1),
        "weights_mb": round(first["weights_mb"]), "checkpoint_mb": round(first["checkpoint_mb"]), "epochs": epochs,
        "steps_per_epoch": steps, "rounds": rounds, "quick": args.quick,
    }
    report = {"benchmark": "async_checkpoint", "ratio": round(ratio, 4), "goal": "<= 0.10"}
    if "orbax" in modes:
        report["orbax_ratio"] = round(per_save["orbax"] / per_save["async"], 4)
        detail.update({
            "orbax_blocked_s": round(per_save["orbax"], 3), "orbax_write_s": round(write_per_save["orbax"], 3),
            "orbax_end_wait_s": round(end_wait["orbax"], 3), "orbax_total_s": round(total["orbax"], 1),
            "orbax_checkpoint_mb": round(statistics.median(r["checkpoint_mb"] for r in results["orbax"])),
        })
    print(json.dumps({**report, "detail": detail}))


if __name__ == "__main__":
    main()
