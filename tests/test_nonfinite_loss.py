"""A loss that turns NaN or infinite fails the run at once (exit 1), naming the epoch and step.

The weights of a diverged run are worthless: no checkpoint of them is ever saved (the newest stays the last
finite one, so the job can be resumed with a smaller learning rate) and no model.keras is written or replaced.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import run_cli
from tests.support.runs import indexed_step, local_index

pytestmark = pytest.mark.slow

STEPS = 16  # tiny MNIST: 2,048 records at batch 128


def strict_json(text: str) -> dict:
    """JSON as the standard has it: NaN and Infinity are not numbers there."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in the summary")

    return json.loads(text, parse_constant=refuse)


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:-6]) for p in (run_dir / "checkpoints").glob("ckpt-*.index"))


def assert_all_finite(run_dir: Path) -> None:
    """Every checkpoint on disk holds finite weights only."""
    for step in checkpoint_steps(run_dir):
        reader = tf.train.load_checkpoint(str(run_dir / "checkpoints" / f"ckpt-{step}"))
        for name, dtype in reader.get_variable_to_dtype_map().items():
            if dtype.is_floating:
                assert np.all(np.isfinite(reader.get_tensor(name))), f"ckpt-{step}: {name} is not finite"


PREPROCESS = """
def scale(batch):
    return {{**batch, "image": {expression}}}
"""

# A linear model without dropout: all-NaN inputs give NaN logits and a NaN loss on every step, whatever the
# batch. A conv net need not: CPU max pooling skips NaN (a window of NaN and 1 pools to 1, a window of NaN only
# to the lowest float), so whether mnist_cnn's loss turns NaN depends on the batch and the dropout masks; its
# loss could stay finite while the update turned the weights NaN, and the run then stopped at the epoch-end
# save (step 32, "the weights are not finite") instead of at step 17.
LINEAR = """
import tensorflow as tf

keras = tf.keras


def build(params, features, inputs):
    (name,) = inputs
    image = keras.Input(shape=features[name].shape, name=name)
    out = keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(image)))
    return keras.Model(image, out, name="linear")
"""


def test_a_resumed_run_whose_loss_blows_up_fails_and_keeps_the_finite_checkpoint(mnist_job, tmp_path):
    """One finite epoch, saved; then the job is continued after a change that makes its loss NaN. The learning
    rate is pinned to the checkpoints (runner/rundir/outputs.py), so the change here is in the user's own code beside
    the spec: its preprocessing now divides by a standard deviation of 0 (0 / 0: every pixel is NaN)."""
    code = tmp_path / "blowup_data.py"
    code.write_text(PREPROCESS.format(expression='batch["image"] / 1.0'))
    (tmp_path / "blowup_model.py").write_text(LINEAR)
    spec = mnist_job(
        "blowup", model={"name": "blowup_model:build"}, data={"preprocess": "blowup_data:scale", "eval": None},
        train={"epochs": 1}, output={"tensorboard": False},
    )
    first = run_cli("run", spec)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "blowup"
    model = run_dir / "model.keras"
    saved_model = model.read_bytes(), model.stat().st_mtime_ns
    assert indexed_step(local_index(run_dir)) == STEPS

    code.write_text(PREPROCESS.format(expression='(batch["image"] - batch["image"]) / 0.0'))
    second = run_cli("run", spec, "--set", "train.epochs=3")
    assert second.returncode == 1, second.stderr[-3000:]
    summary = strict_json(second.stdout.strip().splitlines()[-1])
    assert summary["status"] == "failed"
    error = summary["error"]
    assert f"the loss is not finite (nan) at epoch 2, step {STEPS + 1}" in error
    assert f"the newest checkpoint, ckpt-{STEPS}, holds the last finite weights" in error
    assert "train.learning_rate" in error and "data.preprocess" in error
    assert error in second.stderr
    assert indexed_step(local_index(run_dir)) == STEPS, "the newest checkpoint is the finite one"
    assert checkpoint_steps(run_dir) == [STEPS]
    assert_all_finite(run_dir)
    assert (model.read_bytes(), model.stat().st_mtime_ns) == saved_model, "model.keras is left as it was"
    assert not (run_dir / "model.partial.keras").exists()
    assert strict_json((run_dir / "attempts" / "002.json").read_text())["status"] == "failed"
    # The job is still the finished 1-epoch one: its summary stays.
    assert strict_json((run_dir / "summary.json").read_text())["status"] == "succeeded"


def test_a_run_that_blows_up_at_once_saves_nothing_of_it(mnist_job, tmp_path):
    # A save after every step: whatever diverges must never reach a checkpoint.
    spec = mnist_job(
        "diverged", train={"epochs": 2, "learning_rate": 1e12}, checkpoint={"every_steps": 1},
        output={"tensorboard": False},
    )
    result = run_cli("run", spec)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = strict_json(result.stdout.strip().splitlines()[-1])
    assert summary["status"] == "failed"
    step = int(re.search(r"\bstep (\d+)", summary["error"]).group(1))
    assert "epoch 1" in summary["error"] and 1 <= step <= STEPS
    run_dir = tmp_path / "runs" / "diverged"
    assert all(saved < step for saved in checkpoint_steps(run_dir))
    assert_all_finite(run_dir)
    assert not (run_dir / "model.keras").exists() and not (run_dir / "saved_model").exists()
    assert strict_json((run_dir / "summary.json").read_text())["status"] == "failed"
