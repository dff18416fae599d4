"""Pixels on another scale than a built-in image model divides by: MNIST digits saved as float32 0..1 (the
usual Keras habit) under mnist_cnn, which divides by 255 inside. Trained as is, the model sees values 255 times
too small and ends without an error; `runner validate` and `runner run` refuse it (exit 2, no run folder),
naming the manifest's range and `model.params.pixel_max`, and the fix the message gives trains."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import last_json, run_cli, write_spec
from tests.support.cli import invoke


def _prepare(folder: Path, scale: float) -> Path:
    from runner.prepare.datasets import load_dataset

    mnist = load_dataset("mnist")
    images = mnist.splits["train"]["image"][:1500].astype("float32") * scale
    np.savez(folder / "digits.npz", image=images, label=mnist.splits["train"]["label"][:1500])
    made = run_cli("prepare", "arrays", str(folder / "digits.npz"), "--features", "image", "--label", "label",
                   "--split", "train=0.8,test=0.2", "--out", str(folder / "data"))
    assert made.returncode == 0, made.stderr[-2000:]
    return folder / "data"


@pytest.fixture(scope="module")
def unit_pixels(tmp_path_factory) -> Path:
    """1,500 real MNIST digits as float32 in 0..1."""
    return _prepare(tmp_path_factory.mktemp("unit_pixels"), 1 / 255)


def _spec(folder: Path, data: Path, **model) -> Path:
    return write_spec(folder, {
        "name": "digits",
        "data": {"train": f"{data}/train-*.tfrecord", "eval": f"{data}/test-*.tfrecord", "global_batch_size": 100},
        "model": {"name": "mnist_cnn", **model},
        "train": {"epochs": 2},
        "output": {"dir": str(folder / "runs"), "tensorboard": False},
    })


@pytest.mark.xdist_group("unit_pixels")  # its tests share a worker, so the digits are prepared once
def test_unit_pixels_under_a_255_model_are_refused_and_the_fix_trains(unit_pixels: Path, tmp_path: Path):
    spec = _spec(tmp_path, unit_pixels)
    refused = invoke("validate", spec)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert re.search(r"job\.yaml:\d+: data\.train: model mnist_cnn divides its input 'image' by 255", refused.stderr)
    assert "records float32 values 0..1 (value_ranges)" in refused.stderr, refused.stderr
    assert "set `model.params.pixel_max: 1`" in refused.stderr

    ran = run_cli("run", str(spec))
    assert ran.returncode == 2, ran.stderr[-2000:]
    assert "expects pixels 0..255" in last_json(ran.stdout)["error"]
    assert not (tmp_path / "runs").exists()  # refused before the run folder

    fix = re.search(r"`model\.params\.pixel_max: (\d+)`", refused.stderr).group(1)
    doc = yaml.safe_load(spec.read_text())
    doc["model"]["params"] = {"pixel_max": yaml.safe_load(fix)}
    spec.write_text(yaml.safe_dump(doc))
    assert invoke("validate", spec).returncode == 0
    trained = run_cli("run", str(spec))
    assert trained.returncode == 0, trained.stderr[-3000:]
    # It learns: 0.817 in bfloat16 (auto on a CPU with avx512_bf16), 0.807 in float32, where chance is 0.1; 0.7
    # leaves room for the rounding of bfloat16 and of other CPUs' kernels.
    assert last_json(trained.stdout)["metrics"]["accuracy"] > 0.7


def test_pixels_of_255_under_pixel_max_1_are_refused(tmp_path: Path):
    data = _prepare(tmp_path, 1.0)
    refused = invoke("validate", _spec(tmp_path, data, params={"pixel_max": 1}))
    assert refused.returncode == 2, refused.stderr
    assert "records float32 values 0..255" in refused.stderr and "`model.params.pixel_max: 255`" in refused.stderr


@pytest.mark.xdist_group("unit_pixels")
def test_a_preprocess_may_rescale_so_it_is_not_judged(unit_pixels: Path, tmp_path: Path):
    (tmp_path / "scale.py").write_text("def up(batch):\n    return {**batch, 'image': batch['image'] * 255}\n")
    spec = _spec(tmp_path, unit_pixels)
    doc = yaml.safe_load(spec.read_text())
    doc["data"]["preprocess"] = "scale:up"
    spec.write_text(yaml.safe_dump(doc))
    assert invoke("validate", spec).returncode == 0
