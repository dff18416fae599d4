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
from tests.support.metadata_fake import start_metadata_fake
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
    assert list(checks_) == ["versions", "devices", "allocator", "lockfile", "credentials", "gcs", "tensorflow"]
    assert checks_["versions"]["status"] == "ok" and "tensorflow-cpu 2.21.0" in checks_["versions"]["evidence"]
    assert checks_["tensorflow"]["status"] == "ok" and checks_["tensorflow"]["data"]["version"] == "2.21.0"
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
    """`runner doctor --set accelerator.backend=jax` is not dropped for want of a spec; a wrong key is refused
    before any check."""
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
    jax = checks.Check("jax", "ok", "JAX sees 8 TPU devices", data={"tpu_devices": 8, "device_kind": "TPU v5 lite"})
    found = doctor_module._batch(spec, [jax], replicas=None)
    assert found.status == "warn" and "125 per core is not a multiple of 8" in found.evidence
    assert "8 replicas x 125 (the TPU devices JAX sees (TPU v5 lite))" in found.evidence
    sliced = checks.Check("jax", "ok", "not started", data={"hosts": 2})
    unknown = doctor_module._batch(spec, [sliced], replicas=None)
    assert unknown.status == "warn" and "the TPU of a slice of 2 hosts starts in the job's join" in unknown.evidence
    typed = checks.Check("jax", "ok", "not started", data={"hosts": 4, "accelerator_type": "v6e-16",
                                                            "slice_devices": 16})
    whole = doctor_module._batch(spec, [typed], replicas=None)
    assert whole.status == "fail" and "not divisible by the 16 replicas (the TPU devices of v6e-16, a slice of 4 " \
        "hosts (the TPU table))" in whole.evidence
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
    assert "tpu" not in checks_, "TensorFlow (tensorflow-cpu) is never asked for the TPU: JAX is"
    assert checks_["devices"]["status"] == "fail" and "is 'local'" in checks_["devices"]["evidence"]
    # This machine has jax without libtpu: a TPU wanted here has no TPU runtime, said twice, from metadata and by JAX.
    assert checks_["versions"]["status"] == "fail" and "a TPU is wanted, but libtpu is not installed" in \
        checks_["versions"]["evidence"]
    assert checks_["jax"]["status"] == "fail" and "finds no libtpu" in checks_["jax"]["evidence"]


