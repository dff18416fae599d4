"""The feature schema of your own TFRecords: declared in the spec, written by `runner manifest`, checked by `run`.

Records here are real tf.train.Example protos written with TFRecordWriter, the way a user's own pipeline
writes them: PNG and JPEG images, raw bytes, variable-length lists, floats and strings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from runner import DataError
from runner.data import pipeline
from runner.prepare import manifest as index
from runner.spec.types import JobSpec
from tests.conftest import last_json, run_cli, write_spec
from tests.support.cli import invoke


def _feature(value: Any) -> tf.train.Feature:
    if isinstance(value, tf.train.Feature):
        return value
    if isinstance(value, bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
    array = np.asarray(value)
    if array.dtype.kind == "f":
        return tf.train.Feature(float_list=tf.train.FloatList(value=array.ravel()))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=array.ravel()))


def write_records(path: Path, rows: list[dict[str, Any]]) -> None:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for row in rows:
            features = tf.train.Features(feature={k: _feature(v) for k, v in row.items()})
            writer.write(tf.train.Example(features=features).SerializeToString())


def job(folder: Path, features: dict[str, Any], inputs: list[str], label: str = "label", **data_keys: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": "schema",
        "data": {"train": f"{folder}/train-*.tfrecord", "eval": None, "features": features, "inputs": inputs,
                 "label": label, **data_keys},
    })


# --- decoding ----------------------------------------------------------------------------------

ROWS = 6
rng = np.random.default_rng(7)
RGB = rng.integers(0, 256, (ROWS, 5, 4, 3), dtype=np.uint8)
# JPEG is lossy: a smooth gradient survives it within a few grey levels, noise would not.
PHOTO = np.stack([np.broadcast_to(np.linspace(20 * i, 20 * i + 120, 8, dtype=np.uint8)[:, None, None], (8, 8, 3))
                  for i in range(ROWS)])
RAW = rng.integers(0, 256, (ROWS, 2, 3), dtype=np.uint8)
TOKENS = [list(range(1, 1 + n)) for n in (0, 1, 2, 3, 4, 5)]
WORDS = [[b"w%d" % i for i in range(n)] for n in (0, 1, 2, 3, 1, 0)]
SCORE = rng.normal(size=(ROWS, 2)).astype(np.float32)

FEATURES = {
    "rgb": {"dtype": "uint8", "shape": [5, 4, 3], "decode": "png"},
    "photo": {"dtype": "uint8", "shape": [8, 8, 3], "decode": "jpeg"},
    "raw": {"dtype": "uint8", "shape": [2, 3]},
    "tokens": {"dtype": "int64", "shape": [3], "var_len": True},
    "words": {"dtype": "string", "shape": [2], "var_len": True},
    "score": {"dtype": "float32", "shape": [2]},
    "label": {"dtype": "int64"},
}


@pytest.fixture(scope="module")
def mixed_records(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mixed")
    write_records(folder / "train-0.tfrecord", [
        {
            "rgb": tf.io.encode_png(RGB[i]).numpy(),
            "photo": tf.io.encode_jpeg(PHOTO[i], quality=95).numpy(),
            "raw": RAW[i].tobytes(),
            "tokens": np.array(TOKENS[i], dtype=np.int64),
            "words": tf.train.Feature(bytes_list=tf.train.BytesList(value=WORDS[i])),
            "score": SCORE[i],
            "label": [i],
        }
        for i in range(ROWS)
    ])
    return folder


def test_every_kind_of_feature_decodes_to_a_static_shape(mixed_records: Path):
    spec = job(mixed_records, FEATURES, inputs=[n for n in FEATURES if n != "label"])
    (manifest_path,) = index.write_user_manifests(spec, "schema.yaml")
    shards = pipeline.find_shards(spec.data.train)
    pipeline.check_declared(spec.data.features, shards)
    assert shards.records == ROWS

    dataset = pipeline.make_dataset(shards, ROWS, spec.data.inputs, "label", training=False)
    inputs, labels = next(iter(dataset))
    # Static shapes on every input, batch included: the padded var-len lists too (one compiled program on a TPU).
    assert {n: tuple(s.shape) for n, s in dataset.element_spec[0].items()} == {
        "rgb": (ROWS, 5, 4, 3), "photo": (ROWS, 8, 8, 3), "raw": (ROWS, 2, 3), "tokens": (ROWS, 3),
        "words": (ROWS, 2), "score": (ROWS, 2),
    }
    np.testing.assert_array_equal(inputs["rgb"].numpy(), RGB.astype(np.float32))  # PNG is lossless
    assert inputs["rgb"].dtype == tf.float32
    assert np.abs(inputs["photo"].numpy() - PHOTO).mean() < 4
    np.testing.assert_array_equal(inputs["raw"].numpy(), RAW)
    np.testing.assert_array_equal(inputs["tokens"].numpy(),
                                  [[0, 0, 0], [1, 0, 0], [1, 2, 0], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert inputs["words"].numpy().tolist() == [
        [b"", b""], [b"w0", b""], [b"w0", b"w1"], [b"w0", b"w1"], [b"w0", b""], [b"", b""]]
    np.testing.assert_allclose(inputs["score"].numpy(), SCORE)
    assert labels.numpy().tolist() == list(range(ROWS))

    written = json.loads(Path(manifest_path).read_text())
    assert written["features"]["tokens"] == {"dtype": "int64", "shape": [3], "var_len": True, "decode": "none"}
    assert written["features"]["raw"]["decode"] == "raw"
    assert written["splits"]["train"]["records"] == ROWS
    assert pipeline.verify_shards(str(mixed_records)) == []


def test_a_manifest_is_not_replaced_without_force(mixed_records: Path):
    spec = job(mixed_records, FEATURES, inputs=["rgb"])
    index.write_user_manifests(spec, "schema.yaml", force=True)
    with pytest.raises(DataError,
                       match=r"manifest.json exists; pass --force to replace it with one made from schema.yaml"):
        index.write_user_manifests(spec, "schema.yaml")


# --- records that do not fit the declared schema -------------------------------------------------


@pytest.mark.parametrize(
    "row, declared, expected",
    [
        ({"x": [1, 2], "label": [0]}, {"x": {"dtype": "float32", "shape": [2]}},
         "feature 'x' is stored as int64_list, but {dtype: float32, shape: [2], var_len: false, decode: none} "
         "is read from a float_list"),
        ({"x": [1.0, 2.0, 3.0], "label": [0]}, {"x": {"dtype": "float32", "shape": [4]}},
         "feature 'x' holds 3 values, but shape [4] needs 4"),
        ({"x": [1.0]}, {"x": {"dtype": "float32", "shape": [1]}},
         "feature 'label' is missing (the record has: x)"),
        ({"x": b"\x00" * 5, "label": [0]}, {"x": {"dtype": "uint8", "shape": [2, 3]}},
         "feature 'x' holds 5 bytes, but shape [2, 3] needs 6"),
        ({"x": "png 6x6", "label": [0]}, {"x": {"dtype": "uint8", "shape": [5, 5, 1], "decode": "png"}},
         "feature 'x' decodes to an image of shape [6, 6, 1], but the schema says [5, 5, 1]"),
        ({"x": "png 6x6", "label": [0]}, {"x": {"dtype": "uint8", "shape": [6, 6, 1], "decode": "jpeg"}},
         "feature 'x' is a png image, not jpeg"),
        ({"x": b"not an image", "label": [0]}, {"x": {"dtype": "uint8", "shape": [6, 6, 1], "decode": "png"}},
         "feature 'x' is not a decodable png image"),
    ],
)
def test_runner_manifest_names_the_shard_and_feature_that_do_not_fit(tmp_path, row, declared, expected):
    if row["x"] == "png 6x6":
        row = {**row, "x": tf.io.encode_png(np.zeros((6, 6, 1), np.uint8)).numpy()}
    write_records(tmp_path / "train-0.tfrecord", [row])
    spec = job(tmp_path, {**declared, "label": {"dtype": "int64"}}, inputs=["x"])
    with pytest.raises(DataError) as caught:
        index.write_user_manifests(spec, "schema.yaml")
    assert f"{tmp_path}/train-0.tfrecord: the first record does not fit data.features" in str(caught.value)
    assert expected in str(caught.value)
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("bad_at", [0, 300, 599])
def test_a_misfit_record_deep_in_a_shard_is_named_by_its_number(tmp_path, bad_at):
    """Every record is decoded, not only the first: one PNG of another size among 600 is found and named."""
    good = tf.io.encode_png(np.zeros((5, 5, 1), np.uint8)).numpy()
    bad = tf.io.encode_png(np.zeros((6, 5, 1), np.uint8)).numpy()
    write_records(tmp_path / "train-0.tfrecord", [{"x": good, "label": [0]}] * 3)
    rows = [{"x": bad if i == bad_at else good, "label": [i % 2]} for i in range(600)]
    write_records(tmp_path / "train-1.tfrecord", rows)
    declared = {"x": {"dtype": "uint8", "shape": [5, 5, 1], "decode": "png"}, "label": {"dtype": "int64"}}
    spec = job(tmp_path, declared, inputs=["x"])
    with pytest.raises(DataError) as caught:
        index.write_user_manifests(spec, "schema.yaml")
    where = "the first record" if bad_at == 0 else f"record {bad_at} (counting from 0)"
    assert str(caught.value).startswith(f"{tmp_path}/train-1.tfrecord: {where} does not fit data.features")
    assert "feature 'x' decodes to an image of shape [6, 5, 1], but the schema says [5, 5, 1]" in str(caught.value)
    assert not (tmp_path / "manifest.json").exists()

    write_records(tmp_path / "train-1.tfrecord", [{**row, "x": good} for row in rows])
    index.write_user_manifests(spec, "schema.yaml")
    counted = json.loads((tmp_path / "manifest.json").read_text())["splits"]["train"]
    assert counted["records"] == 603 and [e["records"] for e in counted["shards"]] == [3, 600]


def test_a_file_that_is_not_a_tfrecord_is_named(tmp_path):
    (tmp_path / "train-0.tfrecord").write_bytes(b"x,y\n1,2\n" * 10)
    spec = job(tmp_path, {"x": {"dtype": "float32"}, "label": {"dtype": "int64"}}, inputs=["x"])
    with pytest.raises(DataError, match=r"train-0.tfrecord is not a readable TFRecord file"):
        index.write_user_manifests(spec, "schema.yaml")


def test_runner_manifest_command_indexes_user_records(tmp_path):
    write_records(tmp_path / "part-a.tfrecord", [{"x": [float(i)], "label": [i % 2]} for i in range(10)])
    write_records(tmp_path / "part-b.tfrecord", [{"x": [float(i)], "label": [i % 2]} for i in range(7)])
    write_records(tmp_path / "holdout.tfrecord", [{"x": [1.0], "label": [1]}] * 3)
    spec = write_spec(tmp_path, {
        "name": "mine",
        "data": {"train": f"{tmp_path}/part-*.tfrecord", "eval": f"{tmp_path}/holdout.tfrecord",
                 "features": {"x": {"dtype": "float32", "shape": [1]}, "label": {"dtype": "int64"}},
                 "inputs": ["x"]},
    })
    result = run_cli("manifest", spec, timeout=120)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {s: v["records"] for s, v in manifest["splits"].items()} == {"train": 17, "eval": 3}
    assert [e["file"] for e in manifest["splits"]["train"]["shards"]] == ["part-a.tfrecord", "part-b.tfrecord"]
    assert pipeline.verify_shards(str(tmp_path)) == []


# --- the spec against the manifest --------------------------------------------------------------


def test_a_spec_that_disagrees_with_the_manifest_stops_before_training(small_mnist, mnist_job):
    spec = mnist_job("disagrees", data={
        "features": {"image": {"dtype": "uint8", "shape": [28, 28, 1], "decode": "png"}, "label": {"dtype": "int64"}},
    })
    result = run_cli("run", spec, timeout=120)
    assert result.returncode == 2, result.stderr
    assert (
        "data.features.image: the spec declares {dtype: uint8, shape: [28, 28, 1], var_len: false, decode: png}, "
        f"but {small_mnist}/manifest.json says {{dtype: uint8, shape: [28, 28, 1], var_len: false, decode: raw}}"
    ) in result.stderr
    assert "data.features.label" not in result.stderr  # the label agrees
    summary = last_json(result.stdout)
    assert summary["status"] == "failed" and summary["epochs"] == []
    assert not summary["timing"].get("build_s") and not summary["timing"].get("train_s")


def test_a_prepared_manifest_agrees_with_the_same_schema_declared(tiny_mnist):
    spec = job(tiny_mnist, {"image": {"dtype": "uint8", "shape": [28, 28, 1]}, "label": {"dtype": "int64"}}, ["image"])
    shards = pipeline.find_shards(str(tiny_mnist / "train-*.tfrecord"))
    pipeline.check_declared(spec.data.features, shards)  # raw decode is the default for uint8, as `prepare` writes


def test_a_declared_feature_missing_from_the_manifest_is_named(tiny_mnist):
    spec = job(tiny_mnist, {"image": {"dtype": "uint8", "shape": [28, 28, 1]}, "caption": {"dtype": "string"},
                            "label": {"dtype": "int64"}}, ["image"])
    with pytest.raises(DataError, match=r"data.features.caption: the spec declares \{dtype: string, shape: \[\], "
                                        r"var_len: false, decode: none\}, but .*manifest.json has no feature 'caption' "
                                        r"\(it has: image, label\)"):
        pipeline.check_declared(spec.data.features, pipeline.find_shards(str(tiny_mnist / "train-*.tfrecord")))


# --- the schema in the spec --------------------------------------------------------------------


@pytest.mark.parametrize(
    "features, expected",
    [
        ({"image": {"dtype": "int64", "shape": [4, 4, 1], "decode": "png"}},
         "data.features.image: dtype int64 with decode png: uint8 features are decoded from bytes"),
        ({"image": {"dtype": "uint8", "shape": [4, 4], "decode": "jpeg"}},
         "data.features.image: decode jpeg needs shape [height, width, channels] with 1, 3 or 4 channels"),
        ({"image": {"dtype": "int64", "shape": [4, 4], "var_len": True}},
         "data.features.image: var_len needs a one-dimensional int64, float32 or string feature "
         "with shape [max_length]"),
        ({"image": {"dtype": "float32", "shape": [0]}},
         "data.features.image: shape [0]: every dimension must be at least 1"),
        ({"image": {"dtype": "uint8", "shape": [4], "varlen": True}},
         "data.features.image.varlen: unknown key 'varlen'; did you mean 'var_len'? "
         "(allowed here: decode, dtype, shape, var_len)"),
        ({"image": {"dtype": "float64"}},
         "data.features.image.dtype: Input should be 'uint8', 'int64', 'float32' or 'string'"),
        ({"pixels": {"dtype": "uint8", "shape": [4]}},
         "data: data.inputs names 'image', which data.features does not declare (declared: pixels, label)"),
    ],
)
def test_a_schema_that_cannot_be_read_is_refused_at_spec_load(tmp_path, features, expected):
    spec = write_spec(tmp_path, {"name": "bad_schema", "data": {"features": {**features, "label": {"dtype": "int64"}}}})
    result = invoke("validate", spec)  # TensorFlow-free: in this process
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr
