"""The classic Colab TPU workloads in jobs/: each validates, and each runs through the CLI on real data.

Data is prepared with `runner prepare NAME --limit N` (the real sources, cut short); jobs run their own
YAML with a few steps set on the command line. Accuracy goals are not tested here: they take minutes
of training and live in benchmarks/accuracy.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke

JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.yaml"))
WORKLOADS = {  # job -> (dataset, records per split, global batch)
    "fashion_mnist_cnn": ("fashion_mnist", 256, 32),
    "cifar10_cnn": ("cifar10", 20, 4),
    "imdb_lstm": ("imdb", 256, 32),
    "weather_rnn": ("weather", 256, 32),
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """`runner prepare DATASET --limit N`, once per dataset for this module."""
    folders: dict[str, Path] = {}

    def prepare(dataset: str, limit: int) -> Path:
        if dataset not in folders:
            out = tmp_path_factory.mktemp(dataset)
            result = run_cli("prepare", dataset, "--out", out, "--limit", limit)
            assert result.returncode == 0, result.stderr
            folders[dataset] = out
        return folders[dataset]

    return prepare


def run_job(job: str, data: Path, out: Path, *overrides: str) -> dict:
    """Runs jobs/<job>.yaml on the prepared folder for two short epochs; returns the summary (status
    succeeded, with `warnings` when the six steps left the loss where it was)."""
    sets = [
        f"output.dir={out}",
        f"data.train={data}/train-*.tfrecord",
        f"data.eval={data}/test-*.tfrecord",
        "train.epochs=2",
        "train.steps_per_epoch=3",
        "train.allow_chance=true",  # six steps check the pipeline, not learning: a loss may rise in them
        *overrides,
    ]
    result = run_cli("run", REPO / "jobs" / f"{job}.yaml", *(a for s in sets for a in ("--set", s)))
    assert result.returncode == 0, result.stderr
    return last_json(result.stdout)


@pytest.mark.parametrize("job", JOBS)
def test_every_job_validates(job: str) -> None:
    result = invoke("validate", REPO / "jobs" / f"{job}.yaml", "--no-data", "--show", env=cli_env())
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)
    assert spec["name"] == job
    if job in WORKLOADS:
        dataset = WORKLOADS[job][0]
        # Relative to the job file: the repository's data/, where `runner prepare DATASET --out data/...` writes.
        assert spec["data"]["train"] == f"{REPO}/data/{dataset}/train-*.tfrecord", "the path `runner prepare` writes to"


@pytest.mark.slow
@pytest.mark.parametrize("job", ["fashion_mnist_cnn", "cifar10_cnn"])
def test_image_workloads_train_on_real_images(job: str, prepared, tmp_path: Path) -> None:
    dataset, limit, batch = WORKLOADS[job]
    data = prepared(dataset, limit)
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["source"] and manifest["license"]
    summary = run_job(job, data, tmp_path, f"data.global_batch_size={batch}")
    assert summary["status"] == "succeeded"
    assert [e["steps"] for e in summary["epochs"]] == [3, 3]
    test_records = manifest["splits"]["test"]["records"]
    assert summary["metrics"]["examples"] == test_records, "every test record, the last batch padded"
    assert 0.0 <= summary["metrics"]["accuracy"] <= 1.0
    assert (tmp_path / job / "model.keras").exists()


def serves_records_like_the_model(run_dir: Path, pattern: str, model) -> None:
    """The run's SavedModel, given the test shards' serialized records (`serve_examples`), answers as the
    trained Keras model does on the same records decoded by the runner's parser."""
    import tensorflow as tf

    from runner.data.pipeline import example_inputs, find_shards

    shards = find_shards(pattern)
    records = tf.constant([r.numpy() for r in tf.data.TFRecordDataset(list(shards.files)).take(32)])
    inputs = example_inputs(shards.features, tuple(shards.manifest["inputs"]))(records)
    loaded = tf.saved_model.load(str(run_dir / "saved_model"))
    np.testing.assert_allclose(loaded.serve_examples(records).numpy(), model.predict(inputs, verbose=0), atol=1e-5)


