"""Every error that tells the user what to do is followed here as written: the suggestion is read out of the
message (a key to rename, a `--set`, a command, a file to move), applied, and the command then works. A message
whose advice is wrong or vague fails its test. Every closing line of `runner run` is held to what its run folder
holds: none claims a checkpoint that is not there."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke


@pytest.fixture
def data_copy(tiny_mnist: Path, tmp_path: Path) -> Path:
    """A copy of the tiny MNIST shards and their manifest, for a test to damage."""
    return Path(shutil.copytree(tiny_mnist, tmp_path / "mnist"))


def _job(folder: Path, shards: Path, name: str = "hinted", **sections) -> Path:
    doc = {
        "name": name,
        "accelerator": {"kind": "cpu"},
        "data": {"train": f"{shards}/train-*.tfrecord", "eval": f"{shards}/test-*.tfrecord", "global_batch_size": 128},
        "train": {"epochs": 1, "steps_per_epoch": 2},
        "output": {"dir": str(folder / "runs"), "tensorboard": False},
    }
    for section, values in sections.items():
        doc.setdefault(section, {}).update(values)
    return write_spec(folder, doc, f"{name}.yaml")


def _suggested(pattern: str, text: str) -> re.Match:
    found = re.search(pattern, text)
    assert found, f"no suggestion matching {pattern!r} in:\n{text[-3000:]}"
    return found


def _command(text: str, starts: str) -> list[str]:
    """The first backticked command in `text` that begins with `starts`, as argv without `runner`."""
    words = shlex.split(_suggested(rf"`({re.escape(starts)}[^`]*)`", text).group(1))
    assert words[0] == "runner" and not any(w.isupper() for w in words), f"a placeholder left to fill: {words}"
    return words[1:]


# --- `runner validate`: fixes that need no training ----------------------------------------------------------


def test_a_misspelt_key_is_renamed_as_the_did_you_mean_says(data_copy: Path, tmp_path: Path) -> None:
    spec = _job(tmp_path, data_copy)
    spec.write_text(spec.read_text().replace("  epochs: 1\n", "  epoch: 1\n"))
    refused = invoke("validate", spec)
    assert refused.returncode == 2
    wrong, right = _suggested(r"train\.epoch: unknown key '(\w+)'; did you mean '(\w+)'\?", refused.stderr).groups()
    spec.write_text(spec.read_text().replace(f"  {wrong}:", f"  {right}:"))
    assert invoke("validate", spec).returncode == 0


def test_a_batch_the_cpu_devices_cannot_share_takes_the_size_offered(data_copy: Path, tmp_path: Path) -> None:
    spec = _job(tmp_path, data_copy, accelerator={"cpu_devices": 3})
    refused = invoke("validate", spec)
    assert refused.returncode == 2
    lower, upper = _suggested(r"data\.global_batch_size \(128\) must be divisible by accelerator\.cpu_devices "
                              r"\(3\), the replicas on the CPU: set it to (\d+) or (\d+)", refused.stderr).groups()
    for size in (lower, upper):
        followed = invoke("validate", spec, "--set", f"data.global_batch_size={size}")
        assert followed.returncode == 0, followed.stderr


def test_a_batch_larger_than_the_data_takes_the_size_offered(data_copy: Path, tmp_path: Path) -> None:
    spec = _job(tmp_path, data_copy, data={"global_batch_size": 4096}, train={"steps_per_epoch": None})
    refused = invoke("validate", spec)
    assert refused.returncode == 2
    most = _suggested(r"set data\.global_batch_size to at most ([\d,]+)", refused.stderr).group(1).replace(",", "")
    followed = invoke("validate", spec, "--set", f"data.global_batch_size={most}")
    assert followed.returncode == 0, followed.stderr


def test_a_set_value_yaml_reads_otherwise_is_written_as_offered(data_copy: Path, tmp_path: Path) -> None:
    spec = _job(tmp_path, data_copy)
    folder = f"{tmp_path}/runs #2"  # YAML would read `#2` as a comment
    refused = invoke("validate", spec, "--set", f"output.dir={folder}")
    assert refused.returncode == 2
    offered = shlex.split(_suggested(r"(?m)to mean the text, use (--set .+)$", refused.stderr).group(1))
    followed = invoke("validate", spec, *offered, "--show")
    assert followed.returncode == 0, followed.stderr
    assert json.loads(followed.stdout)["output"]["dir"] == folder


def _unlisted_shard(data: Path) -> None:
    shutil.copy(data / "train-00000-of-00004.tfrecord", data / "train-extra.tfrecord")


def _unreadable_manifest(data: Path) -> None:
    (data / "manifest.json").write_text('{"splits": ')


def _no_manifest(data: Path) -> None:
    (data / "manifest.json").unlink()


@pytest.mark.slow
@pytest.mark.parametrize("damage", [_no_manifest, _unreadable_manifest, _unlisted_shard])
def test_a_manifest_that_does_not_fit_is_written_again_by_the_command_named(damage, data_copy, tmp_path) -> None:
    """The manifest fault's command, run as written: the spec declares its records (data.features) as the
    message says a spec of one's own TFRecords must."""
    features = json.loads((data_copy / "manifest.json").read_text())["features"]
    spec = _job(tmp_path, data_copy, data={"features": features})
    damage(data_copy)
    refused = invoke("validate", spec)
    assert refused.returncode == 2 and "data.train: " in refused.stderr
    command = _command(refused.stderr, "runner manifest")
    assert Path(command[1]) == spec
    written = run_cli(*command)
    if damage is _no_manifest:  # the same command once more: the manifest is there now, and kept unless forced
        assert written.returncode == 0, written.stderr[-3000:]
        again = run_cli(*command)
        assert again.returncode == 2 and "pass --force" in again.stderr, again.stderr[-3000:]
        written = run_cli(*command, _suggested(r"pass (--force)\b", again.stderr).group(1))
    assert written.returncode == 0, written.stderr[-3000:]
    followed = invoke("validate", spec)
    assert followed.returncode == 0, followed.stderr


