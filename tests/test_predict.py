"""A model trained on two replicas evaluates and predicts on one CPU, any batch size; exports load back."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from runner import DataError
from runner.prepare.datasets import load_dataset
from tests.conftest import REPO, last_json, run_cli, write_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_replica_run(tiny_mnist: Path, tmp_path_factory) -> tuple[Path, dict]:
    """A job trained on two replicas (2 epochs of 3 steps), once for this module: (spec, summary). Read only."""
    folder = tmp_path_factory.mktemp("predict")
    spec = write_spec(folder, {
        "name": "two",
        "accelerator": {"kind": "cpu", "cpu_devices": 2},
        "data": {
            "train": f"{tiny_mnist}/train-*.tfrecord",
            "eval": f"{tiny_mnist}/test-*.tfrecord",
            "global_batch_size": 128,
            "shuffle_buffer": 512,
        },
        # float32: the checks below compare outputs across replica counts and batch sizes, exactly; in bfloat16
        # (auto's choice on a CPU with avx512_bf16) a row's output depends on the batch it is computed in.
        "train": {"epochs": 2, "steps_per_epoch": 3, "mixed_precision": "float32"},
        "output": {"dir": str(folder / "runs")},
    }, "two.yaml")
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr
    return spec, last_json(result.stdout)


# The tests of the one trained run share a worker under pytest-xdist, so it trains once.
@pytest.mark.xdist_group("predict_two_replicas")
def test_predict_and_evaluate_on_one_cpu_from_a_two_replica_checkpoint(two_replica_run, tmp_path: Path) -> None:
    trained_on_two, summary = two_replica_run
    assert summary["accelerator"]["replicas"] == 2
    run_dir = trained_on_two.parent / "runs" / "two"
    assert (run_dir / "saved_model" / "saved_model.pb").exists()

    one_cpu = ["--set", "accelerator.cpu_devices=1"]
    evaluated = run_cli("evaluate", trained_on_two, *one_cpu)
    assert evaluated.returncode == 0, evaluated.stderr
    report = last_json(evaluated.stdout)
    assert report["accelerator"]["replicas"] == 1 and report["step"] == 2 * 3
    # The same weights on the same 512 test images: the metric the training run reported.
    assert report["metrics"]["accuracy"] == pytest.approx(summary["metrics"]["accuracy"], abs=1e-6)

    # 7 rows: not a multiple of any batch or replica count.
    images = load_dataset("mnist").splits["test"]["image"][:7]
    np.save(tmp_path / "seven.npy", images)
    predicted = run_cli("predict", trained_on_two, "--input", tmp_path / "seven.npy", *one_cpu)
    assert predicted.returncode == 0, predicted.stderr
    rows = [json.loads(line) for line in predicted.stdout.splitlines() if line.startswith("{")]
    assert [r["index"] for r in rows] == list(range(7))
    assert all(len(r["output"]) == 10 and abs(sum(r["output"]) - 1) < 1e-3 for r in rows)

    # The exported .keras model gives the same classes as the checkpoint.
    model = tf.keras.models.load_model(run_dir / "model.keras")
    expected = np.argmax(model.predict(images.astype("float32"), verbose=0), axis=1)
    assert [r["class"] for r in rows] == expected.tolist()

    # The SavedModel answers the same from the model's inputs (`serve`, the serving default) and from the
    # shards' own serialized records (`serve_examples`: the runner's parser inside the export).
    loaded = tf.saved_model.load(str(run_dir / "saved_model"))
    assert {"serving_default", "serve", "serve_examples"} <= set(loaded.signatures)
    test_shards = tf.io.gfile.glob(yaml.safe_load(Path(trained_on_two).read_text())["data"]["eval"])
    records = [r.numpy() for r in tf.data.TFRecordDataset(test_shards).take(7)]
    pixels = np.stack([_image_of(record) for record in records])
    reference = model.predict(pixels, verbose=0)
    np.testing.assert_allclose(loaded.serve(tf.constant(pixels)).numpy(), reference, atol=1e-5)
    np.testing.assert_allclose(loaded.serve_examples(tf.constant(records)).numpy(), reference, atol=1e-5)

    # Predicting on two replicas works with the odd count too (padding, not a divisibility error).
    on_two = run_cli("predict", trained_on_two, "--input", tmp_path / "seven.npy", "--output", tmp_path / "p.npy")
    assert on_two.returncode == 0, on_two.stderr
    assert np.load(tmp_path / "p.npy").argmax(axis=1).tolist() == expected.tolist()


def _image_of(record: bytes) -> np.ndarray:
    """The 28x28x1 image of a serialized MNIST Example, read without the runner's parser, as float32."""
    feature = tf.train.Example.FromString(record).features.feature["image"]
    values = (np.frombuffer(feature.bytes_list.value[0], np.uint8) if feature.bytes_list.value
              else np.array(feature.int64_list.value))
    return values.reshape(28, 28, 1).astype(np.float32)


