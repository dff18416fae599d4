"""Two worker processes on 127.0.0.1 train one job with MultiWorkerMirroredStrategy, then resume it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, last_json

pytestmark = pytest.mark.slow


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def run_cluster(spec: Path, *overrides: str, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Starts both workers, waits for both; a worker left alone would wait forever, so both are bounded."""
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    procs = []
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = cli_env(TF_CONFIG=json.dumps(tf_config))
        env.pop("TF_USE_LEGACY_KERAS", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "runner", "run", str(spec), *overrides],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        ))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return results


def test_two_workers_train_one_job_and_resume_it(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("cluster", data={"global_batch_size": 32}, train={"epochs": 1, "steps_per_epoch": 16})
    chief, worker = run_cluster(spec)
    assert chief.returncode == 0, chief.stderr[-3000:]
    assert worker.returncode == 0, worker.stderr[-3000:]
    summary = last_json(chief.stdout)
    assert summary["accelerator"]["workers"] == 2 and summary["accelerator"]["replicas"] == 2
    assert summary["accelerator"]["keras"].startswith("tf-keras"), "multi-worker training runs on tf-keras"
    assert summary["final_step"] == 16 and summary["epochs"][0]["steps"] == 16
    run_dir = tmp_path / "runs" / "cluster"
    # Only the chief writes the run folder: one attempt summary, one model, checkpoints of the chief.
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded"
    assert sorted(p.name for p in (run_dir / "attempts").iterdir()) == ["001.json"]
    assert (run_dir / "model.keras").exists()
    assert (run_dir / "checkpoints" / "ckpt-16.index").exists()

    again, again_worker = run_cluster(spec, "--set", "train.epochs=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again_worker.returncode == 0, again_worker.stderr[-3000:]
    resumed = last_json(again.stdout)
    assert resumed["resumed_from_step"] == 16
    assert resumed["final_step"] == 32
    assert [e["epoch"] for e in resumed["epochs"] if e["attempt"] == resumed["attempt"]] == [2]
