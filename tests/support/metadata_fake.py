"""A local fake of the GCE metadata server a TPU VM's startup script asks (its worker number, its slice).

Run as its own process (`start_metadata_fake` does that and stops it by PID):

    python tests/support/metadata_fake.py --port 0 --ttl 900     prints `PORT <n>` once it serves on 127.0.0.1

What it serves, as the real server does (plain text, `Metadata-Flavor: Google` required and echoed):
    GET /computeMetadata/v1/instance/attributes/KEY    a TPU VM's attributes: agent-worker-number,
                                                       worker-network-endpoints, accelerator-type, ...
    GET /computeMetadata/v1/instance/zone              projects/NUMBER/zones/ZONE
    GET /computeMetadata/v1/instance/name, /id
    GET /computeMetadata/v1/project/project-id
A request without the header gets 403; an unknown key 404. Clients reach it through GCE_METADATA_HOST
(host:port), the variable Google's own clients (google-auth, Go's compute/metadata) honour.

Control endpoints for the tests:
    POST /_fake/attributes   {"KEY": "VALUE" | null, ...}   set (null: remove) attributes
    POST /_fake/fail         {"status": 503}                 every metadata read answers 503 from now on
                             {"status": 0}                   answer again
    GET  /_fake/requests     every metadata request so far: path and whether the header was sent
    GET  /_fake/health       "ok"
The process exits by itself after --ttl seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_PREFIX = "/computeMetadata/v1/"


class Metadata:
    def __init__(self, project: str = "runner-test", zone: str = "us-central1-a", name: str = "t1v-n-fake-w-0"):
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.failing = 0
        self.values = {
            "instance/zone": f"projects/123456789/zones/{zone}",
            "instance/name": name,
            "instance/id": "4242424242424242",
            "project/project-id": project,
            "project/numeric-project-id": "123456789",
            "instance/attributes/agent-worker-number": "0",
            "instance/attributes/worker-network-endpoints": "unknown:unknown:10.0.0.2",
            "instance/attributes/accelerator-type": "v5litepod-8",
        }

    def answer(self, path: str, flavoured: bool) -> tuple[int, str]:
        self.requests.append({"path": path, "flavoured": flavoured})
        if not path.startswith(_PREFIX):
            return 404, "not found"
        if not flavoured:
            return 403, "Missing required header: Metadata-Flavor"
        if self.failing:
            return self.failing, "metadata server unavailable (fake)"
        key = path[len(_PREFIX):].rstrip("/")
        if key == "instance/attributes":
            names = sorted(k.rsplit("/", 1)[1] for k in self.values if k.startswith("instance/attributes/"))
            return 200, "\n".join(names) + "\n"
        return (200, self.values[key]) if key in self.values else (404, "not found")


def make_handler(metadata: Metadata) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, code: int, text: str, content_type: str = "application/text") -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            with metadata.lock:
                if path == "/_fake/health":
                    self._reply(200, "ok")
                elif path == "/_fake/requests":
                    self._reply(200, json.dumps(metadata.requests), "application/json")
                else:
                    self._reply(*metadata.answer(path, self.headers.get("Metadata-Flavor") == "Google"))

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            with metadata.lock:
                if self.path == "/_fake/attributes":
                    for key, value in body.items():
                        full = key if "/" in key else f"instance/attributes/{key}"
                        if value is None:
                            metadata.values.pop(full, None)
                        else:
                            metadata.values[full] = str(value)
                    self._reply(200, "{}", "application/json")
                elif self.path == "/_fake/fail":
                    metadata.failing = int(body.get("status") or 0)
                    self._reply(200, "{}", "application/json")
                else:
                    self._reply(404, "no such control endpoint")

    return Handler


class MetadataFake:
    """The test side of a running fake: `host` for GCE_METADATA_HOST, and its controls."""

    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port = process, port
        self.host = f"127.0.0.1:{port}"

    def _call(self, method: str, path: str, doc: Any = None) -> Any:
        data = None if doc is None else json.dumps(doc).encode()
        request = urllib.request.Request(f"http://{self.host}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def set(self, **attributes: Any) -> None:
        """Sets instance attributes; underscores in keyword names become dashes (agent_worker_number=1)."""
        self._call("POST", "/_fake/attributes", {k.replace("_", "-"): v for k, v in attributes.items()})

    def fail(self, status: int = 503) -> None:
        self._call("POST", "/_fake/fail", {"status": status})

    def recover(self) -> None:
        self._call("POST", "/_fake/fail", {"status": 0})

    def requests(self) -> list[dict[str, Any]]:
        return self._call("GET", "/_fake/requests")


@contextlib.contextmanager
def start_metadata_fake(folder: Path, ttl_s: float = 900.0, **attributes: Any) -> Iterator[MetadataFake]:
    log = open(folder / "metadata_fake.log", "wb")
    process = subprocess.Popen([sys.executable, __file__, "--port", "0", "--ttl", str(ttl_s)],
                               stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        line = process.stdout.readline().decode()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the metadata fake did not start: {line!r}; see {folder / 'metadata_fake.log'}")
        fake = MetadataFake(process, int(line.split()[1]))
        with urllib.request.urlopen(f"http://{fake.host}/_fake/health", timeout=5) as answer:
            if answer.read() != b"ok":
                raise RuntimeError(f"port {fake.port} answers, but not as the metadata fake")
        if attributes:
            fake.set(**attributes)
        yield fake
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttl", type=float, default=900.0, help="exit after this many seconds")
    args = parser.parse_args(argv)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(Metadata()))
    server.daemon_threads = True
    timer = threading.Timer(args.ttl, server.shutdown)
    timer.daemon = True
    timer.start()
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