@pytest.mark.xdist_group("predict_two_replicas")
def test_predict_refuses_inputs_of_the_wrong_shape(two_replica_run, tmp_path: Path) -> None:
    spec, _ = two_replica_run
    np.save(tmp_path / "bad.npy", np.zeros((3, 32, 32, 3), np.uint8))
    result = run_cli("predict", spec, "--input", tmp_path / "bad.npy", "--set", "accelerator.cpu_devices=1")
    assert result.returncode == 2
    assert "input 'image' has rows of shape (32, 32, 3), the model expects (28, 28, 1)" in result.stderr


def test_predict_before_training_says_to_run_first(mnist_job) -> None:
    result = run_cli("predict", mnist_job("untrained"), "--input", "x.npy")
    assert result.returncode == 2
    assert "holds no checkpoint of job 'untrained': run `runner run` first" in result.stderr


# --- inputs as the model saw them: the manifest's value_ranges ------------------------------------------------


@pytest.fixture(scope="module")
def mnist_cnn_run(tiny_mnist: Path, tmp_path_factory) -> tuple[list[str], Path]:
    """jobs/mnist_cnn.yaml itself, trained briefly on real MNIST digits: (its --set overrides, the run folder)."""
    folder = tmp_path_factory.mktemp("ranges")
    sets = [
        f"data.train={tiny_mnist}/train-*.tfrecord", f"data.eval={tiny_mnist}/test-*.tfrecord",
        "data.global_batch_size=128", "data.shuffle_buffer=512", "train.epochs=1", "train.steps_per_epoch=3",
        "train.mixed_precision=float32", f"output.dir={folder / 'runs'}",
    ]
    overrides = [arg for s in sets for arg in ("--set", s)]
    result = run_cli("run", REPO / "jobs" / "mnist_cnn.yaml", *overrides)
    assert result.returncode == 0, result.stderr
    return overrides, folder / "runs" / "mnist_cnn"


@pytest.mark.xdist_group("predict_ranges")
def test_pixels_scaled_to_0_1_are_refused_naming_both_ranges_and_the_fix(
    mnist_cnn_run, tiny_mnist: Path, tmp_path: Path
) -> None:
    overrides, run_dir = mnist_cnn_run
    job = REPO / "jobs" / "mnist_cnn.yaml"
    assert json.loads((tiny_mnist / "manifest.json").read_text())["value_ranges"] == {
        "image": {"dtype": "uint8", "min": 0, "max": 255}}
    digits = load_dataset("mnist").splits["test"]["image"][:9]
    np.save(tmp_path / "digits.npy", (digits / 255.0).astype(np.float32))  # the usual "normalised" copy

    refused = run_cli("predict", job, "--input", tmp_path / "digits.npy", *overrides)
    assert refused.returncode == 2, refused.stderr
    assert "input 'image' holds values 0..1 (float32), but the model was trained on 0..255" in refused.stderr
    assert "`--scale 255` multiplies these to 0..255" in refused.stderr and "--no-check" in refused.stderr
    assert not refused.stdout.strip(), "nothing predicted"

    # Following the fix: the classes are the model's own on the raw digits.
    expected = np.argmax(tf.keras.models.load_model(run_dir / "model.keras").predict(
        digits.astype("float32"), verbose=0), axis=1).tolist()
    scaled = run_cli("predict", job, "--input", tmp_path / "digits.npy", "--scale", "255", *overrides)
    assert scaled.returncode == 0, scaled.stderr
    assert [json.loads(line)["class"] for line in scaled.stdout.splitlines()] == expected

    # --no-check predicts on what it is given (here: all but blank images to the model), and says so.
    unchecked = run_cli("predict", job, "--input", tmp_path / "digits.npy", "--no-check", *overrides)
    assert unchecked.returncode == 0, unchecked.stderr
    assert len(unchecked.stdout.splitlines()) == 9
    assert "note: --no-check: the inputs' values were not compared with the training data" in unchecked.stderr

    # evaluate --input: labelled rows get the same check; raw ones are evaluated, every row once.
    labels = load_dataset("mnist").splits["test"]["label"][:9]
    np.savez(tmp_path / "scaled.npz", image=digits / 255.0, label=labels)
    np.savez(tmp_path / "raw.npz", image=digits, label=labels)
    bad = run_cli("evaluate", job, "--input", tmp_path / "scaled.npz", *overrides)
    assert bad.returncode == 2 and "holds values 0..1 (float64)" in bad.stderr, bad.stderr
    good = run_cli("evaluate", job, "--input", tmp_path / "raw.npz", *overrides)
    assert good.returncode == 0, good.stderr
    report = last_json(good.stdout)
    assert report["examples"] == 9
    assert report["metrics"]["accuracy"] == pytest.approx(np.mean(np.array(expected) == labels), abs=1e-6)
    shards = run_cli("evaluate", job, "--input", f"{tiny_mnist}/test-*.tfrecord", *overrides)
    assert shards.returncode == 0 and last_json(shards.stdout)["examples"] == 512, shards.stderr


