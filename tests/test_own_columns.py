"""A user's own arrays and build function meet the spec's defaults: data.inputs `[image]` and data.label `label`
on records whose features are x, w and y, and a build function written as Keras users write one. Each used to
validate and then fail inside the run (a KeyError, exit 1); both are refused by `runner validate` and `runner
run` (exit 2) naming what to write, and the test writes what the message says."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import last_json, run_cli, write_spec
from tests.support.cli import invoke

BUILD = '''import keras


def build({parameters}):
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))
'''


@pytest.fixture(scope="module")
def arrays(tmp_path_factory) -> Path:
    """x (8 floats), w (a weight per record) and y (0/1) as `runner prepare arrays` writes them, with the
    manifest's own `inputs: [x, w]` and `label: y`."""
    folder = tmp_path_factory.mktemp("arrays")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1200, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64")
    np.savez(folder / "arr.npz", x=x, y=y, w=np.where(y == 1, 2.0, 1.0).astype("float32"))
    made = run_cli("prepare", "arrays", str(folder / "arr.npz"), "--features", "x,w", "--label", "y",
                   "--split", "train=0.9,test=0.1", "--out", str(folder / "data"))
    assert made.returncode == 0, made.stderr[-2000:]
    return folder / "data"


def _spec(folder: Path, data: Path, parameters: str, **data_keys) -> Path:
    code = folder / "code"
    code.mkdir(exist_ok=True)
    (code / "mlp.py").write_text(BUILD.format(parameters=parameters))
    return write_spec(folder, {
        "name": "own_columns",
        "code": {"folder": str(code)},
        "data": {"train": f"{data}/train-*.tfrecord", "eval": f"{data}/test-*.tfrecord", "global_batch_size": 60,
                 **data_keys},
        "model": {"name": "mlp:build"},
        "train": {"epochs": 6, "loss": {"class_name": "SparseCategoricalCrossentropy",
                                        "config": {"from_logits": True}}, "sample_weight": "w"},
        "output": {"dir": str(folder / "runs"), "tensorboard": False},
    })


def _apply(spec: Path, message: str) -> None:
    """Writes each `data.KEY: VALUE` the message says to set into the spec, as YAML."""
    found = re.findall(r"data\.(inputs|label): (\[[^\]]*\]|\w+)", message.split("set ", 1)[1])
    assert found, message
    doc = yaml.safe_load(spec.read_text())
    for key, value in found:
        doc["data"][key] = yaml.safe_load(value)
    spec.write_text(yaml.safe_dump(doc))


def test_default_columns_on_other_records_are_refused_with_the_manifests_own(arrays: Path, tmp_path: Path):
    spec = _spec(tmp_path, arrays, "params, features, inputs")
    refused = invoke("validate", spec)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "data.inputs is [image] (the default), but" in refused.stderr
    assert "its features: x, w, y" in refused.stderr
    # The weight is train.sample_weight: the manifest's inputs [x, w] are offered without it.
    assert "set data.inputs: [x] and data.label: y in the spec" in refused.stderr, refused.stderr

    ran = run_cli("run", str(spec))
    assert ran.returncode == 2, ran.stderr[-2000:]
    assert "data.inputs is [image] (the default)" in last_json(ran.stdout)["error"]
    assert not (tmp_path / "runs" / "own_columns").exists()  # refused before the run folder

    _apply(spec, refused.stderr)
    assert invoke("validate", spec).returncode == 0
    trained = run_cli("run", str(spec))
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = last_json(trained.stdout)
    assert summary["status"] == "succeeded" and summary["metrics"]["accuracy"] > 0.8, summary["metrics"]


def test_a_label_given_but_absent_names_the_spec_and_the_features(arrays: Path, tmp_path: Path):
    spec = _spec(tmp_path, arrays, "params, features, inputs", inputs=["x"], label="target")
    refused = invoke("validate", spec)
    assert refused.returncode == 2
    assert re.search(rf"{re.escape(str(spec))}:\d+: data\.train: data\.label is 'target', but ", refused.stderr)
    assert "(the default)" not in refused.stderr and "set data.label: y" in refused.stderr


@pytest.mark.parametrize("parameters, why", [
    ("features, units=16", "too many positional arguments"),
    ("params, features, inputs, extra", "missing a required argument: 'extra'"),
    ("params, features, inputs, *, width", "missing a required keyword-only argument: 'width'"),
])
def test_a_build_function_that_cannot_take_the_runners_arguments_is_refused_by_validate(
        arrays: Path, tmp_path: Path, parameters: str, why: str):
    spec = _spec(tmp_path, arrays, parameters, inputs=["x"], label="y")
    refused = invoke("validate", spec)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (f"model.name: 'mlp:build' has signature build({parameters}), but the runner calls it as "
            f"build(params, features, inputs) ({why})") in refused.stderr, refused.stderr


@pytest.mark.parametrize("parameters", ["params, features, inputs", "params, features, inputs=None, **extra",
                                        "*args"])
def test_build_functions_that_take_the_arguments_validate(arrays: Path, tmp_path: Path, parameters: str):
    spec = _spec(tmp_path, arrays, parameters, inputs=["x"], label="y")
    accepted = invoke("validate", spec)
    assert accepted.returncode == 0, accepted.stderr


KERAS_IO = '''import keras


def build_model({parameters}):
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense({classes})(hidden))
'''


def _keras_io_spec(folder: Path, data: Path, parameters: str, classes: str, params: dict) -> Path:
    """A builder as keras.io writes them (no wrapper taking the runner's params, features, inputs)."""
    spec = _spec(folder, data, "unused", inputs=["x"], label="y")
    (folder / "code" / "mlp.py").write_text(KERAS_IO.format(parameters=parameters, classes=classes))
    doc = yaml.safe_load(spec.read_text())
    doc["model"] = {"name": "mlp:build_model", "params": params}
    doc["train"]["epochs"] = 2
    spec.write_text(yaml.safe_dump(doc))
    return spec


@pytest.mark.parametrize("parameters, classes, params", [
    ("", "2", {}),
    ("num_classes=3", "num_classes", {"num_classes": 2}),
    ("*, num_classes", "num_classes", {"num_classes": 2}),
])
def test_a_keras_io_builder_validates_with_model_params_as_its_keywords(
        arrays: Path, tmp_path: Path, parameters: str, classes: str, params: dict):
    spec = _keras_io_spec(tmp_path, arrays, parameters, classes, params)
    accepted = invoke("validate", spec)
    assert accepted.returncode == 0, accepted.stderr


def test_a_keras_io_builder_whose_keywords_do_not_fit_is_refused_naming_both_forms(arrays: Path, tmp_path: Path):
    spec = _keras_io_spec(tmp_path, arrays, "*, num_classes", "num_classes", {"classes": 2})
    refused = invoke("validate", spec)
    assert refused.returncode == 2
    assert ("model.name: 'mlp:build_model' has signature build_model(*, num_classes), but the runner calls it as "
            "build_model(params, features, inputs) (too many positional arguments), or as keras.io's builders "
            "with model.params as keywords, build_model(classes=2) (missing a required argument: 'num_classes')"
            ) in " ".join(refused.stderr.split()), refused.stderr


@pytest.mark.slow
def test_a_keyword_only_keras_io_builder_trains_with_model_params(arrays: Path, tmp_path: Path):
    spec = _keras_io_spec(tmp_path, arrays, "*, num_classes", "num_classes", {"num_classes": 2})
    trained = run_cli("run", str(spec))
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = last_json(trained.stdout)
    assert summary["status"] == "succeeded" and summary["metrics"]["accuracy"] > 0.7, summary["metrics"]