def test_a_run_name_not_found_points_at_the_listing_that_shows_the_names(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / "kept").mkdir(parents=True)
    (runs / "kept" / "summary.json").write_text(json.dumps({"status": "succeeded", "job": "kept"}))
    refused = invoke("runs", "rm", "kpet", runs, "--yes")
    assert refused.returncode == 2
    listed = invoke(*_command(refused.stderr, "runner runs"))
    assert listed.returncode == 0 and "kept" in listed.stdout, listed.stdout + listed.stderr


# --- `runner run`: each stop followed to a run that works, its closing line held to the run folder --------------


def _closing(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if re.match(r"(failed|refused|succeeded|already complete)\b", line)]
    assert lines, f"no closing line in:\n{stderr[-3000:]}"
    return lines[-1]


def _holds_checkpoint(run_dir: Path) -> bool:
    return (run_dir / "checkpoints" / "checkpoint").is_file() and any((run_dir / "checkpoints").glob("*.index"))


def _agrees(result, run_dir: Path) -> None:
    """The closing line claims checkpoints only when the run folder holds one, and names no folder that is gone."""
    closing = _closing(result.stderr)
    if "checkpoints kept in" in closing:
        assert _holds_checkpoint(run_dir), closing
    if "no checkpoint was saved" in closing:
        assert not _holds_checkpoint(run_dir), closing
    if f"run folder: {run_dir}" in closing:
        assert run_dir.is_dir(), closing
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert not any(re.search(r"checkpoints? (are|is) kept|\bdelete\b", line) for line in error), error


def _doctor_says_the_same(result, code: int, check: str, *args) -> None:
    """`runner doctor` on the same spec: the same fault, in the run's words, under the run's exit code."""
    assert result.returncode == code, result.stderr[-3000:]
    doctor = run_cli("doctor", "--json", *args)
    report = last_json(doctor.stdout)
    failed = {c["name"]: c for c in report["checks"] if c["status"] == "fail"}
    assert doctor.returncode == report["exit_code"] == code and list(failed) == [check], doctor.stdout[-3000:]
    assert f"error: {failed[check]['evidence']}" in result.stderr, (failed[check], result.stderr[-2000:])


