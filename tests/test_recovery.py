"""The recovery loop (runner/cloud/recovery.py) driven end to end: `runner submit --watch` and `runner watch`
against the TPU API fake, whose queued resources move through their states by themselves and whose READY
nodes boot the real startup script as a simulated VM (tests/support/tpu_vm.py: a fake metadata server,
stand-ins for docker and gcloud, the GCS emulator as the bucket, the real gcloud for the VM's own delete).

What each job does on its VM is set per run: exit codes, a hold until the test has seen what it checks, or
real training on this machine's CPU. The watchers and followers run as their own processes (they are killed,
and run beside the test); `status`, `cancel` and a plain `submit` run in this process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner.cloud.recovery import Decision, Seen, decide
from runner.rundir import checkpoints
from tests.conftest import REPO, last_json, write_spec
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke
from tests.support.metadata_fake import MetadataFake
from tests.support.runs import awaited, finish
from tests.support.tpu_fake import TpuFake
from tests.support.tpu_vm import dense_model, release, vm_env

pytest_plugins = ["tests.support.cloud_fixtures"]
pytestmark = pytest.mark.host  # the real gcloud sends the VM's delete

# Bounds on the waits below are generous (a suite on a busy 2-core machine took 68 minutes): a wait ends at its event.
LIFECYCLE = {"provisioning_s": 0.1, "active_s": 0.1, "deleting_s": 1.0, "vm_linger_s": 1.0}


# --- the decision table ------------------------------------------------------------------------


@pytest.mark.parametrize("seen, action, code", [
    (Seen("ACCEPTED"), "wait", 0),
    (Seen("PROVISIONING"), "wait", 0),
    (Seen("WAITING_FOR_RESOURCES"), "wait", 0),
    (Seen("ACTIVE", node_state="READY"), "wait", 0),
    (Seen("ACTIVE", node_state="READY", exit={"exit_code": 0}), "done", 0),
    (Seen(None, exit={"exit_code": 0, "ran": False, "reason": "already complete"}), "done", 0),
    (Seen(None, exit={"exit_code": 75}), "restart", 75),
    (Seen("ACTIVE", exit={"exit_code": 3, "ran": False}), "restart", 3),
    (Seen(None, exit={"exit_code": 1}), "stop", 1),
    (Seen(None, exit={"exit_code": 2}), "stop", 2),
    (Seen(None, exit={"exit_code": 137}), "stop", 137),
    (Seen(None, exit={"exit_code": 124}), "stop", 124),  # --max-run-duration or --stall-timeout: never restarted
    (Seen("SUSPENDING", initiator="SERVICE"), "wait", 0),  # the job is saving on its preemption notice
    (Seen("SUSPENDING", initiator="SERVICE", preempting_for_s=91), "restart", 75),
    (Seen("SUSPENDED", initiator="SERVICE"), "restart", 75),
    (Seen("ACTIVE", node_state="PREEMPTED"), "wait", 0),
    (Seen("ACTIVE", node_state="PREEMPTED", preempting_for_s=91), "restart", 75),
    (Seen("ACTIVE", node_state="TERMINATED", preempting_for_s=91), "restart", 75),
    (Seen("SUSPENDING", exit={"exit_code": 75}), "restart", 75),
    (Seen("FAILED", failure="valid until time passed"), "restart", 3),
    (Seen(None), "stop", 3),
    (Seen(None, cancelled=True), "stop", 130),
    (Seen("ACTIVE", node_state="READY", cancelled=True, exit={"exit_code": 75}), "stop", 130),
])
def test_what_the_watcher_does_in_each_state(seen, action, code):
    decision = decide(seen)
    assert (decision.action, decision.exit_code) == (action, code), decision.reason
    assert isinstance(decision, Decision) and decision.reason


# --- the loop, end to end ------------------------------------------------------------------------


class Cloud:
    """One job's world: the fakes, a bucket, the VM's behaviour, and the environment the CLI runs in."""

    def __init__(self, api: TpuFake, metadata: MetadataFake, gcs, folder: Path):
        self.api, self.metadata, self.gcs, self.folder = api, metadata, gcs, folder
        self.bucket = gcs.bucket()
        self.env = cloud_env(
            api.endpoint, folder, CLOUDSDK_API_ENDPOINT_OVERRIDES_LOGGING=f"{api.endpoint}/", **gcs.env
        )
        self.run_dir = f"gs://{self.bucket}/runs/mnist_cnn"

    def vm(self, job: str, **extra: str) -> None:
        """What the next VMs do (see tests/support/tpu_vm.py), and the queued resources' timing."""
        self.vm_env = env = vm_env(
            self.folder / "vm",
            metadata_host=self.metadata.host,
            tpu_endpoint=self.api.endpoint,
            job=job,
            gcs_env=self.gcs.env,
            logging_endpoint=self.api.endpoint,
            **{"RUNNER_UPLOAD_EVERY_S": "1", "RUNNER_FAKE_PROJECT": PROJECT, **extra},
        )
        self.api.configure(lifecycle=LIFECYCLE, boot={"env": env, "folder": str(self.folder / "boots"), "workers": 1})

    def spec(self, data: str | None = None, into: Path | None = None, **sections: Any) -> Path:
        """The job's spec, in this test's folder or `into` (a folder of its own: the code folder `submit` sends)."""
        doc = {
            "name": "mnist_cnn",
            "data": {"train": data or f"gs://{self.bucket}/data/train-*.tfrecord", "eval": None},
            "train": {"epochs": 2},
            "output": {"dir": f"gs://{self.bucket}/runs"},
        }
        doc["data"].update(sections.pop("batch", {}))
        for section, values in sections.items():
            doc.setdefault(section, {}).update(values)
        return write_spec(into or self.folder, doc)

    def submit_args(self, spec: Path, *extra: str) -> list[str]:
        return [
            "submit",
            str(spec),
            "--tpu-type",
            "v5litepod-8",
            "--zone",
            ZONE,
            "--project",
            PROJECT,
            "--image",
            IMAGE,
            "--no-preflight",  # the recovery is under test here; the preflight is in test_submit_preflight.py
            "--watch",
            "--interval",
            "0.5",
            *extra,
        ]

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "runner", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=REPO,
        )

    def creates(self) -> list[dict]:
        return [r for r in self.api.requests() if r["method"] == "POST" and r["path"].endswith("/queuedResources")]

    def job(self) -> dict | None:
        return self.object("job.json")

    def object(self, name: str) -> dict | None:
        """A JSON file of the run folder, or None while it is not there (or is being replaced)."""
        from google.api_core import exceptions

        try:
            return json.loads(self.gcs.read(self.bucket, f"runs/mnist_cnn/{name}"))
        except (exceptions.NotFound, json.JSONDecodeError):
            return None


