"""The run folder's rules (runner/rundir/outputs.py, docs/resume.md), on real runs: what is pinned and when, storage
faults (a read-only folder, a full disk, a file where checkpoints/ belongs) ending in exit 3 naming the path,
leftovers of a save cut short removed by the next attempt, and train.epochs never shrinking a job.

Every refused or failing run is checked to leave the earlier good run's checkpoints, model.keras and
summary byte for byte. The tests run as root, which ignores permission bits: a read-only folder is a
read-only bind mount and a full disk a small tmpfs (both need CAP_SYS_ADMIN; without it they are skipped
and say why).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.runs import finish, indexed_step, local_index, start_run, wait_for

pytestmark = pytest.mark.slow


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run folder, byte for byte."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


# The job most tests start from: 2 epochs of 16 steps (2,048 records in batches of 128: steps_per_epoch is
# left to the data, so that a batch larger than the data is refused), finished (checkpoints 16 and 32,
# model.keras, summary).
DONE, DONE_STEP = "done", 32


def done_spec(folder: Path, tiny_mnist: Path, output_dir: Path | str) -> Path:
    """The finished job's spec, written into `folder`, its run folder under `output_dir`."""
    doc = {
        "name": DONE,
        "accelerator": {"kind": "cpu"},
        "data": {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": None, "global_batch_size": 128,
                 "shuffle_buffer": 512},
        "train": {"epochs": 2},
        "output": {"dir": str(output_dir), "tensorboard": False},
    }
    return write_spec(folder, doc, f"{DONE}.yaml")


@dataclass(frozen=True)
class Finished:
    run_dir: Path
    files: dict[str, bytes]
    failed_starts: dict[str, subprocess.CompletedProcess]  # the starts that failed before it, under its name
    pinned_after_failures: bool  # whether spec.json or checkpoints/ existed after those starts


@pytest.fixture(scope="module")
def finished(tiny_mnist: Path, tmp_path_factory) -> Finished:
    """The finished job, trained once for this module: the tests copy its run folder and never write to it.
    Before it trained, three starts under its name failed (a typo in data.train, a bad model name, a batch
    too large): the first test reads what they did."""
    folder = tmp_path_factory.mktemp("finished")
    spec = done_spec(folder, tiny_mnist, folder / "runs")
    run_dir = folder / "runs" / DONE
    failed = {
        "typo": run_cli("run", spec, "--set", f"data.train={tiny_mnist}/trian-*.tfrecord"),
        "model": run_cli("run", spec, "--set", "model.name=mnist_cnnn"),
        "batch": run_cli("run", spec, "--set", "data.global_batch_size=4096"),
    }
    pinned = (run_dir / "spec.json").exists() or (run_dir / "checkpoints").exists()
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_json(result.stdout)["status"] == "succeeded"
    files = snapshot(run_dir)
    assert {"model.keras", "summary.json", "checkpoints/checkpoint", "attempts/001.json"} <= set(files)
    assert {f"checkpoints/ckpt-{step}.index" for step in (16, DONE_STEP)} <= set(files)
    return Finished(run_dir, files, failed, pinned)


def copy_of(finished: Finished, tiny_mnist: Path, tmp_path: Path, output_dir: Path | None = None) -> tuple[Path, Path]:
    """(spec, run folder): a copy of the finished job's run folder under `output_dir` (tmp_path/runs)."""
    output_dir = output_dir or tmp_path / "runs"
    run_dir = output_dir / DONE
    shutil.copytree(finished.run_dir, run_dir)
    assert snapshot(run_dir) == finished.files
    return done_spec(tmp_path, tiny_mnist, output_dir), run_dir


@contextlib.contextmanager
def mounted(target: Path, *options: str) -> Iterator[None]:
    """`mount OPTIONS TARGET`, unmounted afterwards; skips the test where this machine cannot mount."""
    result = subprocess.run(["mount", *options, str(target)], check=False, capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount here (`mount {' '.join(options)}`: {result.stderr.strip()}); needs CAP_SYS_ADMIN")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    with mounted(folder, "--bind", str(folder)):
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        probe = folder / "probe"
        with pytest.raises(OSError):  # root too: the mount, not the permission bits, refuses
            probe.write_text("x")
        yield


def assert_no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]