@pytest.mark.slow
def test_each_stop_of_a_run_is_followed_to_a_run_that_works(data_copy: Path, tmp_path: Path) -> None:
    """A spec error, a data error, a storage fault before any step and one after checkpoints were saved, a shrunk
    job and a prediction before training: each message's suggestion applied, and the closing lines true."""
    spec = _job(tmp_path, data_copy, model={"name": "mnist_cnn", "params": {"classes": 5}},
                data={"train": f"{data_copy}/train-00000-of-00004.tfrecord", "eval": None},
                train={"epochs": 2, "allow_chance": True})
    run_dir = tmp_path / "runs" / "hinted"
    sets: list[str] = []

    untrained = run_cli("predict", spec, "--input", str(data_copy / "test-*.tfrecord"))
    assert untrained.returncode == 2, untrained.stderr[-3000:]
    assert _command(untrained.stderr, "runner run") == ["run"]  # done below, with every fix on the way

    # A pattern naming part of a split (a data fault, found before the run folder is made): the whole split.
    partial = run_cli("run", spec)
    assert partial.returncode == 2 and "manifest.json" in partial.stderr, partial.stderr[-3000:]
    whole = _suggested(r"name all of 'train' \(e\.g\. (\S+)\)", partial.stderr).group(1)
    sets += ["--set", f"data.train={whole}"]
    _agrees(partial, run_dir)
    _doctor_says_the_same(partial, 2, "data_train", spec)

    # Labels beyond the model's classes (a data fault naming the shard): the classes it says.
    labels = run_cli("run", spec, *sets)
    assert labels.returncode == 2, labels.stderr[-3000:]
    assert re.search(r"error: \S+/train-0000\d-of-00004\.tfrecord: record \d+", labels.stderr), labels.stderr[-3000:]
    classes = _suggested(r"Set (model\.params\.classes) to at least (\d+)", labels.stderr).groups()
    sets += ["--set", "=".join(classes)]
    _agrees(labels, run_dir)

    # output.dir is a file (a storage fault before any step): nothing claimed.
    in_the_way = tmp_path / "outputs"
    in_the_way.write_text("a file")
    blocked = run_cli("run", spec, *sets, "--set", f"output.dir={in_the_way}")
    assert blocked.returncode == 3, blocked.stderr[-3000:]
    assert "checkpoint" not in _closing(blocked.stderr)
    _agrees(blocked, in_the_way / "hinted")
    _doctor_says_the_same(blocked, 3, "storage_write", spec, *sets, "--set", f"output.dir={in_the_way}")

    # A file where the export's folder belongs (a storage fault after the checkpoints): they are kept, and
    # the same command, once the file is moved away, continues from them.
    run_dir.mkdir(parents=True)
    (run_dir / "saved_model").write_text("a file")
    late = run_cli("run", spec, *sets)
    assert late.returncode == 3, late.stderr[-3000:]
    assert "checkpoints kept in" in _closing(late.stderr) and _holds_checkpoint(run_dir)
    _agrees(late, run_dir)
    path = _suggested(r"storage fault: (\S+): Not a directory; .*move that file away, then run the same job again",
                      late.stderr).group(1)
    Path(path).rename(tmp_path / "moved-away")
    resumed = run_cli("run", spec, *sets)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = last_json(resumed.stdout)
    assert summary["resumed_from_step"] == summary["final_step"] == 4
    assert (run_dir / "saved_model").is_dir()
    _agrees(resumed, run_dir)

    # The prediction refused before training now works.
    predicted = run_cli("predict", spec, *sets, "--input", str(data_copy / "test-*.tfrecord"))
    assert predicted.returncode == 0, predicted.stderr[-3000:]

    # An evaluation with no data.eval: the held-out split the message names, as written.
    unnamed = run_cli("evaluate", spec, *sets)
    assert unnamed.returncode == 2, unnamed.stderr[-3000:]
    offered = shlex.split(_suggested(r"`(--set data\.eval=[^`]+)`", unnamed.stderr).group(1))
    evaluated = run_cli("evaluate", spec, *sets, *offered)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert last_json(evaluated.stdout)["examples"] == 512

    # Rows missing the channel axis: given the shape the message asks for.
    rows = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    np.save(tmp_path / "rows.npy", rows)
    misshapen = run_cli("predict", spec, *sets, "--input", str(tmp_path / "rows.npy"))
    assert misshapen.returncode == 2, misshapen.stderr[-3000:]
    shape = _suggested(r"give arrays of shape \(rows, ([\d, ]+)\)", misshapen.stderr).group(1)
    np.save(tmp_path / "rows.npy", rows.reshape(len(rows), *map(int, shape.split(", "))))
    reshaped = run_cli("predict", spec, *sets, "--input", str(tmp_path / "rows.npy"))
    assert reshaped.returncode == 0, reshaped.stderr[-3000:]

    # A job never shrinks: both ways out, as written.
    shrunk = run_cli("run", spec, *sets, "--set", "train.epochs=1")
    assert shrunk.returncode == 2, shrunk.stderr[-3000:]
    seen = _suggested(r"set (train\.epochs) to (\d+) to see it", shrunk.stderr).groups()
    complete = run_cli("run", spec, *sets, "--set", "=".join(seen))
    assert complete.returncode == 0 and _closing(complete.stderr).startswith("already complete"), complete.stderr
    renamed = shlex.split(_suggested(r"choose a new job name \(`(--set [^`]+)`\)", shrunk.stderr).group(1))
    shorter = run_cli("run", spec, *sets, "--set", "train.epochs=1", *renamed)
    assert shorter.returncode == 0, shorter.stderr[-3000:]
    assert last_json(shorter.stdout)["final_step"] == 2 and (tmp_path / "runs" / renamed[1].split("=")[1]).is_dir()


