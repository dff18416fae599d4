"""The host checks of `runner doctor` (runner/doctor/checks.py), each on its own: installed versions,
devices, the memory allocator, libtpu's lockfile and credentials, with real processes and files. Only what
cannot exist here is stood in for: a TPU device file (a plain file) and Google's metadata server (a local
HTTP server). The whole doctor, as a user runs it, is in test_doctor.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from runner.device.host import TCMALLOC_PRELOAD
from runner.doctor import checks, jax_tpu, versions
from runner.spec.types import AcceleratorSpec
from tests.conftest import REPO
from tests.support.metadata_fake import start_metadata_fake


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


# --- versions ----------------------------------------------------------------------------------


def installed(folder: Path, **versions: str) -> list[str]:
    """Distribution metadata, as pip writes it, for the versions check to find. jax at the version installed
    here gets its real METADATA, whose Requires-Dist carries the `tpu` extra's pins."""
    for name, version in versions.items():
        info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        real = importlib.metadata.distribution("jax")
        if name == "jax" and version == real.version:
            (info / "METADATA").write_text(real.read_text("METADATA"))
        else:
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return [str(folder)]


JAX = importlib.metadata.version("jax")  # requirements.lock's jax, which the TPU image installs with its extra
TPU_IMAGE = {"tensorflow-cpu": "2.21.0", "keras": "3.15.1", "jax": JAX, "jaxlib": JAX, "libtpu": "0.0.42.1"}


def test_versions_of_this_machine_are_known_good() -> None:
    check = versions.check_versions(tpu_wanted=False)
    assert check.status == "ok", check
    assert check.data["known_good"][0] == "tensorflow-cpu==2.21.0" and f"jax=={JAX}" in check.data["known_good"]


def test_jaxs_tpu_extra_is_read_from_its_own_metadata(tmp_path: Path) -> None:
    assert versions.tpu_extra() == [f"jaxlib<={JAX},>={JAX}", "libtpu==0.0.42.*"]
    assert versions.tpu_extra(installed(tmp_path, keras="3.15.1")) == [], "no jax, no extra"


@pytest.mark.parametrize("tpu_wanted", [True, False])
def test_the_tpu_images_set_is_known_good_with_or_without_a_tpu_asked_for(tmp_path: Path, tpu_wanted: bool) -> None:
    check = versions.check_versions(tpu_wanted=tpu_wanted, paths=installed(tmp_path, **TPU_IMAGE))
    assert check.status == "ok", check
    assert "libtpu==0.0.42.*" in check.data["known_good"], "libtpu installed: judged as the TPU image"


@pytest.mark.parametrize(("name", "version"), [("libtpu", "0.0.41.2"), ("libtpu", "0.0.10"), ("jaxlib", "0.10.1")])
def test_a_jaxlib_or_libtpu_other_than_jaxs_tpu_extra_pins_fails(tmp_path: Path, name: str, version: str) -> None:
    check = versions.check_versions(tpu_wanted=True, paths=installed(tmp_path, **{**TPU_IMAGE, name: version}))
    assert check.status == "fail"
    assert f"{name} {version} (wants {name}" in check.evidence and f"jax {JAX}'s `tpu` extra pins" in check.evidence
    assert check.action.startswith(f'pip install "jax[tpu]=={JAX}"')


def test_a_tpu_wanted_without_libtpu_fails_and_the_cpu_is_fine_without_it(tmp_path: Path) -> None:
    paths = installed(tmp_path, **{k: v for k, v in TPU_IMAGE.items() if k != "libtpu"})
    check = versions.check_versions(tpu_wanted=True, paths=paths)
    assert check.status == "fail"
    assert check.evidence.startswith("a TPU is wanted, but libtpu is not installed (wants libtpu==0.0.42.*)")
    assert "JAX has no TPU runtime to load" in check.evidence and "jax[tpu]" in check.action
    assert versions.check_versions(tpu_wanted=False, paths=paths).status == "ok"


