"""Evaluation covers every record of its split, on any number of replicas.

A TPU needs every batch in the same static shape, so the last partial batch of an evaluation split is
padded to a whole batch and the padding carries sample weight 0: every metric and the loss count each
real record once and the padding never. Each test compares the runner's figures with the same figures
computed here by hand: the TFRecords read record by record, `model.predict` over all of them, numpy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import last_json, run_cli, write_spec

BATCH = 128
# Neither is a multiple of the batch: 500 = 3 x 128 + 116, 300 = 2 x 128 + 44.
TEST_RECORDS, VAL_RECORDS = 500, 300


@pytest.fixture(scope="module")
def uneven_mnist(tmp_path_factory) -> Path:
    """Real MNIST: 1,024 training records, a 500-record test split in 2 shards, a 300-record val split."""
    from runner.prepare import shards
    from runner.prepare.datasets import Dataset, load_dataset

    full = load_dataset("mnist")
    train, test = full.splits["train"], full.splits["test"]
    splits = {
        "train": {k: v[:1024] for k, v in train.items()},
        "test": {k: v[:TEST_RECORDS] for k, v in test.items()},
        "val": {k: v[1000 : 1000 + VAL_RECORDS] for k, v in test.items()},
    }
    small = Dataset(full.name, splits, full.features, full.inputs, full.label, full.source, full.license)
    out = tmp_path_factory.mktemp("uneven")
    entries = {
        "train": shards.write_split(small, "train", str(out), 2),
        "test": shards.write_split(small, "test", str(out), 2),
        "val": shards.write_split(small, "val", str(out), 1),
    }
    shards.write_manifest(str(out), shards.manifest_for(small, entries))
    return out


def read_split(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Every record of the split's shards, parsed here without the runner: (images float32, labels)."""
    shape = json.loads((folder / "manifest.json").read_text())["features"]["image"]["shape"]
    images, labels = [], []
    files = [str(f) for f in sorted(folder.glob(f"{split}-*.tfrecord"))]
    for record in tf.data.TFRecordDataset(files):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        images.append(np.frombuffer(feature["image"].bytes_list.value[0], np.uint8).reshape(shape))
        labels.append(feature["label"].int64_list.value[0])
    return np.stack(images).astype(np.float32), np.array(labels)


