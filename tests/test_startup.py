"""The TPU VM's startup script (runner/cloud/tpu_startup.sh), run here as a TPU VM runs it at boot: bash, with a
fake GCE metadata server, stand-ins for docker and gcloud that record every call (tests/support/tpu_vm.py), a
local folder standing for gs://, and the real gcloud sending the queued resource's delete to the TPU API fake.

Each case checks what ran, what was deleted, what the run folder holds and what `runner logs` reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runner.cloud import request, submit, tpu_api
from tests.conftest import cli_env
from tests.support.cloud import IMAGE, PROJECT, ZONE, invoke
from tests.support.metadata_fake import MetadataFake
from tests.support.tpu_fake import TpuFake
from tests.support.tpu_vm import calls, gcs_job_spec, run_startup_script, vm_env

pytest_plugins = ["tests.support.cloud_fixtures"]
pytestmark = pytest.mark.host  # the real gcloud sends the VM's delete

RUN_DIR = "gs://runner-test/runs/mnist_cnn"
QR_PATH = f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources/mnist-cnn"


@pytest.fixture
def vm(tpu_fake: TpuFake, metadata_fake: MetadataFake, tmp_path: Path):
    """Makes startup scripts for new submissions of one job and boots them; gs:// is tmp_path/gcs."""
    return Vm(tpu_fake, metadata_fake, tmp_path)


class Vm:
    def __init__(self, api: TpuFake, metadata: MetadataFake, folder: Path):
        self.api, self.metadata, self.folder = api, metadata, folder
        self.gcs = folder / "gcs"
        self.spec = gcs_job_spec(folder)
        self.boots = 0

    def submission(self, tpu_type: str = "v5litepod-8", **flags) -> submit.Submission:
        """A new submission, created in the TPU API fake as `runner submit` creates it."""
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import tpu_v2

        sub = submit.prepare_submission(self.spec, tpu_type=tpu_type, zone=ZONE, image=IMAGE, project=PROJECT,
                                        **flags)
        client = tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                                  client_options=ClientOptions(api_endpoint=self.api.endpoint))
        tpu_api.create(sub, client)
        return sub

    def boot(self, sub: submit.Submission, job: str = "exit:0", credential_helper: bool = True,
             cloud_logging: bool = True, background: bool = False, **extra: str):
        """Boots a VM for the submission; without cloud_logging, docker cannot reach Cloud Logging."""
        self.boots += 1
        logging_endpoint = self.api.endpoint if cloud_logging else None
        env = vm_env(self.folder / f"vm{self.boots}", metadata_host=self.metadata.host, tpu_endpoint=self.api.endpoint,
                     job=job, gcs_dir=self.gcs, credential_helper=credential_helper, logging_endpoint=logging_endpoint,
                     RUNNER_METADATA_TRIES="3", RUNNER_UPLOAD_EVERY_S="1", **extra)
        script = request.startup_script(sub)
        if background:
            process = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True)
            return process, env
        result = run_startup_script(script, env)
        assert result.returncode == 0, result.stderr
        return result, env

    def local(self, url: str) -> Path:
        return self.gcs / url[len("gs://"):]

    def run_dir(self) -> Path:
        return self.local(RUN_DIR)

    def record(self, sub: submit.Submission, name: str) -> dict | None:
        path = self.run_dir() / "logs" / sub.submission_id / name
        return json.loads(path.read_text()) if path.exists() else None

    def log(self, sub: submit.Submission, worker: str = "0") -> str:
        return (self.run_dir() / "logs" / sub.submission_id / f"worker-{worker}.log").read_text()

    def deletes(self) -> list[dict]:
        return [r for r in self.api.requests() if r["method"] == "DELETE"]


def docker_runs(env: dict) -> list[str]:
    return [c for c in calls(env) if c.startswith("docker run")]


def follow(vm: Vm, sub: submit.Submission) -> subprocess.CompletedProcess:
    return invoke("logs", vm.run_dir(), "--submission", sub.submission_id, "--follow", "--interval", "1", env=cli_env())


