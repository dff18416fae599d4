"""`runner runs`: the table of run folders read from their summaries and leases, locally and on gs://, and
`runner runs rm`, which asks first and never removes a folder a run holds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.rundir import lease as leases
from tests.conftest import cli_env, last_json, run_cli
from tests.support.cli import invoke


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_mnist: Path) -> Path:
    """A run folder a real `runner run` made: 2 short epochs of tiny MNIST."""
    folder = tmp_path_factory.mktemp("made")
    spec = folder / "tiny.yaml"
    spec.write_text(json.dumps({
        "name": "tiny", "accelerator": {"kind": "cpu"},
        "data": {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": f"{tiny_mnist}/test-*.tfrecord",
                 "global_batch_size": 128},
        "train": {"epochs": 2, "steps_per_epoch": 4}, "output": {"dir": str(folder / "runs"), "tensorboard": False},
    }))
    result = run_cli("run", spec, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_json(result.stdout)["status"] == "succeeded"
    return folder / "runs" / "tiny"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _runs_folder(tmp_path: Path, trained: Path) -> Path:
    """Four run folders: finished, held by a live run (this test's process), held by a dead one, no summary."""
    runs = tmp_path / "runs"
    for name in ("done", "busy", "dead"):
        shutil.copytree(trained, runs / name)
    (runs / "fresh").mkdir()
    (runs / "fresh" / "spec.json").write_text("{}")
    (runs / "not-a-run").mkdir()  # no summary, lease, spec or checkpoints: not listed
    (runs / "busy" / leases.LEASE).write_text(json.dumps(leases.owner_doc("busy")))
    (runs / "dead" / leases.LEASE).write_text(json.dumps({**leases.owner_doc("dead"), "pid": _dead_pid()}))
    return runs


@pytest.mark.xdist_group("runs_trained")  # its tests share a worker, so the module's job trains once
def test_runs_lists_each_folder_from_its_summary_and_lease(tmp_path: Path, trained: Path) -> None:
    runs = _runs_folder(tmp_path, trained)
    summary = json.loads((trained / "summary.json").read_text())
    result = invoke("runs", runs, "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert sorted(rows) == ["busy", "dead", "done", "fresh"]
    done = rows["done"]
    assert (done["status"], done["epochs_done"], done["epochs_asked"]) == ("succeeded", 2, 2)
    assert done["best"] == {"metric": "accuracy", "value": summary["metrics"]["accuracy"], "from": "eval"}
    assert done["precision"] == summary["accelerator"]["precision"]["policy"] and done["device"] == "cpu"
    assert done["bytes"] == sum(p.stat().st_size for p in (runs / "done").rglob("*") if p.is_file())
    assert done["holder"] is None and done["updated"].endswith("Z")
    # A live lease makes the row `running`, naming the holder; a dead holder's lease does not.
    assert rows["busy"]["status"] == "running" and f"pid {leases.os.getpid()}" in rows["busy"]["holder"]
    assert rows["dead"]["status"] == "succeeded" and rows["dead"]["holder"] is None
    assert rows["fresh"]["status"] == "no summary" and rows["fresh"]["epochs_done"] is None

    table = invoke("runs", runs)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split() == ["NAME", "STATUS", "EPOCHS", "BEST", "PRECISION", "DEVICE", "WHEN", "(UTC)", "SIZE"]
    done_line = next(line for line in lines if line.startswith("done "))
    assert "succeeded" in done_line and " 2/2 " in done_line and f"accuracy {done['best']['value']:.4f}" in done_line

    # A stalled attempt writes no summary, only its guard's mark: the row says stalled, not the older summary's word.
    shutil.copytree(trained, runs / "stuck")
    (runs / "stuck" / "stalled.json").write_text(json.dumps({"message": "stalled: nothing progressed"}))
    rows = {row["name"]: row for row in json.loads(invoke("runs", runs, "--json").stdout)}
    assert rows["stuck"]["status"] == "stalled" and rows["done"]["status"] == "succeeded"


@pytest.mark.xdist_group("runs_trained")
def test_rm_asks_first_and_never_removes_a_folder_a_run_holds(tmp_path: Path, trained: Path) -> None:
    runs = _runs_folder(tmp_path, trained)
    held = invoke("runs", "rm", "busy", runs, "--yes")
    assert held.returncode == 2
    assert "in use by a run" in held.stderr and f"pid {leases.os.getpid()}" in held.stderr
    assert (runs / "busy" / "summary.json").exists()

    unasked = invoke("runs", "rm", "done", runs)  # no terminal to ask on, no --yes
    assert unasked.returncode == 2 and "pass --yes" in unasked.stderr
    assert (runs / "done").is_dir()

    removed = invoke("runs", "rm", "done", runs, "--yes")
    assert removed.returncode == 0, removed.stderr
    assert "removed" in removed.stdout and not (runs / "done").exists()
    # A lease whose process is gone holds nothing: that folder goes too.
    assert invoke("runs", "rm", "dead", runs, "--yes").returncode == 0 and not (runs / "dead").exists()
    missing = invoke("runs", "rm", "nope", runs, "--yes")
    assert missing.returncode == 2 and "no run folder 'nope'" in missing.stderr


@pytest.mark.xdist_group("runs_trained")
def test_runs_on_a_bucket_lists_and_removes_through_the_emulator(gcs, trained: Path) -> None:
    bucket = gcs.bucket()
    client = gcs.client().bucket(bucket)
    for name in ("done", "busy"):
        for path in trained.rglob("*"):
            if path.is_file():
                client.blob(f"runs/{name}/{path.relative_to(trained)}").upload_from_filename(str(path))
    gcs.write(bucket, f"runs/busy/{leases.LEASE}", json.dumps(leases.owner_doc("busy")).encode())
    env = cli_env(**gcs.env)
    listed = run_cli("runs", f"gs://{bucket}/runs", "--json", env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["done"]["status"] == "succeeded" and rows["done"]["epochs_done"] == 2
    assert rows["done"]["path"] == f"gs://{bucket}/runs/done"
    assert rows["busy"]["status"] == "running"
    assert rows["done"]["bytes"] == sum(p.stat().st_size for p in trained.rglob("*") if p.is_file())

    held = run_cli("runs", "rm", "busy", f"gs://{bucket}/runs", "--yes", env=env, timeout=120)
    assert held.returncode == 2 and "in use by a run" in held.stderr
    removed = run_cli("runs", "rm", "done", f"gs://{bucket}/runs", "--yes", env=env, timeout=120)
    assert removed.returncode == 0, removed.stderr[-3000:]
    remaining = gcs.objects(bucket, "runs/")
    assert remaining and all(name.startswith("runs/busy/") for name in remaining)
