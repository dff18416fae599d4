"""`runner doctor`: every check's ok and fail paths on this machine (no TPU), with real processes, real
files, a real GCS emulator, a real held lockfile and a tampered shard. Only what cannot exist here is
stood in for: a TPU device file (a plain file), Google's metadata server (a local HTTP server), and a
TensorFlow that aborts or hangs at import (a package that does just that, as a mismatched libtpu does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from runner import doctor as doctor_module
from runner import doctor_checks as checks
from runner.spec import AcceleratorSpec, JobSpec
from tests.conftest import cli_env, last_json, run_cli, write_spec

TIMEOUT = 30


def doctor(*args: Any, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    result = run_cli("doctor", "--json", *args, env=env, timeout=timeout)
    assert result.stdout.strip(), result.stderr
    return result.returncode, last_json(result.stdout)


def named(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in report["checks"]}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The CLI's environment, with libtpu's lockfile moved out of the real /tmp."""
    return cli_env(RUNNER_LIBTPU_LOCKFILE=str(tmp_path / "libtpu_lockfile"))


def spawn(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A helper process that prints one line once it is ready; the test stops it by PID."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, text=True, env=env,
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=10)


# --- the whole doctor, as a user runs it ------------------------------------------------------


def test_doctor_on_a_machine_without_tpu_says_so_within_its_bound(env) -> None:
    code, report = doctor("--timeout", TIMEOUT, env=env)
    checks_ = named(report)
    assert code == 0 and report["exit_code"] == 0, report
    assert list(checks_) == ["versions", "devices", "allocator", "lockfile", "credentials", "gcs", "tensorflow", "tpu"]
    assert checks_["versions"]["status"] == "ok" and "tensorflow-cpu 2.21.0" in checks_["versions"]["evidence"]
    assert checks_["tensorflow"]["status"] == "ok" and checks_["tensorflow"]["data"]["version"] == "2.21.0"
    assert checks_["tpu"]["status"] == "warn" and checks_["tpu"]["evidence"].startswith("no TPU")
    assert checks_["devices"]["status"] == "warn" and "runs on the CPU" in checks_["devices"]["evidence"]
    assert checks_["lockfile"]["status"] == "ok"
    assert all(check["seconds"] <= TIMEOUT for check in report["checks"])
    assert report["seconds"] < 2 * TIMEOUT


def test_spec_with_local_data_passes_every_check(mnist_job, env, tmp_path: Path) -> None:
    code, report = doctor(mnist_job("local"), "--timeout", TIMEOUT, env=env)
    checks_ = named(report)
    assert code == 0, report
    assert checks_["data_train"]["status"] == "ok" and checks_["data_train"]["data"]["records"] == 2048
    assert "sha256 of 4 match" in checks_["data_train"]["evidence"]
    assert checks_["data_eval"]["status"] == "ok" and checks_["data_eval"]["data"]["records"] == 512
    assert checks_["storage_write"]["status"] == "ok"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [], "the write probe is deleted"
    assert checks_["batch"]["status"] == "ok"
    assert checks_["batch"]["evidence"].startswith("128 = 1 replica x 128 (accelerator.cpu_devices on the CPU)")
    assert "train: 16 steps of 128" in checks_["batch"]["evidence"]
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
    result = run_cli("doctor", "--save", env=env, timeout=60)
    assert result.returncode == 2 and "--save needs a SPEC" in result.stderr


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
    assert checks_["tpu"]["status"] == "fail" and "could not start the TPU 'local'" in checks_["tpu"]["evidence"]
    assert checks_["tpu"]["seconds"] < TIMEOUT
    assert checks_["devices"]["status"] == "fail" and "is 'local'" in checks_["devices"]["evidence"]
    assert checks_["versions"]["status"] == "fail" and "no TPU kernels" in checks_["versions"]["evidence"]


def test_a_tpu_that_never_answers_is_bounded_by_accelerator_timeout(mnist_job, env) -> None:
    spec = mnist_job("silent", accelerator={"kind": "auto", "timeout_s": 3})
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


# --- versions ----------------------------------------------------------------------------------


def installed(folder: Path, **versions: str) -> list[str]:
    """Distribution metadata, as pip writes it, for the versions check to find."""
    for name, version in versions.items():
        info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return [str(folder)]


def test_versions_of_this_machine_are_known_good() -> None:
    check = checks.check_versions(tpu_wanted=False)
    assert check.status == "ok", check
    assert check.data["known_good"][0] == "tensorflow-cpu==2.21.0"