@pytest.mark.xdist_group("predict_ranges")
def test_a_manifest_without_value_ranges_skips_the_check_with_a_note(
    mnist_cnn_run, tiny_mnist: Path, tmp_path: Path
) -> None:
    overrides, _ = mnist_cnn_run
    old = tmp_path / "old"
    shutil.copytree(tiny_mnist, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["value_ranges"]  # as `runner prepare` wrote manifests before it recorded them
    (old / "manifest.json").write_text(json.dumps(manifest))
    np.save(tmp_path / "digits.npy", load_dataset("mnist").splits["test"]["image"][:3] / 255.0)
    result = run_cli("predict", REPO / "jobs" / "mnist_cnn.yaml", "--input", tmp_path / "digits.npy", *overrides,
                     "--set", f"data.train={old}/train-*.tfrecord")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {old}/manifest.json has no value_ranges (written before they were recorded): the "
                     "inputs' values are not checked; `runner prepare` (or `runner manifest`) again records them"]
    assert len(result.stdout.splitlines()) == 3


def test_the_value_check_knows_pixels_token_ids_and_standardised_floats() -> None:
    from runner.job.predict import InputOptions, check_values

    def check(array, trained_on) -> str | None:
        try:
            check_values(np.asarray(array), trained_on, "x.npy: input 'x'", "m.json", InputOptions())
        except DataError as error:
            return str(error)
        return None

    pixels = {"dtype": "uint8", "min": 0, "max": 253}
    assert check(np.array([0, 255], np.uint8), pixels) is None, "a pixel the split lacked is still a pixel"
    assert check(np.array([0.0, 128.0, 255.0], np.float32), pixels) is None, "whole numbers in a float array"
    assert "fractional values" in check(np.array([0.5, 200.0]), pixels)
    unit = {"dtype": "float32", "min": 0.0, "max": 1.0}
    assert "`--scale 0.00392157` multiplies these to 0..1" in check(np.array([0, 255], np.uint8), unit)
    assert check(np.array([0, 1], np.uint8), unit) is None, "integers are numbers a float model reads alike"
    ids = {"dtype": "int64", "min": 0, "max": 14999}
    assert check(np.array([[1, 2, 14999]]), ids) is None
    assert "values 0..15000 (int64), but the model was trained on 0..14999" in check(np.array([[0, 15000]]), ids)
    weather = {"dtype": "float32", "min": -3.5, "max": 3.7}
    assert check(np.array([-1.2, 0.4, 4.9], np.float32), weather) is None, "a later period may go a little further"
    raw = check(np.array([12.0, 35.5], np.float32), weather)
    assert "holds values 12..35.5 (float32), but the model was trained on -3.5..3.7" in raw
    assert "--scale" not in raw, "no factor turns raw readings into standardised ones"
    assert "fractional values 0.5..2 (float64); the model was trained on whole int64" in check(
        np.array([0.5, 2.0]), ids)
    assert "holds <U3 values" in check(np.array(["cat"]), ids)
    # Each --scale offered is one that passes when followed; fractional pixels are named as that, not as a scale.
    noisy = check(np.array([0.3, 128.6, 255.3]), pixels)
    assert "fractional values 0.3..255.3" in noisy and "round them" in noisy and "--scale" not in noisy
    doubled = check(np.array([0, 510], np.int64), {"dtype": "uint8", "min": 0, "max": 255})
    factor = float(re.search(r"`--scale ([\d.e-]+)`", doubled).group(1))
    assert check(np.array([0, 510], np.int64) * factor, {"dtype": "uint8", "min": 0, "max": 255}) is None
