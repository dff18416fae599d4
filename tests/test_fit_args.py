"""The rest of Keras fit's arguments a spec may set: sample weights from a feature of the records, validation
every N epochs (or as auto decides from the record counts), and label smoothing on class-id labels. Real runs
of `runner run` on tiny MNIST TFRecords; the figures the runner reports are computed again here by hand, from
the saved model's predictions and the records read without the runner."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from runner import SpecError
from runner.spec.load import load_spec
from tests.conftest import last_json, run_cli, write_spec

pytestmark = pytest.mark.slow

TRAIN_RECORDS, TEST_RECORDS, BATCH = 2048, 512, 128


def _weighted_mnist(out: Path, train: int, test: int, weigh) -> Path:
    """Real MNIST with a float32 `weight` feature per record, weigh(labels) -> weights."""
    out.mkdir(parents=True, exist_ok=True)
    from runner.data.schema import Feature
    from runner.prepare import shards
    from runner.prepare.datasets import Dataset, load_dataset

    full = load_dataset("mnist")
    splits = {}
    for split, count in (("train", train), ("test", test)):
        arrays = {k: v[:count] for k, v in full.splits[split].items()}
        arrays["weight"] = weigh(arrays["label"]).astype(np.float32)
        splits[split] = arrays
    features = {**full.features, "weight": Feature("float32", ())}
    small = Dataset(full.name, splits, features, full.inputs, full.label, full.source, full.license)
    entries = {split: shards.write_split(small, split, str(out), 2 if split == "train" else 1) for split in splits}
    shards.write_manifest(str(out), shards.manifest_for(small, entries))
    return out


@pytest.fixture(scope="module")
def zero_weight_mnist(tmp_path_factory) -> Path:
    """2,048 training and 512 test images; every record of class 0 weighs 0, the others 1."""
    return _weighted_mnist(
        tmp_path_factory.mktemp("weighted"), TRAIN_RECORDS, TEST_RECORDS, lambda y: np.where(y == 0, 0.0, 1.0)
    )


def _job(tmp_path: Path, folder: Path, name: str, eval_: bool = True, **train) -> Path:
    return write_spec(tmp_path, {
        "name": name,
        "accelerator": {"kind": "cpu"},
        "data": {
            "train": f"{folder}/train-*.tfrecord", "eval": f"{folder}/test-*.tfrecord" if eval_ else None,
            "global_batch_size": BATCH, "shuffle_buffer": 512,
        },
        # float32: the by-hand figures below are compared to 1e-5.
        "train": {"epochs": 2, "mixed_precision": "float32", **train},
        "output": {"dir": str(tmp_path / "runs"), "tensorboard": False},
    }, f"{name}.yaml")


def _test_split(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images float32, labels, weights) of the test shard, parsed here without the runner."""
    import tensorflow as tf

    images, labels, weights = [], [], []
    for record in tf.data.TFRecordDataset([str(f) for f in sorted(folder.glob("test-*.tfrecord"))]):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        images.append(np.frombuffer(feature["image"].bytes_list.value[0], np.uint8).reshape(28, 28, 1))
        labels.append(feature["label"].int64_list.value[0])
        weights.append(feature["weight"].float_list.value[0])
    return np.stack(images).astype(np.float32), np.array(labels), np.array(weights)


def _predictions(summary: dict, images: np.ndarray) -> np.ndarray:
    import keras

    model = keras.models.load_model(summary["model"], compile=False)
    return model.predict(images, batch_size=BATCH, verbose=0).astype(np.float64)