def test_tensorflow_tpu_with_a_libtpu_that_aborts_its_import_fails(tmp_path: Path) -> None:
    paths = installed(tmp_path, **{"tensorflow-tpu": "2.20.0", "libtpu": "0.0.52", "keras": "3.15.1"})
    check = checks.check_versions(tpu_wanted=True, paths=paths)
    assert check.status == "fail"
    assert "libtpu 0.0.52 (wants libtpu>=0.0.14,<=0.0.31)" in check.evidence and "aborts" in check.evidence
    assert check.action.startswith("pip install tensorflow-tpu==2.20.0 libtpu==0.0.19")


def test_tensorflow_tpu_without_libtpu_fails_and_an_untried_libtpu_warns(tmp_path: Path) -> None:
    bare = installed(tmp_path / "bare", **{"tensorflow-tpu": "2.20.0", "keras": "3.15.1"})
    assert checks.check_versions(tpu_wanted=True, paths=bare).status == "fail"
    older = installed(tmp_path / "older", **{"tensorflow-tpu": "2.20.0", "libtpu": "0.0.13", "keras": "3.15.1"})
    untried = checks.check_versions(tpu_wanted=True, paths=older)
    assert untried.status == "warn" and "nobody has tried" in untried.evidence


@pytest.mark.parametrize("libtpu", ["0.0.14", "0.0.19", "0.0.31"])
def test_tensorflow_tpu_with_a_libtpu_that_loads_is_known_good(tmp_path: Path, libtpu: str) -> None:
    paths = installed(tmp_path, **{"tensorflow-tpu": "2.20.0", "libtpu": libtpu, "keras": "3.15.1"})
    assert checks.check_versions(tpu_wanted=True, paths=paths).status == "ok"


def test_two_tensorflows_in_one_environment_fail(tmp_path: Path) -> None:
    paths = installed(tmp_path, **{"tensorflow": "2.21.0", "tensorflow-cpu": "2.21.0", "keras": "3.15.1"})
    check = checks.check_versions(tpu_wanted=False, paths=paths)
    assert check.status == "fail" and "2 TensorFlow distributions" in check.evidence


def test_the_cpu_wheel_where_a_tpu_is_wanted_fails(tmp_path: Path) -> None:
    paths = installed(tmp_path, **{"tensorflow-cpu": "2.21.0", "keras": "3.15.1"})
    check = checks.check_versions(tpu_wanted=True, paths=paths)
    assert check.status == "fail" and "no TPU kernels" in check.evidence
    assert "pip install tensorflow-tpu==2.20.0 libtpu==0.0.19" in check.action


def test_known_good_rows_carry_their_source_and_date() -> None:
    rows = json.loads(checks.KNOWN_GOOD.read_text())["combos"]
    assert {row["platform"] for row in rows} == {"tpu", "cpu"}
    for row in rows:
        assert row["requires"][0].split("==")[0] in checks.TENSORFLOW_DISTRIBUTIONS
        assert row["source"] and row["checked"] and row["verified"] and row["install"]


# --- devices -----------------------------------------------------------------------------------


def test_devices_follow_what_is_asked(tmp_path: Path) -> None:
    nothing = {}
    assert checks.check_devices(AcceleratorSpec(), nothing).status == "warn"
    assert checks.check_devices(AcceleratorSpec(kind="tpu"), nothing).status == "fail"
    assert checks.check_devices(AcceleratorSpec(kind="gpu"), nothing).status == "fail"
    local = checks.check_devices(AcceleratorSpec(), {"TPU_NAME": "local"})
    assert local.status == "fail" and "--privileged" in local.action
    assert checks.check_devices(AcceleratorSpec(kind="tpu"), {"TPU_NAME": "my-tpu"}).status == "ok"
    (tmp_path / "accel0").write_bytes(b"")  # a TPU VM's device file, as far as a listing goes
    present = checks.check_devices(AcceleratorSpec(kind="tpu"), nothing, dev_root=str(tmp_path))
    assert present.status == "ok" and present.data["tpu_devices"] == [str(tmp_path / "accel0")]


