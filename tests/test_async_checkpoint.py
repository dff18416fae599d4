"""Checkpoints written in the background (runner/train/saver.py over runner/train/tf_store.py): the copy is what
was checked at the save, the index names a checkpoint only once its files are written, a failed write stops the
job with its error, and a real run saves this way and waits for its last write.

The saver runs in a child process against the GCS emulator behind the fault proxy: a delayed or refused
upload of one checkpoint's files shows what the training loop sees while the write is in flight.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli

pytestmark = pytest.mark.slow

# The child: a model of 2.1 M weights (8 MB) and Adam; saves at steps 1, 2 and 3 (each waits for the one
# before), changing the weights right after each save returns, and reports what it saw, down to the kernel
# each written checkpoint holds.
CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import tensorflow as tf
    from runner.rundir.outputs import RunFolder
    from runner.train.saver import Saver
    from runner.train.tf_store import TensorFlowStore

    keras = tf.keras
    run = RunFolder(sys.argv[1])
    folder = run.checkpoints

    def build():
        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(4096),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer="adam", loss="mse")
        model.fit(np.ones((8, 512), "float32"), np.ones((8, 1), "float32"), epochs=1, verbose=0)
        return model, tf.train.Checkpoint(model=model, optimizer=model.optimizer)

    model, checkpoint = build()  # the checkpoint object reads the written ones back below
    saver = Saver(TensorFlowStore(run, model, keep=5))
    kernel = model.layers[0].kernel
    seen = {"steps": []}
    for step in (1, 2, 3):
        kernel.assign(tf.fill(kernel.shape, float(step)))
        began = time.monotonic()
        try:
            saver.wait()  # what save() does first; timed apart so that `returned_s` is the save's own
            waited = time.monotonic() - began
            began = time.monotonic()
            saver.save(step)
        except Exception as exc:
            seen["steps"].append({"step": step, "save_error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        returned = time.monotonic() - began
        kernel.assign(tf.fill(kernel.shape, -1.0))  # training goes on while the copy is written
        entry = {"step": step, "waited_s": waited, "returned_s": returned, "pending": saver.pending,
                 "index_while_writing": tf.train.latest_checkpoint(folder)}
        seen["steps"].append(entry)
    try:
        saver.wait()
        seen["wait"] = "ok"
    except Exception as exc:
        seen["wait"] = f"{type(exc).__name__}: {exc}"[:300]
    seen["index"] = tf.train.latest_checkpoint(folder)
    seen["saver"] = saver.to_dict()
    restored = {}
    for step in (1, 2, 3):
        path = f"{folder}/ckpt-{step}"
        if tf.io.gfile.exists(path + ".index"):
            # Restored into the same model (its kernel is -1.0 now, or the step after): no second one to build.
            kernel.assign(tf.fill(kernel.shape, -2.0))
            checkpoint.read(path).expect_partial()
            restored[step] = np.unique(kernel.numpy()).tolist()
    seen["restored"] = restored
    print(json.dumps(seen))
""")


def run_child(folder: str, env: dict[str, str], tmp_path: Path) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = subprocess.run(
        [sys.executable, str(script), folder], capture_output=True, text=True, timeout=300, cwd=REPO,
        env=cli_env(PYTHONPATH=str(REPO), **env),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_loop_goes_on_while_a_slow_write_completes_and_the_index_waits_for_it(gcs_faults, tmp_path: Path) -> None:
    bucket = gcs_faults.bucket()
    # Every upload of checkpoint 2's files waits 3 s in the proxy (a slow bucket).
    gcs_faults.faults.set([{"match": r"^(POST|PUT) /upload/.*ckpt-2", "action": "delay", "delay_s": 3.0}])
    seen = run_child(f"gs://{bucket}/ckpts", gcs_faults.env, tmp_path)
    assert gcs_faults.faults.stats()["delay"] >= 1
    by_step = {entry["step"]: entry for entry in seen["steps"]}
    # Save 2 returned at once (the copy), with its write in flight and the index still naming checkpoint 1.
    assert by_step[2]["pending"] is True
    assert by_step[2]["returned_s"] < 2.0, by_step[2]
    assert by_step[2]["index_while_writing"].endswith("/ckpt-1")
    # Save 3 first waited for write 2 (the 3 s delay), then returned with the index naming 2.
    assert by_step[3]["waited_s"] >= 2.0, by_step[3]
    assert by_step[3]["index_while_writing"].endswith("/ckpt-2")
    assert seen["wait"] == "ok" and seen["index"].endswith("/ckpt-3")
    # Each checkpoint holds the weights of its save, not the -1.0 written right after it returned.
    assert seen["restored"] == {"1": [1.0], "2": [2.0], "3": [3.0]}
    assert seen["saver"]["mode"] == "async" and seen["saver"]["saves"] == 3
    assert seen["saver"]["write_s"] >= 3.0


def test_a_write_that_fails_in_the_background_raises_at_the_next_save_and_is_never_indexed(
    gcs_faults, tmp_path: Path
) -> None:
    bucket = gcs_faults.bucket()
    # Checkpoint 2's files are refused (403 is not retried): its write fails in the background.
    gcs_faults.faults.set([{"match": r"^(POST|PUT) /upload/.*ckpt-2", "action": "status", "status": 403}])
    seen = run_child(f"gs://{bucket}/ckpts", gcs_faults.env, tmp_path)
    by_step = {entry["step"]: entry for entry in seen["steps"]}
    assert by_step[2]["pending"] is True  # the save itself returned: the upload happens later
    assert "save_error" in by_step[3] and "PermissionDenied" in by_step[3]["save_error"], by_step[3]  # from its wait
    assert seen["index"].endswith("/ckpt-1")  # the failed checkpoint is never chosen
    assert seen["restored"] == {"1": [1.0]}


def test_a_run_saves_in_the_background_and_waits_for_its_last_write(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("async", train={"epochs": 2, "steps_per_epoch": 6}, data={"eval": None},
                     checkpoint={"every_steps": 3})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    saves = summary["checkpoint_saves"]
    assert saves["mode"] == "async" and saves["saves"] == 4  # steps 3, 6 (epoch 1 end), 9, 12 (epoch 2 end)
    # The summary's checkpoint time holds every moment the loop was blocked on a save (and the final wait).
    assert 0 < saves["blocked_s"] <= summary["timing"]["checkpoint_s"] + 0.001
    state = (tmp_path / "runs" / "async" / "checkpoints" / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-12"' in state  # the last write was waited for before the summary
    assert (tmp_path / "runs" / "async" / "checkpoints" / "ckpt-12.index").exists()
