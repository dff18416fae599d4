"""A local fake of the two engine APIs `runner submit --on` sends to, recording every request.

    python -m tests.support.engine_fake --port 0 --ttl 600     prints `PORT <n>` once it serves on 127.0.0.1

    POST /v1/projects/P/locations/R/customJobs                      Vertex AI: the CustomJob back, QUEUED
    GET  /v1/projects/P/locations/R/customJobs                      Vertex AI: the jobs created so far
    GET  /version                                                   Kubernetes: the API server's version
    POST /apis/jobset.x-k8s.io/v1alpha2/namespaces/NS/jobsets       Kubernetes: the JobSet back, with a uid
                                                                    (409 AlreadyExists for a name seen before)
    GET  /api/v1/namespaces/NS, /apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/NAME
                             Kubernetes: an object put there with POST /_fake/objects, else 404 NotFound
    POST /_fake/objects      {"path": P, "object": {...}}: what GET P answers from now on (not recorded)
    GET  /_fake/requests     every API request so far: method, path, query, body (parsed JSON)
    GET  /_fake/health       "ok"
The process exits by itself after --ttl seconds. From a test: `with start_engine_fake(folder) as fake:` gives
`fake.endpoint` and `fake.requests()`; the process is stopped by its PID when the block ends.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from tests.support.fake_server import FakeClient, FakeHandler, Recorder, serve, start_fake

_CUSTOM_JOBS = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/customJobs$")
_JOBSETS = re.compile(r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets$")


JOBSET_GROUP = {"name": "jobset.x-k8s.io", "versions": [{"groupVersion": "jobset.x-k8s.io/v1alpha2",
                                                          "version": "v1alpha2"}]}


def api_groups(*groups: dict[str, Any]) -> dict[str, Any]:
    """GET /apis/ as a Kubernetes API server answers it (an APIGroupList)."""
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [{**g, "preferredVersion": g["versions"][0]} for g in groups]}


class Engines(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.jobsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.objects: dict[str, Any] = {}  # path -> a Kubernetes object a test put there
        self.custom_jobs: list[dict[str, Any]] = []
        self.ids = itertools.count(1)


def handle(state: Engines, method: str, path: str, body: Any) -> tuple[int, Any]:
    if method == "POST" and path == "/_fake/objects":
        state.objects[body["path"]] = body["object"]
        return 200, {}
    if method == "GET" and (match := _CUSTOM_JOBS.match(path)):  # what `runner submit`'s preflight lists
        return 200, {"customJobs": [job for job in state.custom_jobs if job["name"].startswith(
            f"projects/{match.group(1)}/locations/{match.group(2)}/")]} if state.custom_jobs else {}
    if method == "GET" and path in ("/version", "/version/"):  # the kubernetes client asks with the slash
        return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "gitCommit": "fake",
                     "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24",
                     "compiler": "gc", "platform": "linux/amd64"}
    if method == "GET" and path in ("/apis", "/apis/"):  # API discovery: JobSet's group unless a test put others
        return 200, state.objects.get("/apis/", api_groups(JOBSET_GROUP))
    if method == "GET" and path.startswith(("/api/v1/", "/apis/")):
        if path in state.objects:
            return 200, state.objects[path]
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                     "message": f"{path} not found", "code": 404}
    if method == "POST" and (match := _CUSTOM_JOBS.match(path)):
        job = dict(body or {})
        job.update({"name": f"projects/{match.group(1)}/locations/{match.group(2)}/customJobs/{next(state.ids)}",
                    "state": "JOB_STATE_QUEUED", "createTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        state.custom_jobs.append(job)
        return 200, job
    if method == "POST" and (match := _JOBSETS.match(path)):
        name = (body or {}).get("metadata", {}).get("name")
        key = (match.group(1), name)
        if key in state.jobsets:
            return 409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists",
                         "message": f'jobsets.jobset.x-k8s.io "{name}" already exists', "code": 409}
        created = json.loads(json.dumps(body))
        created["metadata"].update({"uid": f"uid-{next(state.ids)}", "namespace": match.group(1)})
        state.jobsets[key] = created
        return 201, created
    return 404, {"error": {"code": 404, "message": f"{method} {path} is not part of this fake", "status": "NOT_FOUND"}}


class Handler(FakeHandler):
    state: Engines

    def answer(self, method: str, url: urllib.parse.SplitResult, body: Any) -> tuple[int, Any]:
        return handle(self.state, method, url.path, body)


class EngineFake(FakeClient):
    """The test side of a running fake: `endpoint`, `requests()` and `put(path, object)`."""

    def put(self, path: str, obj: dict[str, Any]) -> None:
        self.call("POST", "/_fake/objects", {"path": path, "object": obj})


def start_engine_fake(folder: Path, ttl_s: float = 600.0) -> contextlib.AbstractContextManager[EngineFake]:
    return start_fake(__spec__.name, folder, EngineFake, ttl_s)


def main(argv: list[str] | None = None) -> None:
    serve(Handler, Engines(), argv, __doc__.splitlines()[0], default_ttl_s=600.0)


if __name__ == "__main__":
    sys.exit(main())