# --- `runner run`: a stop before any step, followed to a run of two steps ---------------------------------------


def _tiny(folder: Path, shards: Path, **sections) -> Path:
    """A job of two steps without evaluation, whose result at chance is expected."""
    sections["data"] = {"eval": None, **sections.get("data", {})}
    sections["train"] = {"allow_chance": True, **sections.get("train", {})}
    return _job(folder, shards, **sections)


@pytest.mark.slow
def test_a_file_where_the_checkpoints_belong_is_moved_away_as_said(data_copy: Path, tmp_path: Path) -> None:
    spec = _tiny(tmp_path, data_copy)
    run_dir = tmp_path / "runs" / "hinted"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").write_text("a file")
    blocked = run_cli("run", spec)
    assert blocked.returncode == 3, blocked.stderr[-3000:]
    path = _suggested(r"(\S+) is a file, not a folder: .*move that file away", blocked.stderr).group(1)
    _agrees(blocked, run_dir)
    Path(path).rename(tmp_path / "moved-away")
    followed = run_cli("run", spec)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert last_json(followed.stdout)["final_step"] == 2 and _holds_checkpoint(run_dir)


@pytest.mark.slow
def test_a_batch_the_replicas_cannot_share_at_run_time_takes_a_size_offered(data_copy: Path, tmp_path: Path) -> None:
    """`runner run` checks the batch against the replicas its strategy made (`runner validate` only knows the spec's
    CPU devices): both sizes offered divide; the run takes the first."""
    spec = _tiny(tmp_path, data_copy, accelerator={"cpu_devices": 2}, data={"global_batch_size": 127})
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    sizes = _suggested(r"data\.global_batch_size \(127\) must be divisible by the number of replicas \(2\): "
                       r"set it to (\d+) or (\d+)", refused.stderr).groups()
    assert all(int(size) % 2 == 0 for size in sizes), sizes
    followed = run_cli("run", spec, "--set", f"data.global_batch_size={sizes[0]}")
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert last_json(followed.stdout)["final_step"] == 2


