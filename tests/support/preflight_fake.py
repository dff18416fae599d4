"""A local fake of the read calls `runner doctor --cloud` makes, recording every request with its Authorization.

    python -m tests.support.preflight_fake --port 0 --ttl 600     prints `PORT <n>` once it serves on 127.0.0.1

One process answers every API at its own paths (each client is pointed at it by its own override):
    GET /v2/projects/P/locations/Z/nodes | queuedResources     Cloud TPU v2: empty lists
    GET /v2/projects/P/locations/Z/acceleratorTypes            the types offered in Z (POST /_fake/offer)
    GET /v1/projects/P/locations/R/customJobs                  Vertex AI: an empty list
    GET /version                                               Kubernetes: the API server's version
    GET /apis/                                                 Kubernetes: the API groups (JobSet's; /_fake/groups)
    GET /api/health                                            SkyPilot's API server: healthy
    GET /v2/NAME/manifests/REF                                 Docker Registry HTTP API v2: a manifest with its
                                                               Docker-Content-Digest, or 404 MANIFEST_UNKNOWN
    GET /v1/projects/P, POST /v1/projects/P:getIamPolicy       Cloud Resource Manager v1: the project (number
                                                               PROJECT_NUMBER) and its IAM policy (iam_answer;
                                                               also served by tpu_fake.py)
Errors in each API's own form: Google's {"error": {...}} (with an ErrorInfo reason), Kubernetes' Status, the
registry's {"errors": [{"code", "message"}]}.

Control endpoints:
    POST /_fake/images   {"name": N, "reference": R}     the registry holds N:R from now on
    POST /_fake/offer    {"zone": Z, "types": [...]}    what Z's acceleratorTypes list holds
    POST /v1/projects/P/services/S:enable, /v1/projects/P/services:batchEnable
                                                               Service Usage (`gcloud services enable`, its
                                                               endpoint CLOUDSDK_API_ENDPOINT_OVERRIDES_SERVICEUSAGE):
                                                               a done operation; the SERVICE_DISABLED denials
                                                               whose "service" is S are lifted
    POST /_fake/deny     {"prefix": "/v2/projects", "status": 403, "reason": "SERVICE_DISABLED", "service": S}:
                         requests whose path starts with the prefix are refused (several rules may stand; {}
                         clears them)
    POST /_fake/groups   {"groups": [APIGroup...]}       the Kubernetes API groups from now on ([]: no JobSet)
    POST /_fake/iam      {"bindings": [{"role", "members"}...]}   every project's IAM policy from now on ({}: the
                         default, default_bindings)
    POST /_fake/reset    forgets requests, images, offers and denials
    GET  /_fake/requests every API request: method, path, query, body, authorization
From a test: `with start_preflight_fake(folder) as fake:` gives `fake.endpoint`, `fake.requests()`, `fake.image()`,
`fake.offer()`, `fake.deny()` and `fake.reset()`; the process is stopped by its PID when the block ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from tests.support.engine_fake import JOBSET_GROUP, api_groups
from tests.support.fake_server import FakeClient, FakeHandler, Recorder, serve, start_fake

_TPU = re.compile(r"^/v2/projects/([^/]+)/locations/([^/]+)/(nodes|queuedResources|acceleratorTypes)$")
_VERTEX = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/customJobs$")
_MANIFEST = re.compile(r"^/v2/(.+)/manifests/([^/]+)$")
_ENABLE = re.compile(r"^/v1/projects/([^/]+)/services(?:/([^/:]+))?:(enable|batchEnable)$")
_PROJECT = re.compile(r"^/v1/projects/([^/:]+)(:getIamPolicy)?$")
PROJECT_NUMBER = "123456789012"
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
DEFAULT_OFFER = {"us-central1-a": ["v2-8", "v3-8", "v5litepod-1", "v5litepod-4", "v5litepod-8"]}


class Preflight(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.requests.clear()
        self.images: set[tuple[str, str]] = set()
        self.offers: dict[str, list[str]] = {zone: list(types) for zone, types in DEFAULT_OFFER.items()}
        self.denials: list[dict[str, Any]] = []
        self.groups: list[dict[str, Any]] = [JOBSET_GROUP]  # the cluster's API groups (GET /apis/)
        self.iam: list[dict[str, Any]] | None = None  # every project's IAM bindings (None: default_bindings)


def default_bindings(project: str) -> list[dict[str, Any]]:
    """A new project's policy as the tests meet it: Editor for the Compute Engine default service account (Google
    grants it unless an organisation policy turns that off) and TPU Admin for runner@PROJECT."""
    default = f"serviceAccount:{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
    return [{"role": "roles/editor", "members": [default, "user:owner@example.com"]},
            {"role": "roles/tpu.admin", "members": [f"serviceAccount:runner@{project}.iam.gserviceaccount.com"]}]


def iam_answer(method: str, path: str, bindings: list[dict[str, Any]] | None) -> tuple[int, Any] | None:
    """Cloud Resource Manager v1's GET projects/P and POST projects/P:getIamPolicy (None: not such a path)."""
    match = _PROJECT.match(path)
    if not match:
        return None
    project, policy = match.groups()
    if policy and method == "POST":
        return 200, {"version": 1, "etag": "BwYfake=", "bindings": default_bindings(project) if bindings is None
                     else bindings}
    if not policy and method == "GET":
        return 200, {"projectNumber": PROJECT_NUMBER, "projectId": project, "lifecycleState": "ACTIVE",
                     "name": project}
    return None