def test_a_tpu_wanted_without_jax_fails(tmp_path: Path) -> None:
    check = versions.check_versions(tpu_wanted=True, paths=installed(tmp_path, **{"tensorflow-cpu": "2.21.0"}))
    assert check.status == "fail" and "jax is not installed" in check.evidence and "jax[tpu]" in check.action


@pytest.mark.parametrize("tpu_wanted", [True, False])
def test_tensorflow_tpu_is_retired_with_the_way_to_the_jax_image(tmp_path: Path, tpu_wanted: bool) -> None:
    paths = installed(tmp_path, **{"tensorflow-tpu": "2.19.1", "libtpu": "0.0.10"})
    check = versions.check_versions(tpu_wanted=tpu_wanted, paths=paths)
    assert check.status == "fail"
    assert check.evidence.startswith("tensorflow-tpu 2.19.1 is installed: TensorFlow no longer drives TPUs here")
    assert "pip uninstall -y tensorflow-tpu," in check.action and f'"jax[tpu]=={JAX}"' in check.action


def test_two_tensorflows_in_one_environment_fail(tmp_path: Path) -> None:
    paths = installed(tmp_path, **{"tensorflow": "2.21.0", "tensorflow-cpu": "2.21.0", "keras": "3.15.1"})
    check = versions.check_versions(tpu_wanted=False, paths=paths)
    assert check.status == "fail" and "2 TensorFlow distributions" in check.evidence


def test_known_good_rows_carry_their_source_and_date() -> None:
    rows = json.loads(versions.KNOWN_GOOD.read_text())["combos"]
    assert {row["platform"] for row in rows} == {"tpu", "cpu"}
    for row in rows:
        assert row["requires"][0].split("==")[0] in versions.TENSORFLOW_DISTRIBUTIONS
        assert row["source"] and row["checked"] and row["verified"] and row["install"]


@pytest.mark.parametrize(("platform", "lock"), [("tpu", "requirements-tpu.lock"), ("cpu", "requirements.lock")])
def test_known_good_rows_describe_the_locks_the_images_install(platform: str, lock: str) -> None:
    """The TPU row is the TPU image's set (requirements-tpu.lock), the CPU row requirements.lock's."""
    lines = [line for line in (REPO / lock).read_text().splitlines() if "==" in line and not line.startswith("#")]
    pinned = dict(line.split("==") for line in lines)
    pinned = {canonicalize_name(name): version for name, version in pinned.items()}
    row = next(row for row in json.loads(versions.KNOWN_GOOD.read_text())["combos"] if row["platform"] == platform)
    wanted = [Requirement(text) for text in row["requires"] if not text.startswith("python")]
    unmet = [f"{r} ({pinned.get(canonicalize_name(r.name))})" for r in wanted
             if not r.specifier.contains(pinned.get(canonicalize_name(r.name), "0"))]
    assert unmet == [], f"{versions.KNOWN_GOOD.name}'s {platform} row disagrees with {lock}"


# --- JAX's TPU start ---------------------------------------------------------------------------
# The real jax of requirements.lock, without libtpu (this machine's venv): the TPU image's own run, with the real
# libtpu finding no TPU, is tests/test_image.py's.


