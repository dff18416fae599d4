"""`runner doctor` as a user runs it on this machine (no TPU): the whole report, the TensorFlow and TPU
checks in their child process, and buckets on a real GCS emulator, with real processes, a real held
lockfile and a tampered shard. Only what cannot exist here is stood in for: a TPU that never answers and a
TensorFlow that aborts or hangs at import (a package that does just that, as a mismatched libtpu does).
The host checks one by one (versions, devices, allocator, lockfile, credentials): test_doctor_checks.py.

The doctor imports no TensorFlow and sets no signal handler (its probe does the TensorFlow and TPU work in a
child of its own), so it runs in this process with Typer's CliRunner; against the GCS emulator it runs as a
child, as a user runs it, so no storage client outlives its test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from runner.doctor import checks
from runner.doctor import report as doctor_module
from runner.spec.types import JobSpec
from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke
from tests.test_doctor_checks import HOLD_LOCK, spawn, stop

TIMEOUT = 30


def doctor(*args: Any, env: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """`runner doctor --json ARGS` in this process; bounded by its own --timeout per check."""
    result = invoke("doctor", "--json", *args, env=env)
    assert result.stdout.strip(), result.stderr
    return result.returncode, last_json(result.stdout)


def doctor_child(*args: Any, env: dict[str, str], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    result = run_cli("doctor", "--json", *args, env=env, timeout=timeout)
    assert result.stdout.strip(), result.stderr
    return result.returncode, last_json(result.stdout)


def named(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in report["checks"]}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The CLI's environment, with libtpu's lockfile moved out of the real /tmp."""
    return cli_env(RUNNER_LIBTPU_LOCKFILE=str(tmp_path / "libtpu_lockfile"))


# --- the whole doctor, as a user runs it ------------------------------------------------------


def test_doctor_on_a_machine_without_tpu_says_so_within_its_bound(env) -> None:
    code, report = doctor("--timeout", TIMEOUT, env=env)
    checks_ = named(report)
    assert code == 0 and report["exit_code"] == 0, report
    assert list(checks_) == ["versions", "devices", "allocator", "lockfile", "credentials", "gcs", "tensorflow", "tpu"]
    assert checks_["versions"]["status"] == "ok" and "tensorflow-cpu 2.21.0" in checks_["versions"]["evidence"]
    assert checks_["tensorflow"]["status"] == "ok" and checks_["tensorflow"]["data"]["version"] == "2.21.0"
    assert checks_["tpu"]["status"] == "ok" and checks_["tpu"]["evidence"].startswith("not used: no TPU")
    assert checks_["devices"]["status"] == "warn" and "runs on the CPU" in checks_["devices"]["evidence"]
    assert checks_["lockfile"]["status"] == "ok"
    assert all(check["seconds"] <= TIMEOUT for check in report["checks"])
    assert report["seconds"] < 2 * TIMEOUT


def test_spec_with_local_data_passes_every_check(mnist_job, env, tmp_path: Path) -> None:
    code, report = doctor(mnist_job("local"), "--timeout", TIMEOUT, env=env)
    checks_ = named(report)
    assert code == 0, report
    assert checks_["data_train"]["status"] == "ok" and checks_["data_train"]["data"]["records"] == 512
    assert "sha256 of 4 match" in checks_["data_train"]["evidence"]
    assert checks_["data_eval"]["status"] == "ok" and checks_["data_eval"]["data"]["records"] == 512
    assert checks_["storage_write"]["status"] == "ok"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [], "the write probe is deleted"
    assert checks_["batch"]["status"] == "ok"
    assert checks_["batch"]["evidence"].startswith("32 = 1 replica x 32 (accelerator.cpu_devices on the CPU)")
    assert "train: 16 steps of 32 from 512 records" in checks_["batch"]["evidence"]
    assert "storage_read" not in checks_, "only gs:// folders get a read probe"


