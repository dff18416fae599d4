"""The run's SavedModel (runner/rundir/serving.py): `serve` and `serve_examples`, and what happens when preprocessing
cannot run without a label. Trained runs are checked end to end in test_predict.py and test_user_model.py."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import tensorflow as tf

from runner.data import pipeline
from runner.data.schema import Feature
from runner.rundir import serving

FEATURES = {"x": Feature("float32", (3,)), "label": Feature("int64", ())}


def model() -> tf.keras.Model:
    inputs = tf.keras.Input((3,), name="x")
    return tf.keras.Model(inputs, tf.keras.layers.Dense(2, kernel_initializer="ones")(inputs))


def records(rows: np.ndarray) -> list[bytes]:
    def example(row):
        feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=row)),
                   "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1]))}
        return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()

    return [example(row) for row in rows]


def test_serve_examples_parses_and_preprocesses_like_training(tmp_path: Path) -> None:
    def doubled(batch):
        return {**batch, "x": batch["x"] * 2.0}

    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    trained = model()
    path = str(tmp_path / "saved_model")
    assert serving.export(trained, path, pipeline.example_inputs(FEATURES, ("x",), doubled)) == [
        "serve", "serve_examples"]

    loaded = tf.saved_model.load(path)
    expected = trained(rows * 2.0).numpy()
    np.testing.assert_allclose(loaded.serve_examples(tf.constant(records(rows))).numpy(), expected)
    np.testing.assert_allclose(loaded.serve(tf.constant(rows * 2.0)).numpy(), expected)
    served = loaded.signatures["serving_default"](tf.constant(rows))
    np.testing.assert_allclose(next(iter(served.values())).numpy(), trained(rows).numpy())


def test_a_preprocess_that_needs_the_label_leaves_serve_alone_and_says_why(tmp_path: Path, caplog) -> None:
    def uses_label(batch):
        return {**batch, "x": batch["x"] * tf.cast(batch["label"][:, None], tf.float32)}

    path = str(tmp_path / "saved_model")
    with caplog.at_level(logging.WARNING, logger="runner.rundir.serving"):
        endpoints = serving.export(model(), path, pipeline.example_inputs(FEATURES, ("x",), uses_label))
    assert endpoints == ["serve"]
    assert ("no serve_examples endpoint: data.preprocess could not be traced on the input features alone "
            "(KeyError") in caplog.text
    loaded = tf.saved_model.load(path)
    assert not hasattr(loaded, "serve_examples")
    assert loaded.serve(tf.ones((1, 3))).shape == (1, 2)


def test_a_run_exports_a_saved_model_unless_told_not_to_and_never_keeps_one_of_other_weights(mnist_job, tmp_path):
    """output.saved_model: true (the default) writes saved_model/ beside model.keras; false skips the export, and
    removes an earlier attempt's, whose weights are no longer the ones model.keras holds."""
    from tests.conftest import last_json, run_cli

    spec = mnist_job("exported", data={"eval": None}, train={"epochs": 1, "steps_per_epoch": 4, "allow_chance": True},
                     output={"saved_model": True})
    run_dir = tmp_path / "runs" / "exported"
    first = run_cli("run", spec)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run_dir / "saved_model" / "saved_model.pb").is_file() and (run_dir / "model.keras").is_file()
    loaded = tf.saved_model.load(str(run_dir / "saved_model"))
    assert "serve" in loaded.signatures

    longer = run_cli("run", spec, "--set", "train.epochs=2", "--set", "output.saved_model=false")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert last_json(longer.stdout)["final_step"] == 8
    assert not (run_dir / "saved_model").exists()
    assert f"output.saved_model is false: removed {run_dir}/saved_model" in longer.stderr
