"""A table end to end: `runner prepare csv` reports every missing cell at once and drops or fills them on
request; the built-in `tabular` model is built from the manifest alone; and docs/data.md's three commands train
it on a CSV with gaps and a category column to beat the majority class on the held-out split."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runner import DataError, SpecError, models
from runner.prepare import own, shards
from tests.conftest import REPO, cli_env

# Ten records (lines 2-11): gaps in a number column, a category column and the label.
TABLE = """age,chol,city,outcome
63,233.5,Oslo,sick
,250.0,Bergen,well
37,NA,Oslo,sick
41,204.0,,well
56,236.0,Oslo,
57,354.0,Bergen,sick
,192.0,Oslo,well
44,263.0,Bergen,sick
52,199.0,Oslo,well
57,168.0,Tromso,well
"""


def test_every_missing_cell_is_reported_in_one_pass_with_the_options(tmp_path: Path) -> None:
    (tmp_path / "heart.csv").write_text(TABLE)
    with pytest.raises(DataError) as refused:
        own.csv_dataset(str(tmp_path / "heart.csv"), "outcome")
    message = str(refused.value)
    assert message.startswith(f"{tmp_path}/heart.csv:3: column 'age' is empty; 5 missing cells in 5 of 10 records: ")
    for column in ("column 'age' 2 (lines 3, 8)", "column 'chol' 1 (line 4)", "column 'city' 1 (line 5)",
                   "label 'outcome' 1 (line 6)"):
        assert column in message
    assert "`--missing drop` leaves out those 5 records" in message and "`--missing fill=median`" in message


def test_missing_cells_are_dropped_or_filled_from_the_training_split_and_recorded(tmp_path: Path) -> None:
    table = tmp_path / "heart.csv"
    table.write_text(TABLE)
    dropped = own.csv_dataset(str(table), "outcome", split="train=0.5,test=0.5", missing_cells="drop")
    assert sum(len(split["age"]) for split in dropped.splits.values()) == 5
    assert dropped.preprocessing["missing"] == {"rule": "drop", "dropped": 5}

    filled = own.csv_dataset(str(table), "outcome", split="train=0.5,test=0.5", missing_cells="fill=median")
    record = filled.preprocessing["missing"]
    assert record["dropped"] == 1, "the record without a label is left out, never given one"
    # The training split's own values: the 9 labelled records shuffled by the fixed seed, its first 4 or 5.
    train_rows = own.split_rows(9, {"train": 0.5, "test": 0.5}, "t")["train"]
    labelled = [line.split(",") for i, line in enumerate(TABLE.splitlines()[1:]) if i != 4]
    ages = [float(labelled[i][0]) for i in train_rows if labelled[i][0]]
    assert record["filled"]["age"] == {"value": str(round(float(np.median(ages)))), "cells": 2}
    cities = [labelled[i][2] for i in train_rows if labelled[i][2]]
    assert record["filled"]["city"]["value"] == max(sorted(set(cities)), key=cities.count)
    assert sum(len(split["age"]) for split in filled.splits.values()) == 9
    assert filled.features["age"].dtype == "int64", "a filled column of whole numbers stays whole numbers"

    chosen = own.csv_dataset(str(table), "outcome", missing_cells="fill=age:0,chol:median,city:unknown")
    assert chosen.preprocessing["vocabularies"]["city"] == ["Bergen", "Oslo", "Tromso", "unknown"]
    with pytest.raises(SpecError, match=r"columns 'chol', 'city' have missing cells and --missing names no value "
                                        r"for them: add chol:median,city:median"):
        own.csv_dataset(str(table), "outcome", missing_cells="fill=age:0")
    with pytest.raises(SpecError, match=r"column 'age' holds numbers; 'unknown' is no number"):
        own.csv_dataset(str(table), "outcome", missing_cells="fill=unknown")
    with pytest.raises(SpecError, match=r"has no column 'cty' among those used \(did you mean 'city'\?\)"):
        own.csv_dataset(str(table), "outcome", missing_cells="fill=age:0,chol:median,cty:unknown")
    with pytest.raises(SpecError, match=r"'outcome' is the label; a label is never filled"):
        own.csv_dataset(str(table), "outcome", missing_cells="fill=outcome:well")


def test_the_tabular_model_is_built_from_the_manifest_alone(tmp_path: Path) -> None:
    table = tmp_path / "heart.csv"
    table.write_text(TABLE)
    manifest_path = shards.publish(lambda: own.csv_dataset(str(table), "outcome", split="train=0.8,test=0.2",
                                                           missing_cells="drop"),
                                   str(tmp_path / "data"))
    manifest = json.loads(Path(manifest_path).read_text())
    features = {name: type("F", (), {"dtype": f["dtype"], "shape": tuple(f["shape"])})()
                for name, f in manifest["features"].items()}
    columns = models.Columns(manifest, manifest_path, "outcome")
    model = models.build("tabular", {}, features, ("age", "chol", "city"), columns)
    layers = {layer.name: layer for layer in model.layers}
    assert layers["city_embedding"].input_dim == len(manifest["preprocessing"]["vocabularies"]["city"])
    low, high = manifest["value_ranges"]["chol"]["min"], manifest["value_ranges"]["chol"]["max"]
    assert layers["chol_scaled"].scale == pytest.approx(1 / (high - low))
    assert model.output_shape == (None, len(manifest["class_names"]))

    with pytest.raises(SpecError, match=r"has no param 'unit'; did you mean 'units'\?"):
        models.build("tabular", {"unit": [8]}, features, ("age",), columns)
    del manifest["value_ranges"]["age"]
    with pytest.raises(SpecError, match=r"records neither for input 'age' .* `runner prepare csv`"):
        models.build("tabular", {}, features, ("age",), models.Columns(manifest, manifest_path, "outcome"))


def _documented_blocks() -> list[str]:
    """The bash blocks of docs/data.md's "A table in three commands", in order."""
    text = (REPO / "docs" / "data.md").read_text()
    section = text.split("### A table in three commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


@pytest.mark.slow
def test_the_three_documented_commands_train_a_table_with_gaps_beyond_the_majority_class(tmp_path: Path) -> None:
    commands, prediction = _documented_blocks()
    assert len([line for line in commands.splitlines() if line.strip()]) == 3
    folder = tmp_path / "csv"
    shutil.copytree(REPO / "examples" / "csv", folder)
    bin_dir = tmp_path / "bin"  # `python` and `runner` as a user's virtualenv has them
    bin_dir.mkdir()
    (bin_dir / "runner").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m runner "$@"\n')
    (bin_dir / "runner").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO))

    def shell(block: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-e", "-c", block], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=600)

    trained = shell(commands)
    assert trained.returncode == 0, trained.stderr[-3000:]
    manifest = json.loads((folder / "data" / "umbrella" / "manifest.json").read_text())
    table = (folder / "data" / "weather.csv").read_text()
    assert ",," in table or ",NA" in table, "the table has gaps"
    assert manifest["preprocessing"]["vocabularies"]["sky"] == ["clear", "cloudy", "rain"]
    assert set(manifest["preprocessing"]["missing"]["filled"]) == {"temperature", "humidity", "sky"}
    counts = np.sum([s["label_counts"] for s in manifest["splits"]["test"]["shards"]], axis=0)
    majority = counts.max() / counts.sum()
    summary = json.loads(trained.stdout.splitlines()[-1])
    assert summary["metrics"]["examples"] == manifest["splits"]["test"]["records"], "the held-out split"
    assert summary["metrics"]["accuracy"] > majority + 0.2, (summary["metrics"], majority)

    # The documented prediction: the same classes and class names, lines named.
    *shown_commands, = [line for line in prediction.splitlines() if not line.startswith("{")]
    predicted = shell("\n".join(shown_commands))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    documented = [json.loads(line) for line in prediction.splitlines() if line.startswith("{")]
    answered = [json.loads(line) for line in predicted.stdout.splitlines()]
    keys = ("index", "line", "class", "class_name")
    assert [{k: a[k] for k in keys} for a in answered] == [{k: d[k] for k in keys} for d in documented]
    assert all(abs(sum(a["probabilities"]) - 1) < 1e-4 for a in answered)


def test_a_median_between_two_decimals_is_written_as_people_write_it(tmp_path: Path) -> None:
    """7.8 and 7.82: the median is 7.81, not the float sum's 7.8100000000000005, in the manifest and the log."""
    table = tmp_path / "t.csv"
    table.write_text("x,y\n7.8,a\n7.82,b\n,a\n7.8,b\n7.82,a\n")
    filled = own.csv_dataset(str(table), "y", split="train=1.0", missing_cells="fill=median")
    assert filled.preprocessing["missing"]["filled"]["x"]["value"] == "7.81"
