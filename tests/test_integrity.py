"""A job trains on exactly the data its manifest promises, or stops before it writes anything (data.verify,
runner/data/integrity.py, docs/data.md).

Each fault below once trained with exit 0: a listed shard missing, emptied, cut at a record boundary or inside a
record header; a wrong sha256 or record count in the manifest; a manifest without `splits`; a label the model has
no class for; a pattern naming part of a split. Each must end with exit 2, a message naming the shard (or the
manifest field) and what differs, and the run folder as it was: absent for a new job, byte for byte the same
(checkpoints, model.keras, summaries) for a job that has trained before.

These jobs fail before training, so most cases call run_job in this process (what `runner run` runs; the CLI
exits with the error's exit code) and take a fraction of a second; the real CLI runs in a child process for one
local and the gs:// cases.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import cli_env, last_json, run_cli, write_spec

TRAIN_SHARD = "train-00001-of-00004.tfrecord"


# --- helpers ------------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def write_manifest(folder: Path, doc: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(doc, indent=2))


def record_ends(content: bytes) -> list[int]:
    """The offset just after each TFRecord (length 8, crc 4, data, crc 4), read without TensorFlow."""
    ends, offset = [], 0
    while offset < len(content):
        offset += 8 + 4 + int.from_bytes(content[offset : offset + 8], "little") + 4
        ends.append(offset)
    assert offset == len(content)
    return ends


def snapshot(folder: Path) -> dict[str, bytes] | None:
    """Every file under `folder` with its bytes; None when the folder does not exist."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def job_spec(folder: Path, data_dir: Path, name: str, **sections) -> Path:
    doc = {
        "name": name,
        "accelerator": {"kind": "cpu"},
        "data": {
            "train": f"{data_dir}/train-*.tfrecord",
            "eval": f"{data_dir}/test-*.tfrecord",
            "global_batch_size": 128,
            "shuffle_buffer": 512,
        },
        "train": {"epochs": 1},
        "output": {"dir": str(folder / "runs"), "tensorboard": False},
    }
    for section, values in sections.items():
        doc.setdefault(section, {}).update(values)
    return write_spec(folder, doc, f"{name}.yaml")


def run_in_process(spec: Path, *overrides: str):
    """`runner run SPEC --set ...` as the CLI runs it, in this process: (exit code, message, summary)."""
    from runner.job.run import run_job
    from runner.spec.load import load_spec

    result = run_job(load_spec(spec, list(overrides)))
    code = 0 if result.error is None else result.error.exit_code
    return code, "" if result.error is None else str(result.error), result.summary


# --- the faults -------------------------------------------------------------------------------------


def missing(folder: Path) -> None:
    (folder / TRAIN_SHARD).unlink()


def empty(folder: Path) -> None:
    (folder / TRAIN_SHARD).write_bytes(b"")


def cut_at_a_record_boundary(folder: Path) -> None:
    shard = folder / TRAIN_SHARD
    content = shard.read_bytes()
    shard.write_bytes(content[: record_ends(content)[99]])  # exactly 100 whole records of 512 are left


def cut_inside_a_record_header(folder: Path) -> None:
    shard = folder / TRAIN_SHARD
    content = shard.read_bytes()
    shard.write_bytes(content[: record_ends(content)[99] + 5])  # 5 of the next record's 8 length bytes


def wrong_sha256(folder: Path) -> None:
    doc = read_manifest(folder)
    doc["splits"]["train"]["shards"][1]["sha256"] = hashlib.sha256(b"other bytes").hexdigest()
    write_manifest(folder, doc)


def wrong_record_count(folder: Path) -> None:
    doc = read_manifest(folder)
    doc["splits"]["train"]["shards"][1]["records"] += 88  # the shards now add up to 2,136, the split says 2,048
    write_manifest(folder, doc)


def no_splits(folder: Path) -> None:
    doc = read_manifest(folder)
    del doc["splits"]
    write_manifest(folder, doc)


def label_outside_the_classes(folder: Path) -> None:
    """Record 7 of shard 1 relabelled 10 (MNIST has 0-9), indexed again as `runner manifest` indexes user data."""
    import tensorflow as tf

    from runner.prepare.manifest import write_user_manifests
    from runner.spec.load import load_spec

    shard = folder / TRAIN_SHARD
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(shard))]
    example = tf.train.Example.FromString(records[7])
    example.features.feature["label"].int64_list.value[0] = 10
    records[7] = example.SerializeToString()
    with tf.io.TFRecordWriter(str(shard)) as writer:
        for record in records:
            writer.write(record)
    features = {"image": {"dtype": "uint8", "shape": [28, 28, 1]}, "label": {"dtype": "int64"}}
    spec = job_spec(folder, folder, "index", data={"features": features})
    write_user_manifests(load_spec(spec), str(spec), force=True)