def test_spec_with_tampered_shard_empty_glob_and_odd_batch_names_each(tiny_mnist, env, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_mnist, data)
    shard = data / "train-00001-of-00004.tfrecord"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    spec = write_spec(tmp_path, {
        "name": "broken",
        "accelerator": {"kind": "cpu", "cpu_devices": 3},
        "data": {"train": f"{data}/train-*.tfrecord", "eval": f"{data}/valid-*.tfrecord", "global_batch_size": 128},
        "output": {"dir": str(tmp_path / "runs")},
    })
    code, report = doctor(spec, "--timeout", TIMEOUT, env=env)
    checks_ = named(report)
    assert code == 2, "only data and batch checks fail: a spec/data problem"
    assert checks_["data_train"]["status"] == "fail"
    assert str(shard) in checks_["data_train"]["evidence"] and "does not match" in checks_["data_train"]["evidence"]
    assert "train-00000" not in checks_["data_train"]["evidence"]
    assert checks_["data_eval"]["status"] == "fail" and "no files match" in checks_["data_eval"]["evidence"]
    assert checks_["batch"]["status"] == "fail"
    assert "not divisible by the 3 replicas" in checks_["batch"]["evidence"]
    assert "126 or 129" in checks_["batch"]["action"]


def test_save_needs_a_spec(env) -> None:
    result = invoke("doctor", "--save", env=env)  # refused before any check runs: in this process
    assert result.returncode == 2 and "--save needs a SPEC" in result.stderr


def test_a_set_without_a_spec_is_checked_against_the_defaults(env) -> None:
    """`runner doctor --set accelerator.backend=tensorflow` is not dropped for want of a spec (the TPU test in
    tests/test_tpu_runtime.py follows it to TensorFlow's TPU start); a wrong key is refused before any check."""
    result = invoke("doctor", "--set", "accelerator.bakend=tensorflow", env=env)
    assert result.returncode == 2
    assert "--set 'accelerator.bakend=tensorflow': accelerator.bakend: unknown key 'bakend'; did you mean 'backend'?" \
        in result.stderr


def test_batch_arithmetic_for_the_replicas_found_or_asked() -> None:
    spec = JobSpec.model_validate({"data": {"global_batch_size": 1000}})
    records = {"train": 60000, "eval": 10000}
    even = doctor_module.check_batch(spec, 8, "--replicas", records)
    assert even.status == "ok" and even.evidence.startswith("1000 = 8 replicas x 125")
    assert "train: 60 steps of 1000 from 60000 records" in even.evidence
    spec = JobSpec.model_validate({"data": {"global_batch_size": 1000}, "accelerator": {"kind": "tpu"}})
    planned = doctor_module._batch(spec, [], replicas=16)
    assert planned.status == "fail" and "not divisible by the 16 replicas (--replicas)" in planned.evidence
    assert "992 or 1008" in planned.action
    tpu = checks.Check("tpu", "ok", "local: 8 cores", data={"replicas": 8, "target": "local"})
    found = doctor_module._batch(spec, [tpu], replicas=None)
    assert found.status == "warn" and "125 per core is not a multiple of 8" in found.evidence
    assert doctor_module._batch(spec, [], replicas=None).status == "warn", "no TPU started: replicas unknown"
    small = doctor_module.check_batch(JobSpec(), 1, "one CPU", {"train": 2048, "eval": 512})
    assert small.status == "fail" and "data.eval: 512 records make no full batch of 1024" in small.evidence


# --- TPU initialisation in a child process ----------------------------------------------------


