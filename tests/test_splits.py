"""Model selection never on the test split, and a spec's evaluation never another dataset's
(runner/data/splits.py).

The summary's figures are measured on data.eval. Early stopping keeps the best epoch's weights by val_loss:
validated on data.eval, the figure reported would be the one chosen for being best. Without a split of its
own to select on, the job is refused; `runner prepare images` writes one by default. A spec that leaves
data.eval out is measured on the test split beside its data.train, or on nothing, never on MNIST's.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import last_json, run_cli, write_spec


def small_job(tmp_path: Path, name: str, data: dict, train: dict | None = None, **sections) -> Path:
    """A spec of a few steps of mnist_cnn on CPU; `data` and `train` add to its sections."""
    doc = {
        "name": name,
        "accelerator": {"kind": "cpu"},
        "data": {"global_batch_size": 16, "shuffle_buffer": 64, **data},
        "train": {"epochs": 1, "steps_per_epoch": 2, "allow_chance": True, **(train or {})},
        "output": {"dir": str(tmp_path / "runs"), "tensorboard": False},
        **sections,
    }
    return write_spec(tmp_path, doc, f"{name}.yaml")


def mnist_splits(out: Path, counts: dict[str, int]) -> Path:
    """Real MNIST records as prepared shards in `out`: `counts` records of each named split."""
    from runner.prepare import shards
    from runner.prepare.datasets import Dataset, load_dataset

    full = load_dataset("mnist")
    source = {"train": full.splits["train"]}
    splits = {name: {k: v[:n] for k, v in source.get(name, full.splits["test"]).items()} for name, n in counts.items()}
    small = Dataset(full.name, splits, full.features, full.inputs, full.label, full.source, full.license)
    out.mkdir(parents=True)
    entries = {name: shards.write_split(small, name, str(out), 1) for name in counts}
    shards.write_manifest(str(out), shards.manifest_for(small, entries))
    return out


def test_early_stopping_without_a_validation_split_is_refused_not_run_on_the_test_split(
    tiny_mnist: Path, tmp_path: Path
) -> None:
    # The data holds train and test only: selecting by val_loss could only happen on the test split.
    spec = small_job(tmp_path, "stops", {"train": f"{tiny_mnist}/train-*.tfrecord",
                                         "eval": f"{tiny_mnist}/test-*.tfrecord"},
                     {"epochs": 3, "early_stopping_patience": 1})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("train.early_stopping_patience selects by val_loss, and the job has no validation split: "
            f"data.validation is unset and {tiny_mnist}/manifest.json lists no split named validation") in result.stderr
    assert "Set data.validation to held-out shards of their own" in result.stderr
    assert not (tmp_path / "runs" / "stops").exists(), "a refused job writes nothing"


def test_data_validation_naming_the_eval_shards_is_no_validation_split(tiny_mnist: Path, tmp_path: Path) -> None:
    from runner import SpecError
    from runner.data import splits
    from runner.spec.load import load_spec

    test = f"{tiny_mnist}/test-*.tfrecord"
    spec = load_spec(small_job(tmp_path, "same", {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": test,
                                                  "validation": test}, {"reduce_lr_patience": 1}))
    manifest = json.loads((tiny_mnist / "manifest.json").read_text())
    with pytest.raises(SpecError) as refused:
        splits.patterns(spec, manifest)
    assert str(refused.value).startswith(
        "train.reduce_lr_patience selects by val_loss, and the job has no validation split: data.validation names "
        f"the shards of data.eval ({test})."
    )


def test_a_callback_of_the_user_that_monitors_a_val_metric_is_refused_too(tiny_mnist: Path, tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        import tensorflow as tf

        class KeepBest(tf.keras.callbacks.EarlyStopping):
            def __init__(self):
                super().__init__(monitor="val_accuracy", patience=1, restore_best_weights=True)
    """))
    spec = small_job(tmp_path, "mine", {"train": f"{tiny_mnist}/train-*.tfrecord",
                                        "eval": f"{tiny_mnist}/test-*.tfrecord"},
                     {"validation_every": 1, "callbacks": ["mine:KeepBest"]}, code={"folder": str(tmp_path)})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train.callbacks[0] selects by val_accuracy, and the job has no validation split" in result.stderr
    assert not (tmp_path / "runs" / "mine").exists(), "a refused job writes nothing"


@pytest.mark.slow
def test_prepared_images_select_on_their_validation_split_and_are_measured_on_their_test_split(
    tmp_path: Path
) -> None:
    from PIL import Image

    from runner.prepare.datasets import load_dataset

    # 100 MNIST digits (zeros and ones) as a folder of class folders, as a user's own images come.
    train = load_dataset("mnist").splits["train"]
    chosen = np.flatnonzero(train["label"] < 2)[:100]
    for index in chosen:
        folder = tmp_path / "digits" / str(train["label"][index])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(train["image"][index][..., 0]).save(folder / f"{index}.png")
    out = tmp_path / "data"
    prepared = run_cli("prepare", "images", tmp_path / "digits", "--color", "grayscale", "--out", out)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {s: i["records"] for s, i in manifest["splits"].items()} == {"train": 80, "validation": 10, "test": 10}

    # Only data.train is named: validation and evaluation are the splits beside it.
    spec = small_job(tmp_path, "digits", {"train": f"{out}/train-*.tfrecord"},
                     {"epochs": 2, "early_stopping_patience": 1})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["splits"] == {
        "trained_on": f"{out}/train-*.tfrecord", "validated_on": f"{out}/validation-*.tfrecord",
        "selected_on": f"{out}/validation-*.tfrecord", "selected_by": ["train.early_stopping_patience"],
        "measured_on": f"{out}/test-*.tfrecord",
    }
    assert all("val_loss" in epoch["metrics"] for epoch in summary["epochs"])
    assert summary["metrics"]["examples"] == 10
    said = f"data.validation unset: the validation split beside data.train, {out}/validation-*.tfrecord"
    assert said in result.stderr


@pytest.mark.slow
def test_a_spec_without_data_eval_is_measured_on_the_test_split_beside_its_data_never_mnists(
    tiny_mnist: Path, tmp_path: Path
) -> None:
    # MNIST's test shards sit where the default data.eval used to point (data/mnist/ beside the spec).
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mnist").symlink_to(tiny_mnist)
    own = mnist_splits(tmp_path / "own", {"train": 256, "test": 100})
    spec = small_job(tmp_path, "own", {"train": "own/train-*.tfrecord"})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["metrics"]["examples"] == 100, "measured on the test split beside data.train"
    assert summary["splits"]["measured_on"] == f"{own}/test-*.tfrecord"

    # Data with no test split: nothing is measured, and the log says why.
    alone = mnist_splits(tmp_path / "alone", {"train": 256})
    spec = small_job(tmp_path, "alone", {"train": "alone/train-*.tfrecord"})
    assert run_cli("validate", spec).returncode == 0
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert "examples" not in summary["metrics"] and summary["splits"]["measured_on"] is None
    assert f"data.eval unset and {alone}/manifest.json lists no test split: nothing is evaluated" in result.stderr