def allocator_of_a_process(preload: str | None) -> dict[str, Any]:
    """check_allocator as run by a fresh Python process started with (or without) LD_PRELOAD."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | ({"LD_PRELOAD": preload} if preload else {})
    code = "import json; from runner.doctor_checks import check_allocator; print(json.dumps(check_allocator().to_dict()))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_allocator_names_a_preloaded_tcmalloc_and_warns_on_glibc() -> None:
    assert Path(checks.TCMALLOC_PRELOAD).exists(), "scripts/system-deps.sh installs libtcmalloc-minimal4"
    preloaded = allocator_of_a_process(checks.TCMALLOC_PRELOAD)
    mapped = os.path.realpath(checks.TCMALLOC_PRELOAD)  # the file behind the .so.4 link
    assert preloaded["status"] == "ok" and preloaded["data"] == {"allocator": "tcmalloc", "library": mapped}
    plain = allocator_of_a_process(None)
    assert plain["status"] == "warn" and plain["data"]["allocator"] == "glibc"
    assert f"LD_PRELOAD={checks.TCMALLOC_PRELOAD}" in plain["action"]


def test_allocator_reads_the_mapped_libraries(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 42   /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
        "7f10-7f20 rw-p 00000000 00:00 0 \n"
        "7f20-7f30 r-xp 00000000 08:01 43   /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    )
    assert checks.check_allocator(str(maps)).data == {"allocator": "jemalloc", "library": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    maps.write_text("7f20-7f30 r-xp 00000000 08:01 43   /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert checks.check_allocator(str(maps)).status == "warn"


def test_named_tpu_follows_strategy_order() -> None:
    from runner.strategy import tpu_target

    cases = [
        (AcceleratorSpec(tpu="spec-tpu"), {"TPU_NAME": "env-tpu"}),
        (AcceleratorSpec(), {"TPU_NAME": "env-tpu", "COLAB_TPU_ADDR": "10.0.0.2:8470"}),
        (AcceleratorSpec(), {"COLAB_TPU_ADDR": "10.0.0.2:8470"}),
        (AcceleratorSpec(), {}),
    ]
    for spec, environ in cases:
        assert checks.named_tpu(spec, environ) == tpu_target(spec, environ)


# --- libtpu lockfile ---------------------------------------------------------------------------

HOLD_LOCK = """
    import os, sys, time
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
    os.lockf(fd, os.F_TLOCK, 0)  # what libtpu does (tpu_initialize_util.cc)
    print("ready", flush=True)
    time.sleep(120)
"""


def test_lockfile_absent_held_then_left_behind(tmp_path: Path) -> None:
    lockfile = str(tmp_path / "libtpu_lockfile")
    assert checks.check_lockfile(lockfile).status == "ok"
    holder = spawn(HOLD_LOCK, lockfile)
    try:
        held = checks.check_lockfile(lockfile)
        assert held.status == "fail" and held.data["holder"] == holder.pid
        assert f"locked by pid {holder.pid}" in held.evidence and f"kill {holder.pid}" in held.action
        assert checks.check_lockfile(lockfile, tpu_wanted=False).status == "warn"
    finally:
        stop(holder)
    left = checks.check_lockfile(lockfile)
    assert left.status == "warn" and "killed" in left.evidence and left.data["holder"] is None


def test_an_flock_on_the_lockfile_is_found_too(tmp_path: Path) -> None:
    lockfile = tmp_path / "libtpu_lockfile"
    code = "import fcntl, sys, time\nf = open(sys.argv[1], 'w')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
    holder = spawn(code + "print('ready', flush=True)\ntime.sleep(120)\n", str(lockfile))
    try:
        check = checks.check_lockfile(str(lockfile))
        assert check.status == "fail" and check.data["holder"] == holder.pid
    finally:
        stop(holder)


def test_a_process_with_the_tpu_device_open_is_named(tmp_path: Path) -> None:
    device = tmp_path / "accel0"
    device.write_bytes(b"")
    code = "import sys, time\nf = open(sys.argv[1], 'rb')\nprint('ready', flush=True)\ntime.sleep(120)\n"
    user = spawn(code, str(device))
    try:
        check = checks.check_lockfile(str(tmp_path / "libtpu_lockfile"), dev_root=str(tmp_path))
        assert check.status == "fail" and f"pid {user.pid}" in check.evidence and str(device) in check.evidence
    finally:
        stop(user)


# --- credentials -------------------------------------------------------------------------------

METADATA_SERVER = """
    import http.server, json, sys, threading
    email, scopes, log = sys.argv[1], sys.argv[2], sys.argv[3]
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            with open(log, "a") as out:
                out.write(json.dumps({"path": self.path, "flavor": self.headers.get("Metadata-Flavor")}) + "\\n")
            answers = {"email": email, "scopes": scopes.replace(",", "\\n")}
            body = answers.get(self.path.rsplit("/", 1)[-1], "").encode()
            self.send_response(200 if body else 404)
            self.send_header("Metadata-Flavor", "Google")
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Timer(120, server.shutdown).start()
    print("ready", flush=True)
    print(server.server_address[1], flush=True)
    server.serve_forever()