@pytest.mark.slow
def test_data_in_memory_that_cannot_be_honoured_runs_with_either_setting_offered(data_copy: Path, tmp_path) -> None:
    """More records per batch than data.train holds: a pass of whole batches cannot be cut from memory; streamed,
    batches run across passes."""
    spec = _tiny(tmp_path, data_copy, data={"in_memory": True, "global_batch_size": 4096})
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    key, first, second = _suggested(r"cannot be honoured: .*; set (data\.in_memory): (\w+) or (\w+)",
                                    refused.stderr).groups()
    for setting in (first, second):
        followed = run_cli("run", spec, "--set", f"{key}={setting}", "--set", f"name=in-memory-{setting}")
        assert followed.returncode == 0, followed.stderr[-3000:]
        summary = last_json(followed.stdout)
        assert summary["final_step"] == 2 and summary["train_input"]["mode"] == "streamed", summary["train_input"]


@pytest.mark.slow
def test_tf_use_legacy_keras_is_refused_and_unsetting_it_as_said_trains(data_copy: Path, tmp_path: Path) -> None:
    """tf-keras (Keras 2) is no longer supported: TF_USE_LEGACY_KERAS=1 is refused before TensorFlow loads (exit 2,
    no run folder), never trained under silently; unset as the refusal says, the job trains under Keras 3."""
    spec = _tiny(tmp_path, data_copy)
    legacy = cli_env(TF_USE_LEGACY_KERAS="1")
    refused = run_cli("run", spec, env=legacy)
    assert refused.returncode == 2, refused.stderr[-3000:]
    said = "TF_USE_LEGACY_KERAS=1 asks TensorFlow for tf-keras (Keras 2), which the runner no longer supports"
    assert said in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and not (tmp_path / "runs").exists()
    command, variable = shlex.split(_suggested(r"`(unset \w+)`", refused.stderr).group(1))
    assert (command, variable) == ("unset", "TF_USE_LEGACY_KERAS")
    followed = run_cli("run", spec, env={name: value for name, value in legacy.items() if name != variable})
    assert followed.returncode == 0, followed.stderr[-3000:]
    summary = last_json(followed.stdout)
    assert summary["final_step"] == 2 and summary["accelerator"]["keras"].startswith("keras 3."), summary


@pytest.mark.slow
def test_a_run_folder_tf_keras_wrote_starts_over_with_fresh_as_said(data_copy: Path, tmp_path: Path) -> None:
    """An older runner's folder whose checkpoints tf-keras wrote (its pins say so) cannot be resumed: `--fresh`, as
    the refusal writes it, moves the folder aside and trains under Keras 3."""
    spec = _tiny(tmp_path, data_copy)
    assert run_cli("run", spec).returncode == 0
    pinned = tmp_path / "runs" / "hinted" / "spec.json"
    doc = json.loads(pinned.read_text())
    doc["pinned"]["keras.flavour"] = "tf-keras"
    pinned.write_text(json.dumps(doc))
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "tf-keras is no longer supported" in refused.stderr, refused.stderr[-3000:]
    fresh = _command(refused.stderr, "runner run --fresh")
    followed = run_cli(*fresh[:1], spec, *fresh[1:])
    assert followed.returncode == 0, followed.stderr[-3000:]
    summary = last_json(followed.stdout)
    assert summary["final_step"] == 2 and summary["accelerator"]["keras"].startswith("keras 3."), summary
    assert json.loads(pinned.read_text())["pinned"]["keras.flavour"] == "keras3"
    assert [p.name for p in (tmp_path / "runs").iterdir() if p.name != "hinted"], "the old folder is kept aside"


# --- a bucket that does not exist: created by the gcloud command named, against the emulator -------------------


