"""evaluate and predict answer with the weights the run folder reports (runner/rundir/reported.py).

A job finished after 1 epoch; the same job was then run for 3 and interrupted in its third, and left. Its
newer checkpoint is not what summary.json and model.keras describe: `runner run` with the original epochs
finds the job complete, and evaluate and predict use model.keras, each naming the newer checkpoint and how
to use it (`--checkpoint`).
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

from tests.conftest import last_json, run_cli
from tests.support.precision import as_evaluated
from tests.support.runs import STEPS, finish, indexed_step, local_index, start_run, wait_for
from tests.support.runs import interruptible_job as job
from tests.test_evaluation import by_hand, read_split


@pytest.mark.slow
@pytest.mark.timeout(1200)  # seven runner processes, each importing TensorFlow: minutes on a saturated machine
def test_an_abandoned_extension_is_named_and_evaluate_and_predict_use_what_was_reported(
    mnist_job, small_mnist, tmp_path
):
    spec = job(mnist_job, "extended")
    run_dir = tmp_path / "runs" / "extended"
    first = run_cli("run", spec, "--set", "train.epochs=1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert last_json(first.stdout)["final_step"] == STEPS

    # Three epochs asked, interrupted once the second epoch's checkpoint is saved.
    longer = start_run(spec, "--set", "train.epochs=3")
    wait_for(lambda: (s := indexed_step(local_index(run_dir))) is not None and s >= 2 * STEPS or None, longer)
    longer.send_signal(signal.SIGINT)
    code, _, err = finish(longer)
    assert code == 130, err[-3000:]
    left = indexed_step(local_index(run_dir))
    assert left >= 2 * STEPS
    newer = f"{run_dir}/checkpoints/ckpt-{left} (step {left}) is newer than the step {STEPS} {run_dir}/summary.json"
    by = "attempt 2 (train.epochs 3, ended interrupted) left it"

    again = run_cli("run", spec, "--set", "train.epochs=1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete" in again.stderr
    assert newer in again.stderr and by in again.stderr
    assert "`runner run --set train.epochs=3` continues it" in again.stderr

    # What evaluate and predict answer is what model.keras (the reported model) answers, computed here in the
    # precision they compute in (float32).
    images, labels = read_split(small_mnist, "test")
    reported = as_evaluated(run_dir / "model.keras").predict(images, verbose=0)
    test = f"{small_mnist}/test-*.tfrecord"
    evaluated = run_cli("evaluate", spec, "--set", "train.epochs=1", "--input", test)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = last_json(evaluated.stdout)
    assert report["checkpoint"] == f"{run_dir}/model.keras" and report["step"] == STEPS
    assert report["metrics"]["loss"] == pytest.approx(by_hand(reported, labels)["loss"], abs=1e-5)
    assert newer in evaluated.stderr and f"`--checkpoint ckpt-{left}` uses the newer one" in evaluated.stderr

    predictions = tmp_path / "predictions.npy"
    predicted = run_cli("predict", spec, "--set", "train.epochs=1", "--input", test, "--output", predictions)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    np.testing.assert_allclose(np.load(predictions), reported, atol=1e-5)
    assert newer in predicted.stderr

    # --checkpoint names the newer weights: they answer otherwise.
    chosen = run_cli("evaluate", spec, "--input", test, "--checkpoint", f"ckpt-{left}")
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    picked = last_json(chosen.stdout)
    assert picked["checkpoint"] == f"{run_dir}/checkpoints/ckpt-{left}" and picked["step"] == left
    assert picked["metrics"]["loss"] != pytest.approx(report["metrics"]["loss"], abs=1e-5)


def test_a_checkpoint_that_is_not_there_is_refused_naming_those_that_are(mnist_job, tmp_path):
    spec = job(mnist_job, "never")
    (tmp_path / "runs" / "never" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "never" / "checkpoints" / "ckpt-16.index").write_bytes(b"")
    missing = run_cli("evaluate", spec, "--checkpoint", "ckpt-999")
    assert missing.returncode == 2, missing.stderr[-3000:]
    said = " ".join(missing.stderr.split())
    assert (f"--checkpoint ckpt-999: no checkpoint there (no ckpt-999.index); {tmp_path}/runs/never/checkpoints "
            "holds ckpt-16: name one of them, or a .keras file") in said