"""


@pytest.fixture
def metadata_server(tmp_path: Path):
    """Google's metadata server as a local HTTP server that records requests; stopped by PID."""
    started = []

    def start(email: str, scopes: str) -> tuple[str, Path]:
        log = tmp_path / f"metadata-{len(started)}.log"
        process = spawn(METADATA_SERVER, email, scopes, str(log))
        started.append(process)
        return f"127.0.0.1:{process.stdout.readline().strip()}", log

    yield start
    for process in started:
        stop(process)


def test_credentials_from_the_metadata_server(metadata_server) -> None:
    scopes = "https://www.googleapis.com/auth/cloud-platform,https://www.googleapis.com/auth/userinfo.email"
    host, log = metadata_server("runner@project.iam.gserviceaccount.com", scopes)
    check = checks.check_credentials({"GCE_METADATA_HOST": host}, needs_gcs=True)
    assert check.status == "ok" and "service account runner@project.iam.gserviceaccount.com" in check.evidence
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["flavor"] for r in requests} == {"Google"} and len(requests) == 2


def test_a_vm_without_storage_scope_fails_for_a_gcs_job(metadata_server) -> None:
    host, _ = metadata_server("runner@project.iam.gserviceaccount.com", "https://www.googleapis.com/auth/logging.write")
    check = checks.check_credentials({"GCE_METADATA_HOST": host}, needs_gcs=True)
    assert check.status == "fail" and "scopes do not include storage" in check.evidence
    assert checks.check_credentials({"GCE_METADATA_HOST": host}, needs_gcs=False).status == "warn"


def test_service_account_file_is_named_without_its_secret(tmp_path: Path) -> None:
    key = tmp_path / "key.json"
    key.write_text(json.dumps({
        "type": "service_account", "client_email": "job@p.iam.gserviceaccount.com",
        "private_key": "-----BEGIN PRIVATE KEY-----\nSECRET-KEY-MATERIAL\n", "private_key_id": "SECRET-ID",
    }))
    environ = {"GOOGLE_APPLICATION_CREDENTIALS": str(key), "NO_GCE_CHECK": "true"}
    check = checks.check_credentials(environ, needs_gcs=True)
    assert check.status == "ok" and "service_account job@p.iam.gserviceaccount.com" in check.evidence
    assert "SECRET" not in json.dumps(check.to_dict())


def test_proxy_password_is_not_shown() -> None:
    environ = {"https_proxy": "http://user:hunter2@127.0.0.1:9", "CURL_CA_BUNDLE": ""}
    check = checks.check_gcs_endpoint(environ, needs_gcs=True, timeout=2)
    assert check.status == "fail" and "user:***@127.0.0.1:9" in check.evidence and "hunter2" not in check.evidence


def test_missing_credentials_fail_only_a_gcs_job(tmp_path: Path) -> None:
    environ = {
        "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "gone.json"), "NO_GCE_CHECK": "true", "HOME": str(tmp_path)
    }
    check = checks.check_credentials(environ, needs_gcs=True)
    assert check.status == "fail" and "gone.json does not exist" in check.evidence
    assert checks.check_credentials(environ, needs_gcs=False).status == "warn"


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
    code, report = doctor(spec, "--save", "--timeout", TIMEOUT, env={**env, **gcs.env})
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
    code, report = doctor(spec, "--timeout", TIMEOUT, env={**env, **gcs.env})
    write = named(report)["storage_write"]
    assert code == 3 and write["status"] == "fail" and "gs://no-such-bucket-here does not exist" in write["evidence"]
    assert named(report)["storage_read"]["status"] == "ok"


def test_bucket_that_refuses_writes_fails_with_the_role_to_grant(gcs_faults, tiny_mnist, env, tmp_path: Path) -> None:
    bucket = gcs_faults.bucket()
    upload(gcs_faults, tiny_mnist, bucket, "mnist")
    # The emulator has no IAM: the fault proxy answers uploads as GCS does for a reader-only identity.
    gcs_faults.faults.set([{"match": r"^(POST|PUT) /upload/", "action": "status", "status": 403}])
    spec = gcs_spec(tmp_path, bucket, f"gs://{bucket}/runs")
    code, report = doctor(spec, "--timeout", TIMEOUT, env={**env, **gcs_faults.env})
    checks_ = named(report)
    assert code == 3
    assert checks_["storage_write"]["status"] == "fail"
    assert "roles/storage.objectCreator" in checks_["storage_write"]["action"]
    assert checks_["storage_read"]["status"] == "ok" and checks_["data_train"]["status"] == "ok"
    assert gcs_faults.faults.stats()["status"] >= 1
