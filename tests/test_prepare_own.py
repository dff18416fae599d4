"""`runner prepare` for your own data: arrays, an image folder, a CSV, a TensorFlow Datasets folder. Each is
converted to shards with a manifest, checked with `runner verify`, and (arrays, images) trained with
`runner run` from a spec that names only the shards; every bad input stops with exit 2, naming it, with
nothing published."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from runner import DataError
from runner.data import pipeline, rows
from runner.prepare import own, shards
from runner.prepare.images import images_dataset
from runner.prepare.tfds import tfds_dataset
from tests.conftest import cli_env, last_json, run_cli, write_spec

MODELS = '''
import tensorflow as tf

keras = tf.keras


def mlp(params, features, inputs):
    (name,) = inputs
    given = keras.Input(shape=features[name].shape, name=name)
    hidden = keras.layers.Dense(16, activation="relu")(given)
    return keras.Model(given, keras.layers.Dense(2, activation="softmax", dtype="float32")(hidden))


def cnn(params, features, inputs):
    (name,) = inputs
    given = keras.Input(shape=features[name].shape, name=name)
    x = keras.layers.Rescaling(1 / 255)(given)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.GlobalMaxPooling2D()(x)
    return keras.Model(given, keras.layers.Dense(2, activation="softmax", dtype="float32")(x))
'''


def _records(folder: Path, split: str) -> list[tf.train.Example]:
    files = sorted(str(p) for p in folder.glob(f"{split}-*.tfrecord"))
    return [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(files)]


def _train(tmp_path: Path, data: Path, model: str, inputs: list[str], label: str, epochs: int) -> dict:
    (tmp_path / "models.py").write_text(MODELS)
    spec = write_spec(tmp_path, {
        "name": f"own-{model}",
        "accelerator": {"kind": "cpu"},
        "code": {"folder": str(tmp_path)},
        "data": {"train": f"{data}/train-*.tfrecord", "eval": f"{data}/test-*.tfrecord", "inputs": inputs,
                 "label": label, "global_batch_size": 16},
        "model": {"name": f"models:{model}"},
        "train": {"epochs": epochs, "learning_rate": 0.01},
        "output": {"dir": str(tmp_path / "runs"), "tensorboard": False},
    }, f"{model}.yaml")
    result = run_cli("run", spec, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return last_json(result.stdout)


def _verified(folder: Path | str, env: dict | None = None) -> None:
    result = run_cli("verify", folder, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every shard matches manifest.json (size and sha256)" in result.stdout


def test_arrays_become_shards_that_verify_and_train(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(640, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    np.savez(tmp_path / "points.npz", x=x, y=y)
    out = tmp_path / "data"
    result = run_cli("prepare", "arrays", tmp_path / "points.npz", "--features", "x", "--label", "y",
                     "--split", "train=0.9,test=0.1", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"{out}/manifest.json"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["features"] == {"x": {"dtype": "float32", "shape": [8]}, "y": {"dtype": "int64", "shape": []}}
    assert (manifest["inputs"], manifest["label"]) == (["x"], "y")
    assert {s: i["records"] for s, i in manifest["splits"].items()} == {"train": 576, "test": 64}
    assert manifest["splits"]["train"]["shards"][0]["label_range"] == [0, 1]
    # The training split's range, as written: the fixed shuffle picks the rows, so recompute it from them.
    rows = own.split_rows(640, {"train": 0.9, "test": 0.1}, "points")["train"]
    assert manifest["value_ranges"] == {"x": {"dtype": "float32", "min": float(x[rows].min()),
                                              "max": float(x[rows].max())}}
    # The records hold exactly the arrays' rows, in order.
    first = _records(out, "train")[0]
    np.testing.assert_allclose(first.features.feature["x"].float_list.value, x[rows[0]])
    assert not list(out.glob(".prepare-*")), "the staging folder is gone"
    _verified(out)

    summary = _train(tmp_path, out, "mlp", ["x"], "y", epochs=6)
    assert summary["metrics"]["examples"] == 64
    assert summary["metrics"]["accuracy"] > 0.9, summary["metrics"]


def _line_images(folder: Path, count: int, size: int, seed: int, jpeg_every: int = 0) -> None:
    """Grey noise with one bright line: horizontal or vertical, the class. Written by PIL (PNG) and TensorFlow
    (JPEG), as a user's folder holds both."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name in ("horizontal", "vertical"):
        (folder / name).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 60, (size, size), dtype=np.uint8)
            at = rng.integers(2, size - 2)
            if name == "horizontal":
                pixels[at, :] = 255
            else:
                pixels[:, at] = 255
            if jpeg_every and i % jpeg_every == 0:
                (folder / name / f"{i}.jpg").write_bytes(tf.io.encode_jpeg(pixels[..., None], quality=95).numpy())
            else:
                Image.fromarray(pixels).save(folder / name / f"{i}.png")
        (folder / name / "notes.txt").write_text("not an image: skipped, as Keras skips it")