def stand_in_jax(folder: Path, body: str) -> dict[str, str]:
    """A `jax` package first on the path, for what a real one does only on a broken TPU host: hang or abort."""
    (folder / "jax").mkdir(parents=True)
    (folder / "jax" / "__init__.py").write_text(textwrap.dedent(body))
    return {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_jax_without_libtpu_says_it_has_no_tpu_backend_and_how_to_get_one() -> None:
    wanted = jax_tpu.check_jax_tpu(tpu_wanted=True, timeout=60, environ=dict(os.environ))
    assert wanted.status == "fail", wanted
    assert wanted.evidence.startswith(f"JAX {JAX} finds no libtpu (the `libtpu` package is not installed")
    assert wanted.action.startswith(f'pip install "jax[tpu]=={JAX}"') and wanted.data["tpu_devices"] == 0
    assert jax_tpu.check_jax_tpu(tpu_wanted=False, timeout=60, environ=dict(os.environ)).status == "warn"


def test_a_libtpu_that_jax_cannot_load_fails_naming_the_file(tmp_path: Path) -> None:
    library = tmp_path / "libtpu.so"
    library.write_bytes(b"not a shared object")
    check = jax_tpu.check_jax_tpu(False, 60, {**os.environ, "TPU_LIBRARY_PATH": str(library)})
    assert check.status == "fail" and f"could not start libtpu from {library}: " in check.evidence, check
    assert "Failed to open" in check.evidence and "versions check" in check.action


def test_on_a_slice_a_libtpu_other_than_the_packages_still_fails_without_starting_the_tpu(tmp_path: Path) -> None:
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "__init__.py").write_text("def get_library_path():\n    return '/opt/libtpu/libtpu.so'\n")
    other = tmp_path / "old-libtpu.so"
    other.write_bytes(b"\x7fELF stand-in")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TPU_LIBRARY_PATH": str(other)}
    check = jax_tpu.check_jax_tpu(True, 60, env, checks.SliceHosts(2, "TPU_WORKER_HOSTNAMES lists 2 hosts"))
    assert check.status == "fail" and check.evidence == (
        f"JAX loads {other} (TPU_LIBRARY_PATH), not the libtpu package's /opt/libtpu/libtpu.so (the TPU was not "
        "started: a slice of several hosts)"), check
    assert "tpu_devices" not in check.data, "the TPU's start was left to the job's join"


def test_a_jax_start_that_hangs_is_killed_within_the_bound(tmp_path: Path) -> None:
    check = jax_tpu.check_jax_tpu(True, 2, stand_in_jax(tmp_path, "import time\ntime.sleep(3600)\n"))
    assert check.status == "fail" and check.evidence.startswith("no answer within 2 s while JAX started") and \
        check.seconds < 10
    assert "lockfile check" in check.action