@pytest.mark.slow
def test_imdb_lstm_is_a_binary_classifier_through_the_pipeline(prepared, tmp_path: Path) -> None:
    import keras

    from runner.data.pipeline import find_shards, make_dataset

    data = prepared("imdb", 256)
    # A few steps on 256 short reviews: accuracy near chance is expected here, and allowed (train.allow_chance).
    summary = run_job("imdb_lstm", data, tmp_path, "data.global_batch_size=32", "train.allow_chance=true")
    assert summary["status"] == "succeeded"
    assert set(summary["metrics"]) == {"accuracy", "loss", "examples"}
    # The summary's accuracy is binary accuracy (sigmoid > 0.5 vs the 0/1 label) on the test records.
    model = keras.models.load_model(tmp_path / "imdb_lstm" / "model.keras")
    assert model.get_layer(index=1).input_dim == 15000
    batches = make_dataset(find_shards(f"{data}/test-*.tfrecord"), 32, ("tokens",), "label", training=False)
    tokens, labels = (np.concatenate(parts)
                      for parts in zip(*((x.numpy(), y.numpy()) for x, y in batches), strict=True))
    assert tokens.shape == (256, 250) and tokens.dtype == np.int64
    predicted = model.predict(tokens, verbose=0)[:, 0] > 0.5
    assert summary["metrics"]["accuracy"] == pytest.approx(np.mean(predicted == labels), abs=1e-6)
    serves_records_like_the_model(tmp_path / "imdb_lstm", f"{data}/test-*.tfrecord", model)


@pytest.mark.slow
@pytest.mark.xdist_group("weather")  # one worker prepares the weather data for both of its tests
def test_weather_rnn_regression_validates_every_epoch(prepared, tmp_path: Path) -> None:
    import keras

    from runner.data.pipeline import find_shards, make_dataset

    data = prepared("weather", 256)
    summary = run_job(
        "weather_rnn", data, tmp_path, "data.global_batch_size=32", f"data.validation={data}/validation-*.tfrecord"
    )
    assert summary["status"] == "succeeded"
    for epoch in summary["epochs"]:
        assert set(epoch["metrics"]) == {"mae", "val_loss", "val_mae"}, "per-epoch validation on the validation split"
    assert summary["timing"]["eval_s"] > 0, "validation time is counted as eval, not as training"
    assert "accuracy" not in summary["metrics"]
    # The reported MAE is the per-example error of a float label against a [batch, 1] output (no broadcasting).
    model = keras.models.load_model(tmp_path / "weather_rnn" / "model.keras")
    batches = make_dataset(find_shards(f"{data}/test-*.tfrecord"), 32, ("window",), "target", training=False)
    windows, targets = (np.concatenate(parts)
                        for parts in zip(*((x.numpy(), y.numpy()) for x, y in batches), strict=True))
    assert targets.dtype == np.float32 and windows.shape == (256, 24, 12)
    predicted = model.predict(windows, verbose=0)[:, 0]
    assert summary["metrics"]["mae"] == pytest.approx(np.mean(np.abs(predicted - targets)), rel=1e-4)
    assert summary["metrics"]["loss"] == pytest.approx(np.mean((predicted - targets) ** 2), rel=1e-4)
    serves_records_like_the_model(tmp_path / "weather_rnn", f"{data}/test-*.tfrecord", model)


@pytest.mark.slow
@pytest.mark.xdist_group("weather")
def test_early_stopping_ends_the_run_and_every_epoch_is_checkpointed(prepared, tmp_path: Path) -> None:
    data = prepared("weather", 256)
    # A learning rate far below float32 resolution freezes the weights: val_loss repeats exactly, so
    # patience 1 stops after epoch 2 and the learning rate is cut once on the way. A frozen model learns
    # nothing, which this test expects (train.allow_chance).
    summary = run_job(
        "weather_rnn", data, tmp_path, "data.global_batch_size=32", f"data.validation={data}/validation-*.tfrecord",
        "train.epochs=6", "train.learning_rate=1e-12", "train.early_stopping_patience=1", "train.reduce_lr_patience=1",
        "train.allow_chance=true",
    )
    assert summary["status"] == "succeeded"
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert summary["epochs"][0]["metrics"]["val_loss"] == summary["epochs"][1]["metrics"]["val_loss"]
    assert summary["stopped_early_after_epoch"] == 2
    assert summary["final_learning_rate"] == pytest.approx(0.5e-12, rel=1e-6)
    assert summary["final_step"] == 6
    checkpoints = {p.name.split(".")[0] for p in (tmp_path / "weather_rnn" / "checkpoints").glob("ckpt-*")}
    assert checkpoints == {"ckpt-3", "ckpt-6"}
    # Stopped early is finished: running the job again trains nothing.
    again = run_job(
        "weather_rnn", data, tmp_path, "data.global_batch_size=32", f"data.validation={data}/validation-*.tfrecord",
        "train.epochs=6", "train.learning_rate=1e-12", "train.early_stopping_patience=1", "train.reduce_lr_patience=1",
        "train.allow_chance=true",
    )
    assert again == summary


def test_weather_rnn_starts_as_the_persistence_forecast() -> None:
    from runner.data.schema import Feature
    from runner.models import weather_rnn

    model = weather_rnn({"target_feature": 2, "units": 8}, {"window": Feature("float32", (24, 5))}, ("window",))
    windows = np.random.default_rng(0).normal(size=(8, 24, 5)).astype(np.float32)
    # Untrained, it forecasts "the next hour equals the last one"; training learns the change.
    np.testing.assert_allclose(model.predict(windows, verbose=0)[:, 0], windows[:, -1, 2], rtol=1e-6)