# --- what is pinned, and when --------------------------------------------------------------------


@pytest.mark.xdist_group("run_folder_finished")  # its tests share a worker, so the module's job trains once
def test_a_start_that_failed_does_not_lock_the_job_name(finished: Finished, tiny_mnist: Path) -> None:
    typo, model, batch = (finished.failed_starts[k] for k in ("typo", "model", "batch"))
    assert typo.returncode == 2 and "no files match" in typo.stderr, typo.stderr[-3000:]
    assert model.returncode == 2 and "mnist_cnnn" in model.stderr, model.stderr[-3000:]
    assert batch.returncode == 2 and "no full batch" in batch.stderr, batch.stderr[-3000:]
    assert not finished.pinned_after_failures, "nothing is pinned before a checkpoint exists"

    # The same name, fixed, then trained: the fixture's run.
    assert json.loads(finished.files["summary.json"])["status"] == "succeeded"
    pinned = json.loads(finished.files["spec.json"])["pinned"]
    assert pinned["data.global_batch_size"] == 128 and pinned["model.name"] == "mnist_cnn"
    assert len(pinned["data.fingerprint"]) == 64


def test_the_checkpoints_pin_what_they_mean_and_nothing_else(
    finished: Finished, tiny_mnist: Path, tmp_path: Path
) -> None:
    spec, run_dir = copy_of(finished, tiny_mnist, tmp_path)
    before = finished.files
    # Data copied elsewhere, the tf.data tuner, the shuffle buffer, the checkpoint cadence and the epochs may change.
    copy = shutil.copytree(tiny_mnist, tmp_path / "elsewhere")
    moved = run_cli(
        "run", spec, "--set", "train.epochs=3", "--set", f"data.train={copy}/train-*.tfrecord",
        "--set", "data.autotune=true", "--set", "data.shuffle_buffer=64", "--set", "checkpoint.every_steps=8",
    )
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert last_json(moved.stdout)["resumed_from_step"] == DONE_STEP
    after = snapshot(run_dir)

    # Another optimizer class has other slots in the checkpoints: refused, with what to do instead. (A new
    # learning rate is not pinned: it is applied on resume, tests/test_model_loss.py.)
    optimizer = run_cli("run", spec, "--set", "train.epochs=4", "--set", "train.optimizer=sgd")
    assert optimizer.returncode == 2, optimizer.stderr[-3000:]
    assert "train.optimizer_class: 'Adam' -> 'SGD'" in optimizer.stderr
    assert f"--set name={DONE}-2" in optimizer.stderr and "--fresh" in optimizer.stderr
    assert not re.search(r"\bdelete\b", optimizer.stderr), "no suggestion deletes a folder holding checkpoints"
    # It refused: the epochs its closing line knows are the earlier attempts', not ones it failed after.
    assert "refused before training, in " in optimizer.stderr and "epochs were trained earlier" in optimizer.stderr
    assert "failed after" not in optimizer.stderr, optimizer.stderr[-3000:]
    assert_no_traceback(optimizer.stderr)
    assert snapshot(run_dir) == after, "a refused run writes nothing, not even its summary"

    # Other records under the same names, sizes and counts, their manifest consistent: other data all the same.
    other = shutil.copytree(tiny_mnist, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    swapped, test = manifest["splits"]["train"]["shards"][3], manifest["splits"]["test"]["shards"][0]
    shutil.copyfile(other / test["file"], other / swapped["file"])
    swapped.update({key: test[key] for key in test if key != "file"})
    (other / "manifest.json").write_text(json.dumps(manifest))
    changed = run_cli("run", spec, "--set", "train.epochs=4", "--set", f"data.train={other}/train-*.tfrecord")
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "data.fingerprint: " in changed.stderr and "choose a new job name" in changed.stderr
    assert "the training data changed" in changed.stderr and f"{other}/manifest.json" in changed.stderr
    assert "another spec" not in changed.stderr and not re.search(r"\bdelete\b", changed.stderr)
    assert snapshot(run_dir) == after
    name = f"checkpoints/ckpt-{DONE_STEP}.index"
    assert before[name] == after[name]


# --- train.epochs never shrinks a job -----------------------------------------------------------------


def test_fewer_epochs_than_a_finished_job_holds_is_refused(
    finished: Finished, tiny_mnist: Path, tmp_path: Path
) -> None:
    spec, run_dir = copy_of(finished, tiny_mnist, tmp_path)
    result = run_cli("run", spec, "--set", "train.epochs=1")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "finished after 2 epochs" in result.stderr and "train.epochs (1) is lower" in result.stderr
    assert f"--set name={DONE}-1ep" in result.stderr
    assert_no_traceback(result.stderr)
    assert snapshot(run_dir) == finished.files


def test_fewer_epochs_than_the_checkpoints_hold_is_refused(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job(
        "partial", data={"eval": None, "global_batch_size": 32}, train={"epochs": 4, "steps_per_epoch": 16},
        output={"tensorboard": False},
    )
    run_dir = tmp_path / "runs" / "partial"
    process = start_run(spec)
    wait_for(lambda: (s := indexed_step(local_index(run_dir))) is not None and s >= 32 or None, process)
    process.send_signal(signal.SIGTERM)
    code, _, err = finish(process)
    assert code == 75, err[-3000:]
    before = snapshot(run_dir)
    step = indexed_step(local_index(run_dir))

    result = run_cli("run", spec, "--set", "train.epochs=1")
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"already holds {step / 16:g} epochs (ckpt-{step}: step {step}, 16 steps per epoch)" in result.stderr
    assert "train.epochs (1) is lower" in result.stderr
    assert snapshot(run_dir) == before


# --- storage faults: exit 3, naming the path ------------------------------------------------------------


@pytest.mark.xdist_group("run_folder_finished")
def test_a_read_only_run_folder_exits_3_naming_it(finished: Finished, tiny_mnist: Path, tmp_path: Path) -> None:
    spec, run_dir = copy_of(finished, tiny_mnist, tmp_path)
    with read_only(run_dir):
        result = run_cli("run", spec, "--set", "train.epochs=3")
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"cannot write the run folder {run_dir}" in result.stderr and "Read-only file system" in result.stderr
    assert_no_traceback(result.stderr)
    assert last_json(result.stdout)["status"] == "failed"
    assert snapshot(run_dir) == finished.files


@pytest.mark.xdist_group("run_folder_finished")
def test_a_file_in_place_of_checkpoints_exits_3_naming_it(finished: Finished, tiny_mnist: Path, tmp_path: Path) -> None:
    spec, run_dir = copy_of(finished, tiny_mnist, tmp_path)
    (run_dir / "checkpoints").rename(tmp_path / "checkpoints-aside")
    (run_dir / "checkpoints").write_bytes(b"not a folder\n")
    before = snapshot(run_dir)
    result = run_cli("run", spec, "--set", "train.epochs=3")
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"{run_dir}/checkpoints is a file, not a folder" in result.stderr
    assert_no_traceback(result.stderr)
    assert snapshot(run_dir) == before


def test_a_full_disk_exits_3_naming_the_path_and_the_next_attempt_removes_the_cut_save(
    finished: Finished, tiny_mnist: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    with mounted(disk, "-t", "tmpfs", "-o", "size=256m", "tmpfs"):
        spec, run_dir = copy_of(finished, tiny_mnist, tmp_path, output_dir=disk)
        before = finished.files
        cut = DONE_STEP + 16  # the save the full disk cuts short: the end of epoch 3
        checkpoint_bytes = sum(len(v) for k, v in before.items() if k.startswith(f"checkpoints/ckpt-{DONE_STEP}."))
        # Fill the disk but for half a checkpoint: room for the lease and spec.json, not for the save.
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(disk / "filler", "wb") as filler:
            left = free - max(checkpoint_bytes // 2, 256 << 10)
            while left > 0:
                left -= filler.write(b"\0" * min(left, 8 << 20))

        full = run_cli("run", spec, "--set", "train.epochs=3")
        assert full.returncode == 3, full.stderr[-3000:]
        assert "No space left on device" in full.stderr and f"{run_dir}/checkpoints/ckpt-{cut}_temp" in full.stderr
        assert_no_traceback(full.stderr)
        after = snapshot(run_dir)
        kept = {k: v for k, v in before.items() if k != "spec.json"}
        assert {k: after.get(k) for k in kept} == kept, "the good run's checkpoints, model and summary are intact"
        assert (run_dir / "checkpoints" / f"ckpt-{cut}_temp").is_dir(), "the save that was cut short left its folder"

        (disk / "filler").unlink()
        again = run_cli("run", spec, "--set", "train.epochs=3")
        assert again.returncode == 0, again.stderr[-3000:]
        assert (f"removed 1 leftover(s) of a checkpoint save that was cut short from {run_dir}/checkpoints: "
                f"ckpt-{cut}_temp") in again.stderr
        assert last_json(again.stdout)["resumed_from_step"] == DONE_STEP
        assert not list((run_dir / "checkpoints").glob("*_temp*"))


# --- leftovers of a save cut short ---------------------------------------------------------------------


def test_leftovers_of_a_save_killed_in_a_bucket_are_removed_and_the_checkpoints_kept(
    gcs_faults, small_mnist, mnist_job
) -> None:
    """kill -9 while a save to the bucket waits on its .index: the part files under ckpt-16_temp/ and the
    merged data file without its index are paid-for objects; the next attempt removes them, logs it, and
    resumes from the complete checkpoint before."""
    bucket = gcs_faults.bucket()
    spec = mnist_job(
        "cut",
        data={"eval": None, "global_batch_size": 32},
        train={"epochs": 2, "steps_per_epoch": 24},
        checkpoint={"every_steps": 8},
        output={"dir": f"gs://{bucket}/runs", "tensorboard": False},
    )
    hang = {"match": r"^POST /upload/.*name=runs/cut/checkpoints/ckpt-16\.index", "action": "stall", "delay_s": 60}
    gcs_faults.faults.set([hang])
    process = start_run(spec, env=cli_env(**gcs_faults.env))
    # This rule's own hits: the rig's "holding" count also counts a stall an earlier test left behind.
    wait_for(lambda: gcs_faults.faults.stats()["hits"][0] or None, process, every=0.2)
    process.send_signal(signal.SIGKILL)
    finish(process)
    prefix = "runs/cut/checkpoints/"
    left = set(gcs_faults.objects(bucket, prefix))
    temp = {n for n in left if n.startswith(prefix + "ckpt-16_temp/")}
    assert temp, f"the killed save left no temp objects: {sorted(left)}"
    assert prefix + "ckpt-16.data-00000-of-00001" in left and prefix + "ckpt-16.index" not in left
    complete = {n: gcs_faults.read(bucket, n) for n in left if n.startswith(prefix + "ckpt-8.")}
    assert len(complete) == 2

    gcs_faults.faults.clear()
    result = run_cli("run", spec, "--set", "checkpoint.keep=10", env=cli_env(**gcs_faults.env))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "removed 2 leftover(s) of a checkpoint save that was cut short from "
        f"gs://{bucket}/{prefix[:-1]}: ckpt-16.data-00000-of-00001, ckpt-16_temp" in result.stderr
    )
    assert "taking over a stale lease (its process" in result.stderr
    assert last_json(result.stdout)["resumed_from_step"] == 8
    now = set(gcs_faults.objects(bucket, prefix))
    assert not temp & now and not any("_temp" in n for n in now)
    assert {n: gcs_faults.read(bucket, n) for n in complete} == complete, "the complete checkpoint is untouched"
