"""What the local fakes of Google's APIs share (engine_fake.py, metadata_fake.py, tpu_fake.py).

In the fake's own process:
    FakeHandler        a request handler that records every API request (method, path, query, body), answers
                       GET /_fake/health ("ok") and GET /_fake/requests itself, and hands the rest to `answer`
    serve(...)         binds a ThreadingHTTPServer to 127.0.0.1 (port 0: the system picks one), prints
                       `PORT <n>` once it serves, runs a clock (`tick`) and stops by itself after --ttl seconds
                       or on SIGTERM
From a test:
    start_fake(module, folder, client)   starts `python -m MODULE --port 0 --ttl S` as a context manager that
                                         yields `client(process, port)` once the fake answers its health
                                         check, and stops the process by its PID when the block ends
    FakeClient                           `endpoint`, `requests()` and `call(method, path, doc)` for controls
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

LOCALHOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]


class Recorder:
    """The state every handler thread shares: a lock and the requests recorded so far."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.requests: list[dict[str, Any]] = []


class FakeHandler(http.server.BaseHTTPRequestHandler):
    """Answers one request; a fake subclasses it and implements `answer` (`serve` sets `state`)."""

    protocol_version = "HTTP/1.1"
    state: Recorder
    text_type = "text/plain"  # the Content-Type of a plain-text answer
    extra_headers: dict[str, str] = {}

    def log_message(self, format: str, *args: Any) -> None:  # stderr is kept for real problems
        pass

    def reply(self, code: int, doc: Any, content_type: str | None = None) -> None:
        text = isinstance(doc, str)
        data = (doc if text else json.dumps(doc)).encode()
        self.send_response(code)
        for name, value in self.extra_headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type or (self.text_type if text else "application/json"))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def record(self, method: str, url: urllib.parse.SplitResult, body: Any) -> None:
        """Keeps one API request for GET /_fake/requests (a fake may keep less, or other fields)."""
        self.state.requests.append({"method": method, "path": url.path, "query": urllib.parse.parse_qs(url.query),
                                    "body": body})

    def answer(self, method: str, url: urllib.parse.SplitResult, body: Any) -> tuple[int, Any]:
        raise NotImplementedError

    def parse_body(self, raw: bytes) -> Any:
        """The request's body: JSON here; a fake of an API that takes other forms reads them too. ValueError: 400."""
        return json.loads(raw) if raw else None

    def _serve(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = self.parse_body(raw)
        except ValueError:
            self.reply(400, {"error": {"code": 400, "message": "body is not JSON", "status": "INVALID_ARGUMENT"}})
            return
        with self.state.lock:
            if url.path == "/_fake/health":
                code, doc = 200, "ok"
            elif url.path == "/_fake/requests" and method == "GET":
                code, doc = 200, self.state.requests
            else:
                if not url.path.startswith("/_fake/"):
                    self.record(method, url, body)
                code, doc = self.answer(method, url, body)
            self.reply(code, doc)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")


def serve(handler: type[FakeHandler], state: Recorder, argv: list[str] | None, description: str,
          default_ttl_s: float, tick: Callable[[], None] | None = None,
          on_stop: Callable[[], None] | None = None) -> None:
    """Runs a fake on `state` until --ttl seconds have passed or SIGTERM comes; `tick` runs every 0.1 s
    meanwhile and `on_stop` once serving has ended."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttl", type=float, default=default_ttl_s, help="exit after this many seconds")
    args = parser.parse_args(argv)
    bound = type(handler.__name__, (handler,), {"state": state})
    server = http.server.ThreadingHTTPServer((LOCALHOST, args.port), bound)
    server.daemon_threads = True
    stopping = threading.Event()

    def stop(*_: Any) -> None:
        stopping.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + args.ttl

    def clock() -> None:
        while not stopping.wait(0.1):
            if tick is not None:
                tick()
            if time.monotonic() > deadline:
                stop()

    threading.Thread(target=clock, daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        if on_stop is not None:
            on_stop()


class FakeClient:
    """The test side of a running fake: its endpoint and its control endpoints."""

    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port = process, port
        self.endpoint = f"http://{LOCALHOST}:{port}"

    def call(self, method: str, path: str, doc: Any = None) -> Any:
        data = None if doc is None else json.dumps(doc).encode()
        request = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def requests(self) -> list[dict[str, Any]]:
        return self.call("GET", "/_fake/requests")


Client = TypeVar("Client", bound=FakeClient)


@contextlib.contextmanager
def start_fake(module: str, folder: Path, client: type[Client], ttl_s: float,
               start_timeout_s: float = 20.0) -> Iterator[Client]:
    """Starts a fake's process (MODULE, e.g. tests.support.tpu_fake); its stderr goes to FOLDER/NAME.log."""
    name = module.rsplit(".", 1)[-1]
    log_path = folder / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 (closed in finally, after the process)
    process = subprocess.Popen([sys.executable, "-m", module, "--port", "0", "--ttl", str(ttl_s)],
                               stdout=subprocess.PIPE, stderr=log, start_new_session=True, cwd=REPO)
    try:
        ready, _, _ = select.select([process.stdout], [], [], start_timeout_s)
        line = process.stdout.readline().decode() if ready else ""  # printed once the server is bound
        if not line.startswith("PORT "):
            raise RuntimeError(f"{name} did not start within {start_timeout_s:.0f} s: {line!r}; see {log_path}")
        fake = client(process, int(line.split()[1]))
        with urllib.request.urlopen(f"{fake.endpoint}/_fake/health", timeout=5) as answer:
            if answer.read() != b"ok":
                raise RuntimeError(f"port {fake.port} answers, but not as {name}")
        yield fake
    finally:
        process.terminate()  # a fake stops on SIGTERM (the TPU API fake kills its VMs first)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()