def _google_error(code: int, status: str, message: str, reason: str | None = None) -> tuple[int, dict[str, Any]]:
    error: dict[str, Any] = {"code": code, "message": message, "status": status}
    if reason:
        error["details"] = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": reason,
                             "domain": "googleapis.com"}]
    return code, {"error": error}


def _denied(path: str, rule: dict[str, Any]) -> tuple[int, Any]:
    status = int(rule.get("status", 403))
    if path.startswith(("/version", "/api/v1", "/apis/")):
        return status, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                        "message": f"forbidden: {path} (fake)", "code": status}
    if _MANIFEST.match(path):
        return status, {"errors": [{"code": "DENIED", "message": "Permission \"artifactregistry.repositories."
                                    "downloadArtifacts\" denied (fake)"}]}
    if rule.get("reason") == "SERVICE_DISABLED":
        return _google_error(status, "PERMISSION_DENIED", "the API has not been used in this project before or it "
                             "is disabled (fake)", "SERVICE_DISABLED")
    return _google_error(status, "PERMISSION_DENIED", f"Permission denied on {path} (fake)", rule.get("reason"))


def manifest_answer(handler: FakeHandler, name: str, reference: str, present: bool) -> tuple[int, Any]:
    """GET /v2/NAME/manifests/REF as a Docker Registry HTTP API v2 answers it (also served by tpu_fake.py)."""
    if not present:
        return 404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": f"manifest unknown: {name}:{reference}"}]}
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "layers": []}
    digest = "sha256:" + hashlib.sha256(json.dumps(manifest).encode()).hexdigest()
    handler.extra_headers = {"Docker-Content-Digest": digest}
    handler.text_type = MANIFEST_TYPE
    return 200, json.dumps(manifest)


