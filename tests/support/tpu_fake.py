"""A local fake of the Cloud TPU v2 REST API (and of Cloud Build's submit) that records every request.

Run as its own process (the fixture `tpu_api` does that and stops it by PID):

    python tests/support/tpu_fake.py --port 0 --ttl 900     prints `PORT <n>` once it serves on 127.0.0.1

What it serves, in the JSON form of the real API (proto3 JSON, camelCase):
    POST   /v2/projects/P/locations/Z/queuedResources?queuedResourceId=ID   -> Operation (done)
    GET    /v2/projects/P/locations/Z/queuedResources[/ID]
    DELETE /v2/projects/P/locations/Z/queuedResources/ID[?force=true]     -> Operation (done)
    GET    /v2/projects/P/locations/Z/nodes/ID                              (the node a queued resource made)
    GET    /v2/projects/P/locations/Z/operations/OP
    POST   /v1/projects/P[/locations/L]/builds                             -> Operation carrying the Build
Errors use Google's error body ({"error": {"code", "message", "status"}}): 404 NOT_FOUND, 409 ALREADY_EXISTS.
A queued resource starts in state ACCEPTED with no node. Control endpoints for the tests:
    GET  /_fake/requests            every API request so far: method, path, query, body (parsed JSON)
    POST /_fake/state               {"name": ID, "state": "ACTIVE", "node_state": "READY"} moves a resource on
    POST /_fake/reset               forgets requests and resources
    GET  /_fake/health              "ok"
The process exits by itself after --ttl seconds, so a lost fixture never leaves it running.

From a test: `with start_tpu_fake(log_folder) as api:` gives `api.endpoint` (for
CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU), `api.requests()`, `api.set_state(...)` and `api.reset()`; the
process is stopped by its PID when the block ends.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import itertools
import json
import re
import sys
import threading
import time
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

_BUILDS = re.compile(r"^/v1/projects/([^/]+)(?:/locations/([^/]+))?/builds$")
_RESOURCE = re.compile(r"^/v2/projects/([^/]+)/locations/([^/]+)/(queuedResources|nodes|operations)(?:/([^/:]+))?$")


class Fake:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.queued: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.ids = itertools.count(1)

    def operation(self, parent: str, verb: str, target: str, response: dict[str, Any] | None) -> dict[str, Any]:
        name = f"{parent}/operations/operation-{next(self.ids)}"
        op: dict[str, Any] = {
            "name": name,
            "metadata": {
                "@type": "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata",
                "target": target, "verb": verb, "apiVersion": "v2",
            },
            "done": True,
        }
        op["response"] = {"@type": "type.googleapis.com/google.protobuf.Empty"} if response is None else {
            "@type": "type.googleapis.com/google.cloud.tpu.v2.QueuedResource", **response
        }
        self.operations[name] = op
        return op

    def set_state(self, short: str, state: str, node_state: str | None) -> dict[str, Any]:
        resource = next((r for n, r in self.queued.items() if n.endswith(f"/queuedResources/{short}")), None)
        if resource is None:
            raise KeyError(short)
        resource["state"] = {"state": state}
        if node_state:
            for spec in resource.get("tpu", {}).get("nodeSpec", []):
                node_name = f"{spec['parent']}/nodes/{spec['nodeId']}"
                node = dict(spec.get("node", {}))
                node.update({"name": node_name, "state": node_state, "queuedResource": resource["name"]})
                self.nodes[node_name] = node
        return resource


def _error(code: int, status: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"error": {"code": code, "message": message, "status": status}}


def handle_build(fake: Fake, method: str, path: str, body: Any) -> tuple[int, Any]:
    """Cloud Build v1: a submitted build is queued and never runs; the operation carries it back."""
    match = _BUILDS.match(path)
    if method != "POST" or not match:
        return _error(405, "UNIMPLEMENTED", f"{method} {path} is not part of this fake")
    project, location = match.group(1), match.group(2) or "global"
    build_id = f"build-{next(fake.ids)}"
    build = {**(body or {}), "id": build_id, "projectId": project, "status": "QUEUED", "createTime": _now()}
    return 200, {
        "name": f"projects/{project}/locations/{location}/operations/{build_id}",
        "metadata": {"@type": "type.googleapis.com/google.devtools.cloudbuild.v1.BuildOperationMetadata", "build": build},
    }


def handle(fake: Fake, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
    if path.startswith("/v1/"):
        return handle_build(fake, method, path, body)
    match = _RESOURCE.match(path)
    if not match:
        return _error(404, "NOT_FOUND", f"no such API path {path}")
    project, zone, collection, short = match.groups()
    parent = f"projects/{project}/locations/{zone}"
    name = f"{parent}/{collection}/{short}" if short else None
    if collection == "queuedResources":
        if method == "POST" and short is None:
            wanted = (query.get("queuedResourceId") or [""])[0]
            if not wanted:
                return _error(400, "INVALID_ARGUMENT", "queuedResourceId is required")
            full = f"{parent}/queuedResources/{wanted}"
            if full in fake.queued:
                return _error(409, "ALREADY_EXISTS", f"Resource '{full}' already exists")
            resource = dict(body or {})
            resource.update({"name": full, "state": {"state": "ACCEPTED"}, "createTime": _now()})
            fake.queued[full] = resource
            return 200, fake.operation(parent, "create", full, resource)
        if method == "GET" and short is None:
            items = [r for n, r in fake.queued.items() if n.startswith(parent + "/")]
            return 200, {"queuedResources": items}
        if method == "GET":
            return (200, fake.queued[name]) if name in fake.queued else _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
        if method == "DELETE":
            resource = fake.queued.pop(name, None)
            if resource is None:
                return _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
            for spec in resource.get("tpu", {}).get("nodeSpec", []):
                fake.nodes.pop(f"{spec['parent']}/nodes/{spec['nodeId']}", None)
            return 200, fake.operation(parent, "delete", name, None)
    if collection == "nodes" and method == "GET" and short:
        return (200, fake.nodes[name]) if name in fake.nodes else _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
    if collection == "operations" and method == "GET" and short:
        return (200, fake.operations[name]) if name in fake.operations else _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
    return _error(405, "UNIMPLEMENTED", f"{method} {path} is not part of this fake")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def make_handler(fake: Fake) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # keep stderr for real problems
            pass

        def _reply(self, code: int, doc: Any) -> None:
            data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if not isinstance(doc, str) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                self._reply(400, {"error": {"code": 400, "message": "body is not JSON", "status": "INVALID_ARGUMENT"}})
                return
            with fake.lock:
                if url.path.startswith("/_fake/"):
                    self._control(method, url.path, body)
                    return
                query = urllib.parse.parse_qs(url.query)
                fake.requests.append({"method": method, "path": url.path, "query": query, "body": body})
                code, doc = handle(fake, method, url.path, query, body)
            self._reply(code, doc)

        def _control(self, method: str, path: str, body: Any) -> None:
            if path == "/_fake/health":
                self._reply(200, "ok")
            elif path == "/_fake/requests" and method == "GET":
                self._reply(200, fake.requests)
            elif path == "/_fake/reset" and method == "POST":
                fake.requests.clear(), fake.queued.clear(), fake.nodes.clear(), fake.operations.clear()
                self._reply(200, {})
            elif path == "/_fake/state" and method == "POST":
                try:
                    self._reply(200, fake.set_state(body["name"], body["state"], body.get("node_state")))
                except KeyError:
                    self._reply(404, {"error": f"no queued resource {body.get('name')!r}"})
            else:
                self._reply(404, {"error": f"no control endpoint {method} {path}"})

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

    return Handler


class TpuFake:
    """The test side of a running fake: its endpoint and its control endpoints."""

    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port = process, port
        self.endpoint = f"http://127.0.0.1:{port}"

    def _call(self, method: str, path: str, doc: Any = None) -> Any:
        data = None if doc is None else json.dumps(doc).encode()
        request = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def requests(self) -> list[dict[str, Any]]:
        return self._call("GET", "/_fake/requests")

    def set_state(self, name: str, state: str, node_state: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/_fake/state", {"name": name, "state": state, "node_state": node_state})

    def reset(self) -> None:
        self._call("POST", "/_fake/reset", {})


@contextlib.contextmanager
def start_tpu_fake(folder: Path, ttl_s: float = 900.0, start_timeout_s: float = 20.0) -> Iterator[TpuFake]:
    log = open(folder / "tpu_fake.log", "wb")
    process = subprocess.Popen([sys.executable, __file__, "--port", "0", "--ttl", str(ttl_s)],
                               stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        line = process.stdout.readline().decode()  # the server prints its port once it is bound
        if not line.startswith("PORT ") or time.monotonic() > deadline:
            raise RuntimeError(f"the TPU API fake did not start: {line!r}; see {folder / 'tpu_fake.log'}")
        fake = TpuFake(process, int(line.split()[1]))
        with urllib.request.urlopen(f"{fake.endpoint}/_fake/health", timeout=5) as answer:
            if answer.read() != b"ok":
                raise RuntimeError(f"port {fake.port} answers, but not as the TPU API fake")
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
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(Fake()))
    server.daemon_threads = True
    timer = threading.Timer(args.ttl, server.shutdown)
    timer.daemon = True
    timer.start()
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
