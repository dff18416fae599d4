"""A local fake of the Google APIs that the commands of docs/cloud.md "From an empty project" call, recording every
request, so that the real gcloud can run each command as written (its own parser, its own requests).

    python -m tests.support.setup_fake --port 0 --ttl 600     prints `PORT <n>` once it serves on 127.0.0.1

Point gcloud at it with CLOUDSDK_API_ENDPOINT_OVERRIDES_<API>=http://127.0.0.1:PORT/ for SERVICEUSAGE,
ARTIFACTREGISTRY, STORAGE, CLOUDRESOURCEMANAGER and CLOUDBUILD (one process serves them all: their paths differ):
    POST /v1/projects/P/services:batchEnable                       Service Usage: a done operation
    POST /v1/projects/P/locations/L/repositories?repositoryId=R   Artifact Registry: a done operation; GET .../R
    GET  .../repositories/R:getIamPolicy, POST ...:setIamPolicy   the repository's policy (empty, then as set)
    GET  /v1/projects/P                                             Resource Manager: the project and its number
    POST /v1/projects/P:getIamPolicy, :setIamPolicy                 the project's policy (empty, then as set)
    POST /storage/v1/b?project=P, GET /storage/v1/b[/B]            Cloud Storage JSON API: buckets (P_cloudbuild
                                                                    exists and belongs to P, as gcloud checks)
    GET|PUT /storage/v1/b/B/iam                                    the bucket's policy
    POST /upload/storage/v1/b/B/o                                  a multipart upload (gcloud builds submit's source)
    POST /resumable/upload/storage/v1/b/B/o, PUT /_upload/ID       a resumable upload (the same, when it is large)
    POST /v1/projects/P/locations/L/builds                         Cloud Build: the build, QUEUED; a GET of it
                                                                    then finds it SUCCESS (it never runs here)
A body that is not JSON (an uploaded archive) is recorded as {"bytes": N, "content_type": T}, with the object's
"metadata" for a multipart upload; the object answered has that size, which gcloud compares with its file.
GET /_fake/requests gives every API request (method, path, query, body); GET /_fake/health answers "ok".
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from tests.support.fake_server import FakeClient, FakeHandler, Recorder, serve, start_fake

PROJECT_NUMBER = "123456789012"
_REPOSITORIES = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/repositories(?:/([^/:]+))?(?::(\w+))?$")
_BUCKET_IAM = re.compile(r"^/storage/v1/b/([^/]+)/iam$")
_BUCKET = re.compile(r"^/storage/v1/b/([^/]+)$")
_UPLOAD = re.compile(r"^/resumable/upload/storage/v1/b/([^/]+)/o$")
_MULTIPART = re.compile(r"^/upload/storage/v1/b/([^/]+)/o$")
_BUILDS = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/builds$")


class Setup(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.policies: dict[str, dict[str, Any]] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.builds: dict[str, dict[str, Any]] = {}
        self.ids = itertools.count(1)


def _error(code: int, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"error": {"code": code, "message": message, "status": "NOT_FOUND" if code == 404 else "INVALID"}}


def _upload_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """What an upload carried: a multipart/related one is the object's JSON metadata, then its bytes (gcloud
    quotes the boundary with single quotes, which the email package does not take, so it is split here)."""
    boundary = re.search(r"boundary=['\"]?([^'\";]+)", content_type)
    if not content_type.startswith("multipart/") or not boundary:
        return {"bytes": len(raw), "content_type": content_type}
    parts = [part for part in raw.split(b"--" + boundary.group(1).encode())[1:] if not part.startswith(b"--")]
    (_, metadata), (headers, data) = (part.strip(b"\r\n").split(b"\n\n", 1) for part in parts)
    kind = re.search(rb"Content-Type: (\S+)", headers)
    return {"metadata": json.loads(metadata), "bytes": len(data), "content_type": kind.group(1).decode()}


class Handler(FakeHandler):
    state: Setup

    def parse_body(self, raw: bytes) -> Any:
        try:
            return super().parse_body(raw)
        except ValueError:  # gcloud's source upload: a multipart body, not JSON
            return _upload_body(raw, self.headers.get("Content-Type") or "")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def answer(self, method: str, url: urllib.parse.SplitResult, body: Any) -> tuple[int, Any]:
        self.extra_headers = {}
        state, path = self.state, url.path
        query = urllib.parse.parse_qs(url.query)
        if method == "POST" and (match := re.match(r"^/v1/projects/([^/]+)/services:batchEnable$", path)):
            return 200, {"name": f"operations/enable-{next(state.ids)}", "done": True, "response": {
                "@type": "type.googleapis.com/google.api.serviceusage.v1.BatchEnableServicesResponse"}}
        if match := _REPOSITORIES.match(path):
            project, location, repository, verb = match.groups()
            parent = f"projects/{project}/locations/{location}"
            if method == "POST" and repository is None:
                created = {**(body or {}), "name": f"{parent}/repositories/{query['repositoryId'][0]}"}
                return 200, {"name": f"{parent}/operations/{next(state.ids)}", "done": True, "response": {
                    "@type": "type.googleapis.com/google.devtools.artifactregistry.v1.Repository", **created}}
            name = f"{parent}/repositories/{repository}"
            if verb == "getIamPolicy":
                return 200, state.policies.get(name, {"etag": "BwA=", "version": 1})
            if verb == "setIamPolicy":
                state.policies[name] = body["policy"]
                return 200, body["policy"]
            if method == "GET" and verb is None:
                return 200, {"name": name, "format": "DOCKER"}
        if method == "POST" and (match := re.match(r"^/v1/projects/([^/:]+):(getIamPolicy|setIamPolicy)$", path)):
            name = f"projects/{match.group(1)}"
            if match.group(2) == "setIamPolicy":
                state.policies[name] = body["policy"]
            return 200, state.policies.get(name, {"etag": "BwA=", "version": 1})
        if method == "GET" and (match := re.match(r"^/v1/projects/([^/]+)$", path)):
            return 200, {"projectId": match.group(1), "projectNumber": PROJECT_NUMBER, "lifecycleState": "ACTIVE"}
        if path == "/storage/v1/b" and method == "POST":
            return 200, {"kind": "storage#bucket", "id": body["name"], **body}
        if path == "/storage/v1/b" and method == "GET":  # gcloud checks its staging bucket is the project's own
            staging = f"{query['project'][0]}_cloudbuild"
            return 200, {"items": [{"kind": "storage#bucket", "id": staging, "name": staging}]}
        if match := _BUCKET_IAM.match(path):
            bucket = match.group(1)
            if method == "PUT":
                state.policies[f"gs://{bucket}"] = body
                return 200, body
            return 200, state.policies.get(f"gs://{bucket}", {"kind": "storage#policy", "etag": "CAE=",
                                                              "resourceId": f"projects/_/buckets/{bucket}"})
        if method == "GET" and (match := _BUCKET.match(path)):
            return 200, {"kind": "storage#bucket", "id": match.group(1), "name": match.group(1)}
        if method == "POST" and (match := _UPLOAD.match(path)):
            session = f"s{next(state.ids)}"
            state.uploads[session] = {"bucket": match.group(1), "name": query["name"][0]}
            self.extra_headers = {"Location": f"http://{self.headers['Host']}/_upload/{session}"}
            return 200, {}
        if method == "POST" and (match := _MULTIPART.match(path)):  # a small file goes in one request
            return 200, {"kind": "storage#object", "bucket": match.group(1), "name": query["name"][0],
                         "generation": "1", "size": str((body or {}).get("bytes", 0))}
        if method == "PUT" and path.startswith("/_upload/"):
            upload = state.uploads[path.rsplit("/", 1)[1]]
            return 200, {"kind": "storage#object", "bucket": upload["bucket"], "name": upload["name"],
                         "generation": "1", "size": str((body or {}).get("bytes", 0))}
        if method == "POST" and (match := _BUILDS.match(path)):
            project, location = match.groups()
            build_id = f"build-{next(state.ids)}"
            build = {**(body or {}), "id": build_id, "projectId": project, "status": "QUEUED"}
            state.builds[f"{path}/{build_id}"] = build
            return 200, {"name": f"projects/{project}/locations/{location}/operations/{build_id}", "metadata": {
                "@type": "type.googleapis.com/google.devtools.cloudbuild.v1.BuildOperationMetadata", "build": build}}
        if method == "GET" and path in state.builds:  # gcloud waits for the build: it has run, and succeeded
            return 200, {**state.builds[path], "status": "SUCCESS"}
        return _error(404, f"{method} {path} is not part of this fake")


def start_setup_fake(folder: Path, ttl_s: float = 600.0) -> contextlib.AbstractContextManager[FakeClient]:
    return start_fake(__spec__.name, folder, FakeClient, ttl_s)


def main(argv: list[str] | None = None) -> None:
    serve(Handler, Setup(), argv, __doc__.splitlines()[0], default_ttl_s=600.0)


if __name__ == "__main__":
    sys.exit(main())
