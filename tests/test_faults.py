"""Storage faults: a fault proxy between the clients and the emulator answers 503, drops connections, cuts
responses short and delays them. Jobs must finish with correct results, or, when storage stays away longer
than `storage.timeout_s`, stop with exit 3 naming the bucket, never hang.

TensorFlow's gs:// client retries internally and exposes no count (its retry log is VLOG 1), so for `runner
run` the proxy's own counts prove the faults happened; `runner prepare` (google-cloud-storage) reports its
retries, and they must equal the faults injected.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from runner.data.storage import storage_error, tensorflow_env
from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.runs import finish, indexed_step, start_run, wait_for

ANY = r"^(GET|POST|PUT|DELETE) "
MEDIA_READ = r"^GET /b-"  # object bytes (storage.googleapis.com/<bucket>/<object>): where a cut hurts most


def gcs_index(gcs, bucket: str, run: str) -> str | None:
    name = f"runs/{run}/checkpoints/checkpoint"
    return gcs.read(bucket, name).decode() if name in gcs.objects(bucket, f"runs/{run}/checkpoints/") else None


@pytest.mark.parametrize("timeout_s", [2, 4, 30, 300, 3600])
def test_storage_timeout_sets_tensorflow_retries_that_add_up_to_it(timeout_s):
    env = tensorflow_env(timeout_s)
    init, longest = int(env["GCS_RETRY_CONFIG_INIT_DELAY_TIME_US"]), int(env["GCS_RETRY_CONFIG_MAX_DELAY_TIME_US"])
    retries = int(env["GCS_RETRY_CONFIG_MAX_RETRIES"])
    # TensorFlow waits min(init << n, max) (+ up to 1 s of jitter) before retry n (tsl/platform/retrying_utils.cc).
    waits = [min(init << n, longest) / 1e6 for n in range(retries)]
    assert timeout_s <= sum(waits) < timeout_s + longest / 1e6
    assert int(env["GCS_REQUEST_IDLE_TIMEOUT_SECS"]) <= max(2, timeout_s)


# storage.timeout_s 2 s: TensorFlow then waits 0.25-0.5 s (+ its jitter) before each of its 5 retries instead of the
# default's 1-32 s, so the same faults and the same outage cost a fraction of the time; the retry count that
# carries a request through consecutive faults is the same 5 as at storage.timeout_s 4 s.
FAST_RETRIES = {"timeout_s": 2}


@pytest.mark.slow
def test_a_short_job_completes_through_503s_drops_cuts_and_delays(gcs_faults, small_mnist, mnist_job):
    bucket = gcs_faults.bucket()
    data_url = gcs_faults.upload_folder(small_mnist, bucket, "mnist")  # straight to the emulator, past the faults
    spec = mnist_job(
        "faulty",
        data={"train": f"{data_url}/train-*.tfrecord", "eval": f"{data_url}/test-*.tfrecord"},
        output={"dir": f"gs://{bucket}/runs", "tensorboard": False},
        checkpoint={"every_steps": 8},
        storage=FAST_RETRIES,
    )
    gcs_faults.faults.set(
        [
            # An upload PUT failing once makes TensorFlow ask how much arrived, then upload again.
            {"match": r"^PUT /upload/", "action": "status", "status": 503, "times": 1},
            {"match": r"^PUT /upload/.*/checkpoints/", "action": "drop", "times": 1},
            {"match": MEDIA_READ, "action": "cut", "p": 0.5, "times": 3},
            {"match": ANY, "action": "status", "status": 503, "p": 0.05, "times": 6},
            {"match": ANY, "action": "drop", "p": 0.03, "times": 3},
            {"match": ANY, "action": "delay", "delay_s": 0.3, "p": 0.05, "times": 6},
        ],
        seed=7,
    )
    result = run_cli("run", spec, env=cli_env(**gcs_faults.env), timeout=400)
    stats = gcs_faults.faults.stats()
    assert result.returncode == 0, result.stderr[-3000:]
    assert stats["cut"] >= 1 and stats["status"] >= 1 and stats["drop"] >= 1 and stats["delay"] >= 1, stats
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded"
    assert summary["final_step"] == 32 and [e["steps"] for e in summary["epochs"]] == [16, 16]
    assert summary["metrics"]["examples"] == 512
    assert summary["metrics"]["accuracy"] > 0.5  # it learned from intact records (a cut record fails its CRC)
    gcs_faults.faults.clear()
    assert json.loads(gcs_faults.read(bucket, "runs/faulty/summary.json")) == summary
    assert indexed_step(gcs_index(gcs_faults, bucket, "faulty")) == 32


@pytest.mark.slow
def test_an_outage_longer_than_storage_timeout_fails_with_exit_3_and_the_rerun_resumes(
    gcs_faults, small_mnist, mnist_job
):
    bucket = gcs_faults.bucket()
    # Data and run folder in one bucket: the error names the bucket of whichever request gives up first.
    data_url = gcs_faults.upload_folder(small_mnist, bucket, "mnist")
    spec = mnist_job(
        "outage",
        data={"train": f"{data_url}/train-*.tfrecord", "eval": None},
        train={"epochs": 2, "steps_per_epoch": 16},
        output={"dir": f"gs://{bucket}/runs", "tensorboard": False},
        checkpoint={"every_steps": 8},
        storage=FAST_RETRIES,
    )
    process = start_run(spec, env=cli_env(**gcs_faults.env))
    saved = wait_for(lambda: indexed_step(gcs_index(gcs_faults, bucket, "outage")), process, every=0.3)
    gcs_faults.faults.set([{"match": ANY, "action": "status", "status": 503}])
    began = time.monotonic()
    code, out, err = finish(process, timeout=150)
    stopped_after = time.monotonic() - began
    assert code == 3, err[-3000:]
    assert stopped_after < 90, f"an outage past storage.timeout_s (2 s) took {stopped_after:.0f} s to stop the job"
    assert re.search(rf"error: storage unreachable: gs://{bucket}\b.*storage\.timeout_s \(2 s\)", err), err[-2000:]
    summary = last_json(out)
    assert summary["status"] == "failed" and f"gs://{bucket}" in summary["error"]
    assert gcs_faults.faults.stats()["status"] > 5  # it retried before giving up

    gcs_faults.faults.clear()  # the bucket is back
    result = run_cli("run", spec, env=cli_env(**gcs_faults.env))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["resumed_from_step"] >= saved
    assert summary["final_step"] == 32


def test_prepare_retries_through_faults_and_reports_them(gcs_faults):
    bucket = gcs_faults.bucket()
    gcs_faults.faults.set(
        [
            {"match": r"^POST /upload/", "action": "status", "status": 503, "p": 0.4, "times": 3},
            {"match": r"^POST /upload/", "action": "drop", "p": 0.3, "times": 2},
            {"match": r"^POST /upload/", "action": "cut", "p": 0.3, "times": 2},
        ],
        seed=3,
    )
    out = f"gs://{bucket}/mnist"
    env = cli_env(**gcs_faults.env)
    result = run_cli("prepare", "mnist", "--out", out, "--limit", "1200", "--shards", "4", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = gcs_faults.faults.stats()
    injected = stats["status"] + stats["drop"] + stats["cut"]
    assert stats["status"] >= 1 and stats["drop"] >= 1 and stats["cut"] >= 1, stats
    assert re.search(rf"uploaded 9 files, .* to {out} in .* \({injected} retries\)", result.stderr), (
        result.stderr[-2000:])
    gcs_faults.faults.clear()
    result = run_cli("verify", out, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_prepare_into_an_unreachable_bucket_stops_with_exit_3_in_bounded_time(gcs_faults):
    bucket = gcs_faults.bucket()
    gcs_faults.faults.set([{"match": ANY, "action": "status", "status": 503}])
    began = time.monotonic()
    result = run_cli(
        "prepare", "mnist", "--out", f"gs://{bucket}/mnist", "--limit", "100", "--storage-timeout", "1",
        env=cli_env(**gcs_faults.env), timeout=120,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert time.monotonic() - began < 60
    assert f"gs://{bucket} did not answer within 1 s" in result.stderr


def test_tensorflow_giving_up_on_gcs_inside_another_op_is_the_outage():
    """A checkpoint's merge step that meets the outage re-raises TensorFlow's retry text as InvalidArgumentError
    (seen: the background write of a checkpoint during a 503 outage). That is the bucket not answering (exit 3,
    run again), not a failed training (exit 1)."""
    import tensorflow as tf

    message = ("{{function_node __wrapped__MergeV2Checkpoints_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
               "allow_missing_files was set to false and "
               "gs://b-5/runs/outage/checkpoints/ckpt-16_temp/part-00000-of-00001 "
               "did not exist.ABORTED: All 5 retry attempts failed. The last failure: Error executing an HTTP request: "
               "HTTP response code 503 with body 'injected' [Op:MergeV2Checkpoints]")
    error = storage_error(tf.errors.InvalidArgumentError(None, None, message),
                          ("gs://b-5/mnist/*", None, "gs://b-5/runs"), 2)
    assert error is not None and error.exit_code == 3
    assert str(error).startswith("storage unreachable: gs://b-5 did not answer within storage.timeout_s (2 s)")
    # The same error type with no retry text is a real argument error: not a storage fault.
    assert storage_error(tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]"), (), 2) is None


@pytest.mark.parametrize("reported", ["/runs/outage/checkpoints", "gs://b-1/runs/outage/checkpoints"])
def test_no_folder_in_a_bucket_that_does_not_answer_is_the_outage_not_a_file_in_the_way(reported, tmp_path):
    """TensorFlow's gs:// client, asked for a folder while the bucket gives 503s, says "PATH is not a directory"
    with the bucket left out (seen when a checkpoint's background write met the outage). That is reported as
    the bucket not answering, with the full gs:// path; a local file in the way is still named as one."""
    import tensorflow as tf

    paths = ("gs://b-1/mnist/train-*.tfrecord", None, "gs://b-1/runs")
    error = storage_error(tf.errors.FailedPreconditionError(None, None, f"{reported} is not a directory"), paths, 2)
    assert error is not None and error.exit_code == 3
    assert str(error).startswith("storage unreachable: gs://b-1 did not answer within storage.timeout_s (2 s)")
    assert "gs://b-1/runs/outage/checkpoints" in str(error) and "run the same job again" in str(error)

    in_the_way = tmp_path / "checkpoints"
    in_the_way.write_text("not a folder")
    local = storage_error(OSError(f"{in_the_way} is not a directory"), (str(tmp_path / "d"), None, str(tmp_path)), 2)
    assert str(local).startswith(
        f"storage fault: {in_the_way}: Not a directory; a file stands where a folder is needed")


def test_manifest_of_an_unreachable_bucket_stops_within_the_specs_storage_timeout(gcs_faults, tmp_path: Path):
    bucket = gcs_faults.bucket()
    gcs_faults.faults.set([{"match": ANY, "action": "status", "status": 503}])
    spec = write_spec(tmp_path, {
        "name": "own", "data": {"train": f"gs://{bucket}/own/train-*.tfrecord",
                                "features": {"x": {"shape": [2], "dtype": "float32"}, "label": {"dtype": "int64"}},
                                "inputs": ["x"], "label": "label"},
        "storage": {"timeout_s": 1},
    })
    began = time.monotonic()
    result = run_cli("manifest", spec, env=cli_env(**gcs_faults.env), timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    assert time.monotonic() - began < 60, "TensorFlow's gs:// client retried past storage.timeout_s"
    assert f"gs://{bucket} did not answer within storage.timeout_s (1 s)" in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_of_an_unreachable_bucket_stops_within_its_storage_timeout(gcs_faults):
    """`runner verify gs://...` is bounded by --storage-timeout (the default, 300 s, would hold a user for
    minutes on a bucket that answers nothing but 503)."""
    bucket = gcs_faults.bucket()
    gcs_faults.faults.set([{"match": ANY, "action": "status", "status": 503}])
    began = time.monotonic()
    result = run_cli("verify", f"gs://{bucket}/mnist", "--storage-timeout", "1", env=cli_env(**gcs_faults.env),
                     timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    assert time.monotonic() - began < 60, "TensorFlow's gs:// client retried past --storage-timeout"
    assert f"gs://{bucket} did not answer within --storage-timeout (1 s)" in result.stderr
    assert "Traceback" not in result.stderr
