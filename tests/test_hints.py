"""Every error that tells the user what to do is followed here as written: the suggestion is read out of the
message (a key to rename, a `--set`, a command, a file to move), applied, and the command then works. A message
whose advice is wrong or vague fails its test. Every closing line of `runner run` is held to what its run folder
holds: none claims a checkpoint that is not there."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli, write_spec
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
    lines = [line for line in stderr.splitlines() if re.match(r"(failed|succeeded|already complete)\b", line)]
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
    spec = _job(tmp_path, data_copy, model={"name": "mnist_cnn", "params": {"clases": 5}},
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

    # A built-in model's misspelt param (a spec fault found when the model is built): renamed in the file.
    typo = run_cli("run", spec, *sets)
    assert typo.returncode == 2, typo.stderr[-3000:]
    wrong, right = _suggested(r"has no param '(\w+)'; did you mean '(\w+)'\?", typo.stderr).groups()
    _agrees(typo, run_dir)
    assert not run_dir.exists() and "run folder:" not in _closing(typo.stderr), "a refused start leaves no folder"
    spec.write_text(spec.read_text().replace(f"{wrong}:", f"{right}:"))

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
