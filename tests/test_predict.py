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
from tests.support.precision import as_evaluated

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
    assert all(len(r["probabilities"]) == 10 and abs(sum(r["probabilities"]) - 1) < 1e-3 for r in rows)

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
    assert "holds <U3 values" in check(np.array(["cat"]), ids) and "--no-check" not in check(np.array(["cat"]), ids)
    # Each --scale offered is one that passes when followed; fractional pixels are named as that, not as a scale.
    noisy = check(np.array([0.3, 128.6, 255.3]), pixels)
    assert "fractional values 0.3..255.3" in noisy and "round them" in noisy and "--scale" not in noisy
    doubled = check(np.array([0, 510], np.int64), {"dtype": "uint8", "min": 0, "max": 255})
    factor = float(re.search(r"`--scale ([\d.e-]+)`", doubled).group(1))
    assert check(np.array([0, 510], np.int64) * factor, {"dtype": "uint8", "min": 0, "max": 255}) is None


# --- predict speaks the data: a CSV's words and gaps, class names, images, probabilities ---------------------


@pytest.fixture(scope="module")
def tabular_run(tmp_path_factory) -> tuple[Path, Path]:
    """A CSV with a category column and gaps, prepared with --missing fill=median and trained briefly with the
    built-in tabular model: (the spec, the data folder). Read only."""
    folder = tmp_path_factory.mktemp("tabular")
    rng = np.random.default_rng(3)
    rows = ["temperature,humidity,sky,umbrella"]
    for i in range(400):
        sky, humidity = rng.choice(["clear", "cloudy", "rain"]), int(rng.integers(20, 100))
        umbrella = "yes" if sky == "rain" or (sky == "cloudy" and humidity > 70) else "no"
        rows.append(f"{rng.normal(15, 8):.1f},{'' if i % 37 == 0 else humidity},{sky},{umbrella}")
    (folder / "days.csv").write_text("\n".join(rows) + "\n")
    prepared = run_cli("prepare", "csv", folder / "days.csv", "--label", "umbrella", "--missing", "fill=median",
                       "--out", folder / "data")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    spec = write_spec(folder, {
        "name": "umbrella", "accelerator": {"kind": "cpu"},
        "data": {"train": "data/train-*.tfrecord", "eval": "data/test-*.tfrecord",
                 "inputs": ["temperature", "humidity", "sky"], "label": "umbrella", "global_batch_size": 32},
        "model": {"name": "tabular"},
        "train": {"epochs": 3, "learning_rate": 0.01},
        "output": {"dir": "runs", "tensorboard": False},
    })
    trained = run_cli("run", spec)
    assert trained.returncode == 0, trained.stderr[-3000:]
    return spec, folder / "data"


@pytest.mark.xdist_group("predict_tabular")
def test_predict_maps_a_csvs_category_words_and_gaps_through_the_manifest_and_names_the_classes(
    tabular_run, tmp_path: Path
) -> None:
    spec, data = tabular_run
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["class_names"] == ["no", "yes"]
    filled = manifest["preprocessing"]["missing"]["filled"]["humidity"]["value"]

    # As a user met it: the category words saved as they read. They were refused as "not numbers", with a
    # --no-check that did not help; the vocabulary beside the shards knows them.
    np.savez(tmp_path / "words.npz", temperature=np.array([12.5, 21.0, 3.0]), humidity=np.array([85, 40, 60]),
             sky=np.array(["cloudy", "clear", "rain"]))
    from_words = run_cli("predict", spec, "--input", tmp_path / "words.npz")
    assert from_words.returncode == 0, from_words.stderr[-3000:]

    # The same rows as a CSV, with the label column (ignored) and a gap training filled: answered per line.
    (tmp_path / "days.csv").write_text("sky,temperature,humidity,umbrella\ncloudy,12.5,85,yes\nclear,21.0,,no\n"
                                       "rain,3.0,60,yes\n")
    from_csv = run_cli("predict", spec, "--input", tmp_path / "days.csv")
    assert from_csv.returncode == 0, from_csv.stderr[-3000:]
    lines = [json.loads(line) for line in from_csv.stdout.splitlines()]
    assert [line["line"] for line in lines] == [2, 3, 4]

    # The classes are the trained model's own on the ids the vocabulary gives, named by class_names; computed in
    # float32 as predict computes them, whatever precision the job trained in.
    model = as_evaluated(spec.parent / "runs" / "umbrella" / "model.keras")
    vocabulary = manifest["preprocessing"]["vocabularies"]["sky"]
    outputs = model.predict({"temperature": np.array([12.5, 21.0, 3.0], np.float32),
                             "humidity": np.array([85, int(filled), 60]),
                             "sky": np.array([vocabulary.index(w) for w in ("cloudy", "clear", "rain")])}, verbose=0)
    expected = outputs.argmax(axis=1).tolist()
    assert [line["class"] for line in lines] == expected
    assert [line["class_name"] for line in lines] == [manifest["class_names"][c] for c in expected]
    np.testing.assert_allclose([line["probabilities"] for line in lines], outputs, atol=1e-5)
    assert [json.loads(line)["class"] for line in from_words.stdout.splitlines()][::2] == expected[::2]

    # evaluate reads the same CSV with its label column, the text labels through class_names.
    evaluated = run_cli("evaluate", spec, "--input", tmp_path / "days.csv")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = last_json(evaluated.stdout)
    assert report["examples"] == 3
    assert report["metrics"]["accuracy"] == pytest.approx(np.mean(np.array(expected) == [1, 0, 1]), abs=1e-6)

    # A word training never saw: refused naming the line, the column, the words it knows; no --no-check offered.
    (tmp_path / "snow.csv").write_text("temperature,humidity,sky\n-2.0,90,Cloudy\n")
    refused = run_cli("predict", spec, "--input", tmp_path / "snow.csv")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (f"snow.csv:2: column 'sky': 'Cloudy' is not a category the model was trained on (did you mean "
            f"'cloudy'?); {data}/manifest.json (preprocessing.vocabularies) knows 'clear', 'cloudy', 'rain'") \
        in refused.stderr
    assert "--no-check" not in refused.stderr


