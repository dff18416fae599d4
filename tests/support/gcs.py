"""A real GCS rig on 127.0.0.1 for tests and benchmarks: an emulator, the TLS proxy TensorFlow needs, faults.

    google-cloud-storage --------------------------------------------> emulator (gcp-storage-emulator)
    TensorFlow gs:// --CONNECT--> tls-proxy (test CA) ---------------> emulator
    (fault chain)            ...> tls-proxy --> fault-proxy ---------> the same emulator

Every server is its own process (tests/support/gcs_servers.py), on a port it picked itself, health-checked
through its own answer, and stopped by PID by whoever started it. TensorFlow's gs:// client has no endpoint
setting: it is sent to the TLS proxy with `https_proxy` and trusts the test CA through `CURL_CA_BUNDLE`.

Fixtures (import them: `from tests.support.gcs import gcs, gcs_faults`):

    gcs         session: a `Gcs`. `gcs.env` holds the variables a child process needs (pass them with
                `run_cli(..., env=cli_env(**gcs.env))`); `gcs.bucket()` creates a fresh bucket and returns
                its name; `gcs.client()` is a google-cloud-storage client on the emulator; `gcs.objects(b)`,
                `gcs.read(b, name)`, `gcs.write(b, name, bytes)` and `gcs.upload_folder(dir, b, prefix)` work
                on the emulator directly. Never put `gcs.env` into the test process's own os.environ.
    gcs_faults  function: the same `Gcs`, whose children's TensorFlow and google-cloud-storage traffic
                passes the fault proxy (with no rules, as `gcs`'s does); `gcs_faults.faults.set([...rules])`,
                `.stats()`, `.clear()` (rules in gcs_servers.FaultProxy). Cleared before and after each test.

Outside pytest (benchmarks): `with start_gcs(folder) as gcs: ...`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_SERVERS = Path(__file__).with_name("gcs_servers.py")
_START_TIMEOUT_S = 30.0
# The names TensorFlow's client connects to (kGcsUriBase, kGcsUploadUriBase, kStorageHost).
_GOOGLE_HOSTS = ("www.googleapis.com", "storage.googleapis.com")


class Server:
    """One child process from gcs_servers.py; `port` is what it reported once it served."""

    def __init__(self, folder: Path, name: str, *args: str):
        self.name = name
        self.log = folder / f"{name}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(_SERVERS), *args], stdout=subprocess.PIPE, stderr=log, start_new_session=True
            )
        self.port = self._await_ready()

    def _await_ready(self) -> int:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            ready, _, _ = select.select([self.process.stdout], [], [], 0.2)
            if ready:
                line = self.process.stdout.readline().decode().split()
                if line[:1] == ["READY"]:
                    return int(line[1])
        self.stop()
        raise RuntimeError(f"{self.name} did not start within {_START_TIMEOUT_S:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process.stdout.close()


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class Faults:
    """Controls a fault proxy: rules apply from the next request on."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/__rig__"

    def _call(self, method: str, path: str, doc: dict | None = None) -> dict[str, Any]:
        body = None if doc is None else json.dumps(doc).encode()
        request = urllib.request.Request(f"{self.url}/{path}", data=body, method=method)
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as answer:
            return json.loads(answer.read())

    def set(self, rules: list[dict[str, Any]], seed: int = 0) -> None:
        self._call("PUT", "faults", {"rules": rules, "seed": seed})

    def clear(self) -> None:
        self.set([])
        self._call("POST", "reset", {})

    def stats(self) -> dict[str, Any]:
        """Counts: requests, status, drop, cut, delay, holding (delayed right now), hits per rule, recent lines."""
        return self._call("GET", "stats")


