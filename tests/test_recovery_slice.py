"""`runner submit --watch` of a multi-host slice (v5p-16: two TPU VMs), end to end: the TPU API fake boots the real
startup script on both workers of every slice it makes ready (each worker with its own fake metadata server and its
own job plan, tests/support/tpu_vm.py), the bucket is the GCS emulator, and the watcher runs as its own process.

The slice is one queued resource: the watcher reads its job's end from worker 0's exit record, or from another
worker's once the slice is going (worker 0 lost), and a restart deletes and creates the whole slice again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, last_json, write_spec
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env
from tests.support.metadata_fake import MetadataFake, start_metadata_fake
from tests.support.runs import finish, wait_for
from tests.support.tpu_fake import TpuFake
from tests.support.tpu_vm import vm_env

pytest_plugins = ["tests.support.cloud_fixtures"]
pytestmark = pytest.mark.host  # the real gcloud sends the VMs' describe and delete calls

LIFECYCLE = {"provisioning_s": 0.1, "active_s": 0.1, "deleting_s": 1.0, "vm_linger_s": 1.0}
QUICK = {"RUNNER_UPLOAD_EVERY_S": "1", "RUNNER_WORKER_LOST_S": "4", "RUNNER_PEER_POLL_S": "0.5",
         "RUNNER_PEER_STAGGER_S": "1", "RUNNER_FAKE_PROJECT": PROJECT}
WAIT_S = 900  # a busy 2-core machine boots the simulated VMs slowly; each wait ends at its event


@pytest.fixture
def worker_1_metadata(tmp_path: Path) -> Iterator[MetadataFake]:
    (tmp_path / "metadata-1").mkdir()
    with start_metadata_fake(tmp_path / "metadata-1", ttl_s=WAIT_S + 300) as fake:
        yield fake


class Slice:
    """A v5p-16 job's world: the fakes, the bucket, each worker's job plan, and the watcher's environment."""

    def __init__(self, api: TpuFake, metadata: list[MetadataFake], gcs, folder: Path):
        self.api, self.gcs, self.folder = api, gcs, folder
        self.bucket = gcs.bucket()
        endpoints = "unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3"
        for worker, server in enumerate(metadata):
            server.set(agent_worker_number=worker, worker_network_endpoints=endpoints, accelerator_type="v5p-16")
        self.metadata = metadata
        self.env = cloud_env(api.endpoint, folder, CLOUDSDK_API_ENDPOINT_OVERRIDES_LOGGING=f"{api.endpoint}/",
                             **gcs.env)

    def vms(self, *plans: str) -> None:
        """Worker N runs plans[N] (comma separated, one entry per boot: tests/support/tpu_vm.py's FAKE_JOB)."""
        base = vm_env(self.folder / "vm", metadata_host=self.metadata[0].host, tpu_endpoint=self.api.endpoint,
                      gcs_env=self.gcs.env, logging_endpoint=self.api.endpoint, **QUICK)
        self.workers = [{"GCE_METADATA_HOST": self.metadata[w].host, "FAKE_JOB": plan,
                         "FAKE_STATE": str(self.folder / f"state-{w}"), "FAKE_CALLS": str(self.folder / f"calls-{w}")}
                        for w, plan in enumerate(plans)]
        self.api.configure(lifecycle=LIFECYCLE, boot={"env": base, "worker_env": self.workers,
                                                      "folder": str(self.folder / "boots"), "workers": len(plans)})

    def watch(self) -> subprocess.Popen:
        spec = write_spec(self.folder, {
            "name": "mnist_cnn",
            "data": {"train": f"gs://{self.bucket}/data/train-*.tfrecord", "eval": None},
            "train": {"epochs": 2},
            "output": {"dir": f"gs://{self.bucket}/runs"},
        })
        args = ["submit", str(spec), "--tpu-type", "v5p-16", "--zone", ZONE, "--project", PROJECT, "--image", IMAGE,
                "--no-preflight", "--watch", "--interval", "0.5", "--spot", "--max-restarts", "2"]
        return subprocess.Popen([sys.executable, "-m", "runner", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env, cwd=REPO)

    def creates(self) -> list[dict]:
        return [r for r in self.api.requests() if r["method"] == "POST" and r["path"].endswith("/queuedResources")]

    def job_runs(self, worker: int) -> int:
        """How many times the worker's VMs ran the job's container, over every boot."""
        path = Path(self.workers[worker]["FAKE_CALLS"])
        lines = path.read_text().splitlines() if path.exists() else []
        return len([c for c in lines if c.startswith("docker run") and " run /job/spec.yaml" in c])


@pytest.fixture
def slice_world(tpu_fake, metadata_fake, worker_1_metadata, gcs, tmp_path) -> Slice:
    return Slice(tpu_fake, [metadata_fake, worker_1_metadata], gcs, tmp_path)


def test_a_preempted_slice_is_created_again_whole_and_its_job_completes(slice_world):
    slice_world.vms("exit:75,exit:0", "exit:75,exit:0")  # both hosts stop on the notice (75), then complete
    code, out, err = finish(slice_world.watch(), timeout=WAIT_S)
    assert code == 0, err[-3000:]
    final = last_json(out)
    assert final["outcome"]["outcome"] == "complete"
    [restart] = final["restarts"]
    assert "preempted (exit 75)" in restart["cause"]
    assert len(slice_world.creates()) == 2, "the whole slice, once more"
    assert all(c["body"]["tpu"]["nodeSpec"][0]["node"]["acceleratorType"] == "v5p-16" for c in slice_world.creates())
    assert (slice_world.job_runs(0), slice_world.job_runs(1)) == (2, 2), "both hosts ran the job on both slices"
    boots = slice_world.api.boots()
    assert len(boots) == 2 and all(len(boot["pids"]) == 2 for boot in boots)


def test_when_worker_0_is_lost_the_watcher_reads_worker_1s_exit_and_restarts_the_slice(slice_world):
    # First slice: worker 0 holds its job until its VM is killed; worker 1's process ends (exit 3) and, worker 0's
    # heartbeat gone, deletes the slice. Second slice: both complete.
    slice_world.vms("hold:0,exit:0", "exit:3,exit:0")
    watcher = slice_world.watch()
    started = Path(slice_world.workers[0]["FAKE_STATE"]) / "job_listening"
    wait_for(lambda: started.exists() or None, watcher, timeout=WAIT_S, every=0.2)
    [boot] = slice_world.api.boots()
    _kill_session(boot["pids"][0])  # worker 0's VM is gone
    code, out, err = finish(watcher, timeout=WAIT_S)
    assert code == 0, err[-3000:]
    final = last_json(out)
    assert final["outcome"]["outcome"] == "complete"
    [restart] = final["restarts"]
    assert "an infrastructure failure (exit 3)" in restart["cause"], restart
    assert len(slice_world.creates()) == 2
    first = final["submissions"][0]
    ended = json.loads(slice_world.gcs.read(slice_world.bucket, f"runs/mnist_cnn/logs/{first}/worker-1.exit.json"))
    assert ended["exit_code"] == 3
    # Its log goes to the bucket before the delete, which ends its VM (the exit record may stay "pending").
    log = slice_world.gcs.read(slice_world.bucket, f"runs/mnist_cnn/logs/{first}/worker-1.log").decode()
    assert "worker 0 is lost (its heartbeat has not changed for" in log and "worker 1 deletes queued resource" in log


def _kill_session(pid: int) -> None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == pid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