def _gcloud(text: str, gcs, tmp_path: Path) -> subprocess.CompletedProcess:
    """The first backticked `gcloud ...` command in `text`, run as written by the real gcloud, its Cloud Storage
    calls sent to the emulator; the project is the one a configured gcloud carries (core/project)."""
    words = shlex.split(_suggested(r"`(gcloud [^`]*)`", text).group(1))
    assert shutil.which(words[0]), "gcloud is not installed on this machine"
    env = cli_env(
        CLOUDSDK_API_ENDPOINT_OVERRIDES_STORAGE=f"{gcs.emulator}/", CLOUDSDK_AUTH_ACCESS_TOKEN="emulator-token",
        CLOUDSDK_CORE_CHECK_GCE_METADATA="false", CLOUDSDK_CORE_DISABLE_PROMPTS="1",
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), CLOUDSDK_CORE_PROJECT="my-project",
    )
    return subprocess.run(words, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_a_bucket_that_does_not_exist_is_created_by_the_command_named(gcs, data_copy: Path, tmp_path: Path) -> None:
    """`runner prepare --out gs://...` and a run whose output.dir is in a missing bucket: each names the gcloud
    command that creates it; run as written, the same command then works."""
    env = cli_env(**gcs.env)
    data = f"gs://hint-data-{uuid.uuid4().hex[:8]}/mnist"
    refused = run_cli("prepare", "mnist", "--out", data, "--limit", "256", env=env)
    assert refused.returncode == 3, refused.stderr[-3000:]
    created = _gcloud(refused.stderr, gcs, tmp_path)
    assert created.returncode == 0, created.stderr[-3000:]
    prepared = run_cli("prepare", "mnist", "--out", data, "--limit", "256", env=env)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "mnist/manifest.json" in gcs.objects(data.split("/")[2], "mnist/")

    runs = f"gs://hint-runs-{uuid.uuid4().hex[:8]}/runs"
    spec = _tiny(tmp_path, data_copy, output={"dir": runs})
    refused = run_cli("run", spec, env=env)
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "(output.dir) does not exist" in refused.stderr
    created = _gcloud(refused.stderr, gcs, tmp_path)
    assert created.returncode == 0, created.stderr[-3000:]
    followed = run_cli("run", spec, env=env)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "runs/hinted/summary.json" in gcs.objects(runs.split("/")[2], "runs/hinted/")


# --- `runner prepare`: a usage error followed as written ---------------------------------------------------------


def test_prepare_usage_errors_are_followed_as_written(tmp_path: Path) -> None:
    """A --split that does not add up, a --label that names no column, images of several sizes without --size:
    each refusal's example, passed as written, prepares the data."""
    table = tmp_path / "heart.csv"
    rows = "\n".join(f"{age},{age * 5},{'sick' if age % 2 else 'well'}" for age in range(30, 70))
    table.write_text(f"age,chol,target\n{rows}\n")

    uneven = run_cli("prepare", "csv", table, "--label", "target", "--split", "train=0.8,test=0.1",
                     "--out", tmp_path / "split")
    assert uneven.returncode == 2, uneven.stderr[-3000:]
    offered = _suggested(r"they must add up to 1, e\.g\. --split (\S+)", uneven.stderr).group(1)
    split = run_cli("prepare", "csv", table, "--label", "target", "--split", offered, "--out", tmp_path / "split")
    assert split.returncode == 0, split.stderr[-3000:]
    assert set(json.loads((tmp_path / "split" / "manifest.json").read_text())["splits"]) == {"train", "test"}

    misnamed = run_cli("prepare", "csv", table, "--label", "Target", "--out", tmp_path / "label")
    assert misnamed.returncode == 2, misnamed.stderr[-3000:]
    label = _suggested(r"no column 'Target' for --label \(did you mean '(\w+)'\?\)", misnamed.stderr).group(1)
    named = run_cli("prepare", "csv", table, "--label", label, "--out", tmp_path / "label")
    assert named.returncode == 0, named.stderr[-3000:]

    from PIL import Image

    for name, size in (("horizontal", 12), ("vertical", 16)):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(4):
            Image.new("L", (size, size), 40 * i).save(tmp_path / "images" / name / f"{i}.png")
    sizes = run_cli("prepare", "images", tmp_path / "images", "--color", "grayscale", "--out", tmp_path / "pixels")
    assert sizes.returncode == 2, sizes.stderr[-3000:]
    size = _suggested(r"pass --size HEIGHTxWIDTH .*\(e\.g\. --size (\d+x\d+)", sizes.stderr).group(1)
    resized = run_cli("prepare", "images", tmp_path / "images", "--color", "grayscale", "--size", size,
                      "--out", tmp_path / "pixels")
    assert resized.returncode == 0, resized.stderr[-3000:]
    features = json.loads((tmp_path / "pixels" / "manifest.json").read_text())["features"]
    assert features["image"]["shape"][:2] == [int(n) for n in size.split("x")]


# --- a manifest that no longer describes its shards, found by the run: written again by the command named ------


def _spec_command(text: str, starts: str, spec: Path) -> list[str]:
    """As _command, for a command the message writes with SPEC, saying SPEC is this job's spec file."""
    _suggested(r"SPEC:? (this|the) job's spec file", text)
    words = shlex.split(_suggested(rf"`({re.escape(starts)}[^`]*)`", text).group(1))
    return [str(spec) if word == "SPEC" else word for word in words[1:]]


def _miscounted(manifest: dict) -> tuple[dict, str]:
    manifest["splits"]["train"]["shards"][0]["records"] += 1  # and the split's total, which the run checks first
    manifest["splits"]["train"]["records"] += 1
    return {"data": {"in_memory": True}}, r"hold 2048 records, their manifest lists 2049 \(in \S+/manifest\.json: "


def _uncounted(manifest: dict) -> tuple[dict, str]:
    for entry in manifest["splits"]["train"]["shards"]:
        del entry["label_counts"]
    return {"train": {"class_weight": "balanced"}}, r"balanced needs the records per class"


@pytest.mark.slow
@pytest.mark.parametrize("damage", [_miscounted, _uncounted])
def test_a_manifest_the_run_finds_wanting_is_written_again_as_said(damage, data_copy: Path, tmp_path: Path) -> None:
    """Records counted otherwise than the shards hold (seen when data.train is loaded into memory), or no label
    counts for `train.class_weight: balanced`: the manifest command the error names, run as written, mends it."""
    path = data_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    sections, said = damage(manifest)
    path.write_text(json.dumps(manifest))
    sections["data"] = {"features": manifest["features"], **sections.get("data", {})}
    spec = _tiny(tmp_path, data_copy, **sections)
    refused = run_cli("run", spec)
    assert refused.returncode == 2 and re.search(said, refused.stderr), refused.stderr[-3000:]
    written = run_cli(*_spec_command(refused.stderr, "runner manifest", spec))
    assert written.returncode == 0, written.stderr[-3000:]
    followed = run_cli("run", spec)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert last_json(followed.stdout)["final_step"] == 2


# --- a benchmark whose numbers overflow ------------------------------------------------------------------------


def test_a_matmul_chain_that_overflows_takes_either_way_offered(tmp_path: Path) -> None:
    """A 1 x 1 "matrix" B of 1.27 overflows float16 after some tens of products: both ways out the message names
    (the chain it gives, float32) measure a finite result."""
    spec = write_spec(tmp_path, {
        "name": "overflow", "kind": "matmul_bench", "accelerator": {"kind": "cpu"},
        "matmul": {"size": 1, "chain": 100, "iterations": 1, "dtype": "float16"},
        "output": {"dir": str(tmp_path / "runs")},
    })
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    key, chain = _suggested(r"set (matmul\.chain) to (\d+) or less", refused.stderr).groups()
    dtype = _suggested(r"use (matmul\.dtype) (\w+)", refused.stderr).groups()
    for setting in (f"{key}={chain}", "=".join(dtype)):
        followed = run_cli("run", spec, "--set", setting)
        assert followed.returncode == 0, followed.stderr[-3000:]
        assert math.isfinite(last_json(followed.stdout)["matmul"]["checksum"])


# --- the verdict on a loss that never fell ----------------------------------------------------------------------


def _epochs(*losses: float) -> list:
    from runner.rundir.timing import EpochRecord

    return [EpochRecord(i, 1.0, 4, 100.0, loss, {}) for i, loss in enumerate(losses, 1)]


def test_the_learning_rate_is_named_only_for_a_loss_that_rose() -> None:
    """A rate too high overshoots and the loss rises; a loss that stays flat (a constant model, labels that do not
    fit the loss) is not helped by a lower rate, and the advice says what to check instead."""
    from runner.train.verdict import warnings_of

    [rose] = warnings_of(_epochs(2.30, 2.41, 3.9), {}, None)
    [flat] = warnings_of(_epochs(2.3026, 2.3026, 2.3026), {}, None)
    assert "never fell below its first epoch's" in rose and "never fell below its first epoch's" in flat
    assert "lower train.learning_rate" in rose
    assert "lower train.learning_rate" not in flat and "depends on weights that train" in flat
    # A rate far too small (1e-12) leaves the loss where it was, give or take the noise of other batches: that
    # small rise is not the overshoot a lower rate would cure.
    [noise] = warnings_of(_epochs(2.3050, 2.3120, 2.3090), {}, None)
    assert "lower train.learning_rate" not in noise and "not too small to move it" in noise


def test_an_accuracy_below_chance_is_no_success_either() -> None:
    """A loss option out of its range (label_smoothing 50) trained to accuracy 0.0097 for 10 classes, far below
    chance, and once counted as a success: it is learned nothing too."""
    from runner.train.verdict import warnings_of

    [below] = warnings_of([], {"accuracy": 0.0097}, 10)
    assert "accuracy 0.0097 is far below chance for 10 classes" in below
    assert warnings_of([], {"accuracy": 0.06}, 10) == [], "a few steps' noise under chance is not judged"
    assert warnings_of([], {"accuracy": 0.5}, 10) == []


# --- a metric for class ids under a one-hot loss ----------------------------------------------------------------


@pytest.mark.slow
def test_a_metric_setting_its_one_hot_counterpart_lacks_is_removed_as_said(data_copy: Path, tmp_path: Path) -> None:
    """train.loss CategoricalCrossentropy one-hot encodes the class ids, so a Sparse metric becomes its one-hot
    counterpart: a setting that one takes no is named, and removed from the spec file the run works."""
    metric = {"class_name": "SparseTopKCategoricalAccuracy", "config": {"k": 3, "from_sorted_ids": False}}
    spec = _tiny(tmp_path, data_copy, train={"loss": {"class_name": "CategoricalCrossentropy", "config": {}},
                                             "metrics": [metric]})
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    index, setting = _suggested(r"train\.metrics\[(\d+)\]: SparseTopKCategoricalAccuracy .* takes no (\w+): remove it",
                                refused.stderr).groups()
    doc = yaml.safe_load(spec.read_text())
    del doc["train"]["metrics"][int(index)]["config"][setting]
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    followed = run_cli("run", spec)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "sparse_top_k_categorical_accuracy" in last_json(followed.stdout)["epochs"][0]["metrics"]


@pytest.mark.slow
def test_a_record_that_cannot_be_loaded_is_named_by_the_command_said(data_copy: Path, tmp_path: Path) -> None:
    """One image 10 bytes short in a shard swapped in after the manifest (data.verify off lets it reach the load):
    the manifest command the error names finds that record, in that shard, as the error promises."""
    import tensorflow as tf

    shard = data_copy / "train-00003-of-00004.tfrecord"
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(shard))]
    short = tf.train.Example.FromString(records[100])
    short.features.feature["image"].bytes_list.value[0] = short.features.feature["image"].bytes_list.value[0][:-10]
    records[100] = short.SerializeToString()
    with tf.io.TFRecordWriter(str(shard)) as writer:
        for record in records:
            writer.write(record)
    features = json.loads((data_copy / "manifest.json").read_text())["features"]
    spec = _tiny(tmp_path, data_copy, data={"features": features, "in_memory": True, "verify": "off"})
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    _suggested(r"a record could not be decoded while loading it into memory .*names the record", refused.stderr)
    named = run_cli(*_spec_command(refused.stderr, "runner manifest", spec))
    assert named.returncode == 2, named.stderr[-3000:]
    where = rf"{re.escape(str(shard))}: record 100\b.*\n.*feature 'image' holds 774 bytes"
    assert re.search(where, named.stderr), named.stderr[-3000:]