def test_an_image_folder_becomes_shards_that_verify_and_train(tmp_path: Path) -> None:
    images = tmp_path / "lines"
    _line_images(images / "train", 80, 20, seed=0, jpeg_every=7)
    _line_images(images / "test", 20, 24, seed=1)  # another size: --size makes them one
    out = tmp_path / "data"
    result = run_cli("prepare", "images", images, "--size", "16x16", "--color", "grayscale", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["features"]["image"] == {"dtype": "uint8", "shape": [16, 16, 1], "var_len": False, "decode": "png"}
    assert manifest["class_names"] == ["horizontal", "vertical"]
    assert {s: i["records"] for s, i in manifest["splits"].items()} == {"train": 160, "test": 40}
    # The decoded pixels' range over the training images: the bright line, resized, stays near 255.
    ranges = manifest["value_ranges"]["image"]
    assert ranges["dtype"] == "uint8" and 0 <= ranges["min"] < 30 and 200 < ranges["max"] <= 255
    record = _records(out, "train")[0]
    pixels = tf.io.decode_png(record.features.feature["image"].bytes_list.value[0]).numpy()
    assert pixels.shape == (16, 16, 1) and record.features.feature["label"].int64_list.value[0] == 0
    _verified(out)

    summary = _train(tmp_path, out, "cnn", ["image"], "label", epochs=8)
    assert summary["metrics"]["accuracy"] > 0.9, summary["metrics"]


def test_a_csv_with_mixed_types_gets_its_schema_inferred(tmp_path: Path) -> None:
    table = tmp_path / "heart.csv"
    table.write_text(textwrap.dedent("""\
        age,sex,thal,chol,target
        63,1,fixed,233.5,sick
        67,1,normal,286,well
        37,0,"reversible",250,sick
        41,1,normal,204,well
        56,0,fixed,236,sick

        62,1,normal,268,well
        57,0,reversible,354,sick
        63,1,normal,254,well
        53,1,fixed,203,sick
        57,1,normal,192,well
    """))
    out = tmp_path / "data"
    result = run_cli("prepare", "csv", table, "--label", "target", "--split", "train=0.8,test=0.2", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["features"] == {
        "age": {"dtype": "int64", "shape": []}, "sex": {"dtype": "int64", "shape": []},
        "thal": {"dtype": "int64", "shape": []}, "chol": {"dtype": "float32", "shape": []},
        "target": {"dtype": "int64", "shape": []},
    }
    assert manifest["inputs"] == ["age", "sex", "thal", "chol"] and manifest["class_names"] == ["sick", "well"]
    assert manifest["preprocessing"]["vocabularies"] == {"thal": ["fixed", "normal", "reversible"]}
    assert manifest["preprocessing"]["columns"]["thal"] == "category"
    assert manifest["value_ranges"]["thal"] == {"dtype": "int64", "min": 0, "max": 2}
    assert {s: i["records"] for s, i in manifest["splits"].items()} == {"train": 8, "test": 2}
    # Every record carries its row: a category as its id, the text label as its class id.
    records = _records(out, "train") + _records(out, "test")
    rows = {int(r.features.feature["chol"].float_list.value[0]): r for r in records}
    assert rows[233].features.feature["thal"].int64_list.value[0] == 0
    assert rows[233].features.feature["target"].int64_list.value[0] == 0
    assert rows[192].features.feature["target"].int64_list.value[0] == 1
    _verified(out)


def write_tfds_layout(data_dir: Path, name: str = "tinydigits") -> tuple[Path, dict]:
    """A dataset in the layout `tfds build` writes: dataset_info.json, features.json, the labels file and
    `NAME-SPLIT.tfrecord-NNNNN-of-MMMMM` shards of tf.train.Example. Returns the folder and the images."""
    folder = data_dir / name / "1.0.0"
    folder.mkdir(parents=True)
    lengths = {"train": [12, 12], "test": [8]}
    rng = np.random.default_rng(3)
    written: dict[str, list] = {}
    for split, sizes in lengths.items():
        for index, length in enumerate(sizes):
            path = folder / f"{name}-{split}.tfrecord-{index:05d}-of-{len(sizes):05d}"
            with tf.io.TFRecordWriter(str(path)) as writer:
                for _ in range(length):
                    label = int(rng.integers(0, 3))
                    image = (40 * label + rng.integers(0, 30, (8, 8, 1))).astype(np.uint8)
                    written.setdefault(split, []).append((image, label))
                    png = tf.io.encode_png(image).numpy()
                    feature = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png])),
                               "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}
                    writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    info = {
        "name": name, "version": "1.0.0", "fileFormat": "tfrecord",
        "splits": [{"name": s, "shardLengths": [str(n) for n in sizes]} for s, sizes in lengths.items()],
        "supervisedKeys": {"tuple": {"items": [{"featureKey": "image"}, {"featureKey": "label"}]}},
    }
    (folder / "dataset_info.json").write_text(json.dumps(info))
    image = {"shape": {"dimensions": ["8", "8", "1"]}, "dtype": "uint8", "encodingFormat": "png"}
    features = {"pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
                "featuresDict": {"features": {
                    "image": {"pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
                              "image": image},
                    "label": {"pythonClassName": "tensorflow_datasets.core.features.class_label_feature.ClassLabel",
                              "classLabel": {"numClasses": "3"}}}}}
    (folder / "features.json").write_text(json.dumps(features))
    (folder / "label.labels.txt").write_text("zero\none\ntwo\n")
    return folder, written