@pytest.mark.xdist_group("predict_ranges")
def test_predict_takes_image_files_and_folders_decoded_as_prepare_images_did(mnist_cnn_run, tmp_path: Path) -> None:
    overrides, run_dir = mnist_cnn_run
    job = REPO / "jobs" / "mnist_cnn.yaml"
    digits = load_dataset("mnist").splits["test"]["image"][:3]
    folder = tmp_path / "digits"
    (folder / "more").mkdir(parents=True)
    for i, digit in enumerate(digits[:2]):
        (folder / f"{i}.png").write_bytes(tf.io.encode_png(digit).numpy())
    large = tf.image.resize(digits[2], (56, 56), method="nearest").numpy().astype(np.uint8)
    (folder / "more" / "2.png").write_bytes(tf.io.encode_png(large).numpy())
    (folder / "notes.txt").write_text("skipped, as prepare images skips it")

    result = run_cli("predict", job, "--input", folder, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["file"] for line in lines] == ["0.png", "1.png", "more/2.png"]
    assert "note: resized to 28x28 (bilinear, as `runner prepare images --size` does): 2.png (56x56)" in result.stderr
    model = tf.keras.models.load_model(run_dir / "model.keras")
    expected = model.predict(digits.astype("float32"), verbose=0)
    assert [line["class"] for line in lines[:2]] == expected[:2].argmax(axis=1).tolist()
    np.testing.assert_allclose([line["probabilities"] for line in lines[:2]], expected[:2], atol=1e-5)

    one = run_cli("predict", job, "--input", folder / "1.png", *overrides)
    assert one.returncode == 0, one.stderr[-3000:]
    assert json.loads(one.stdout)["file"] == "1.png" and json.loads(one.stdout)["class"] == lines[1]["class"]


def test_a_model_that_ends_in_logits_answers_probabilities_and_says_so() -> None:
    from runner.job import answers
    from runner.train import build

    keras = tf.keras
    given = keras.Input((2,))
    logits = keras.Model(given, keras.layers.Dense(3)(given))
    logits.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert build.output_kind(logits) == "logits"
    outputs = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 50.0]], np.float32)
    made, kind, notes = answers.probabilities(outputs, build.output_kind(logits))
    np.testing.assert_allclose(made.sum(axis=1), 1, atol=1e-6)
    assert notes == ["the model ends in logits (its train.loss has from_logits: true): softmax applied, the "
                     "`probabilities` printed (and any --output) are probabilities"]
    lines = answers.lines(made, kind, ["cat", "dog", "eel"], [])
    assert [(line["class"], line["class_name"]) for line in lines] == [(0, "cat"), (2, "eel")]

    regression = keras.Model(given, keras.layers.Dense(1)(given))
    regression.compile(loss="mse")
    assert build.output_kind(regression) is None
    assert answers.lines(*answers.probabilities(np.array([[3.5]]), None)[:2], [], []) == [
        {"index": 0, "output": [3.5]}]