def test_a_tpu_vm_whose_tpu_is_taken_fails_fast_naming_the_holder(env) -> None:
    holder = spawn(HOLD_LOCK, env["RUNNER_LIBTPU_LOCKFILE"])
    try:
        code, report = doctor("--timeout", TIMEOUT, env={**env, "TPU_NAME": "local"})
    finally:
        stop(holder)
    checks_ = named(report)
    assert code == 3
    assert checks_["lockfile"]["status"] == "fail" and checks_["lockfile"]["data"]["holder"] == holder.pid
    # A TPU makes `auto` compute with JAX: TensorFlow (tensorflow-cpu there) is not asked for the TPU, JAX is.
    assert checks_["tpu"]["status"] == "ok" and "computes with JAX" in checks_["tpu"]["evidence"]
    assert checks_["devices"]["status"] == "fail" and "is 'local'" in checks_["devices"]["evidence"]
    # This machine has jax without libtpu: a TPU wanted here has no TPU runtime, said twice, from metadata and by JAX.
    assert checks_["versions"]["status"] == "fail" and "a TPU is wanted, but libtpu is not installed" in \
        checks_["versions"]["evidence"]
    assert checks_["jax"]["status"] == "fail" and "finds no libtpu" in checks_["jax"]["evidence"]


def test_a_tpu_that_never_answers_is_bounded_by_accelerator_timeout(mnist_job, env) -> None:
    # TensorFlow's TPU path (a remote TPU node at COLAB_TPU_ADDR): under JAX the tpu check leaves it to JAX.
    spec = mnist_job("silent", accelerator={"kind": "auto", "backend": "tensorflow", "timeout_s": 3})
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never speaks gRPC
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        code, report = doctor(spec, "--timeout", TIMEOUT, env={**env, "COLAB_TPU_ADDR": address})
    checks_ = named(report)
    assert code == 3 and checks_["tpu"]["status"] == "fail", report
    assert "did not finish within" in checks_["tpu"]["evidence"] or "no answer within 3 s" in checks_["tpu"]["evidence"]
    assert checks_["tpu"]["seconds"] < 3 + 5
    assert checks_["data_train"]["status"] == "ok", "a hung TPU hides none of the other checks"