def test_a_tfds_folder_on_disk_is_read_without_tensorflow_datasets(tmp_path: Path) -> None:
    _, written = write_tfds_layout(tmp_path / "tensorflow_datasets")
    out = tmp_path / "data"
    result = run_cli("prepare", "tfds", "tinydigits", "--data-dir", tmp_path / "tensorflow_datasets", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["features"]["image"] == {"dtype": "uint8", "shape": [8, 8, 1], "var_len": False, "decode": "png"}
    assert (manifest["inputs"], manifest["label"]) == (["image"], "label")
    assert manifest["class_names"] == ["zero", "one", "two"]
    assert {s: i["records"] for s, i in manifest["splits"].items()} == {"train": 24, "test": 8}
    train_pixels = np.stack([image for image, _ in written["train"]])
    assert manifest["value_ranges"]["image"] == {"dtype": "uint8", "min": int(train_pixels.min()),
                                                 "max": int(train_pixels.max())}
    # The same images and labels, in the same order.
    for record, (image, label) in zip(_records(out, "test"), written["test"], strict=True):
        decoded = tf.io.decode_png(record.features.feature["image"].bytes_list.value[0]).numpy()
        np.testing.assert_array_equal(decoded, image)
        assert record.features.feature["label"].int64_list.value[0] == label
    _verified(out)


def test_the_built_in_path_records_value_ranges_and_verify_reads_manifests_without_them(
    tiny_mnist: Path, tmp_path: Path
) -> None:
    manifest = json.loads((tiny_mnist / "manifest.json").read_text())
    assert manifest["value_ranges"] == {"image": {"dtype": "uint8", "min": 0, "max": 255}}
    old = tmp_path / "old"
    old.mkdir()
    for path in tiny_mnist.iterdir():
        (old / path.name).write_bytes(path.read_bytes())
    del manifest["value_ranges"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert pipeline.read_manifest(str(old))["splits"]["train"]["records"] == 2048
    _verified(old)


# --- bad inputs: exit 2, named, nothing published ---------------------------------------------------


def _bad_arrays(tmp_path: Path) -> tuple[Path, list[str], str]:
    np.savez(tmp_path / "bad.npz", x=np.zeros((10, 3), np.float32), y=np.zeros(9, np.int64))
    return tmp_path / "bad.npz", ["arrays", "--features", "x", "--label", "y"], "x: 10, y: 9"


def _nan_label(tmp_path: Path) -> tuple[Path, list[str], str]:
    y = np.arange(10, dtype=np.float32)
    y[6] = np.nan
    np.savez(tmp_path / "nan.npz", x=np.zeros((10, 3), np.float32), y=y)
    return tmp_path / "nan.npz", ["arrays", "--features", "x", "--label", "y"], "y: record 6 (counting from 0)"


def _ragged_csv(tmp_path: Path) -> tuple[Path, list[str], str]:
    (tmp_path / "ragged.csv").write_text("a,b,label\n1,2,0\n3,4,1\n5,6\n7,8,1\n")
    return tmp_path / "ragged.csv", ["csv", "--label", "label"], "ragged.csv:4: 2 fields, the header has 3"


def _nan_csv_label(tmp_path: Path) -> tuple[Path, list[str], str]:
    (tmp_path / "nan.csv").write_text("a,label\n1,0.5\n2,NaN\n3,1.5\n")
    return tmp_path / "nan.csv", ["csv", "--label", "label"], "nan.csv:3: label 'label' is missing ('NaN')"


def _outcomes(replaced: dict[int, str]) -> str:
    """A table of 100 records (ages, a decimal, a text label), the records at the lines given (the header is
    line 1) replaced by the text given."""
    rng = np.random.default_rng(5)
    rows = [f"{rng.integers(20, 90)},{rng.uniform(100, 300):.1f},{rng.choice(['good', 'bad'])}" for _ in range(100)]
    for line, row in replaced.items():
        rows[line - 2] = row
    return "age,chol,outcome\n" + "\n".join(rows) + "\n"


def _nan_text_label(tmp_path: Path) -> tuple[Path, list[str], str]:
    # A text label with one 'NaN': it was a third class, 'NaN', exit 0.
    (tmp_path / "bad.csv").write_text(_outcomes({91: "52,180.5,NaN"}))
    return tmp_path / "bad.csv", ["csv", "--label", "outcome"], "bad.csv:91: label 'outcome' is missing ('NaN')"


def _na_among_whole_numbers(tmp_path: Path) -> tuple[Path, list[str], str]:
    # One 'NA' among ages: it made the ages a category of ids in string order, exit 0.
    (tmp_path / "bad.csv").write_text(_outcomes({42: "NA,180.5,good"}))
    return tmp_path / "bad.csv", ["csv", "--label", "outcome"], "bad.csv:42: column 'age' is missing ('NA')"


def _na_in_a_category(tmp_path: Path) -> tuple[Path, list[str], str]:
    # A blank line and a quoted line break before it: the line named is the one an editor shows.
    (tmp_path / "heart.csv").write_text('age,thal,target\n63,fixed,1\n\n67,"normal\n",0\n37,NA,1\n41,None,0\n')
    return tmp_path / "heart.csv", ["csv", "--label", "target"], "heart.csv:6: column 'thal' is missing ('NA')"


def _id_beyond_int64(tmp_path: Path) -> tuple[Path, list[str], str]:
    # A 20-digit id: numpy cannot hold it as int64, and the conversion crashed with a traceback.
    (tmp_path / "ids.csv").write_text("id,x,y\n12345678901234567890,1.0,a\n2,2.0,b\n3,1.5,a\n4,2.5,b\n")
    return tmp_path / "ids.csv", ["csv", "--label", "y"], "ids.csv:2: column 'id' is 12345678901234567890, beyond"


def _broken_image(tmp_path: Path) -> tuple[Path, list[str], str]:
    _line_images(tmp_path / "pics", 4, 12, seed=2)
    (tmp_path / "pics" / "vertical" / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return tmp_path / "pics", ["images"], "vertical/2.png: not a readable image"


@pytest.mark.parametrize("bad", [_bad_arrays, _nan_label, _ragged_csv, _nan_csv_label, _nan_text_label,
                                 _na_among_whole_numbers, _na_in_a_category, _id_beyond_int64, _broken_image])
def test_a_bad_input_stops_with_exit_2_naming_it_and_publishes_nothing(bad, tmp_path: Path) -> None:
    location, (form, *flags), named = bad(tmp_path)
    out = tmp_path / "data"
    result = run_cli("prepare", form, location, *flags, "--out", out)
    assert result.returncode == 2, result.stderr[-3000:]
    assert named in result.stderr
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


@pytest.mark.parametrize("marker", sorted(rows.MISSING))
@pytest.mark.parametrize("column", ["age", "thal", "target"])
def test_every_missing_marker_stops_a_number_a_category_or_a_label_column(column, marker, tmp_path: Path) -> None:
    rows = [["63", "fixed", "sick"], ["67", "normal", "well"], ["37", "reversible", "sick"], ["41", "normal", "well"]]
    rows[2][["age", "thal", "target"].index(column)] = f" {marker} "  # spaces around a cell are stripped
    table = tmp_path / "heart.csv"
    table.write_text("age,thal,target\n" + "".join(",".join(row) + "\n" for row in rows))
    what = "label" if column == "target" else "column"
    held = "empty" if marker == "" else f"missing ({marker!r})"
    with pytest.raises(DataError, match=rf"heart.csv:4: {what} '{column}' is {re.escape(held)}; .* drop the row") as e:
        own.csv_dataset(str(table), "target")
    assert e.value.exit_code == 2


def test_words_like_the_missing_markers_are_values_and_columns_without_gaps_keep_their_kind(tmp_path: Path) -> None:
    # Only the exact markers are missing: 'none', 'Na' (sodium) and 'NONE' are words; a column not used may have gaps.
    table = tmp_path / "mixed.csv"
    table.write_text("age,smoker,ion,notes,target\n63,none,Na,,1.5\n67,daily,K,NA,2.5\n37,NONE,Na,x,0.5\n"
                     "41,daily,Ca,,3\n")
    dataset = own.csv_dataset(str(table), "target", ("age", "smoker", "ion"), split="train=0.5,test=0.5")
    assert {name: f.dtype for name, f in dataset.features.items()} == {
        "age": "int64", "smoker": "int64", "ion": "int64", "target": "float32"}
    assert dataset.preprocessing["vocabularies"] == {"smoker": ["NONE", "daily", "none"], "ion": ["Ca", "K", "Na"]}
    ages = np.concatenate([split["age"] for split in dataset.splits.values()])
    assert sorted(ages.tolist()) == [37, 41, 63, 67] and dataset.class_names == ()


def test_a_failed_prepare_leaves_the_published_dataset_whole_and_a_new_one_replaces_it(tmp_path: Path) -> None:
    x, y = np.arange(400, dtype=np.float32).reshape(100, 4), np.arange(100) % 3
    out = str(tmp_path / "data")
    first = shards.publish(lambda: own.arrays_dataset(_npz(tmp_path, "a", x, y), ("x",), "y"), out, shards=3)
    listed = sorted(e["file"] for e in json.loads(Path(first).read_text())["splits"]["train"]["shards"])
    assert len(listed) == 3

    def broken():
        return own.arrays_dataset(_npz(tmp_path, "b", x, y[:50]), ("x",), "y")

    with pytest.raises(DataError, match="x: 100, y: 50") as caught:
        shards.publish(broken, out)
    assert caught.value.exit_code == 2
    assert sorted(p.name for p in Path(out).glob("train-*")) == listed
    # Prepared again with other shard counts: the old shards go, the new manifest lists what is there.
    shards.publish(lambda: own.arrays_dataset(_npz(tmp_path, "c", x * 2, y), ("x",), "y"), out, shards=1)
    assert sorted(p.name for p in Path(out).iterdir()) == [
        "manifest.json", "test-00000-of-00001.tfrecord", "train-00000-of-00001.tfrecord",
        "validation-00000-of-00001.tfrecord"]
    assert pipeline.verify_shards(out) == []


def _npz(folder: Path, name: str, x: np.ndarray, y: np.ndarray) -> str:
    path = folder / f"{name}.npz"
    np.savez(path, x=x, y=y)
    return str(path)


def test_library_forms_refuse_what_they_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "a").mkdir()
    with pytest.raises(DataError, match="its class folders hold no .bmp/.gif/.jpeg/.jpg/.png images"):
        images_dataset(str(tmp_path / "odd"))
    folder, _ = write_tfds_layout(tmp_path / "tfds")
    info = json.loads((folder / "dataset_info.json").read_text())
    info["splits"][0]["shardLengths"] = ["12", "13"]
    (folder / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match=r"00001-of-00002: 12 records, dataset_info.json's shardLengths lists 13"):
        tfds_dataset("tinydigits", str(tmp_path / "tfds"))


@pytest.mark.slow
def test_arrays_go_straight_to_a_bucket_and_verify_there(gcs, tmp_path: Path) -> None:
    bucket = gcs.bucket()
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "points.npz", x_train=rng.normal(size=(300, 4)).astype(np.float32),
             y_train=rng.integers(0, 2, 300), x_test=rng.normal(size=(50, 4)).astype(np.float32),
             y_test=rng.integers(0, 2, 50))
    env = cli_env(**gcs.env)
    out = f"gs://{bucket}/points"
    result = run_cli("prepare", "arrays", tmp_path / "points.npz", "--features", "x", "--label", "y", "--out", out,
                     env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert gcs.objects(bucket) == ["points/manifest.json", "points/test-00000-of-00001.tfrecord",
                                   "points/train-00000-of-00001.tfrecord"]
    manifest = json.loads(gcs.read(bucket, "points/manifest.json"))
    assert {s: i["records"] for s, i in manifest["splits"].items()} == {"train": 300, "test": 50}
    assert manifest["value_ranges"]["x"]["dtype"] == "float32"
    _verified(out, env=env)
