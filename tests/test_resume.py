"""Resume semantics (runner/rundir/outputs.py docstring), tested on real processes that are killed and re-run.

Each job runs 3 epochs of 24 steps over small MNIST (the training data repeats) at a batch of 128, so an epoch
lasts a second or more on a CPU: long enough to interrupt it in the middle (tests/support/runs.py).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.conftest import cli_env, last_json, run_cli
from tests.support.runs import (
    EPOCHS,
    STEPS,
    finish,
    indexed_step,
    local_index,
    signal_in_second_epoch,
    start_run,
    wait_for,
)
from tests.support.runs import interruptible_job as job


def assert_exact_count(summary: dict, resumed_from: int) -> None:
    """The resumed attempt trains exactly the steps that were missing: none twice, none skipped."""
    assert summary["status"] == "succeeded", summary.get("error")
    assert summary["resumed_from_step"] == resumed_from
    assert summary["final_step"] == EPOCHS * STEPS
    # The summary lists every attempt's epochs that were reported (a killed attempt reports none), each marked.
    epochs = [e for e in summary["epochs"] if e["attempt"] == summary["attempt"]]
    assert sum(e["steps"] for e in epochs) == EPOCHS * STEPS - resumed_from
    assert epochs[0]["epoch"] == resumed_from // STEPS + 1  # numbering continues across attempts
    assert epochs[0]["steps"] == STEPS - resumed_from % STEPS
    assert [e["epoch"] for e in epochs] == list(range(resumed_from // STEPS + 1, EPOCHS + 1))


@pytest.mark.slow
def test_kill_9_mid_epoch_resumes_from_the_last_complete_checkpoint(mnist_job, tmp_path):
    spec = job(mnist_job, "killed", every_steps=5)
    run_dir = tmp_path / "runs" / "killed"
    process = start_run(spec)
    # 10 steps into epoch 2: kill there, far from the epoch's end-of-epoch save.
    wait_for(lambda: (s := indexed_step(local_index(run_dir))) is not None and s >= STEPS + 10 or None, process)
    os.kill(process.pid, signal.SIGKILL)
    code, _, _ = finish(process)
    assert code == -signal.SIGKILL
    latest = indexed_step(local_index(run_dir))
    assert latest >= STEPS + 10 and latest % STEPS, f"killed at step {latest}, expected mid-epoch"
    assert not (run_dir / "attempts").exists()  # a killed process writes nothing more

    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_exact_count(last_json(result.stdout), resumed_from=latest)


@pytest.mark.slow
def test_sigterm_saves_within_grace_exits_75_and_the_rerun_continues(mnist_job, tmp_path):
    spec = job(mnist_job, "preempted", grace_s=20)  # epoch-end saves only: the notice's save is its own
    run_dir = tmp_path / "runs" / "preempted"
    process = start_run(spec, progress=True)
    noticed = signal_in_second_epoch(process, run_dir, signal.SIGTERM)
    code, out, err = finish(process)
    exited_after = time.monotonic() - noticed
    assert code == 75, err[-3000:]
    assert exited_after < 20
    assert "run the same job again to continue" in err
    summary = last_json(out)
    assert summary["status"] == "preempted"
    assert 0 <= summary["preemption"]["saved_after_notice_s"] <= 20
    stored = json.loads((run_dir / "summary.json").read_text())
    assert stored["status"] == "preempted"
    saved = indexed_step(local_index(run_dir))
    assert STEPS < saved < EPOCHS * STEPS and saved % STEPS, f"the notice's save is mid-epoch, got step {saved}"

    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_exact_count(last_json(result.stdout), resumed_from=saved)
    attempts = sorted(p.name for p in (run_dir / "attempts").iterdir())
    statuses = [json.loads((run_dir / "attempts" / a).read_text())["status"] for a in attempts]
    assert statuses == ["preempted", "succeeded"]


@pytest.mark.slow
def test_a_half_written_checkpoint_on_disk_is_never_chosen(mnist_job, tmp_path):
    """What a kill during a save leaves (a temp folder, a data file without its index, an unindexed
    checkpoint) must not be restored: the index names only checkpoints written whole."""
    spec = mnist_job(
        "half", data={"eval": None, "global_batch_size": 32}, train={"epochs": 1, "steps_per_epoch": 8},
        output={"tensorboard": False},
    )
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "half"
    checkpoints = run_dir / "checkpoints"
    assert indexed_step(local_index(run_dir)) == 8
    # Leftovers of a save of step 12 cut short, as TensorFlow lays them out while it writes.
    (checkpoints / "ckpt-12_temp").mkdir()
    (checkpoints / "ckpt-12_temp" / "part-00000-of-00001.data-00000-of-00001.tempstate1").write_bytes(os.urandom(999))
    (checkpoints / "ckpt-12.data-00000-of-00001").write_bytes(
        (checkpoints / "ckpt-8.data-00000-of-00001").read_bytes()[:1000]
    )
    (checkpoints / "checkpoint.tmp9f2e").write_text('model_checkpoint_path: "ckpt-12"\n')
    # One more epoch: the rerun must resume from step 8, not from the half-written step 12.
    result = run_cli("run", spec, "--set", "train.epochs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["resumed_from_step"] == 8
    assert summary["final_step"] == 16


@pytest.mark.slow
def test_a_save_stuck_past_the_grace_period_exits_75_and_is_never_chosen(gcs_faults, mnist_job):
    """SIGTERM while a save to the bucket hangs: the process must not outlive checkpoint.grace_s, and the
    checkpoint it left half written (data file present, no .index, not in the index) is ignored."""
    bucket = gcs_faults.bucket()
    spec = mnist_job(
        "stuck",
        data={"eval": None, "global_batch_size": 32},  # the data stays local: the saves to the bucket hang
        train={"epochs": 2, "steps_per_epoch": 24},
        checkpoint={"every_steps": 8, "grace_s": 3},
        output={"dir": f"gs://{bucket}/runs", "tensorboard": False},
    )
    # The save of step 16 hangs on its last object, the .index, after its data file is in place.
    hang = {"match": r"^POST /upload/.*name=runs/stuck/checkpoints/ckpt-16\.index", "action": "stall", "delay_s": 60}
    gcs_faults.faults.set([hang])
    process = start_run(spec, env=cli_env(**gcs_faults.env))
    # This rule's own hits: the rig's "holding" count also counts a stall an earlier test left behind.
    wait_for(lambda: gcs_faults.faults.stats()["hits"][0] or None, process, every=0.2)
    noticed = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code, _, err = finish(process, timeout=60)
    assert code == 75, err[-3000:]
    assert time.monotonic() - noticed < 3 + 10
    assert "did not save and stop within checkpoint.grace_s (3 s)" in err
    names = gcs_faults.objects(bucket, "runs/stuck/checkpoints/")
    assert "runs/stuck/checkpoints/ckpt-16.data-00000-of-00001" in names
    assert "runs/stuck/checkpoints/ckpt-16.index" not in names
    index = gcs_faults.read(bucket, "runs/stuck/checkpoints/checkpoint").decode()
    assert indexed_step(index) == 8

    gcs_faults.faults.clear()
    result = run_cli("run", spec, env=cli_env(**gcs_faults.env))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["resumed_from_step"] == 8
    assert summary["final_step"] == 48


@pytest.mark.slow
def test_a_model_edited_between_runs_is_refused_before_training_naming_the_variable(mnist_job, tmp_path):
    """Under TensorFlow (Orbax's twin is in tests/test_backend_jax.py): exit 2 naming the variable and both
    shapes, and `--fresh`; never "failed after N epochs", and the run folder is left as it was."""
    code = tmp_path / "widthnet.py"
    template = (
        "import keras\n\n\n"
        "def build(params, features, inputs):\n"
        "    x = keras.Input((28, 28, 1))\n"
        "    flat = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))\n"
        "    hidden = keras.layers.Dense({width}, activation='relu')(flat)\n"
        "    return keras.Model(x, keras.layers.Dense(10, activation='softmax')(hidden))\n"
    )
    code.write_text(template.format(width=16))
    spec = mnist_job("edited", accelerator={"kind": "cpu", "backend": "tensorflow"}, model={"name": "widthnet:build"},
                     data={"eval": None}, train={"epochs": 1, "steps_per_epoch": 4, "allow_chance": True},
                     output={"tensorboard": False})
    first = run_cli("run", spec)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "edited"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    code.write_text(template.format(width=24))
    edited = run_cli("run", spec, "--set", "train.epochs=2")
    assert edited.returncode == 2, edited.stderr[-3000:]
    assert "the model changed since" in edited.stderr and "(784, 24) in the model and (784, 16)" in edited.stderr
    assert "--fresh" in edited.stderr and "failed after" not in edited.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