def fake_tensorflow(folder: Path, body: str) -> dict[str, str]:
    """A `tensorflow` package first on the path: what a broken TensorFlow install does at import."""
    (folder / "tensorflow").mkdir(parents=True)
    (folder / "tensorflow" / "__init__.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_tensorflow_that_aborts_at_import_is_reported_and_the_doctor_survives(env, tmp_path: Path) -> None:
    # What tensorflow-tpu 2.20.0 does once libtpu 0.0.52 loads (seen with TPU_LOAD_LIBRARY=1): this line, SIGABRT.
    path = fake_tensorflow(tmp_path / "site", """
        import os, sys
        sys.stderr.write("F0000 tpu_library_init_fns.inc:12] "
                         "ConfigureDistributedTpuOp_DoWork not available in this library.\\n")
        sys.stderr.flush()
        os.abort()
    """)
    code, report = doctor("--timeout", TIMEOUT, env={**env, **path})
    checks_ = named(report)
    assert code == 3
    assert checks_["tensorflow"]["status"] == "fail"
    assert "died (signal SIGABRT) during import tensorflow" in checks_["tensorflow"]["evidence"]
    assert "ConfigureDistributedTpuOp_DoWork not available" in checks_["tensorflow"]["evidence"]
    assert checks_["tpu"]["status"] == "fail" and checks_["tpu"]["evidence"].startswith("not run")


def test_tensorflow_that_hangs_at_import_is_killed_by_pid_and_tabled(env, tmp_path: Path) -> None:
    path = fake_tensorflow(tmp_path / "site", "import time\ntime.sleep(3600)\n")
    began = time.monotonic()
    result = run_cli("doctor", "--timeout", "2", env={**env, **path}, timeout=60)
    assert result.returncode == 3 and time.monotonic() - began < 30
    lines = result.stdout.splitlines()
    assert all(column in lines[1] for column in ("check", "status", "evidence", "what to do"))
    assert lines[-1].startswith("doctor: 2 fail, ")
    code, report = doctor("--timeout", "2", env={**env, **path})
    tensorflow = named(report)["tensorflow"]
    assert "no answer within 2 s during import tensorflow; killed the probe (pid" in tensorflow["evidence"]
    pid = int(re.search(r"killed the probe \(pid (\d+)\)", tensorflow["evidence"]).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# --- buckets on the GCS emulator ---------------------------------------------------------------


def upload(gcs, folder: Path, bucket: str, prefix: str) -> None:
    target = gcs.client().bucket(bucket)
    for path in folder.iterdir():
        target.blob(f"{prefix}/{path.name}").upload_from_filename(str(path))


def gcs_spec(tmp_path: Path, bucket: str, output: str) -> Path:
    return write_spec(tmp_path, {
        "name": "remote",
        "accelerator": {"kind": "cpu"},
        "data": {"train": f"gs://{bucket}/mnist/train-*.tfrecord", "eval": None, "global_batch_size": 128},
        "output": {"dir": output},
    })


def test_bucket_read_write_and_saved_report(gcs, tiny_mnist, env, tmp_path: Path) -> None:
    bucket = gcs.bucket()
    upload(gcs, tiny_mnist, bucket, "mnist")
    spec = gcs_spec(tmp_path, bucket, f"gs://{bucket}/runs")
    code, report = doctor_child(spec, "--save", "--timeout", TIMEOUT, env={**env, **gcs.env})
    checks_ = named(report)
    assert code == 0, report
    assert checks_["storage_read"]["status"] == "ok"
    assert f"gs://{bucket}/mnist/manifest.json" in checks_["storage_read"]["evidence"]
    assert checks_["storage_write"]["status"] == "ok"
    assert checks_["data_train"]["status"] == "ok" and checks_["data_train"]["data"]["hashed"] == 4
    assert checks_["credentials"]["status"] == "ok"
    assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" in checks_["credentials"]["evidence"]
    assert checks_["gcs"]["status"] == "ok"
    assert report["saved_to"] == f"gs://{bucket}/runs/remote/doctor.json"
    saved = json.loads(gcs.read(bucket, "runs/remote/doctor.json"))
    assert [c["name"] for c in saved["checks"]] == [c["name"] for c in report["checks"]]
    assert not [name for name in gcs.objects(bucket) if ".runner-doctor-" in name], "the probe object is deleted"


def test_output_bucket_that_does_not_exist_fails(gcs, tiny_mnist, env, tmp_path: Path) -> None:
    bucket = gcs.bucket()
    upload(gcs, tiny_mnist, bucket, "mnist")
    spec = gcs_spec(tmp_path, bucket, "gs://no-such-bucket-here/runs")
    code, report = doctor_child(spec, "--timeout", TIMEOUT, env={**env, **gcs.env})
    write = named(report)["storage_write"]
    assert code == 3 and write["status"] == "fail" and "gs://no-such-bucket-here does not exist" in write["evidence"]
    assert named(report)["storage_read"]["status"] == "ok"


def test_bucket_that_refuses_writes_fails_with_the_role_to_grant(gcs_faults, tiny_mnist, env, tmp_path: Path) -> None:
    bucket = gcs_faults.bucket()
    upload(gcs_faults, tiny_mnist, bucket, "mnist")
    # The emulator has no IAM: the fault proxy answers uploads as GCS does for a reader-only identity.
    gcs_faults.faults.set([{"match": r"^(POST|PUT) /upload/", "action": "status", "status": 403}])
    spec = gcs_spec(tmp_path, bucket, f"gs://{bucket}/runs")
    code, report = doctor_child(spec, "--timeout", TIMEOUT, env={**env, **gcs_faults.env})
    checks_ = named(report)
    assert code == 3
    assert checks_["storage_write"]["status"] == "fail"
    assert "roles/storage.objectCreator" in checks_["storage_write"]["action"]
    assert checks_["storage_read"]["status"] == "ok" and checks_["data_train"]["status"] == "ok"
    assert gcs_faults.faults.stats()["status"] >= 1