def test_workload_models_check_their_params_and_inputs() -> None:
    from runner import SpecError
    from runner.data.schema import Feature
    from runner.models import imdb_lstm, weather_rnn

    tokens = {"tokens": Feature("int64", (250,))}
    with pytest.raises(SpecError, match=r"imdb_lstm has no param 'unit'; did you mean 'units'\?"):
        imdb_lstm({"unit": 64}, tokens, ("tokens",))
    with pytest.raises(SpecError,
                       match=r"imdb_lstm reads one int64 feature .* data.inputs gives 'image': uint8 \[28, 28, 1\]"):
        imdb_lstm({}, {"image": Feature("uint8", (28, 28, 1))}, ("image",))
    with pytest.raises(SpecError, match=r"target_feature \(12\) must be a feature index from 0 to 11"):
        weather_rnn({"target_feature": 12}, {"window": Feature("float32", (24, 12))}, ("window",))


def test_plateau_settings_need_per_epoch_validation(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"name": "w", "train": {"early_stopping_patience": 3, "validation_every": 2}})
    result = invoke("validate", spec, env=cli_env())
    assert result.returncode == 2
    assert ("train.early_stopping_patience (3) watches val_loss after every epoch, but train.validation_every is 2: "
            "set train.validation_every: 1 (or leave it auto)") in result.stderr
    spec = write_spec(tmp_path, {"name": "w", "data": {"eval": None}, "train": {"validation_every": 1}})
    result = invoke("validate", spec, env=cli_env())
    assert result.returncode == 2
    assert "train.validation_every needs data to validate on: set data.validation or data.eval" in result.stderr
    spec = write_spec(tmp_path, {"name": "w", "data": {"eval": None}, "train": {"early_stopping_patience": 3}})
    result = invoke("validate", spec, env=cli_env())
    assert result.returncode == 2 and "train.early_stopping_patience needs data to validate on" in result.stderr


def test_matmul_bench_spec_refuses_training_sections(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"name": "m", "kind": "matmul_bench", "train": {"epochs": 3}})
    result = invoke("validate", spec, env=cli_env())
    assert result.returncode == 2 and "kind matmul_bench trains nothing: remove train" in result.stderr
    spec = write_spec(tmp_path, {"name": "m", "matmul": {"size": 128}})
    result = invoke("validate", spec, env=cli_env())
    assert result.returncode == 2 and "matmul: is read only by kind: matmul_bench" in result.stderr


@pytest.mark.slow
def test_matmul_bench_reports_cold_and_warm_tflops_of_a_real_chain(tmp_path: Path) -> None:
    import tensorflow as tf

    size, chain = 256, 3
    result = run_cli(
        "run", REPO / "jobs" / "matmul_bench.yaml", "--set", f"output.dir={tmp_path}", "--set", f"matmul.size={size}",
        "--set", f"matmul.chain={chain}", "--set", "matmul.iterations=4", "--set", "accelerator.cpu_devices=2",
    )
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded" and summary["kind"] == "matmul_bench"
    assert summary["accelerator"]["kind"] == "cpu" and summary["accelerator"]["replicas"] == 2
    bench = summary["matmul"]
    assert bench["flops_per_call"] == 2 * size**3 * chain * 2
    assert len(bench["warm_calls_s"]) == 4
    assert bench["warm_s"] == pytest.approx(float(np.median(bench["warm_calls_s"])), abs=1e-6)
    assert summary["tflops"]["warm"] == pytest.approx(bench["flops_per_call"] / bench["warm_s"] / 1e12, rel=1e-2)
    assert summary["tflops"]["cold"] == pytest.approx(bench["flops_per_call"] / bench["cold_s"] / 1e12, rel=1e-2)
    assert bench["cold_s"] > bench["warm_s"], "the first call traces the function"
    assert summary["timing"]["train_s"] >= bench["cold_s"] + sum(bench["warm_calls_s"])
    # The device really computed the chain on both replicas: the same product in float64 on the host.
    a = tf.random.stateless_normal((size, size), seed=(0, 1)).numpy().astype(np.float64)
    b = (tf.random.stateless_normal((size, size), seed=(0, 2)) / np.sqrt(size)).numpy().astype(np.float64)
    product = a
    for _ in range(chain):
        product = product @ b
    assert bench["checksum"] == pytest.approx(2 * product.sum(), abs=1e-3 * size)
    written = json.loads((tmp_path / "matmul_bench" / "summary.json").read_text())
    assert written == summary