def test_first_run_pulls_checks_runs_records_and_worker_0_deletes_the_queued_resource(vm):
    sub = vm.submission(spot=True)
    _, env = vm.boot(sub)
    made = calls(env)
    assert f"docker pull {IMAGE}" in made
    assert any(c.startswith("gcloud auth configure-docker us-central1-docker.pkg.dev") for c in made)
    doctor, job = docker_runs(env)
    assert doctor.endswith(f"{IMAGE} doctor --json --save /job/spec.yaml"), "the doctor checks the VM first"
    assert "--net=host --privileged" in job and "-e TPU_NAME=local" in job
    assert "-e RUNNER_TPU_RUNTIME_VERSION=v2-alpha-tpuv5-lite" in job, "the summary records the VM's runtime"
    assert f"-e RUNNER_TPU_TYPE={sub.tpu.name}" in job, "the summary records the accelerator type submitted"
    assert f"--name runner-mnist-cnn-{sub.submission_id}-w0" in job
    assert job.endswith(f"{IMAGE} run /job/spec.yaml --set train.max_duration=86400 --set train.stall_timeout=1800")
    assert "rm -f /tmp/libtpu_lockfile" not in request.startup_script(sub)

    started, ended = vm.record(sub, "worker-0.started.json"), vm.record(sub, "worker-0.exit.json")
    assert started["submission"] == ended["submission"] == sub.submission_id
    assert (ended["exit_code"], ended["ran"], ended["worker"]) == (0, True, 0)
    assert (ended["accelerator_type"], ended["spot"]) == ("v5litepod-8", True)
    log = vm.log(sub)
    assert '"status": "succeeded"' in log and "job exited with code 0" in log
    assert "deleting queued resource mnist-cnn: the job exited with code 0" in log
    [delete] = vm.deletes()
    assert delete["path"] == QR_PATH and [v.lower() for v in delete["query"]["force"]] == ["true"]

    followed = follow(vm, sub)
    assert followed.returncode == 0, followed.stderr
    assert '"status": "succeeded"' in followed.stdout


def test_resubmission_after_a_failure_runs_the_job_again_under_its_own_id(vm):
    first = vm.submission()
    vm.boot(first, job="exit:1")
    assert vm.record(first, "worker-0.exit.json")["exit_code"] == 1
    assert len(vm.deletes()) == 1, "a failed job still frees its slice"
    assert follow(vm, first).returncode == 1

    second = vm.submission()
    assert second.submission_id != first.submission_id
    _, env = vm.boot(second, job="exit:0")
    assert [c for c in docker_runs(env) if " run /job/spec.yaml" in c], "the old exit record does not stop it"
    assert vm.record(second, "worker-0.exit.json")["exit_code"] == 0
    assert vm.record(first, "worker-0.exit.json")["exit_code"] == 1, "each submission keeps its own record"
    assert len(vm.deletes()) == 2
    assert follow(vm, second).returncode == 0, "runner logs reports the new submission, not the old exit code"


def test_resubmission_after_success_runs_nothing_deletes_the_slice_and_says_why(vm):
    first = vm.submission()
    vm.boot(first, job="exit:0")
    summary = json.loads((vm.run_dir() / "summary.json").read_text())
    assert (summary["status"], summary["train_epochs"]) == ("succeeded", 2)

    second = vm.submission()
    _, env = vm.boot(second)
    assert not [c for c in calls(env) if c.startswith("docker")], "a complete job pulls and runs nothing"
    record = vm.record(second, "worker-0.exit.json")
    assert (record["exit_code"], record["ran"]) == (0, False)
    assert "already complete" in record["reason"]
    log = vm.log(second)
    assert "summary.json says succeeded for at least 2 epochs" in log
    assert "deleting queued resource mnist-cnn: job mnist-cnn is already complete" in log
    assert len(vm.deletes()) == 2
    followed = follow(vm, second)
    assert followed.returncode == 0 and "already complete" in followed.stdout

    # More epochs asked for: the same job continues.
    vm.spec.write_text(vm.spec.read_text().replace("epochs: 2", "epochs: 3"))
    third = vm.submission()
    _, env = vm.boot(third)
    assert [c for c in docker_runs(env) if " run /job/spec.yaml" in c]