def test_a_jax_start_that_aborts_is_reported_with_its_last_words(tmp_path: Path) -> None:
    env = stand_in_jax(tmp_path, """
        import os, sys
        sys.stderr.write("F0000 libtpu: TPU is already in use by process with pid 4242.\\n")
        sys.stderr.flush()
        os.abort()
    """)
    check = jax_tpu.check_jax_tpu(True, 30, env)
    assert check.status == "fail" and "died (signal SIGABRT)" in check.evidence, check
    assert "already in use by process with pid 4242" in check.evidence


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
    code = ("import json; from runner.doctor.checks import check_allocator; "
            "print(json.dumps(check_allocator().to_dict()))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_allocator_names_a_preloaded_tcmalloc_and_warns_on_glibc() -> None:
    assert Path(TCMALLOC_PRELOAD).exists(), "scripts/system-deps.sh installs libtcmalloc-minimal4"
    preloaded = allocator_of_a_process(TCMALLOC_PRELOAD)
    mapped = os.path.realpath(TCMALLOC_PRELOAD)  # the file behind the .so.4 link
    assert preloaded["status"] == "ok" and preloaded["data"] == {"allocator": "tcmalloc", "library": mapped}
    plain = allocator_of_a_process(None)
    assert plain["status"] == "warn" and plain["data"]["allocator"] == "glibc"
    assert f"LD_PRELOAD={TCMALLOC_PRELOAD}" in plain["action"]


def test_allocator_reads_the_mapped_libraries(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 42   /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
        "7f10-7f20 rw-p 00000000 00:00 0 \n"
        "7f20-7f30 r-xp 00000000 08:01 43   /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    )
    assert checks.check_allocator(str(maps)).data == {
        "allocator": "jemalloc", "library": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    maps.write_text("7f20-7f30 r-xp 00000000 08:01 43   /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert checks.check_allocator(str(maps)).status == "warn"


def test_tpu_precedence_spec_then_tpu_name_then_colab_then_device_files(tmp_path: Path) -> None:
    from runner.device import host

    assert host.named_tpu("spec-tpu", {"TPU_NAME": "env-tpu"}) == "spec-tpu"
    assert host.named_tpu(None, {"TPU_NAME": "env-tpu", "COLAB_TPU_ADDR": "10.0.0.2:8470"}) == "env-tpu"
    assert host.named_tpu(None, {"COLAB_TPU_ADDR": "10.0.0.2:8470"}) == "grpc://10.0.0.2:8470"
    assert host.tpu_target(None, {}, dev_root=str(tmp_path)) is None, "nothing names a TPU: no TPU attempt"
    (tmp_path / "accel0").touch()
    assert host.tpu_target(None, {}, dev_root=str(tmp_path)) == "local"
    assert host.tpu_target(None, {"TPU_NAME": "env-tpu"}, dev_root=str(tmp_path)) == "env-tpu"


# --- the hosts of a TPU slice ---------------------------------------------------------------


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_hosts_of_a_slice_are_found_where_jax_finds_them(tmp_path: Path) -> None:
    silent = {"GCE_METADATA_IP": f"127.0.0.1:{closed_port()}"}  # the server JAX asks, as the job's count does
    gke = checks.slice_hosts({**silent, "TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-3"}, local_tpu=True)
    assert (gke.hosts, gke.found_by) == (4, "TPU_WORKER_HOSTNAMES lists 4 hosts")
    # A type bigger than one host: 16 v5e chips are 4 VMs of 4 (the TPU table); a v5p-16 counts TensorCores.
    for accelerator_type, hosts in (("v5litepod-16", 4), ("v5p-16", 2), ("v5litepod-8", 1), ("v6e-8", 1)):
        found = checks.slice_hosts({**silent, "TPU_ACCELERATOR_TYPE": accelerator_type}, local_tpu=True)
        assert found.hosts == hosts, (accelerator_type, found)
    assert checks.slice_hosts({**silent, "TPU_ACCELERATOR_TYPE": "v9-64"}, local_tpu=True).hosts == 1, "unknown"
    # The devices JAX makes of a whole slice: a v3 chip is two (each TensorCore), a v5p chip one (megacore).
    devices = {t: checks.SliceHosts(2, "", t).devices for t in ("v5litepod-16", "v5p-32", "v3-32", "v2-32", "v9-8")}
    assert devices == {"v5litepod-16": 16, "v5p-32": 16, "v3-32": 32, "v2-32": None, "v9-8": None}
    with start_metadata_fake(tmp_path, ttl_s=60, accelerator_type="v5litepod-8",
                             worker_network_endpoints="w-0:0:10.0.0.2,w-1:1:10.0.0.3") as metadata:
        vm = {"GCE_METADATA_IP": metadata.host}
        assert checks.slice_hosts(vm, local_tpu=True) == checks.SliceHosts(
            2, "the metadata server's worker-network-endpoints lists 2 hosts", "v5litepod-8")
        metadata.set(worker_network_endpoints="w-0:0:10.0.0.2", accelerator_type="v5p-32")
        assert checks.slice_hosts(vm, local_tpu=True).found_by == (
            "v5p-32 (the metadata server) is 16 chips on 4 hosts (the TPU table)")
        # Not a TPU VM (no local TPU), or JAX told not to ask (TPU_SKIP_MDS_QUERY): the server is left alone.
        asked = len(metadata.requests())
        assert checks.slice_hosts(vm, local_tpu=False).hosts == 1
        assert checks.slice_hosts({**vm, "TPU_SKIP_MDS_QUERY": "1"}, local_tpu=True).hosts == 1
        assert len(metadata.requests()) == asked


def test_a_metadata_server_that_never_answers_is_one_host_within_the_bound() -> None:
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        began = time.monotonic()
        found = checks.slice_hosts({"GCE_METADATA_IP": f"127.0.0.1:{silent.getsockname()[1]}"}, True, timeout=1.0)
    assert found.hosts == 1 and time.monotonic() - began < 3


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
