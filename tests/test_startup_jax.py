"""The startup script (runner/cloud/tpu_startup.sh) running the job as the TPU image runs it: Keras on JAX, one JAX
process per worker of the slice (tests/support/tpu_vm.py's `jax` job: the worker's number and the slice's workers
come from its own metadata server, as JAX reads them on a TPU VM; the processes meet on 127.0.0.1). The data and
the run folder are in a bucket (the GCS emulator); the model is a dense layer sent with the job as its code.

A slice whose workers reach the job far apart (worker 1's image pull takes longer) still forms one job and trains
to the end, and `runner status` shows its checkpoint step (Orbax's); a worker that never starts the job ends the
other within the join's bound, and the slice is deleted once. A preemption reaches the job through Docker: the
container is stopped as dockerd stops it (SIGTERM, SIGKILL after its stop timeout), and the job saves and exits 75.

Time is scaled: the late worker is LATE_S behind, the join waits JOIN_S (accelerator.join_timeout_s; minutes on a
real slice, docs/multihost.md), NEVER_S where no worker comes; dockerd's default stop timeout of 10 s stands at
DOCKER_STOP_S here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runner.cloud import codefetch, jobs, record, request, submit, tpu_api
from runner.rundir import checkpoints
from runner.spec.types import AcceleratorSpec
from tests.conftest import last_json, write_spec
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke
from tests.support.metadata_fake import start_metadata_fake
from tests.support.tpu_vm import dense_model, vm_env

pytest_plugins = ["tests.support.cloud_fixtures"]
pytestmark = pytest.mark.host  # the real gcloud sends the VMs' describe and delete calls

STEPS, LATE_S, JOIN_S, NEVER_S, DOCKER_STOP_S = 4, 20, 45, 20, 0.5
WAIT_S = 600  # generous: two JAX processes on a busy 2-core machine; each wait ends at its event
QUICK = {"RUNNER_UPLOAD_EVERY_S": "1", "RUNNER_WORKER_LOST_S": "30", "RUNNER_PEER_POLL_S": "0.5",
         "RUNNER_PEER_STAGGER_S": "1", "RUNNER_METADATA_TRIES": "3", "RUNNER_FAKE_PROJECT": PROJECT}
# The join's bound: accelerator.join_timeout_s where the spec has it, else the older accelerator.timeout_s.
JOIN_KEY = "join_timeout_s" if "join_timeout_s" in AcceleratorSpec.model_fields else "timeout_s"


_BOOTED: list[subprocess.Popen] = []  # every simulated VM's startup script, ended with its test


@pytest.fixture(autouse=True)
def _vms_end_with_their_test():
    """What a failed test's VMs still run (a JAX process waiting to join) is killed, as a deleted VM's would be."""
    yield
    while _BOOTED:
        session = _BOOTED.pop().pid
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.getsid(int(entry.name)) == session:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


class Vms:
    """One submission of a JAX job and the boots of its workers, each with its own metadata server."""

    def __init__(self, tpu_fake, metadatas, gcs, folder: Path, small_mnist: Path, tpu_type: str,
                 join_s: float = JOIN_S, **train):
        self.api, self.gcs, self.folder = tpu_fake, gcs, folder
        self.bucket = gcs.bucket()
        data = _upload(gcs, small_mnist, self.bucket, "data")
        job = folder / "job"
        job.mkdir()
        spec = write_spec(job, {
            "name": "mnist_cnn",
            "accelerator": {"backend": "jax", JOIN_KEY: join_s, "heartbeat_s": 10},
            "data": {"train": f"{data}/train-*.tfrecord", "eval": None, "global_batch_size": 32,
                     "shuffle_buffer": 128, "in_memory": False},
            "model": {"name": dense_model(job)},
            "train": {"epochs": 2, "steps_per_epoch": STEPS, "allow_chance": True, **train},
            "checkpoint": {"grace_s": 20},
            "output": {"dir": f"gs://{self.bucket}/runs", "tensorboard": False, "saved_model": False},
        })
        self.sub = submit.prepare_submission(spec, tpu_type=tpu_type, zone=ZONE, image=IMAGE, project=PROJECT)
        codefetch.upload(self.sub.code, 60)  # as `runner submit` does before its request
        record.save_job(jobs.job_record(self.sub))
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import tpu_v2

        tpu_api.create(self.sub, tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                                                  client_options=ClientOptions(api_endpoint=tpu_fake.endpoint)))
        endpoints = ",".join(f"unknown:unknown:10.0.0.{2 + w}" for w in range(self.sub.tpu.hosts))
        for worker, server in enumerate(metadatas[: self.sub.tpu.hosts]):
            server.set(agent_worker_number=worker, worker_network_endpoints=endpoints, accelerator_type=tpu_type)
        self.metadatas = metadatas
        self.port = free_port()
        self.envs: list[dict[str, str]] = []
        self.processes: list[subprocess.Popen] = []

    def boot(self, worker: int, **extra: str) -> None:
        env = vm_env(self.folder / f"w{worker}", metadata_host=self.metadatas[worker].host,
                     tpu_endpoint=self.api.endpoint, job="jax", gcs_env=self.gcs.env,
                     logging_endpoint=self.api.endpoint, FAKE_JAX_PORT=str(self.port),
                     FAKE_DOCKER_STOP_TIMEOUT_S=str(DOCKER_STOP_S), **QUICK, **_compile_cache(), **extra)
        self.envs.append(env)
        self.processes.append(subprocess.Popen(["bash", "-c", request.startup_script(self.sub)], env=env,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               start_new_session=True))
        _BOOTED.append(self.processes[-1])

    def finish(self, worker: int) -> None:
        _, err = self.processes[worker].communicate(timeout=WAIT_S)
        assert self.processes[worker].returncode == 0, err[-3000:]

    @property
    def run_dir(self) -> str:
        return self.sub.spec.run_dir

    def object(self, name: str) -> dict | None:
        text = record.read_text(f"{self.run_dir}/{name}")
        return None if text is None else json.loads(text)

    def exit_record(self, worker: int) -> dict | None:
        return self.object(f"logs/{self.sub.submission_id}/worker-{worker}.exit.json")

    def log(self, worker: int) -> str:
        return (Path(self.envs[worker]["RUNNER_WORKDIR"]) / f"worker-{worker}.log").read_text()

    def deletes(self) -> list[dict]:
        return [r for r in self.api.requests() if r["method"] == "DELETE"]


@pytest.fixture
def in_bucket(gcs, monkeypatch):
    """This process reaches the emulator as the VMs do (the job record, the code archive, status)."""
    for key, value in gcs.env.items():
        monkeypatch.setenv(key, value)
    return gcs


@pytest.fixture
def second_metadata(tmp_path: Path):
    (tmp_path / "metadata-1").mkdir()
    with start_metadata_fake(tmp_path / "metadata-1", ttl_s=WAIT_S + 300) as fake:
        yield fake


def test_a_slice_whose_worker_1_starts_late_trains_to_the_end_and_status_shows_its_orbax_step(
    tpu_fake, metadata_fake, second_metadata, in_bucket, small_mnist, tmp_path
):
    vms = Vms(tpu_fake, [metadata_fake, second_metadata], in_bucket, tmp_path, small_mnist, "v5p-16")
    assert vms.sub.tpu.hosts == 2
    vms.boot(0)
    vms.boot(1, FAKE_PULL_DELAY_S=str(LATE_S))  # its image pull takes LATE_S longer: it joins that much later
    for worker in (0, 1):
        vms.finish(worker)
    zero, one = vms.exit_record(0), vms.exit_record(1)
    assert (zero["exit_code"], one["exit_code"]) == (0, 0), (vms.log(0)[-3000:], vms.log(1)[-3000:])
    summary = vms.object("summary.json")
    assert summary["status"] == "succeeded" and summary["processes"]["count"] == 2
    assert summary["final_step"] == 2 * STEPS
    assert summary["accelerator"]["backend"]["name"] == "jax"
    started = [vms.object(f"logs/{vms.sub.submission_id}/worker-{w}.started.json") for w in (0, 1)]
    late = record.parse_time(started[1]["started_at"]) - record.parse_time(started[0]["started_at"])
    assert late.total_seconds() >= LATE_S - 2, "worker 1 started its job well after worker 0"
    assert len(vms.deletes()) == 1, "the slice is deleted once"

    saved = checkpoints.newest(vms.run_dir)
    assert (saved.step, saved.store) == (2 * STEPS, "orbax")
    shown = invoke("status", vms.run_dir, "--zone", ZONE, "--project", PROJECT,
                   env=cloud_env(tpu_fake.endpoint, tmp_path, **in_bucket.env))
    assert shown.returncode == 0, shown.stderr
    assert last_json(shown.stdout)["step"] == 2 * STEPS, "runner status shows the JAX job's checkpoint step"


def test_a_worker_that_never_starts_the_job_ends_the_other_within_the_join_bound_and_the_slice_goes_once(
    tpu_fake, metadata_fake, second_metadata, in_bucket, small_mnist, tmp_path
):
    vms = Vms(tpu_fake, [metadata_fake, second_metadata], in_bucket, tmp_path, small_mnist, "v5p-16", join_s=NEVER_S)
    vms.boot(0)
    vms.boot(1, FAKE_PULL="fail")  # worker 1 cannot pull the image: its job never starts
    began = time.monotonic()
    for worker in (0, 1):
        vms.finish(worker)
    zero, one = vms.exit_record(0), vms.exit_record(1)
    assert (one["exit_code"], one["ran"]) == (3, False)
    assert (zero["exit_code"], zero["ran"], zero["delete"]) == (3, True, "requested"), vms.log(0)[-3000:]
    ran_s = (record.parse_time(zero["finished_at"]) - record.parse_time(zero["started_at"])).total_seconds()
    assert NEVER_S <= time.monotonic() - began and ran_s < NEVER_S + 120, f"worker 0 ended after {ran_s:.0f} s"
    assert f"accelerator.{JOIN_KEY}" in vms.log(0), vms.log(0)[-3000:]
    assert len(vms.deletes()) == 1, "the slice is deleted once, by worker 0"
    assert one["delete"].startswith("left to worker 0")


def test_a_preemption_stops_the_container_as_dockerd_does_and_the_job_saves_and_exits_75(
    tpu_fake, metadata_fake, in_bucket, small_mnist, tmp_path
):
    vms = Vms(tpu_fake, [metadata_fake], in_bucket, tmp_path, small_mnist, "v5litepod-8", epochs=400,
              steps_per_epoch=STEPS)
    assert vms.sub.tpu.hosts == 1
    vms.boot(0)
    deadline = time.monotonic() + WAIT_S
    while checkpoints.latest_step(vms.run_dir) is None:  # training, a checkpoint saved
        assert time.monotonic() < deadline and vms.processes[0].poll() is None, vms.processes[0].communicate()
        time.sleep(0.5)
    os.killpg(vms.processes[0].pid, signal.SIGTERM)  # the VM shuts down: its startup script's processes are told
    container = Path(vms.envs[0]["FAKE_STATE"]) / "containers"
    while not any(container.glob("*.exit")):
        assert time.monotonic() < deadline, vms.log(0)[-3000:]
        time.sleep(0.2)
    [ended] = container.glob("*.exit")
    assert ended.read_text() == "75", f"the job was killed before it saved: {vms.log(0)[-3000:]}"
    summary = vms.object("summary.json")
    assert summary["status"] == "preempted"
    saved = int(re.search(r"saved step (\d+)", summary["error"]).group(1))
    assert checkpoints.latest_step(vms.run_dir) == saved, "the notice's save is the newest whole one"
    docker_run = next(c for c in (Path(vms.envs[0]["FAKE_CALLS"]).read_text().splitlines())
                      if c.startswith("docker run") and " run /job/spec.yaml" in c)
    assert f"--stop-timeout {20 + 30}" in docker_run, "the stop timeout covers checkpoint.grace_s"


def _upload(gcs, folder: Path, bucket: str, prefix: str) -> str:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            gcs.write(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
    return f"gs://{bucket}/{prefix}"


def _compile_cache() -> dict[str, str]:
    found = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return {"JAX_COMPILATION_CACHE_DIR": found} if found else {}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