class Gcs:
    """What a test needs from the rig; see the module docstring."""

    def __init__(self, emulator_port: int, api_port: int, proxy_port: int, ca: Path, faults: Faults | None = None):
        self.emulator = f"http://127.0.0.1:{emulator_port}"
        self.api = f"http://127.0.0.1:{api_port}"  # the emulator, or the fault proxy in front of it
        self.faults = faults
        self.pids: list[int] = []  # the rig's server processes (benchmarks read their CPU time)
        self.env = {
            "https_proxy": f"http://127.0.0.1:{proxy_port}",
            "HTTPS_PROXY": f"http://127.0.0.1:{proxy_port}",
            "no_proxy": "127.0.0.1,localhost",
            "NO_PROXY": "127.0.0.1,localhost",
            "CURL_CA_BUNDLE": str(ca),
            # TensorFlow sends this instead of asking the metadata server; not a credential of anything real.
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator-token",
            "NO_GCE_CHECK": "true",
            "GCS_STAT_CACHE_MAX_AGE": "0",
            "STORAGE_EMULATOR_HOST": self.api,
            # Orbax writes a JAX run's arrays through TensorStore's own GCS client, which has an endpoint setting.
            "TENSORSTORE_GCS_HTTP_URL": self.api,
        }

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.emulator}
        )

    def bucket(self, name: str | None = None) -> str:
        """Creates a bucket (a fresh unique name by default) directly on the emulator; returns its name."""
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        return sorted(blob.name for blob in self.client().list_blobs(bucket, prefix=prefix))

    def read(self, bucket: str, name: str) -> bytes:
        return self.client().bucket(bucket).blob(name).download_as_bytes()

    def write(self, bucket: str, name: str, content: bytes) -> None:
        self.client().bucket(bucket).blob(name).upload_from_string(content)

    def upload_folder(self, folder: Path, bucket: str, prefix: str) -> str:
        """Copies the files of a local folder under gs://bucket/prefix/; returns that URL."""
        client = self.client()
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                client.bucket(bucket).blob(f"{prefix}/{path.name}").upload_from_filename(str(path))
        return f"gs://{bucket}/{prefix}"


def _check_tls_proxy(port: int, ca: Path, bucket: str) -> None:
    """A GET through CONNECT + TLS, as TensorFlow's curl does, must reach this rig's own emulator."""
    context = ssl.create_default_context(cafile=str(ca))
    for host in _GOOGLE_HOSTS:
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        connection.set_tunnel(host, 443)
        path = f"/storage/v1/b/{bucket}" if host.startswith("www") else f"/{bucket}/health"
        connection.request("GET", path)
        status = connection.getresponse().status
        connection.close()
        if status not in (200, 404):  # the health bucket exists; its object `health` need not
            raise RuntimeError(f"the TLS proxy on port {port} answered {status} for https://{host}{path}")


@contextlib.contextmanager
def start_gcs(folder: Path, faults: bool = False) -> Iterator[Gcs]:
    """Starts emulator + TLS proxy (+ fault proxy) in `folder`; stops them by PID on exit."""
    import trustme

    folder.mkdir(parents=True, exist_ok=True)
    authority = trustme.CA()
    ca, cert = folder / "ca.pem", folder / "proxy.pem"
    ca.write_bytes(authority.cert_pem.bytes())
    issued = authority.issue_cert(*_GOOGLE_HOSTS, "*.googleapis.com")
    cert.write_bytes(b"".join(blob.bytes() for blob in (issued.private_key_pem, *issued.cert_chain_pems)))
    health = f"health-{uuid.uuid4().hex[:12]}"
    servers: list[Server] = []
    try:
        emulator = Server(folder, "emulator", "emulator", "--health-bucket", health)
        servers.append(emulator)
        # Another server may answer on a reused port: only ours holds the health bucket.
        status, _ = _get(f"http://127.0.0.1:{emulator.port}/storage/v1/b/{health}")
        if status != 200:
            raise RuntimeError(f"port {emulator.port} is not this rig's emulator (GET bucket {health}: {status})")
        api_port, control = emulator.port, None
        if faults:
            fault_proxy = Server(folder, "fault-proxy", "fault-proxy", "--upstream", f"127.0.0.1:{emulator.port}")
            servers.append(fault_proxy)
            api_port, control = fault_proxy.port, Faults(fault_proxy.port)
            control.clear()
        proxy = Server(folder, "tls-proxy", "tls-proxy", "--upstream", f"127.0.0.1:{api_port}", "--cert", str(cert))
        servers.append(proxy)
        _check_tls_proxy(proxy.port, ca, health)
        rig = Gcs(emulator.port, api_port, proxy.port, ca, control)
        rig.pids = [server.process.pid for server in servers]
        yield rig
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory) -> Iterator[Gcs]:
    # One rig, the fault chain's, for both fixtures: the variables a child gets are then the same with and
    # without faults, and its commands share one zygote (tests/support/zygote.py) instead of two.
    with start_gcs(tmp_path_factory.mktemp("gcs"), faults=True) as rig:
        yield rig


@pytest.fixture
def gcs_faults(gcs: Gcs) -> Iterator[Gcs]:
    gcs.faults.clear()
    yield gcs
    gcs.faults.clear()