def libtpu_installed(site: Path) -> dict[str, str]:
    """libtpu's Python package as pip lays it out, its library a stand-in file that no loader accepts."""
    (site / "libtpu").mkdir(parents=True)
    (site / "libtpu" / "libtpu.so").write_bytes(b"\x7fELF stand-in")
    (site / "libtpu" / "__init__.py").write_text(
        "import os\ndef get_library_path():\n    return os.path.join(os.path.dirname(__file__), 'libtpu.so')\n")
    return {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_tensorflow_is_never_pointed_at_libtpu(env, tmp_path: Path) -> None:
    """A TPU VM's doctor (TPU_NAME=local, a v5e, libtpu installed): the job computes with JAX, so nothing of
    TensorFlow's TPU path (TF_PLUGGABLE_DEVICE_LIBRARY_PATH, PJRT_DEVICE) is set for the probe. tensorflow-cpu
    2.21 loads that variable's library while it imports: pointed at libtpu, `import tensorflow` fails here
    ("file too short") and on a TPU VM takes the TPU that JAX drives."""
    site = libtpu_installed(tmp_path / "site")
    tpu_vm = {"TPU_NAME": "local", "TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_SKIP_MDS_QUERY": "1"}
    code, report = doctor("--timeout", TIMEOUT, env={**env, **site, **tpu_vm})
    checks_ = named(report)
    assert checks_["tensorflow"]["status"] == "ok", checks_["tensorflow"]
    assert "tpu_runtime" not in checks_ and "tpu" not in checks_
    assert f"from {tmp_path / 'site' / 'libtpu' / 'libtpu.so'}" in checks_["jax"]["evidence"], "JAX alone loads it"
    # An environment that sets it itself: failed, as `runner run` refuses it, and kept from the probe's TensorFlow.
    pointed = {**env, **site, **tpu_vm, "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": str(tmp_path / "site/libtpu/libtpu.so")}
    code, report = doctor("--timeout", TIMEOUT, env=pointed)
    checks_ = named(report)
    assert code == 3 and checks_["tensorflow_env"]["status"] == "fail", report
    assert "points TensorFlow at libtpu" in checks_["tensorflow_env"]["evidence"]
    assert checks_["tensorflow"]["status"] == "ok", checks_["tensorflow"]


def a_slice_host(folder: Path) -> tuple[str, dict[str, str]]:
    """A TPU VM of a slice as this machine can stand for one: a TPU device file, libtpu installed, and jax whose
    TPU start waits for the other hosts, as libtpu does (jax-ml/jax#12456): `jax.devices()` never returns.
    Gives (dev_root, PYTHONPATH)."""
    (folder / "dev").mkdir(parents=True)
    (folder / "dev" / "accel0").write_text("")
    libtpu_installed(folder / "site")
    (folder / "site" / "jax").mkdir()
    (folder / "site" / "jax" / "__init__.py").write_text(textwrap.dedent("""
        # The real jax in this one's place, its TPU start waiting without end.
        import os, sys, time
        site = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != site]
        del sys.modules["jax"]
        import jax
        jax.devices = lambda backend=None: time.sleep(3600)
        sys.modules["jax"] = jax
    """))
    return str(folder / "dev"), {"PYTHONPATH": f"{folder / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.parametrize("listed_by", ["metadata", "gke"])
def test_on_a_slice_of_two_hosts_the_tpu_is_left_to_the_jobs_join(env, tmp_path: Path, listed_by: str) -> None:
    """Worker 0 of a v5p-16 (2 hosts), listed by the metadata server (a TPU VM) or by GKE's TPU_WORKER_HOSTNAMES:
    JAX's TPU start would wait for worker 1, so the doctor does not start it."""
    dev_root, site = a_slice_host(tmp_path)
    endpoints = "t1v-n-w-0:0:10.0.0.2,t1v-n-w-1:1:10.0.0.3"
    with start_metadata_fake(tmp_path, ttl_s=120, accelerator_type="v5p-16") as metadata:
        if listed_by == "metadata":
            metadata.set(worker_network_endpoints=endpoints)
            gke = {}
        else:
            gke = {"TPU_WORKER_HOSTNAMES": "w-0.slice,w-1.slice", "TPU_SKIP_MDS_QUERY": "true"}
        environ = {**env, **site, **gke, "GCE_METADATA_IP": metadata.host, "GCE_METADATA_HOST": metadata.host}
        if listed_by == "metadata":  # JAX sets it in a process where it found no TPU chip (cloud_tpu_init.py)
            environ.pop("TPU_SKIP_MDS_QUERY", None)
        began = time.monotonic()
        report = doctor_module.run_doctor(timeout=TIMEOUT, environ=environ, dev_root=dev_root)
        took = time.monotonic() - began
        asked = [r["path"] for r in metadata.requests()]
    jax = {c.name: c for c in report.checks}["jax"]
    assert jax.status == "ok" and jax.evidence.startswith(
        "not started: the TPU of a slice of 2 hosts starts only when every host joins: the job's own join checks it"
    ), jax
    assert f"finds libtpu at {tmp_path / 'site' / 'libtpu' / 'libtpu.so'}" in jax.evidence
    assert jax.data["hosts"] == 2 and jax.seconds < TIMEOUT / 2, "the TPU start was not waited for"
    # This venv has no libtpu in its metadata: `versions` alone says so; nothing else fails for the slice.
    assert [c.name for c in report.checks if c.status == "fail"] == ["versions"], report.to_dict()
    assert took < TIMEOUT
    if listed_by == "metadata":
        assert "worker-network-endpoints lists 2 hosts" in jax.evidence
        assert (jax.data["accelerator_type"], jax.data["slice_devices"]) == ("v5p-16", 8), "8 chips, one device each"
        assert "/computeMetadata/v1/instance/attributes/worker-network-endpoints" in asked
    else:
        assert "TPU_WORKER_HOSTNAMES lists 2 hosts" in jax.evidence
        assert not [path for path in asked if "/attributes/" in path], "GKE: no TPU VM metadata is asked"


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


def test_tensorflow_that_hangs_at_import_is_killed_by_pid_and_tabled(env, tmp_path: Path) -> None:
    path = fake_tensorflow(tmp_path / "site", "import time\ntime.sleep(3600)\n")
    began = time.monotonic()
    result = run_cli("doctor", "--timeout", "2", env={**env, **path}, timeout=60)
    assert result.returncode == 3 and time.monotonic() - began < 30
    lines = result.stdout.splitlines()
    assert all(column in lines[1] for column in ("check", "status", "evidence", "what to do"))
    assert lines[-1].startswith("doctor: 1 fail, ")
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
