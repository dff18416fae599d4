"""The newest whole checkpoint of a run folder (runner/rundir/checkpoints.py), read without TensorFlow from the
checkpoints real short runs wrote: TensorFlow's CheckpointManager (a CPU job) and Orbax (a JAX job), in a local
folder and in a bucket (the GCS emulator). A save cut short, as each format leaves one, is never the answer."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cloud import record
from runner.rundir import checkpoints
from tests.conftest import REPO, last_json, run_cli
from tests.support.tpu_vm import dense_model

STEPS = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_mnist) -> dict[str, Path]:
    """Two run folders, each of a real two-epoch run: TensorFlow's checkpoints and Orbax's."""
    import yaml

    folder = tmp_path_factory.mktemp("trained")
    runs = {}
    for store, backend in (("tensorflow", "tensorflow"), ("orbax", "jax")):
        doc = {
            "name": store,
            "accelerator": {"kind": "cpu", "backend": backend},
            "data": {"train": f"{small_mnist}/train-*.tfrecord", "eval": None, "global_batch_size": 32,
                     "shuffle_buffer": 128},
            "model": {"name": dense_model(folder)},
            "train": {"epochs": 2, "steps_per_epoch": STEPS, "allow_chance": True},
            "output": {"dir": str(folder / "runs"), "saved_model": False, "tensorboard": False},
        }
        spec = folder / f"{store}.yaml"
        spec.write_text(yaml.safe_dump(doc, sort_keys=False))
        done = run_cli("run", str(spec), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert last_json(done.stdout)["final_step"] == 2 * STEPS
        runs[store] = folder / "runs" / store
    return runs


def test_the_newest_whole_step_of_either_format_and_never_a_save_cut_short(trained, tmp_path: Path) -> None:
    tensorflow, orbax = (_copy(trained[s], tmp_path / s) for s in ("tensorflow", "orbax"))
    assert (tensorflow / "checkpoints" / "ckpt-8.index").is_file()
    assert (orbax / "checkpoints" / "ckpt_8").is_dir()
    for run, store, name in ((tensorflow, "tensorflow", "ckpt-8"), (orbax, "orbax", "ckpt_8")):
        assert checkpoints.newest(str(run)) == (2 * STEPS, str(run / "checkpoints" / name), store)
        assert record.checkpoint_step(str(run)) == 2 * STEPS  # what status, --watch and restart records show

    # TensorFlow: the data and .index of a save whose index file was not yet rewritten (a kill mid-save).
    for part in (tensorflow / "checkpoints").glob("ckpt-8.*"):
        shutil.copy(part, part.with_name(part.name.replace("ckpt-8", "ckpt-12")))
    (tensorflow / "checkpoints" / "checkpoint.tmp3f2a").write_text('model_checkpoint_path: "ckpt-12"\n')
    # Orbax on a local disk: the temporary folder a save writes into before its rename.
    shutil.copytree(orbax / "checkpoints" / "ckpt_8", orbax / "checkpoints" / "ckpt_12.orbax-checkpoint-tmp-1764")
    assert (checkpoints.latest_step(str(tensorflow)), checkpoints.latest_step(str(orbax))) == (8, 8)
    assert checkpoints.newest(str(tmp_path / "no-such-run")) is None


def test_in_a_bucket_an_orbax_step_counts_once_its_commit_file_is_written(trained, gcs, monkeypatch) -> None:
    for key, value in gcs.env.items():
        monkeypatch.setenv(key, value)
    bucket = gcs.bucket()
    runs = {store: _upload(gcs, trained[store], bucket, f"runs/{store}") for store in ("tensorflow", "orbax")}
    assert checkpoints.newest(runs["tensorflow"]) == (8, f"{runs['tensorflow']}/checkpoints/ckpt-8", "tensorflow")
    assert checkpoints.newest(runs["orbax"]) == (8, f"{runs['orbax']}/checkpoints/ckpt_8", "orbax")
    # On gs:// Orbax writes into ckpt_<step>/ itself and puts commit_success.txt there last.
    for name in gcs.objects(bucket, "runs/orbax/checkpoints/ckpt_8/"):
        if not name.endswith(checkpoints.COMMIT):
            gcs.write(bucket, name.replace("ckpt_8/", "ckpt_12/"), gcs.read(bucket, name))
    assert checkpoints.latest_step(runs["orbax"]) == 8
    gcs.write(bucket, f"runs/orbax/checkpoints/ckpt_12/{checkpoints.COMMIT}", b"Checkpoint commit was successful")
    assert checkpoints.latest_step(runs["orbax"]) == 12


def test_reading_the_step_loads_no_tensorflow() -> None:
    code = ("import sys; from runner.cloud import record; record.checkpoint_step('/nonexistent'); "
            "print('tensorflow' in sys.modules, 'jax' in sys.modules, 'orbax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.stdout.split() == ["False", "False", "False"], done.stderr


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _upload(gcs, folder: Path, bucket: str, prefix: str) -> str:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            gcs.write(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
    return f"gs://{bucket}/{prefix}"
