"""A user's first mistakes with data get a usage error (exit 2) that names the file at fault and what to do.

`runner verify` given a file (a job spec, the manifest, a shard) where the dataset folder goes names the folder to
give, never calling the file a storage fault. A manifest whose schema says another dtype or shape than its records
hold stops training naming the manifest and the first shard whose record does not parse with it, with the command
that writes the manifest again, and none of TensorFlow's own wrapping (`{{function_node ...}}`).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke

TF_INTERNALS = ("function_node", "IteratorGetNext", "Iterator::", "Traceback", "[[")


def _command(text: str, starts: str) -> list[str]:
    """The last backticked command in `text` that begins with `starts` (the one to run: an earlier one may name
    the command itself), as argv without `runner`."""
    found = re.findall(rf"`({re.escape(starts)}[^`]*)`", text)
    assert found, f"no `{starts}...` in:\n{text[-3000:]}"
    return shlex.split(found[-1])[1:]


# --- `runner verify FILE` ---------------------------------------------------------------------------------


def test_verify_given_a_job_spec_names_the_folder_its_data_patterns_point_into(tiny_mnist: Path, tmp_path: Path):
    data = {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": f"{tiny_mnist}/test-*.tfrecord"}
    spec = write_spec(tmp_path, {"name": "spec_not_folder", "data": data})
    result = invoke("verify", spec)
    assert result.returncode == 2, result.stderr
    assert (f"error: {spec} is a file, not a dataset folder: `runner verify` takes the folder that holds manifest.json "
            f"and the shards it lists; this is a job spec, whose data.train and data.eval point into {tiny_mnist}: "
            f"`runner verify {tiny_mnist}`") in result.stderr, result.stderr
    for wrong in ("storage fault", "move that file", "Not a directory"):
        assert wrong not in result.stderr
    followed = run_cli(*_command(result.stderr, "runner verify"), timeout=120)
    assert followed.returncode == 0, followed.stderr[-2000:]
    assert f"{tiny_mnist}: every shard matches manifest.json" in followed.stdout


def test_verify_given_a_spec_reading_two_folders_names_both(tmp_path: Path):
    """Relative patterns resolve from the spec's folder, as `runner run` reads them; a spec that does not load
    (an unknown key) is still read for its data patterns."""
    spec = write_spec(tmp_path, {"name": "two", "data": {"train": "train_data/train-*.tfrecord",
                                                          "eval": "eval_data/test-*.tfrecord"}})
    result = invoke("verify", spec)
    assert result.returncode == 2, result.stderr
    assert (f"data.train points into {tmp_path}/train_data; data.eval points into {tmp_path}/eval_data: "
            f"`runner verify {tmp_path}/train_data`, `runner verify {tmp_path}/eval_data`") in result.stderr
    broken = write_spec(tmp_path, {"name": "broken", "dtaa": {}, "data": {"train": "mine/train-*.tfrecord"}},
                        "broken.yaml")
    result = invoke("verify", broken)
    assert result.returncode == 2, result.stderr
    assert f"data.train points into {tmp_path}/mine: `runner verify {tmp_path}/mine`" in result.stderr


def test_verify_given_the_manifest_a_shard_or_another_file_names_the_folder(tiny_mnist: Path, tmp_path: Path):
    for given in (tiny_mnist / "manifest.json", tiny_mnist / "test-00000-of-00001.tfrecord"):
        result = invoke("verify", given)
        assert result.returncode == 2, result.stderr
        assert f"{given} is a file, not a dataset folder" in result.stderr
        assert f"`runner verify {tiny_mnist}`" in result.stderr
    other = tmp_path / "notes.txt"
    other.write_text("not a dataset\n")
    result = invoke("verify", other)
    assert result.returncode == 2, result.stderr
    assert (f"{other} is a file, not a dataset folder: `runner verify` takes the folder that holds manifest.json and "
            "the shards it lists (written by `runner prepare` or `runner manifest`)") in result.stderr
    assert "storage fault" not in result.stderr


def test_verify_given_a_bucket_object_names_the_folder(gcs):
    bucket = gcs.bucket()
    gcs.write(bucket, "jobs/job.yaml", b"name: in_a_bucket\n")
    gcs.write(bucket, "mnist/manifest.json", b"{}")
    env = cli_env(**gcs.env)
    spec = run_cli("verify", f"gs://{bucket}/jobs/job.yaml", env=env, timeout=120)
    assert spec.returncode == 2, spec.stderr[-2000:]
    assert f"gs://{bucket}/jobs/job.yaml is a file, not a dataset folder" in spec.stderr
    manifest = run_cli("verify", f"gs://{bucket}/mnist/manifest.json", env=env, timeout=120)
    assert manifest.returncode == 2, manifest.stderr[-2000:]
    assert f"this is that manifest: `runner verify gs://{bucket}/mnist`" in manifest.stderr


# --- a manifest whose schema the records do not fit -------------------------------------------------------


def _edited_copy(tiny_mnist: Path, tmp_path: Path, **image: object) -> Path:
    folder = Path(shutil.copytree(tiny_mnist, tmp_path / "mnist"))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["features"]["image"].update(image)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder


@pytest.mark.parametrize(
    ("image", "why"),
    [({"dtype": "float32"}, "feature 'image' is stored as bytes_list, but {dtype: float32, shape: [28, 28, 1], "
                            "var_len: false, decode: none} is read from a float_list"),
     ({"shape": [28, 28, 3]}, "feature 'image' holds 784 bytes, but shape [28, 28, 3] needs 2352 ({dtype: uint8, "
                             "shape: [28, 28, 3], var_len: false, decode: raw})")],
    ids=["dtype", "shape"],
)
def test_a_manifest_schema_the_records_do_not_fit_names_the_manifest_and_the_shard(
    small_mnist: Path, mnist_job, tmp_path: Path, image: dict, why: str
):
    folder = _edited_copy(small_mnist, tmp_path, **image)
    spec = mnist_job("misfit", data={"train": f"{folder}/train-*.tfrecord", "eval": None, "in_memory": False},
                     train={"epochs": 1, "steps_per_epoch": 2})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    error = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert (f"error: data.train: {folder}/train-00000-of-00004.tfrecord: its first record does not fit the schema "
            f"of {folder}/manifest.json: {why}. The shards match their size and sha256 there, so the manifest's "
            f"schema does not describe these records: write it again, as it was made: "
            f"`runner prepare mnist --out {folder}`") == error, error
    for internal in TF_INTERNALS:
        assert internal not in error, internal
    assert last_json(result.stdout)["status"] == "failed"


@pytest.mark.slow
def test_the_command_it_gives_writes_a_manifest_that_trains(small_mnist: Path, mnist_job, tmp_path: Path):
    folder = _edited_copy(small_mnist, tmp_path, dtype="float32")
    spec = mnist_job("misfit", data={"train": f"{folder}/train-*.tfrecord", "eval": None, "in_memory": False},
                     train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True})
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    written = run_cli(*_command(refused.stderr, "runner prepare"), timeout=300)
    assert written.returncode == 0, written.stderr[-3000:]
    trained = run_cli("run", spec)
    assert trained.returncode == 0, trained.stderr[-3000:]


def test_held_in_memory_the_load_error_names_the_shard_and_the_manifest(small_mnist: Path, mnist_job, tmp_path: Path):
    folder = _edited_copy(small_mnist, tmp_path, dtype="float32")
    spec = mnist_job("misfit", data={"train": f"{folder}/train-*.tfrecord", "eval": None, "in_memory": True},
                     train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"{folder}/train-00000-of-00004.tfrecord: its first record does not fit the schema of "
            f"{folder}/manifest.json: feature 'image' is stored as bytes_list") in result.stderr, result.stderr[-3000:]
    assert f"`runner prepare mnist --out {folder}`" in result.stderr


def test_input_error_leaves_tensorflow_internals_out(tiny_mnist: Path, tmp_path: Path):
    """The error an eager read of the batches raises (as runner/data/in_memory.py's load meets it), made into a
    DataError by input_error: the manifest and the shard, not `{{function_node __wrapped__IteratorGetNext...}}`."""
    import tensorflow as tf

    from runner import DataError
    from runner.data import faults, pipeline

    folder = _edited_copy(tiny_mnist, tmp_path, dtype="float32")
    pattern = f"{folder}/train-*.tfrecord"
    dataset = pipeline.make_dataset(pipeline.find_shards(pattern), 128, ("image",), "label", training=False)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        next(iter(dataset))
    assert "function_node" in raised.value.message  # what the user saw before
    error = faults.input_error(raised.value, pattern, "data.train")
    assert isinstance(error, DataError) and error.exit_code == 2
    assert f"{folder}/train-00000-of-00004.tfrecord: its first record does not fit the schema of" in str(error)
    for internal in TF_INTERNALS:
        assert internal not in str(error), internal


def test_tf_reason_keeps_what_went_wrong_only():
    from runner.data.faults import tf_reason

    message = (
        "{{function_node __wrapped__IteratorGetNext_output_types_2_device_/job:localhost/replica:0/task:0/"
        "device:CPU:0}} Error in user-defined function passed to MapDataset:5 transformation with iterator: "
        "Iterator::Root::ParallelInterleaveV4[0]::Map: Name: <unknown>, Key: image, Index: 0.  Data types don't "
        "match. Data type: string but expected type: float\n\t [[{{node ParseExample/ParseExampleV2}}]] "
        "[Op:IteratorGetNext] name: "
    )
    expected = "Key: image, Index: 0. Data types don't match. Data type: string but expected type: float"
    assert tf_reason(message) == expected


def test_a_manifest_written_by_runner_manifest_is_written_again_the_same_way():
    from runner.data.faults import Misfit

    mine = Misfit("/d/train-0.tfrecord", "/d/manifest.json", ("feature 'x' ...",),
                  {"dataset": "mine", "source": "TFRecords described by data.features of job.yaml (runner manifest)"})
    assert mine.fix() == ("write it again from data.features declared as the records hold them: "
                          "`runner manifest SPEC --force` (SPEC: this job's spec file)")
    built_in = Misfit("/d/train-0.tfrecord", "/d/manifest.json", (), {"dataset": "cifar10", "source": "x"})
    assert built_in.fix() == "write it again, as it was made: `runner prepare cifar10 --out /d`"