def test_sample_weights_from_a_feature_weigh_training_and_evaluation(zero_weight_mnist: Path, tmp_path: Path):
    spec = _job(tmp_path, zero_weight_mnist, "weighted", sample_weight="weight")
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)

    images, labels, weights = _test_split(zero_weight_mnist)
    probabilities = _predictions(summary, images)
    predicted = probabilities.argmax(axis=1)
    # Class 0 weighed nothing in training: the model learned the other nine and almost never answers 0.
    zeros = labels == 0
    assert np.mean(predicted[zeros] == 0) < 0.1, np.mean(predicted[zeros] == 0)
    assert np.mean(predicted[~zeros] == labels[~zeros]) > 0.6
    # Evaluation is weighted alike (docs/specs.md): the accuracy is over the records that weigh, and the loss is
    # Keras's weighted mean, sum(weight x loss) / records.
    metrics = summary["metrics"]
    assert metrics["examples"] == TEST_RECORDS
    assert metrics["accuracy"] == pytest.approx(np.mean(predicted[~zeros] == labels[~zeros]), abs=1e-6)
    picked = np.clip(probabilities[np.arange(len(labels)), labels], 1e-7, 1 - 1e-7)
    assert metrics["loss"] == pytest.approx(np.sum(weights * -np.log(picked)) / TEST_RECORDS, abs=1e-5)
    # `runner evaluate` weighs the same way.
    evaluated = run_cli("evaluate", spec)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert last_json(evaluated.stdout)["metrics"] == pytest.approx({k: metrics[k] for k in ("accuracy", "loss")})


def test_a_sample_weight_the_records_lack_or_that_is_negative_stops_the_job_with_exit_2(
    zero_weight_mnist: Path, tmp_path: Path
):
    spec = _job(tmp_path, zero_weight_mnist, "lacking", sample_weight="wieght")
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"train.sample_weight names 'wieght', but {zero_weight_mnist}/manifest.json (the schema of data.train) "
            "has no such feature; it has: image, label, weight") in result.stderr
    assert not (tmp_path / "runs" / "lacking").exists()  # refused before the run folder was touched

    negative = _weighted_mnist(tmp_path / "negative", 512, 128, lambda y: np.where(y == 3, -1.0, 1.0))
    spec = _job(tmp_path, negative, "negative", eval_=False, epochs=1, steps_per_epoch=2, sample_weight="weight")
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("data.train: train.sample_weight feature weight holds a negative or non-finite weight (each must be "
            ">= 0)") in result.stderr


def test_sample_weight_is_refused_beside_class_weight_or_as_the_label(tmp_path: Path) -> None:
    both = write_spec(tmp_path, {"name": "both", "train": {"sample_weight": "w", "class_weight": "balanced"}})
    with pytest.raises(SpecError, match=r"Keras takes one or the other: remove train.class_weight"):
        load_spec(both)
    label = write_spec(tmp_path, {"name": "label", "train": {"sample_weight": "label"}})
    with pytest.raises(SpecError, match=r"train.sample_weight names 'label', which is data.label"):
        load_spec(label)