@pytest.fixture
def cloud(tpu_fake, metadata_fake, gcs, tmp_path) -> Cloud:
    return Cloud(tpu_fake, metadata_fake, gcs, tmp_path)


def wait_until(probe, process: subprocess.Popen | None = None, timeout: float = 120, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        if process is not None and process.poll() is not None:
            _, err = process.communicate()
            raise AssertionError(f"the process ended ({process.returncode}) first: {err[-3000:]}")
        time.sleep(every)
    raise AssertionError(f"waited {timeout:g} s for {awaited(probe)}: not reached")


def test_a_bad_spec_exit_2_is_not_restarted(cloud):
    cloud.vm("exit:2")
    code, out, err = finish(cloud.start(*cloud.submit_args(cloud.spec(), "--max-restarts", "3")), timeout=900)
    assert code == 2, err[-3000:]
    assert "exit 2 is not retryable" in err
    final = last_json(out)
    assert final["outcome"]["outcome"] == "failed" and final["restarts"] == []
    assert len(cloud.creates()) == 1, "a job that fails on its spec is never created again"
    assert cloud.job()["outcome"]["exit_code"] == 2


def test_a_stalled_job_is_not_restarted_even_on_spot_and_its_slice_goes(cloud):
    cloud.vm("stall")  # the job's stall guard fires after the --stall-timeout it was given: exit 124, "stalled"
    args = cloud.submit_args(cloud.spec(), "--spot", "--stall-timeout", "10s")
    code, out, err = finish(cloud.start(*args), timeout=900)
    assert code == 124, err[-3000:]
    final = last_json(out)
    assert final["outcome"]["outcome"] == "stalled" and final["restarts"] == []
    assert "--max-run-duration or --stall-timeout; not restarted" in final["outcome"]["reason"]
    assert len(cloud.creates()) == 1, "spot restarts are for preemptions, not for a job that stopped itself"
    assert [r for r in cloud.api.requests() if r["method"] == "DELETE"], "the slice was deleted"
    assert wait_until(lambda: tpu_fake_has_no_queued_resource(cloud), timeout=300)


def test_repeated_preemption_stops_when_the_restarts_are_spent_and_says_so(cloud):
    cloud.vm("exit:75")
    code, out, err = finish(cloud.start(*cloud.submit_args(cloud.spec(), "--spot", "--max-restarts", "2")), timeout=900)
    assert code == 75, err[-3000:]
    assert "gave up" in err and "2 of 2 restarts spent (--max-restarts 2)" in err
    creates = cloud.creates()
    assert len(creates) == 3, "the first submission and two restarts"
    ids = [c["body"]["tpu"]["nodeSpec"][0]["node"]["labels"]["runner-submission"] for c in creates]
    assert len(set(ids)) == 3, "every submission has its own id"
    final = last_json(out)
    assert final["outcome"]["outcome"] == "gave_up"
    assert [r["from"] for r in final["restarts"]] == ids[:2] and [r["to"] for r in final["restarts"]] == ids[1:]
    assert all("preempted (exit 75)" in r["cause"] for r in final["restarts"])
    assert final["submissions"] == ids
    assert tpu_fake_has_no_queued_resource(cloud)


def test_a_failed_queued_resource_is_created_again_and_a_cancel_stops_the_watcher(cloud):
    cloud.vm("hold:0")  # never released: the job still runs when it is cancelled
    cloud.api.configure(lifecycle={"provisioning_s": None, "active_s": None})  # the test moves the states
    watcher = cloud.start(*cloud.submit_args(cloud.spec(), "--max-restarts", "1"))
    wait_until(lambda: cloud.creates(), watcher)
    cloud.api.set_state("mnist-cnn", "FAILED")  # e.g. its --valid-until passed before capacity came
    wait_until(lambda: len(cloud.creates()) == 2, watcher, timeout=300)
    cloud.api.set_state("mnist-cnn", "PROVISIONING")
    cloud.api.set_state("mnist-cnn", "ACTIVE", node_state="READY")  # the VM boots and the job starts
    wait_until(
        lambda: (
            (job := cloud.job())
            and len(job["submissions"]) == 2
            and cloud.object(f"logs/{job['submissions'][1]['id']}/worker-0.started.json")
        ),
        watcher,
        timeout=300,
    )
    cancelled = invoke("cancel", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=cloud.env)
    assert cancelled.returncode == 0, cancelled.stderr
    code, out, err = finish(watcher, timeout=900)
    assert code == 130, err[-3000:]
    final = last_json(out)
    assert final["outcome"]["outcome"] == "cancelled"
    assert [r["cause"] for r in final["restarts"]] == ["the queued resource FAILED"]
    assert len(cloud.creates()) == 2, "a cancelled job is not created again"


def test_the_watcher_rides_out_an_api_that_does_not_answer_for_a_while(cloud):
    cloud.vm("hold:0")
    watcher = cloud.start(*cloud.submit_args(cloud.spec()))
    wait_until(
        lambda: (job := cloud.job()) and cloud.object(f"logs/{job['submissions'][0]['id']}/worker-0.started.json"),
        watcher,
    )
    cloud.api.fail(3)  # three polls in a row meet 503 UNAVAILABLE
    after = len(cloud.api.requests())
    wait_until(
        lambda: len([r for r in cloud.api.requests()[after:] if r["path"].startswith("/v2/projects/")]) >= 3,
        watcher,
        every=0.05,
    )
    release(cloud.vm_env)  # the job ends once the watcher has met the failures (the VM's delete meets none)
    code, out, err = finish(watcher, timeout=900)
    assert code == 0, err[-3000:]
    assert "3 of 20 failures in a row; trying again" in err
    assert last_json(out)["outcome"]["outcome"] == "complete"


def test_a_watcher_killed_and_started_again_picks_up_the_same_job_and_never_duplicates_it(cloud):
    cloud.vm("hold:75,exit:0")
    cloud.api.configure(lifecycle={**LIFECYCLE, "deleting_s": 2.5})  # a slow delete: time to kill mid-restart
    spec = cloud.spec()
    first = cloud.start(*cloud.submit_args(spec, "--spot"))
    wait_until(
        lambda: cloud.job() and cloud.object(f"logs/{cloud.job()['submissions'][0]['id']}/worker-0.started.json"), first
    )
    first.send_signal(signal.SIGKILL)  # the laptop's lid closes while the job runs
    finish(first)

    again = cloud.start("watch", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, "--interval", "0.5")
    release(cloud.vm_env)  # the job is preempted (exit 75)
    # The job exits 75; the watcher records the restart, then deletes; killed in between, it must resume it.
    wait_until(
        lambda: (job := cloud.job()) and job["restarts"] and job["restarts"][-1]["to"] is None, again, every=0.05
    )
    again.send_signal(signal.SIGKILL)
    finish(again)
    assert len(cloud.creates()) == 1

    last = cloud.start("watch", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, "--interval", "0.5")
    code, out, err = finish(last, timeout=900)
    assert code == 0, err[-3000:]
    assert "finishing the restart begun at" in err
    creates = cloud.creates()
    assert len(creates) == 2, "one restart, made once"
    final = last_json(out)
    assert final["outcome"]["outcome"] == "complete" and len(final["restarts"]) == 1
    restart = final["restarts"][0]
    assert restart["to"] == creates[1]["body"]["tpu"]["nodeSpec"][0]["node"]["labels"]["runner-submission"]
    assert restart["time_lost_s"] is not None and restart["time_lost_s"] >= 0

    status = invoke("status", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=cloud.env)
    assert status.returncode == 0, status.stderr
    shown = last_json(status.stdout)
    assert (shown["state"], shown["restarts"][0]["cause"]) == ("complete", restart["cause"])

    listing = invoke("status", "--zone", ZONE, "--project", PROJECT, env=cloud.env)
    assert listing.returncode == 0, listing.stderr
    [row] = [json.loads(line) for line in listing.stdout.splitlines() if line.strip()]
    assert (row["name"], row["restarts"], row["state"]) == ("mnist-cnn", 1, "complete")
    assert row["usd"] is not None and row["usd"] >= 0


def test_logs_follow_streams_through_cloud_logging_within_seconds(cloud):
    cloud.vm("hold:0", RUNNER_UPLOAD_EVERY_S="600")  # the bucket copy comes only at the end
    submitted = invoke(*cloud.submit_args(cloud.spec())[:-3], env=cloud.env)  # no --watch
    assert submitted.returncode == 0, submitted.stderr
    follower = cloud.start("logs", "mnist-cnn", "--follow", "--interval", "0.5", "--zone", ZONE, "--project", PROJECT)
    started = time.monotonic()
    line = wait_until(lambda: _read_line(follower), follower, timeout=300)
    assert "epoch 1/2: training" in line
    sub = cloud.job()["submissions"][0]["id"]
    assert cloud.object(f"logs/{sub}/worker-0.exit.json") is None, "seen while the job still runs"
    listed = [r for r in cloud.api.requests() if r["path"] == "/v2/entries:list"]
    assert listed and f'jsonPayload.container.name="/runner-mnist-cnn-{sub}-w0"' in listed[-1]["body"]["filter"]
    release(cloud.vm_env)
    code, out, err = finish(follower, timeout=900)
    assert code == 0, err
    assert '"status": "succeeded"' in out
    assert time.monotonic() - started < 60


def _read_line(process: subprocess.Popen) -> str | None:
    import select

    ready, _, _ = select.select([process.stdout], [], [], 0.1)
    return process.stdout.readline() if ready else None


def tpu_fake_has_no_queued_resource(cloud: Cloud) -> bool:
    listing = invoke("status", "--zone", ZONE, "--project", PROJECT, env=cloud.env)
    rows = [json.loads(line) for line in listing.stdout.splitlines() if line.strip()]
    return all(row["state"] not in ("ACTIVE", "SUSPENDED", "FAILED", "ACCEPTED") for row in rows)


@pytest.mark.slow
def test_preemption_mid_epoch_resumes_from_the_newest_checkpoint_with_the_exact_final_step(
    cloud, tiny_mnist, tmp_path, monkeypatch
):
    """The job as the TPU image runs it (Keras on JAX, Orbax's checkpoints in the bucket), preempted as a Spot VM
    is: its container stopped through Docker; the restart record's step is Orbax's newest whole step."""
    for key, value in cloud.gcs.env.items():  # this process reads the bucket's checkpoints as `runner status` does
        monkeypatch.setenv(key, value)
    data = cloud.gcs.upload_folder(tiny_mnist, cloud.bucket, "data")
    steps, epochs = 40, 3
    job = tmp_path / "job"
    job.mkdir()
    # allow_chance: a few hundred tiny-MNIST steps may end near chance, which `runner run` reports as exit 4;
    # this test is about resuming to the exact final step, not about what the model learned.
    spec = cloud.spec(
        data=f"{data}/train-*.tfrecord",
        into=job,
        accelerator={"backend": "jax"},
        model={"name": dense_model(job)},  # sent with the job as its code, as `runner submit` sends it
        train={"epochs": epochs, "steps_per_epoch": steps, "allow_chance": True},
        checkpoint={"grace_s": 20, "every_steps": 8},  # a save 8 steps into epoch 2 says it has begun
        output={"tensorboard": False, "saved_model": False},
        batch={"global_batch_size": 128, "shuffle_buffer": 512},
    )
    cloud.vm("jax")
    watcher = cloud.start(*cloud.submit_args(spec, "--spot", "--max-restarts", "2"))

    # Into epoch 2 (a whole save there), not a wall-clock guess: a busy machine may not have begun it yet.
    wait_until(lambda: (s := checkpoints.latest_step(cloud.run_dir)) is not None and s > steps, watcher,
               timeout=600, every=0.2)
    cloud.api.preempt("mnist-cnn", grace_s=20)  # Spot preemption: SIGTERM on the VM, then it is gone
    code, out, err = finish(watcher, timeout=900)
    assert code == 0, err[-4000:]
    final = last_json(out)
    assert final["status"] == "succeeded" and final["outcome"]["outcome"] == "complete"
    [restart] = final["restarts"]
    assert "SUSPEND" in restart["cause"] and "SERVICE" in restart["cause"]
    saved = restart["step_reached"]
    assert saved is not None, "the restart record names the newest Orbax step"
    assert steps < saved < epochs * steps and saved % steps, f"the notice's save is mid-epoch, got step {saved}"
    assert final["resumed_from_step"] == saved
    assert final["final_step"] == epochs * steps, "no step trained twice, none skipped"
    assert final["accelerator"]["backend"]["name"] == "jax"
    assert restart["time_lost_s"] is not None
    assert len(cloud.creates()) == 2