def by_hand(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy, top-2 accuracy and sparse categorical cross-entropy (Keras clips at 1e-7) over every row."""
    rows = np.arange(len(labels))
    top2 = np.argsort(probabilities, axis=1)[:, -2:]
    picked = np.clip(probabilities[rows, labels], 1e-7, 1 - 1e-7)
    return {
        "accuracy": float(np.mean(np.argmax(probabilities, axis=1) == labels)),
        "top2_accuracy": float(np.mean((top2 == labels[:, None]).any(axis=1))),
        "loss": float(np.mean(-np.log(picked))),
    }


def assert_matches(reported: dict, expected: dict, records: int, prefix: str = "") -> None:
    # One record in 500 moves the accuracy by 0.002: a tolerance of 1e-6 is exact in records.
    for name in ("accuracy", "loss"):
        assert reported[prefix + name] == pytest.approx(expected[name], abs=1e-6 if name == "accuracy" else 1e-5), (
            f"{prefix}{name} over {records} records"
        )


def test_evaluation_batches_hold_every_record_once_then_weightless_padding(uneven_mnist: Path):
    from runner.data import pipeline

    shards = pipeline.find_shards(f"{uneven_mnist}/test-*.tfrecord")
    assert shards.records == TEST_RECORDS and pipeline.eval_steps(shards, BATCH, "data.eval") == 4
    dataset = pipeline.make_dataset(shards, BATCH, ("image",), "label", training=False, weighted=True)
    # One static shape for every batch, the last one included (a TPU compiles one program).
    assert [tuple(spec.shape) for spec in dataset.element_spec] == [(BATCH, 28, 28, 1), (BATCH,), (BATCH,)]
    images, labels, weights = (np.concatenate(parts) for parts in
                               zip(*((x.numpy(), y.numpy(), w.numpy()) for x, y, w in dataset), strict=True))
    assert len(labels) == 4 * BATCH
    expected_x, expected_y = read_split(uneven_mnist, "test")
    # Shards are read in parallel in blocks; each record comes once, with its own label.
    real = weights > 0
    assert real.sum() == TEST_RECORDS
    def rows(x: np.ndarray, y: np.ndarray) -> Counter:
        return Counter((image.tobytes(), int(label)) for image, label in zip(x, y, strict=True))

    assert rows(images[real], labels[real]) == rows(expected_x, expected_y)
    assert np.all(weights[real] == np.float32(4 * BATCH / TEST_RECORDS)) and np.all(weights[~real] == 0)
    assert real[:TEST_RECORDS].all(), "the padding comes last"
    assert np.sum(weights, dtype=np.float64) == pytest.approx(4 * BATCH, rel=1e-6)


def test_a_manifest_that_lists_more_records_than_the_shards_hold_fails_evaluation(uneven_mnist: Path, tmp_path: Path):
    import shutil

    from runner import DataError
    from runner.data import faults, pipeline

    folder = tmp_path / "data"
    shutil.copytree(uneven_mnist, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["splits"]["val"]["shards"][0]["records"] += 1  # the bytes are right, the count is not
    manifest["splits"]["val"]["records"] += 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    shards = pipeline.find_shards(f"{folder}/val-*.tfrecord")
    dataset = pipeline.make_dataset(shards, BATCH, ("image",), "label", training=False, weighted=True)
    with pytest.raises(tf.errors.FailedPreconditionError) as raised:
        list(dataset)
    error = faults.input_error(raised.value, str(shards.pattern), "data.eval")
    assert isinstance(error, DataError)
    assert (f"hold only {VAL_RECORDS} records, their manifest lists {VAL_RECORDS + 1} (in {folder}/manifest.json"
            in str(error))


def job(folder: Path, tmp_path: Path, name: str, replicas: int, **data: object) -> Path:
    return write_spec(tmp_path, {
        "name": name,
        "accelerator": {"kind": "cpu", "cpu_devices": replicas},
        "data": {
            "train": f"{folder}/train-*.tfrecord",
            "eval": f"{folder}/test-*.tfrecord",
            "validation": f"{folder}/val-*.tfrecord",
            "global_batch_size": BATCH,
            **data,
        },
        # Two steps: what is checked is every evaluation record counted once, not what training learns.
        # float32: in bfloat16 (auto's choice on a CPU with avx512_bf16) a row's output depends on the batch it
        # is computed in (the kernels block the matmuls by batch size), so a near tie can flip between the
        # runner's padded batches and predict()'s, and the comparison would measure rounding, not counting.
        "train": {"epochs": 1, "steps_per_epoch": 2, "validation_every": "never" if "validation" in data else 1,
                  "mixed_precision": "float32"},
        "output": {"dir": str(tmp_path / "runs"), "tensorboard": False},
    }, f"{name}.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_eval_validation_and_evaluate_count_every_record_exactly(uneven_mnist: Path, tmp_path: Path, replicas: int):
    spec = job(uneven_mnist, tmp_path, f"uneven{replicas}", replicas)
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["accelerator"]["replicas"] == replicas

    import keras

    model = keras.models.load_model(summary["model"], compile=False)
    test_x, test_y = read_split(uneven_mnist, "test")
    val_x, val_y = read_split(uneven_mnist, "val")
    assert len(test_y) == TEST_RECORDS and len(val_y) == VAL_RECORDS
    expected_test = by_hand(model.predict(test_x, verbose=0), test_y)
    expected_val = by_hand(model.predict(val_x, verbose=0), val_y)

    metrics = summary["metrics"]
    assert metrics["examples"] == TEST_RECORDS and isinstance(metrics["examples"], int)
    assert_matches(metrics, expected_test, TEST_RECORDS)
    # The epoch's validation ran on the weights the model was saved with (one epoch, no early stopping).
    assert_matches(summary["epochs"][-1]["metrics"], expected_val, VAL_RECORDS, prefix="val_")

    # `runner evaluate` restores the newest checkpoint (the same weights) on the other replica count: across
    # the two cases it evaluates on 1 and on 2 replicas, each from a checkpoint another count wrote.
    devices = 3 - replicas
    evaluated = run_cli("evaluate", spec, "--set", f"accelerator.cpu_devices={devices}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "Skipping variable loading" not in evaluated.stderr, "no optimizer warning: evaluate trains nothing"
    report = last_json(evaluated.stdout)
    assert report["accelerator"]["replicas"] == devices
    assert report["examples"] == TEST_RECORDS and isinstance(report["examples"], int)
    assert_matches(report["metrics"], expected_test, TEST_RECORDS)


@pytest.mark.slow
def test_an_eval_split_smaller_than_one_batch_is_evaluated_whole(uneven_mnist: Path, tmp_path: Path):
    """300 validation records at batch 512: one batch, 212 rows of it padding."""
    spec = job(
        uneven_mnist, tmp_path, "small", 2, eval=f"{uneven_mnist}/val-*.tfrecord", validation=None,
        global_batch_size=512,
    )
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    import keras

    model = keras.models.load_model(summary["model"], compile=False)
    val_x, val_y = read_split(uneven_mnist, "val")
    assert summary["metrics"]["examples"] == VAL_RECORDS
    assert_matches(summary["metrics"], by_hand(model.predict(val_x, verbose=0), val_y), VAL_RECORDS)


@pytest.mark.slow
def test_a_user_model_metric_and_preprocess_count_every_record(tmp_path: Path):
    """The fashion example (user model, user metric, user preprocessing) with 300 eval records at batch 256;
    one training step of 256 records (the count of evaluated records is the point, not what training learns)."""
    from tests.test_user_model import EXAMPLE, example_env, example_overrides, standardize

    data = tmp_path / "fashion"
    prepared = subprocess.run(
        [sys.executable, "-m", "fashionnet.prepare", "--out", str(data), "--train", "256", "--eval", "300"],
        capture_output=True, text=True, timeout=180, env=example_env(),
    )
    assert prepared.returncode == 0, prepared.stderr
    indexed = run_cli("manifest", EXAMPLE / "job.yaml", *example_overrides(data, data / "unused")[:4],
                      env=example_env())
    assert indexed.returncode == 0, indexed.stderr
    result = run_cli(
        "run", EXAMPLE / "job.yaml", *example_overrides(data, tmp_path / "runs"), "--set", "train.epochs=1",
        "--set", "accelerator.cpu_devices=2", "--set", "train.mixed_precision=float32", env=example_env(),
    )  # float32: see job() above
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    import keras

    model = keras.models.load_model(summary["model"], compile=False)
    pixels, labels = [], []
    for record in tf.data.TFRecordDataset([str(f) for f in sorted(data.glob("eval-*.tfrecord"))]):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        pixels.append(tf.io.decode_png(feature["image"].bytes_list.value[0], channels=1).numpy())
        labels.append(feature["label"].int64_list.value[0])
    expected = by_hand(model.predict(standardize(np.stack(pixels).astype(np.float32)), verbose=0), np.array(labels))
    metrics = summary["metrics"]
    assert metrics["examples"] == 300
    assert_matches(metrics, expected, 300)
    assert metrics["top2_accuracy"] == pytest.approx(expected["top2_accuracy"], abs=1e-6)