class Handler(FakeHandler):
    state: Preflight

    def record(self, method: str, url: urllib.parse.SplitResult, body: Any) -> None:
        self.state.requests.append({"method": method, "path": url.path, "query": urllib.parse.parse_qs(url.query),
                                    "body": body, "authorization": self.headers.get("Authorization"),
                                    "accept": self.headers.get("Accept")})

    def answer(self, method: str, url: urllib.parse.SplitResult, body: Any) -> tuple[int, Any]:
        state, path = self.state, url.path
        self.extra_headers, self.text_type = {}, "text/plain"  # one handler serves a keep-alive connection
        if path.startswith("/_fake/"):
            return self._control(method, path, body or {})
        if method == "POST" and (match := _ENABLE.match(path)):
            project, service, _ = match.groups()
            enabled = [service] if service else list((body or {}).get("serviceIds", []))
            state.denials = [rule for rule in state.denials if not (
                rule.get("reason") == "SERVICE_DISABLED" and rule.get("service") in enabled)]
            return 200, {"name": "operations/noop.DONE_OPERATION", "done": True,
                         "response": {"@type": "type.googleapis.com/google.api.serviceusage.v1.EnableServiceResponse",
                                      "service": {"name": f"projects/{project}/services/{enabled[0]}",
                                                  "state": "ENABLED"}}}
        for rule in state.denials:
            if path.startswith(rule["prefix"]):
                return _denied(path, rule)
        if (found := iam_answer(method, path, state.iam)) is not None:
            return found
        if method != "GET":
            return _google_error(405, "UNIMPLEMENTED", f"{method} {path} is not part of this fake")
        if match := _MANIFEST.match(path):
            return manifest_answer(self, *match.groups(), present=tuple(match.groups()) in state.images)
        if match := _TPU.match(path):
            project, zone, collection = match.groups()
            if collection != "acceleratorTypes":
                return 200, {}
            parent = f"projects/{project}/locations/{zone}"
            return 200, {"acceleratorTypes": [{"name": f"{parent}/acceleratorTypes/{t}", "type": t}
                                              for t in state.offers.get(zone, [])]}
        if _VERTEX.match(path):
            return 200, {}
        if path in ("/version", "/version/"):  # the kubernetes client asks with the slash
            return 200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake", "gitCommit": "fake",
                         "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.23",
                         "compiler": "gc", "platform": "linux/amd64"}
        if path in ("/apis", "/apis/"):  # Kubernetes API discovery
            return 200, api_groups(*state.groups)
        if path == "/api/health":
            return 200, {"status": "healthy", "api_version": "1", "version": "0.14.1", "commit": "fake"}
        return _google_error(404, "NOT_FOUND", f"{method} {path} is not part of this fake")

    def _control(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        state = self.state
        if method == "POST" and path == "/_fake/images":
            state.images.add((body["name"], body["reference"]))
        elif method == "POST" and path == "/_fake/offer":
            state.offers[body["zone"]] = list(body["types"])
        elif method == "POST" and path == "/_fake/deny":
            state.denials = [] if not body else [*state.denials, body]
        elif method == "POST" and path == "/_fake/groups":
            state.groups = list(body["groups"])
        elif method == "POST" and path == "/_fake/iam":
            state.iam = body.get("bindings")
        elif method == "POST" and path == "/_fake/reset":
            state.reset()
        else:
            return 404, {"error": f"no control endpoint {method} {path}"}
        return 200, {}


class PreflightFake(FakeClient):
    """The test side of a running fake."""

    def image(self, name: str, reference: str) -> None:
        self.call("POST", "/_fake/images", {"name": name, "reference": reference})

    def offer(self, zone: str, types: list[str]) -> None:
        self.call("POST", "/_fake/offer", {"zone": zone, "types": types})

    def deny(self, prefix: str, status: int = 403, reason: str | None = None, service: str | None = None) -> None:
        self.call("POST", "/_fake/deny", {"prefix": prefix, "status": status, "reason": reason, "service": service})

    def groups(self, groups: list[dict[str, Any]]) -> None:
        self.call("POST", "/_fake/groups", {"groups": groups})

    def iam(self, bindings: list[dict[str, Any]] | None) -> None:
        """Every project's IAM bindings from now on (None: default_bindings)."""
        self.call("POST", "/_fake/iam", {"bindings": bindings})

    def reset(self) -> None:
        self.call("POST", "/_fake/reset", {})


def start_preflight_fake(folder: Path, ttl_s: float = 600.0) -> contextlib.AbstractContextManager[PreflightFake]:
    return start_fake(__spec__.name, folder, PreflightFake, ttl_s)


def main(argv: list[str] | None = None) -> None:
    serve(Handler, Preflight(), argv, __doc__.splitlines()[0], default_ttl_s=600.0)


if __name__ == "__main__":
    sys.exit(main())