def test_a_reboot_does_not_run_a_submission_twice_but_still_frees_the_slice(vm):
    sub = vm.submission()
    vm.boot(sub, job="exit:2")
    _, env = vm.boot(sub, job="exit:0")  # the same submission's VM boots again
    assert not docker_runs(env)
    assert "already ran on worker 0" in vm.log(sub)
    assert vm.record(sub, "worker-0.exit.json")["exit_code"] == 2, "the record of the run stays"
    assert len(vm.deletes()) == 2


def test_a_worker_that_cannot_read_its_number_runs_as_worker_0_of_its_single_host_slice(vm):
    sub = vm.submission()  # a single-host type (RUNNER_HOSTS=1)
    vm.metadata.fail(503)
    _, env = vm.boot(sub)
    assert [c for c in docker_runs(env) if " run /job/spec.yaml" in c], "the job runs"
    record = vm.record(sub, "worker-0.exit.json")
    assert (record["exit_code"], record["ran"], record["worker"], record["delete"]) == (0, True, 0, "requested")
    assert ("this slice has one host (RUNNER_HOSTS=1, from runner/device/tpus.json for v5litepod-8), so this is "
            "worker 0") in vm.log(sub)
    assert "creates no other" not in vm.log(sub), "runner submit creates slices of several hosts too"
    assert len(vm.deletes()) == 1, "and frees the slice: nothing bills unwatched"
    flavoured = [r for r in vm.metadata.requests() if r["path"].endswith("agent-worker-number")]
    assert len(flavoured) >= 3 and all(r["flavoured"] for r in flavoured), "it retried, with the header"


def test_the_preemption_notice_ends_the_job_with_75_which_is_recorded_and_the_slice_freed(vm):
    sub = vm.submission(spot=True)
    process, env = vm.boot(sub, job="sleep:60:0", background=True)
    pid_file = Path(env["FAKE_STATE"]) / "job_listening"  # the job's SIGTERM handler is in place
    deadline = time.monotonic() + 300  # generous: a busy machine boots slowly; each wait ends at its event
    while vm.record(sub, "worker-0.started.json") is None or not pid_file.exists():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.2)
    container = next(c for c in _children(process.pid)
                     if "tpu_vm.py docker run" in _cmdline(c) and " run /job/" in _cmdline(c))
    os.kill(container, signal.SIGTERM)  # what `docker stop` delivers when the VM's shutdown begins
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    record = vm.record(sub, "worker-0.exit.json")
    assert record["exit_code"] == 75 and record["ran"] is True
    [delete] = vm.deletes()
    assert delete["path"] == QR_PATH
    followed = follow(vm, sub)
    assert followed.returncode == 75
    assert "preemption notice" in followed.stdout


def test_a_vm_killed_by_preemption_leaves_its_start_and_log_and_no_exit_record(vm):
    sub = vm.submission(spot=True)
    process, _ = vm.boot(sub, job="sleep:60:0", background=True)
    deadline = time.monotonic() + 300  # generous: a busy machine boots slowly; each wait ends at its event
    while vm.record(sub, "worker-0.started.json") is None:
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.2)
    copied = vm.run_dir() / "logs" / sub.submission_id / "worker-0.log"
    while not (copied.exists() and "starting the job in container" in copied.read_text()):  # a periodic copy
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # the VM is gone: nothing runs after this
    process.communicate(timeout=30)
    assert vm.record(sub, "worker-0.exit.json") is None
    assert "starting the job in container" in vm.log(sub)
    assert vm.deletes() == [], "a dead VM deletes nothing: the watcher frees the slice"