def test_validation_every_2_validates_on_epochs_2_and_4_only(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("every2", train={"epochs": 4, "steps_per_epoch": 2, "validation_every": 2,
                                      "mixed_precision": "float32"}, output={"tensorboard": False})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = last_json(result.stdout)["epochs"]
    validated = [e["epoch"] for e in epochs if "val_loss" in e["metrics"]]
    assert validated == [2, 4], epochs
    assert all(math.isfinite(e["metrics"]["val_accuracy"]) for e in epochs if e["epoch"] in validated)


def test_auto_validates_only_a_split_small_against_an_epoch(mnist_job, tmp_path: Path) -> None:
    """512 eval records: 10% of 40 steps x 128 (validated), 100% of 4 steps x 128 (not)."""
    for steps, share, validated in ((40, "10.0%", True), (4, "100.0%", False)):
        spec = mnist_job(f"auto{steps}", train={"epochs": 1, "steps_per_epoch": steps, "allow_chance": True},
                         data={"global_batch_size": 128}, output={"tensorboard": False})
        result = run_cli("run", spec)
        assert result.returncode == 0, result.stderr[-3000:]
        decision = "every epoch" if validated else "never"
        assert (f"train.validation_every auto: {decision}: data.eval holds 512 records, {share} of the "
                f"{steps * 128:,} one epoch trains (auto validates at most 10%)") in result.stderr
        metrics = last_json(result.stdout)["epochs"][0]["metrics"]
        assert ("val_loss" in metrics) is validated, metrics


def test_auto_validates_the_jobs_own_validation_split_every_epoch_as_keras_does(mnist_job, small_mnist) -> None:
    """A split of the job's own (data.validation) is validated after every epoch, as Keras's validation_data is,
    whatever its size (here 512 records against 64 trained an epoch); the log says what it costs and how to turn it
    off. data.eval alone keeps the share rule (the test above)."""
    spec = mnist_job("ownval", train={"epochs": 2, "steps_per_epoch": 2, "allow_chance": True},
                     data={"eval": None, "validation": f"{small_mnist}/test-*.tfrecord"}, output={"tensorboard": False})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("train.validation_every auto: every epoch, as Keras's validation_data: data.validation is the job's "
            "validation split (512 records, 800.0% of the 64 one epoch trains") in result.stderr
    assert "train.validation_every: never turns it off" in result.stderr
    summary = last_json(result.stdout)
    assert [("val_loss" in e["metrics"]) for e in summary["epochs"]] == [True, True]
    assert summary["timing"]["eval_s"] > 0


def test_the_older_per_epoch_key_keeps_its_meaning(tmp_path: Path) -> None:
    on = write_spec(tmp_path, {"name": "on", "train": {"validate_every_epoch": True}})
    assert load_spec(on).train.validation_every == 1
    off = write_spec(tmp_path, {"name": "off", "train": {"validate_every_epoch": False}})
    assert load_spec(off).train.validation_every == "never"
    plateau = write_spec(tmp_path, {"name": "p", "train": {"validate_every_epoch": False, "reduce_lr_patience": 2}})
    with pytest.raises(SpecError, match=r"train.reduce_lr_patience \(2\) watches val_loss after every epoch"):
        load_spec(plateau)
    both = write_spec(tmp_path, {"name": "b", "train": {"validate_every_epoch": True, "validation_every": 3}})
    with pytest.raises(SpecError, match=r"both set the validation cadence: keep train.validation_every only"):
        load_spec(both)


def test_label_smoothing_on_class_ids_trains_and_reports_the_smoothed_loss(mnist_job, small_mnist: Path,
                                                                         tmp_path: Path) -> None:
    smoothing = 0.1
    spec = mnist_job(
        "smoothed", output={"tensorboard": False},
        train={"epochs": 2, "steps_per_epoch": 8, "mixed_precision": "float32",
               "loss": {"class_name": "CategoricalCrossentropy", "config": {"label_smoothing": smoothing}},
               "metrics": ["accuracy", "sparse_categorical_accuracy"]},
    )
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the class ids are one-hot encoded to 10 classes" in result.stderr
    summary = last_json(result.stdout)

    import tensorflow as tf

    images, labels = [], []
    for record in tf.data.TFRecordDataset([str(f) for f in sorted(small_mnist.glob("test-*.tfrecord"))]):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        images.append(np.frombuffer(feature["image"].bytes_list.value[0], np.uint8).reshape(28, 28, 1))
        labels.append(feature["label"].int64_list.value[0])
    labels = np.array(labels)
    probabilities = _predictions(summary, np.stack(images).astype(np.float32))
    # Keras's CategoricalCrossentropy on probabilities: rows normalised, clipped to [1e-7, 1 - 1e-7], against
    # targets smoothed to 1 - 0.1 + 0.01 for the class and 0.01 for each other one.
    targets = np.eye(10)[labels] * (1 - smoothing) + smoothing / 10
    clipped = np.clip(probabilities / probabilities.sum(axis=1, keepdims=True), 1e-7, 1 - 1e-7)
    by_hand = float(np.mean(-np.sum(targets * np.log(clipped), axis=1)))
    metrics = summary["metrics"]
    assert metrics["loss"] == pytest.approx(by_hand, abs=1e-5)
    # Even a perfect prediction keeps the smoothed targets' entropy: the loss cannot fall to 0.
    floor = -(0.91 * math.log(0.91) + 9 * 0.01 * math.log(0.01))
    assert floor == pytest.approx(0.50, abs=0.01) and metrics["loss"] > floor
    # Both accuracy names measure what they say on the one-hot labels: the share of records whose top class is
    # the label.
    accuracy = float(np.mean(probabilities.argmax(axis=1) == labels))
    assert metrics["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert metrics["sparse_categorical_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert json.loads((tmp_path / "runs" / "smoothed" / "summary.json").read_text())["status"] == "succeeded"
    # `runner evaluate` one-hot encodes the labels as the run did.
    evaluated = run_cli("evaluate", spec)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    expected = {k: v for k, v in metrics.items() if k != "examples"}
    assert last_json(evaluated.stdout)["metrics"] == pytest.approx(expected)


# --- class weights as Keras writes them ------------------------------------------------------------------------


def test_class_weight_takes_integer_keys_and_every_class_must_have_one(mnist_job, tmp_path: Path) -> None:
    """`class_weight: {0: 1.0, 1: 2.0}` is how Keras users write it. Keras looks each label up in a table of
    the weights of class 0 up: a map that leaves a class out used to fail inside the input pipeline with an
    error that blamed the records; validate and run now name the classes to add (exit 2, no run folder)."""
    from tests.support.cli import invoke

    partial = mnist_job("weights", train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True,
                                          "class_weight": {0: 1.0, 2: 2.0}}, output={"tensorboard": False})
    assert "  class_weight:\n    0: 1.0\n" in partial.read_text(), "integer keys, as YAML writes them"
    refused = invoke("validate", partial)
    assert refused.returncode == 2, refused.stderr
    assert "train.class_weight gives weights for classes 0, 2, but the labels run up to 9" in refused.stderr
    assert "add 1, 3, 4, 5, 6, 7, 8, 9" in refused.stderr
    ran = run_cli("run", partial)
    assert ran.returncode == 2 and "add 1, 3, 4" in last_json(ran.stdout)["error"], ran.stderr[-2000:]
    assert not (tmp_path / "runs" / "weights").exists()

    every = "{" + ", ".join(f"{c}: {2.0 if c == 3 else 1.0}" for c in range(10)) + "}"
    trained = run_cli("run", partial, "--set", f"train.class_weight={every}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert last_json(trained.stdout)["status"] == "succeeded"


def test_the_first_step_is_traced_once_and_trains_as_keras_alone_does() -> None:
    """fit.build_state makes the optimizer's and metrics' variables before `fit`: Keras on TensorFlow without a
    strategy would make them inside the first step's trace, which TensorFlow then traces a second time."""
    import keras
    import tensorflow as tf

    from runner.train import fit

    class Counted(keras.Sequential):
        """Counts the traces of its train step (Python runs it once per trace)."""

        traces = 0

        def train_step(self, data):  # noqa: ANN001, ANN202
            self.traces += 1
            return super().train_step(data)

    def trained(built: bool) -> tuple[int, list[np.ndarray]]:
        keras.utils.set_random_seed(3)
        model = Counted([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", weighted_metrics=["accuracy"])
        rows = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
        dataset = tf.data.Dataset.from_tensor_slices((rows, np.arange(64) % 3)).batch(16)
        if built:
            fit.build_state(model, dataset.element_spec)
            assert model.optimizer.built
        model.fit(dataset, epochs=2, verbose=0)
        return model.traces, model.get_weights()

    once, weights = trained(built=True)
    twice, keras_weights = trained(built=False)
    assert (once, twice) == (1, 2)
    assert all(np.array_equal(a, b) for a, b in zip(weights, keras_weights, strict=True))
