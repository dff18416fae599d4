"""A model trained on two replicas evaluates and predicts on one CPU, any batch size; exports load back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from runner.prepare.datasets import load_dataset
from tests.conftest import last_json, run_cli, write_spec

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