# fault -> (spec overrides, what the message must say: a regex)
FAULTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...], str]] = {
    "missing": (
        missing, (), rf"{TRAIN_SHARD}: missing; .*manifest\.json lists it \(splits\.train\.shards\[1\]: 512 records\)"
    ),
    "empty": (
        empty, (), rf"{TRAIN_SHARD}: empty \(0 bytes\), the manifest lists [\d,]+ bytes "
                   r"\(.*splits\.train\.shards\[1\]\)"
    ),
    "cut_at_a_record_boundary": (
        cut_at_a_record_boundary, (), rf"{TRAIN_SHARD}: [\d,]+ bytes, the manifest lists [\d,]+ bytes "
                                      r"\(.*splits\.train\.shards\[1\]\)"
    ),
    "cut_inside_a_record_header": (
        cut_inside_a_record_header, (), rf"{TRAIN_SHARD}: [\d,]+ bytes, the manifest lists [\d,]+ bytes"
    ),
    "wrong_sha256": (
        wrong_sha256, ("data.verify=sha256",),
        rf"{TRAIN_SHARD}: sha256 [0-9a-f]{{12}}\.\.\. does not match the manifest's [0-9a-f]{{12}}\.\.\.",
    ),
    "wrong_record_count": (
        wrong_record_count, (),
        r"manifest\.json: field `splits\.train\.records` is 2048, but the records of its 4 shard\(s\) "
        r"\(splits\.train\.shards\[\*\]\.records\) add up to 2,136",
    ),
    "no_splits": (no_splits, (), r"manifest\.json: field `splits` is missing"),
    "label_outside_the_classes": (
        label_outside_the_classes, (),
        rf"{TRAIN_SHARD}: record 7 \(counting from 0\) has label 10, outside the 10 classes of model mnist_cnn "
        r"\(0 to 9, model\.params\.classes\); .*manifest\.json: splits\.train\.shards\[1\]\.label_range is \[0, 10\]",
    ),
}