def test_without_the_credential_helper_docker_logs_in_with_the_vms_token(vm):
    sub = vm.submission()
    _, env = vm.boot(sub, credential_helper=False)
    made = calls(env)
    assert not [c for c in made if c.startswith("gcloud auth configure-docker")], (
        "a helper docker cannot find breaks pulls")
    assert "gcloud auth print-access-token" in made
    assert "docker login -u oauth2accesstoken --password-stdin https://us-central1-docker.pkg.dev" in made
    assert "docker-credential-gcloud is not on PATH" in vm.log(sub)

    vm.spec.write_text(vm.spec.read_text().replace("epochs: 2", "epochs: 5"))  # not complete: it runs
    again = vm.submission()
    vm.boot(again)
    assert "docker uses gcloud's credential helper" in vm.log(again)


def test_the_job_logs_to_cloud_logging_and_falls_back_to_the_bucket_when_docker_cannot(vm):
    sub = vm.submission()
    _, env = vm.boot(sub)
    job = next(c for c in docker_runs(env) if " run /job/spec.yaml" in c)
    assert "--log-driver=gcplogs" in job
    assert vm.record(sub, "worker-0.started.json")["log_driver"] == "gcplogs"
    container = f"/runner-mnist-cnn-{sub.submission_id}-w0"
    lines = [e["jsonPayload"]["message"] for e in vm.api.entries()
             if e["jsonPayload"]["container"]["name"] == container]
    assert lines and '"status": "succeeded"' in lines[-1]

    vm.spec.write_text(vm.spec.read_text().replace("epochs: 2", "epochs: 4"))
    unlogged = vm.submission()
    _, env = vm.boot(unlogged, cloud_logging=False)  # no Cloud Logging: docker refuses the gcplogs driver (exit 125)
    doctor_tries = [c for c in docker_runs(env) if " doctor " in c]
    assert len(doctor_tries) == 2 and "--log-driver=gcplogs" not in doctor_tries[1]
    job = next(c for c in docker_runs(env) if " run /job/spec.yaml" in c)
    assert "--log-driver" not in job
    assert vm.record(unlogged, "worker-0.started.json")["log_driver"] == "json-file"
    assert "the log goes to the bucket only" in vm.log(unlogged)
    assert vm.record(unlogged, "worker-0.exit.json")["exit_code"] == 0


def test_other_workers_and_kept_jobs_leave_the_queued_resource(vm):
    sub = vm.submission()
    vm.metadata.set(agent_worker_number=1)
    _, env = vm.boot(sub)
    assert [c for c in docker_runs(env) if " run /job/spec.yaml" in c]
    assert vm.deletes() == []

    vm.api.reset()  # worker 1 left the first queued resource, as it should
    vm.metadata.set(agent_worker_number=0)
    vm.spec.write_text(vm.spec.read_text().replace("epochs: 2", "epochs: 6"))
    kept = vm.submission(keep=True)
    vm.boot(kept)
    assert vm.deletes() == []
    assert "keeping queued resource mnist-cnn (--keep)" in vm.log(kept)


def test_on_a_multi_host_slice_a_worker_without_its_number_runs_nothing_and_deletes_nothing(vm):
    sub = vm.submission(tpu_type="v5p-16")  # two hosts: a worker that may not be worker 0 must not act as it
    vm.metadata.fail(503)
    _, env = vm.boot(sub)
    assert not docker_runs(env) and vm.deletes() == []
    record = vm.record(sub, "worker-unknown.exit.json")
    assert (record["exit_code"], record["ran"], record["worker"]) == (3, False, "unknown")
    assert record["delete"] == "not this worker: its number is unknown"
    assert "on a slice of 2 hosts: ran nothing" in record["reason"]


def test_a_slice_whose_metadata_lists_other_workers_than_the_table_says_so_and_runs(vm):
    sub = vm.submission()  # v5litepod-8: one host in the TPU table
    vm.metadata.set(worker_network_endpoints=",".join(f"u:u:10.0.0.{n}" for n in range(4)))
    _, env = vm.boot(sub)
    assert [c for c in docker_runs(env) if " run /job/spec.yaml" in c]
    assert "the metadata server lists 4 workers in this slice, the submission expected 1" in vm.log(sub)
    assert len(vm.deletes()) == 1


def _children(pid: int) -> list[int]:
    """Every descendant of a process, from /proc (the VM's process tree)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == parent:
                    found.append(int(entry.name))
                    frontier.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""

