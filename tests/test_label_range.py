"""Every model's labels are checked before training (runner/data/integrity.py `check_labels_fit`): a user's own
model of 3 outputs on labels 1 to 3 (the manifest's label_range [1, 3], label_counts [0, n, n, n]) stops with
exit 2 naming the range, a record and the fix, under both backends; TensorFlow used to end it in a 70-line
traceback ("Received a label value of 3 which is outside the valid range of [0, 3)"), and a TPU trains on such
labels without an error."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import last_json, run_cli, write_spec

BUILD = '''import keras


def build_model(num_classes=3):
    inputs = keras.Input(shape=(4,), name="x")
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(num_classes, activation="softmax")(hidden))
'''


@pytest.fixture(scope="module")
def counted_from_one(tmp_path_factory) -> Path:
    """x (4 floats) and y in 1..3, as `runner prepare arrays` writes them."""
    folder = tmp_path_factory.mktemp("from-one")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4)).astype("float32")
    y = (1 + np.arange(120) % 3).astype("int64")
    np.savez(folder / "arr.npz", x=x, y=y)
    made = run_cli("prepare", "arrays", str(folder / "arr.npz"), "--features", "x", "--label", "y",
                   "--split", "train=0.8,test=0.2", "--out", str(folder / "data"))
    assert made.returncode == 0, made.stderr[-2000:]
    return folder / "data"


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_labels_1_to_3_for_3_classes_of_an_own_model_are_refused_before_training_with_the_fix(
    counted_from_one: Path, tmp_path: Path, backend: str
):
    (tmp_path / "shapes.py").write_text(BUILD)
    spec = write_spec(tmp_path, {
        "name": "from-one",
        "accelerator": {"kind": "cpu", "backend": backend},
        "data": {"train": f"{counted_from_one}/train-*.tfrecord", "eval": f"{counted_from_one}/test-*.tfrecord",
                 "inputs": ["x"], "label": "y", "global_batch_size": 16},
        "model": {"name": "shapes:build_model", "params": {"num_classes": 3}},
        "train": {"epochs": 2},
        "output": {"dir": str(tmp_path / "runs"), "tensorboard": False, "saved_model": False},
    })
    ran = run_cli("run", str(spec), timeout=600)
    assert ran.returncode == 2, ran.stderr[-3000:]
    said = " ".join(ran.stderr.split())
    assert "Traceback" not in ran.stderr and "outside the valid range" not in said
    assert "data.train: the labels run from 1 to 3" in said, said
    assert re.search(r"label_counts \[0, \d+, \d+, \d+\]\); \S+/train-00000-of-00001.tfrecord: record \d+ "
                     r"\(counting from 0\) has y 3", said), said
    assert ("model 'shapes:build_model' ends in 3 outputs and train.loss sparse_categorical_crossentropy takes "
            "class ids 0 to 2") in said, said
    assert "No record is labelled 0: the labels count from 1" in said, said
    assert "write the labels again as 0 to 2" in said and "subtract 1 in a data.preprocess function" in said
    assert "end the model in 4 outputs" in said
    summary = last_json(ran.stdout)
    assert summary["epochs"] == [] and not (tmp_path / "runs" / "from-one" / "checkpoints").exists()


def test_what_each_loss_takes_is_read_from_the_model_and_the_loss():
    import keras

    from runner.spec.types import JobSpec
    from runner.train import build

    def model(units: int, activation: str, loss) -> keras.Model:
        x = keras.Input((4,))
        made = keras.Model(x, keras.layers.Dense(units, activation=activation)(x))
        build.compile_model(made, JobSpec.model_validate({"train": {"loss": loss, "metrics": []}}))
        return made

    one = model(1, "sigmoid", "binary_crossentropy")
    assert build.label_expectation(one, one.loss, "own:net") == (
        0, 1, "model 'own:net' ends in 1 output and train.loss binary_crossentropy takes labels 0 and 1")
    three = model(3, "softmax", {"class_name": "SparseCategoricalCrossentropy", "config": {}})
    assert build.label_expectation(three, three.loss)[:2] == (0, 2)
    regression = model(1, "linear", "mse")
    assert build.label_expectation(regression, regression.loss) is None


def test_a_preprocess_may_map_the_labels_so_they_are_named_not_refused(counted_from_one: Path, caplog):
    from runner import DataError
    from runner.data import integrity, pipeline
    from runner.spec.types import JobSpec

    spec = JobSpec.model_validate({"data": {"train": f"{counted_from_one}/train-*.tfrecord", "inputs": ["x"],
                                            "label": "y", "preprocess": "shift:minus_one"}})
    found = {"data.train": pipeline.find_shards(spec.data.train, "data.train")}
    integrity.check_labels_fit(spec, found, (0, 2, "model 'm' ends in 3 outputs"))
    assert "the labels run from 1 to 3" in caplog.text
    assert "data.preprocess (shift:minus_one) may map them" in caplog.text
    with pytest.raises(DataError, match="No record is labelled 0"):
        integrity.check_labels_fit(spec.model_copy(update={"data": spec.data.model_copy(update={"preprocess": None})}),
                                   found, (0, 2, "model 'm' ends in 3 outputs"))
