"""A local fake of the two engine APIs `runner submit --on` sends to, recording every request.

    python tests/support/engine_fake.py --port 0 --ttl 600     prints `PORT <n>` once it serves on 127.0.0.1

    POST /v1/projects/P/locations/R/customJobs                      Vertex AI: the CustomJob back, QUEUED
    POST /apis/jobset.x-k8s.io/v1alpha2/namespaces/NS/jobsets       Kubernetes: the JobSet back, with a uid
                                                                    (409 AlreadyExists for a name seen before)
    GET  /_fake/requests     every API request so far: method, path, query, body (parsed JSON)
    GET  /_fake/health       "ok"
The process exits by itself after --ttl seconds. From a test: `with start_engine_fake(folder) as fake:` gives
`fake.endpoint` and `fake.requests()`; the process is stopped by its PID when the block ends.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import itertools
import json
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CUSTOM_JOBS = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/customJobs$")
_JOBSETS = re.compile(r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets$")


def handle(state: dict[str, Any], method: str, path: str, body: Any) -> tuple[int, Any]:
    if method == "POST" and (match := _CUSTOM_JOBS.match(path)):
        job = dict(body or {})
        job.update({"name": f"projects/{match.group(1)}/locations/{match.group(2)}/customJobs/{next(state['ids'])}",
                    "state": "JOB_STATE_QUEUED", "createTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return 200, job
    if method == "POST" and (match := _JOBSETS.match(path)):
        name = (body or {}).get("metadata", {}).get("name")
        key = (match.group(1), name)
        if key in state["jobsets"]:
            return 409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists",
                         "message": f'jobsets.jobset.x-k8s.io "{name}" already exists', "code": 409}
        created = json.loads(json.dumps(body))
        created["metadata"].update({"uid": f"uid-{next(state['ids'])}", "namespace": match.group(1)})
        state["jobsets"][key] = created
        return 201, created
    return 404, {"error": {"code": 404, "message": f"{method} {path} is not part of this fake", "status": "NOT_FOUND"}}


def make_handler(state: dict[str, Any]) -> type[http.server.BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, code: int, doc: Any) -> None:
            data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(doc, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            with lock:
                if url.path == "/_fake/health":
                    self._reply(200, "ok")
                    return
                if url.path == "/_fake/requests":
                    self._reply(200, state["requests"])
                    return
                state["requests"].append({"method": method, "path": url.path,
                                          "query": urllib.parse.parse_qs(url.query), "body": body})
                code, doc = handle(state, method, url.path, body)
            self._reply(code, doc)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler


class EngineFake:
    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port = process, port
        self.endpoint = f"http://127.0.0.1:{port}"

    def requests(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.endpoint}/_fake/requests", timeout=10) as answer:
            return json.loads(answer.read())


@contextlib.contextmanager
def start_engine_fake(folder: Path, ttl_s: float = 600.0) -> Iterator[EngineFake]:
    log = open(folder / "engine_fake.log", "wb")  # noqa: SIM115 (closed in finally, after the process)
    process = subprocess.Popen([sys.executable, __file__, "--port", "0", "--ttl", str(ttl_s)],
                               stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        line = process.stdout.readline().decode()  # printed once the server is bound
        if not line.startswith("PORT "):
            raise RuntimeError(f"the engine fake did not start: {line!r}; see {folder / 'engine_fake.log'}")
        fake = EngineFake(process, int(line.split()[1]))
        with urllib.request.urlopen(f"{fake.endpoint}/_fake/health", timeout=5) as answer:
            if answer.read() != b"ok":
                raise RuntimeError(f"port {fake.port} answers, but not as the engine fake")
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
    parser.add_argument("--ttl", type=float, default=600.0, help="exit after this many seconds")
    args = parser.parse_args(argv)
    state = {"requests": [], "jobsets": {}, "ids": itertools.count(1)}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(state))
    server.daemon_threads = True
    timer = threading.Timer(args.ttl, server.shutdown)
    timer.daemon = True
    timer.start()
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
