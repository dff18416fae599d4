"""The startup script (runner/cloud/tpu_startup.sh) on a simulated TPU VM slice of two hosts: a v5p-16 is two TPU
VMs of 4 chips (runner/device/tpus.json). Each worker runs the script as its VM runs it at boot (bash, in a
session of its own), with its own fake metadata server (agent-worker-number 0 or 1, both listing the slice's two
workers); the two share the bucket (a local folder standing for gs://) and the Cloud TPU API fake, to which the
real gcloud sends the queued resource's delete.

In every case both workers run the container, and the fake records exactly one delete of the queued resource:
when the job succeeds, when it fails, and when either worker is lost (its whole VM killed while its job runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.cloud import request, submit, tpu_api
from tests.support.cloud import IMAGE, PROJECT
from tests.support.metadata_fake import MetadataFake, start_metadata_fake
from tests.support.tpu_fake import TpuFake
from tests.support.tpu_vm import calls, gcs_job_spec, release, vm_env

pytest_plugins = ["tests.support.cloud_fixtures"]
pytestmark = pytest.mark.host  # the real gcloud sends the VMs' describe and delete calls

TPU_TYPE, ZONE = "v5p-16", "us-central1-a"
QR_PATH = f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources/mnist-cnn"
WAIT_S = 300  # generous: a busy 2-core machine runs the fake gcloud slowly; every wait ends at its event
# The script's bounds, made short: worker 0 beats every second; it is lost after 4 s without a beat.
QUICK = {"RUNNER_UPLOAD_EVERY_S": "1", "RUNNER_WORKER_LOST_S": "4", "RUNNER_PEER_POLL_S": "0.5",
         "RUNNER_PEER_STAGGER_S": "1", "RUNNER_METADATA_TRIES": "3"}


@pytest.fixture
def worker_1_metadata(tmp_path: Path) -> Iterator[MetadataFake]:
    (tmp_path / "metadata-1").mkdir()
    with start_metadata_fake(tmp_path / "metadata-1", ttl_s=900) as fake:
        yield fake


@pytest.fixture
def slice_vms(tpu_fake: TpuFake, metadata_fake: MetadataFake, worker_1_metadata: MetadataFake, tmp_path: Path):
    endpoints = "unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3"
    metadata_fake.set(agent_worker_number=0, worker_network_endpoints=endpoints, accelerator_type=TPU_TYPE)
    worker_1_metadata.set(agent_worker_number=1, worker_network_endpoints=endpoints, accelerator_type=TPU_TYPE)
    return Slice(tpu_fake, [metadata_fake, worker_1_metadata], tmp_path)


class Slice:
    """One submission of a two-host slice and its two workers' boots."""

    def __init__(self, api: TpuFake, metadata: list[MetadataFake], folder: Path):
        self.api, self.metadata, self.folder = api, metadata, folder
        self.gcs = folder / "gcs"
        self.spec = gcs_job_spec(folder)
        self.sub = self.create()
        self.envs: list[dict[str, str]] = []
        self.processes: list[subprocess.Popen] = []

    def create(self) -> submit.Submission:
        """The queued resource, created in the fake as `runner submit` creates it."""
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import tpu_v2

        sub = submit.prepare_submission(self.spec, tpu_type=TPU_TYPE, zone=ZONE, image=IMAGE, project=PROJECT)
        assert sub.tpu.hosts == 2
        client = tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                                  client_options=ClientOptions(api_endpoint=self.api.endpoint))
        tpu_api.create(sub, client)
        return sub

    def boot(self, *jobs: str) -> None:
        """Boots worker 0 and worker 1 at once, each running its job (tests/support/tpu_vm.py's FAKE_JOB)."""
        script = request.startup_script(self.sub)
        assert "RUNNER_HOSTS=2" in script
        for worker, job in enumerate(jobs):
            env = vm_env(self.folder / f"w{worker}", metadata_host=self.metadata[worker].host,
                         tpu_endpoint=self.api.endpoint, job=job, gcs_dir=self.gcs, logging_endpoint=self.api.endpoint,
                         **QUICK)
            self.envs.append(env)
            self.processes.append(subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True, start_new_session=True))

    def finish(self, *workers: int) -> None:
        for worker in workers:
            _, err = self.processes[worker].communicate(timeout=WAIT_S)
            assert self.processes[worker].returncode == 0, err

    def await_started(self, worker: int) -> None:
        """Until the worker's job is running (its start record is in the bucket, its job has its handler)."""
        deadline = time.monotonic() + WAIT_S
        listening = Path(self.envs[worker]["FAKE_STATE"]) / "job_listening"
        while self.record(worker, "started") is None or not listening.exists():
            assert time.monotonic() < deadline and self.processes[worker].poll() is None, self.processes[worker]
            time.sleep(0.2)

    def lose(self, worker: int) -> None:
        """The worker's VM is gone: every process of its session is killed at once, as a dead VM's are."""
        session = self.processes[worker].pid
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.getsid(int(entry.name)) == session:
                        os.kill(int(entry.name), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    continue
        self.processes[worker].communicate(timeout=60)

    def logs(self) -> Path:
        return self.gcs / "runner-test/runs/mnist_cnn/logs" / self.sub.submission_id

    def record(self, worker: int, kind: str = "exit") -> dict | None:
        path = self.logs() / f"worker-{worker}.{kind}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def log(self, worker: int) -> str:
        return (self.logs() / f"worker-{worker}.log").read_text()

    def ran_the_job(self, worker: int) -> bool:
        return any(c.startswith("docker run") and " run /job/spec.yaml" in c for c in calls(self.envs[worker]))

    def deletes(self) -> list[dict]:
        return [r for r in self.api.requests() if r["method"] == "DELETE"]


def test_both_workers_run_the_job_and_worker_0_deletes_the_slice_once_it_succeeds(slice_vms):
    slice_vms.boot("exit:0", "exit:0")
    slice_vms.finish(0, 1)
    assert slice_vms.ran_the_job(0) and slice_vms.ran_the_job(1)
    [delete] = slice_vms.deletes()
    assert delete["path"] == QR_PATH
    zero, one = slice_vms.record(0), slice_vms.record(1)
    assert (zero["exit_code"], zero["worker"], zero["delete"]) == (0, 0, "requested")
    assert (one["exit_code"], one["worker"]) == (0, 1) and one["delete"].startswith("left to worker 0")
    assert "worker 1: waiting for worker 0 to delete queued resource mnist-cnn" in slice_vms.log(1)
    assert "worker 0 of 2: job mnist-cnn" in slice_vms.log(0)
    doctors = [[c for c in calls(env) if c.startswith("docker run") and " doctor " in c] for env in slice_vms.envs]
    assert doctors[0][-1].endswith("doctor --json --save /job/spec.yaml"), "worker 0's report goes to the run folder"
    assert doctors[1][-1].endswith("doctor --json /job/spec.yaml"), "worker 1's to its log only"


def test_a_failed_job_still_frees_the_slice_once(slice_vms):
    slice_vms.boot("sleep:2:3", "exit:1")  # worker 1 fails first; JAX ends worker 0 (exit 3) after it
    slice_vms.finish(0, 1)
    assert slice_vms.ran_the_job(0) and slice_vms.ran_the_job(1)
    assert len(slice_vms.deletes()) == 1
    assert (slice_vms.record(0)["exit_code"], slice_vms.record(1)["exit_code"]) == (3, 1)
    assert slice_vms.record(0)["delete"] == "requested"


def test_when_worker_0_is_lost_worker_1_deletes_the_slice_once(slice_vms):
    slice_vms.boot("hold:0", "exit:3")  # worker 1's JAX process ends (exit 3) when worker 0 is gone
    slice_vms.await_started(0)
    deadline = time.monotonic() + WAIT_S
    while "waiting for worker 0" not in _text(slice_vms, 1):  # worker 1's job is over: it waits on worker 0
        assert time.monotonic() < deadline and slice_vms.processes[1].poll() is None
        time.sleep(0.2)
    assert slice_vms.deletes() == [], "worker 0 still beats: worker 1 does not delete"
    slice_vms.lose(0)
    slice_vms.finish(1)
    assert slice_vms.ran_the_job(0) and slice_vms.ran_the_job(1)
    [delete] = slice_vms.deletes()
    assert delete["path"] == QR_PATH
    assert slice_vms.record(0) is None, "a lost VM writes no exit record"
    one = slice_vms.record(1)
    assert (one["exit_code"], one["delete"]) == (3, "requested")
    assert "worker 0 is lost (its heartbeat has not changed for" in slice_vms.log(1)


def test_when_worker_1_is_lost_worker_0_deletes_the_slice_once(slice_vms):
    slice_vms.boot("hold:3", "hold:0")
    slice_vms.await_started(0)
    slice_vms.await_started(1)
    slice_vms.lose(1)
    release(slice_vms.envs[0])  # worker 0's JAX process ends with exit 3: a host of its group is gone
    slice_vms.finish(0)
    assert slice_vms.ran_the_job(0) and slice_vms.ran_the_job(1)
    [delete] = slice_vms.deletes()
    assert delete["path"] == QR_PATH
    assert (slice_vms.record(0)["exit_code"], slice_vms.record(0)["delete"]) == (3, "requested")
    assert slice_vms.record(1) is None


def _text(slice_vms: Slice, worker: int) -> str:
    """The worker's log on its own disk (the bucket's copy lags by RUNNER_UPLOAD_EVERY_S)."""
    path = Path(slice_vms.envs[worker]["RUNNER_WORKDIR"]).glob(f"worker-{worker}.log")
    return "".join(p.read_text() for p in path)