@pytest.fixture
def data_copy(tiny_mnist: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "mnist"
    shutil.copytree(tiny_mnist, folder)
    return folder


# --- a new job ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_new_job_on_faulty_data_stops_with_exit_2_and_writes_nothing(fault, data_copy, tmp_path):
    mutate, overrides, expected = FAULTS[fault]
    mutate(data_copy)
    spec = job_spec(tmp_path, data_copy, "new")
    code, message, summary = run_in_process(spec, *overrides)
    assert code == 2, message
    assert re.search(expected, message), message
    assert summary["status"] == "failed" and summary["error"] == message
    assert not (tmp_path / "runs").exists(), "the run folder was created"


def test_the_cli_exits_2_naming_the_shard_and_writes_no_run_folder(data_copy, tmp_path):
    cut_at_a_record_boundary(data_copy)
    spec = job_spec(tmp_path, data_copy, "cli")
    result = run_cli("run", spec, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    shard = data_copy / TRAIN_SHARD
    assert re.search(rf"error: data\.verify \(size\): 1 of the 5 shards the job reads differ from their manifest:\n"
                     rf"  {shard}: 83,800 bytes, the manifest lists 429,\d+ bytes", result.stderr), (
        result.stderr[-3000:])
    assert "Nothing was written to the run folder" in result.stderr
    assert last_json(result.stdout)["status"] == "failed"
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_shard_replaced_by_one_of_the_same_size_passes_size_and_is_named_by_sha256(data_copy, tmp_path):
    """What `size` cannot see: the test shard (512 records of the same size) copied over a training shard."""
    from runner.data.integrity import check_job_data
    from runner.spec.load import load_spec

    shutil.copy(data_copy / "test-00000-of-00001.tfrecord", data_copy / TRAIN_SHARD)
    spec = job_spec(tmp_path, data_copy, "replaced")
    assert check_job_data(load_spec(spec)).record["mode"] == "size"  # sizes match: the job would train
    code, message, _ = run_in_process(spec, "data.verify=sha256")
    assert code == 2, message
    assert re.search(rf"{TRAIN_SHARD}: sha256 [0-9a-f]{{12}}\.\.\. does not match the manifest's", message), message
    assert "bytes, the manifest lists" not in message
    assert not (tmp_path / "runs").exists()


def test_a_pattern_naming_part_of_a_split_is_refused(data_copy, tmp_path):
    spec = job_spec(tmp_path, data_copy, "part", data={"train": f"{data_copy}/train-0000[0-2]-*.tfrecord"})
    code, message, _ = run_in_process(spec)
    assert code == 2, message
    assert (f"data.train ('{data_copy}/train-0000[0-2]-*.tfrecord') names 3 of the 4 shards of split 'train' in "
            f"{data_copy}/manifest.json; not named: train-00003-of-00004.tfrecord") in message
    assert f"name all of 'train' (e.g. {data_copy}/train-*.tfrecord)" in message
    assert not (tmp_path / "runs").exists()


def test_a_file_the_manifest_does_not_list_is_refused(data_copy, tmp_path):
    shutil.copy(data_copy / TRAIN_SHARD, data_copy / "train-00004-of-00004.tfrecord")
    code, message, _ = run_in_process(job_spec(tmp_path, data_copy, "extra"))
    assert code == 2
    assert message == (f"{data_copy}/train-00004-of-00004.tfrecord matches '{data_copy}/train-*.tfrecord' (data.train) "
                       f"but is not listed in {data_copy}/manifest.json")


def test_labels_beyond_the_models_classes_are_named_by_shard_and_record(data_copy, tmp_path):
    """MNIST's labels 0-9 against a 5-class model: the first shard's first label of 5 or more is named."""
    import tensorflow as tf

    spec = job_spec(tmp_path, data_copy, "five", model={"params": {"classes": 5}})
    code, message, _ = run_in_process(spec)
    assert code == 2, message
    first = data_copy / "train-00000-of-00004.tfrecord"
    labels = [tf.train.Example.FromString(r.numpy()).features.feature["label"].int64_list.value[0]
              for r in tf.data.TFRecordDataset(str(first))]
    index = next(i for i, label in enumerate(labels) if label >= 5)
    assert message.startswith(f"{first}: record {index} (counting from 0) has label {labels[index]}, outside the 5 "
                              f"classes of model mnist_cnn (0 to 4, model.params.classes); {data_copy}/manifest.json: "
                              "splits.train.shards[0].label_range is [0, 9]. Set model.params.classes to at least 10")


def test_the_classifiers_classes_are_those_the_models_are_built_with():
    from runner import models
    from runner.data.schema import Feature
    from runner.spec.types import JobSpec
    from runner.train.build import build_model

    classifiers = {name: known.classes for name, known in models.BUILTIN.items() if known.classes}
    assert classifiers == {"mnist_cnn": 10, "cifar10_cnn": 10}
    for name, classes in classifiers.items():
        shape = (28, 28, 1) if name == "mnist_cnn" else (32, 32, 3)
        spec = JobSpec.model_validate({"model": {"name": name}})
        model = build_model(spec, {"image": Feature("uint8", shape), "label": Feature("int64", ())})
        assert model.output_shape[-1] == classes, name


# --- manifests: sizes and label ranges written, old manifests read ------------------------------------


def test_prepare_records_each_shards_size_and_label_range(tiny_mnist):
    import tensorflow as tf

    for _split, info in read_manifest(tiny_mnist)["splits"].items():
        for entry in info["shards"]:
            path = tiny_mnist / entry["file"]
            assert entry["bytes"] == path.stat().st_size
            labels = [tf.train.Example.FromString(r.numpy()).features.feature["label"].int64_list.value[0]
                      for r in tf.data.TFRecordDataset(str(path))]
            assert entry["label_range"] == [min(labels), max(labels)] and len(labels) == entry["records"]


def test_runner_manifest_records_sizes_and_label_ranges(data_copy):
    label_outside_the_classes(data_copy)  # indexes the folder as `runner manifest` does
    doc = read_manifest(data_copy)
    assert set(doc["splits"]) == {"train", "eval"}
    for info in doc["splits"].values():
        for entry in info["shards"]:
            assert entry["bytes"] == (data_copy / entry["file"]).stat().st_size
            assert entry["sha256"] == hashlib.sha256((data_copy / entry["file"]).read_bytes()).hexdigest()
    ranges = [entry["label_range"] for entry in doc["splits"]["train"]["shards"]]
    assert ranges[1] == [0, 10] and all(r == [0, 9] for i, r in enumerate(ranges) if i != 1)


def strip_sizes(folder: Path) -> None:
    """The manifest as runners before sizes wrote it."""
    doc = read_manifest(folder)
    for info in doc["splits"].values():
        for entry in info["shards"]:
            del entry["bytes"]
    write_manifest(folder, doc)


def test_a_manifest_without_sizes_names_the_fix_for_size_and_works_for_sha256_and_off(data_copy, tmp_path):
    from runner.data.integrity import check_job_data
    from runner.spec.load import load_spec

    strip_sizes(data_copy)
    spec = job_spec(tmp_path, data_copy, "old")
    code, message, _ = run_in_process(spec)
    assert code == 2
    assert message.startswith(
        f"data.verify (size): {data_copy}/manifest.json lists no size for 5 of the 5 shards "
        f"(e.g. {data_copy}/manifest.json: splits.train.shards[0].bytes): it was written before manifests recorded "
        "sizes. Record them once with "
        f"`runner verify {data_copy} --record-sizes`"
    ), message
    assert "--set data.verify=sha256" in message and not (tmp_path / "runs").exists()
    checked = check_job_data(load_spec(spec, ["data.verify=sha256"])).record
    total = sum(p.stat().st_size for p in data_copy.glob("*.tfrecord"))
    assert checked["mode"] == "sha256" and checked["shards"] == 5 and checked["bytes_read"] == total
    assert check_job_data(load_spec(spec, ["data.verify=off"])).record["shards"] == 5


def invoke(*args: str):
    from runner.cli import app

    return CliRunner().invoke(app, list(args))


def test_runner_verify_records_missing_sizes_once_every_sha256_matches(data_copy, tmp_path):
    strip_sizes(data_copy)
    result = invoke("verify", str(data_copy))
    assert result.exit_code == 0, result.output
    assert re.search(r"every shard matches manifest\.json \(sha256\): 5 shards, 2\.\d MB in [\d.]+ s, "
                     r"[\d,]+ MB/s on \d threads", result.stdout), result.output
    assert (f"lists no size for 5 shards (written by an older runner): add them with "
            f"`runner verify {data_copy} --record-sizes`") in result.output

    result = invoke("verify", str(data_copy), "--record-sizes")
    assert result.exit_code == 0, result.output
    assert f"{data_copy}/manifest.json: recorded the size of 5 shards" in result.stdout
    for entry in read_manifest(data_copy)["splits"]["train"]["shards"]:
        assert entry["bytes"] == (data_copy / entry["file"]).stat().st_size
    from runner.data.integrity import check_job_data
    from runner.spec.load import load_spec

    assert check_job_data(load_spec(job_spec(tmp_path, data_copy, "sized"))).record["mode"] == "size"


@pytest.mark.slow
def test_a_job_trained_on_a_manifest_without_sizes_resumes_after_they_are_recorded(data_copy, tmp_path):
    """The upgrade path: sizes added to the manifest change nothing the checkpoints are pinned to."""
    strip_sizes(data_copy)
    spec = job_spec(tmp_path, data_copy, "upgraded", data={"eval": None}, train={"steps_per_epoch": 4})
    first = run_cli("run", spec, "--set", "data.verify=sha256")
    assert first.returncode == 0, first.stderr[-3000:]
    assert invoke("verify", str(data_copy), "--record-sizes").exit_code == 0
    again = run_cli("run", spec, "--set", "train.epochs=2")  # data.verify: size, the default
    assert again.returncode == 0, again.stderr[-3000:]
    summary = last_json(again.stdout)
    assert summary["resumed_from_step"] == 4 and summary["final_step"] == 8
    assert summary["data_verify"]["mode"] == "size" and summary["data_verify"]["bytes_read"] == 0


def test_runner_verify_records_no_size_while_a_shard_differs(data_copy):
    strip_sizes(data_copy)
    cut_at_a_record_boundary(data_copy)
    result = invoke("verify", str(data_copy), "--record-sizes")
    assert result.exit_code == 2
    assert f"{data_copy / TRAIN_SHARD}: sha256" in result.output
    assert "bytes" not in read_manifest(data_copy)["splits"]["train"]["shards"][0]


def test_runner_verify_names_each_shard_that_differs_and_what_differs(data_copy):
    missing(data_copy)
    empty_shard = data_copy / "train-00002-of-00004.tfrecord"
    size = empty_shard.stat().st_size
    empty_shard.write_bytes(b"")
    result = invoke("verify", str(data_copy))
    assert result.exit_code == 2
    assert (f"{data_copy / TRAIN_SHARD}: missing; {data_copy}/manifest.json: splits.train.shards[1] lists it "
            "(512 records") in result.output
    assert re.search(rf"{empty_shard}: sha256 [0-9a-f]{{12}}\.\.\. does not match the manifest's [0-9a-f]{{12}}\.\.\.; "
                     rf"empty \(0 bytes\), the manifest lists {size:,} bytes", result.output), result.output
    assert "2 of 5 shards differ" in result.output and "every shard matches" not in result.output


# --- a job that has trained: nothing of its run folder changes ------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_mnist, tmp_path_factory):
    """A job trained for one short epoch (checkpoints, model.keras, summaries) with data.verify: sha256, its data
    folder, and a snapshot of its run folder's bytes."""
    folder = tmp_path_factory.mktemp("trained")
    data_dir = folder / "mnist"
    shutil.copytree(tiny_mnist, data_dir)
    spec = job_spec(folder, data_dir, "trained", train={"steps_per_epoch": 4}, checkpoint={"every_steps": 2})
    result = run_cli("run", spec, "--set", "data.verify=sha256")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = folder / "runs" / "trained"
    before = snapshot(run_dir)
    assert {"model.keras", "summary.json", "checkpoints/checkpoint"} <= set(before)
    return spec, data_dir, run_dir, before, last_json(result.stdout)


@pytest.mark.slow
@pytest.mark.xdist_group("integrity_trained")  # its tests share a worker, so the module's job trains once
def test_a_trained_job_reports_what_verifying_by_sha256_cost(trained, tiny_mnist):
    import jsonschema

    summary = trained[4]
    total = sum(p.stat().st_size for p in tiny_mnist.glob("*.tfrecord"))
    record = summary["data_verify"]
    assert record["mode"] == "sha256" and record["shards"] == 5
    assert record["bytes"] == record["bytes_read"] == total
    assert record["mb_per_s"] > 0 and record["seconds"] <= summary["timing"]["data_init_s"]
    schema = json.loads((Path(__file__).parents[1] / "runner" / "rundir" / "summary.schema.json").read_text())
    jsonschema.validate(summary, schema)


@pytest.mark.slow
@pytest.mark.xdist_group("integrity_trained")
@pytest.mark.parametrize("fault", FAULTS)
def test_a_job_with_checkpoints_on_faulty_data_keeps_its_run_folder_byte_for_byte(fault, trained, tiny_mnist):
    spec, data_dir, run_dir, before, _ = trained
    shutil.rmtree(data_dir)
    shutil.copytree(tiny_mnist, data_dir)
    mutate, overrides, expected = FAULTS[fault]
    mutate(data_dir)
    code, message, summary = run_in_process(spec, "train.epochs=2", *overrides)  # one more epoch, if it trained
    assert code == 2, message
    assert re.search(expected, message), message
    assert summary["status"] == "failed"
    assert snapshot(run_dir) == before, "the run folder changed"


# --- gs:// --------------------------------------------------------------------------------------


def test_gs_shards_are_checked_by_size_and_sha256_and_the_bucket_gets_no_run_folder(gcs, data_copy, tmp_path):
    bucket = gcs.bucket()
    cut_inside_a_record_header(data_copy)
    flipped = data_copy / "train-00003-of-00004.tfrecord"
    content = bytearray(flipped.read_bytes())
    content[len(content) // 2] ^= 0x01  # same size, other bytes
    flipped.write_bytes(bytes(content))
    url = gcs.upload_folder(data_copy, bucket, "mnist")
    spec = job_spec(tmp_path, data_copy, "remote",
                    data={"train": f"{url}/train-*.tfrecord", "eval": f"{url}/test-*.tfrecord"},
                    output={"dir": f"gs://{bucket}/runs"})
    env = cli_env(**gcs.env)

    result = run_cli("run", spec, env=env, timeout=180)  # data.verify: size
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(rf"{url}/{TRAIN_SHARD}: [\d,]+ bytes, the manifest lists [\d,]+ bytes", result.stderr), (
        result.stderr[-3000:])
    assert "train-00003" not in result.stderr  # its size is right: only sha256 can tell

    result = run_cli("run", spec, "--set", "data.verify=sha256", env=env, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "2 of the 5 shards the job reads differ" in result.stderr
    assert re.search(rf"{url}/{TRAIN_SHARD}: sha256 .*; [\d,]+ bytes, the manifest lists", result.stderr)
    assert re.search(rf"{url}/train-00003-of-00004\.tfrecord: sha256 [0-9a-f]{{12}}\.\.\. does not match",
                     result.stderr)
    assert gcs.objects(bucket, "runs/") == []
