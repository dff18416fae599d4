"""The image a submission names, asked of its registry before anything bills (Docker Registry HTTP API v2, as
Artifact Registry's docs call it): present, missing (with how cloudbuild.yaml would push it) or denied (with
the grant). `RUNNER_REGISTRY_ENDPOINT` (tests, private mirrors) replaces the registry's https://HOST.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

from runner.doctor.checks import Check

REGISTRY_ENV = "RUNNER_REGISTRY_ENDPOINT"
# The manifest kinds a multi-arch or single image can have: without them a registry may answer 404 for an
# index it holds (the OCI Distribution Spec's content negotiation).
_MANIFEST_TYPES = ", ".join((
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
))
_GOOGLE_REGISTRY = re.compile(r"^(?:[a-z0-9-]+-docker\.pkg\.dev|(?:[a-z]+\.)?gcr\.io)$")
_REFERENCE = re.compile(r"^(?P<host>[^/]+)/(?P<name>[^:@]+)(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>\S+))?$")

def parse_image(image: str) -> tuple[str, str, str]:
    """(registry host, repository name, tag or digest) of a full image reference."""
    match = _REFERENCE.match(image)
    if not match or "." not in match["host"] and ":" not in match["host"] and match["host"] != "localhost":
        raise ValueError(f"--image {image!r} names no registry host (write HOST/PATH/NAME:TAG)")
    return match["host"], match["name"], match["digest"] or match["tag"] or "latest"


_ARTIFACT_REGISTRY = re.compile(r"^(?P<region>[a-z0-9-]+)-docker\.pkg\.dev$")


def push_action(host: str, name: str, reference: str) -> str:
    """How to make `host/name:reference` exist: cloudbuild.yaml's TPU variant pushes
    ${_REGION}-docker.pkg.dev/${_PROJECT}/${_REPOSITORY}/${_IMAGE}:tpu and :tpu-$SHORT_SHA, so its substitutions
    are read off the image's own name; for a tag it does not make, the tag it makes is named instead."""
    where = _ARTIFACT_REGISTRY.match(host)
    parts = name.split("/")
    if not where or len(parts) != 3:
        return (f"push it to {host}/{name}:{reference} yourself: cloudbuild.yaml pushes only to Artifact Registry, "
                "as REGION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE:tpu (docs/image.md)")
    project, repository, image = parts
    tagged = re.fullmatch(r"tpu-([0-9a-f]{7,40})", reference)
    sha = tagged.group(1) if tagged else "$(git rev-parse --short HEAD)"
    build = ("gcloud builds submit --config cloudbuild.yaml "
             f"--project={project} --substitutions=SHORT_SHA={sha},_BUILD_TPU=true,"
             f"_REGION={where['region']},_PROJECT={project},_REPOSITORY={repository},_IMAGE={image} .")
    if reference == "tpu" or tagged:
        return f"build and push it: {build}"
    return (f"cloudbuild.yaml tags the TPU image :tpu and :tpu-SHORT_SHA, never :{reference}: build and push it "
            f"({build}) and pass --image {host}/{name}:tpu")


def check_image(access: Any, image: str, environ: dict[str, str], timeout: float) -> Check:
    """GET /v2/NAME/manifests/REF with the access token as a Bearer token, as Artifact Registry's docs do it."""
    try:
        host, name, reference = parse_image(image)
    except ValueError as exc:
        return Check("image", "fail", str(exc), "pass it as pushed: REGION-docker.pkg.dev/PROJECT/runner/runner:tpu")
    override = environ.get(REGISTRY_ENV, "").rstrip("/")
    if not override and not _GOOGLE_REGISTRY.match(host):
        return Check("image", "warn", f"not checked: {host} is not Artifact Registry (*-docker.pkg.dev) or gcr.io",
                     f"check it with `docker manifest inspect {image}` using the TPU VM's credentials")
    url = f"{override or 'https://' + host}/v2/{name}/manifests/{reference}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {access.token}",
                                                   "Accept": _MANIFEST_TYPES})
    registry = _ARTIFACT_REGISTRY.match(host)
    repository, holder = ((name.split("/")[1], name.split("/")[0]) if registry and name.count("/") == 2 else
                          ("REPOSITORY", access.project))
    reader = (f"gcloud artifacts repositories add-iam-policy-binding {repository} "
              f"--location={registry['region'] if registry else 'REGION'} --member=user:EMAIL "
              f"--role=roles/artifactregistry.reader --project={holder}")
    push = push_action(host, name, reference)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            digest = answer.headers.get("Docker-Content-Digest") or "?"
            kind = answer.headers.get("Content-Type", "?").split(";")[0]
    except urllib.error.HTTPError as exc:
        body = exc.read()[:300].decode(errors="replace")
        try:
            codes = ", ".join(error.get("code", "?") for error in json.loads(body).get("errors", []))
        except (ValueError, AttributeError):
            codes = body.strip()[:120]
        if exc.code == 404:
            return Check("image", "fail", f"missing (404 {codes}): {image} is not in {host}", push)
        if exc.code in (401, 403):
            return Check("image", "fail", f"denied ({exc.code} {codes}): {host} refused these credentials for "
                         f"{image}", f"{reader} (Artifact Registry API: gcloud services enable "
                         f"artifactregistry.googleapis.com --project {holder})")
        return Check("image", "fail", f"{host} answered {exc.code} ({codes}) for {image}", push)
    except (OSError, urllib.error.URLError) as exc:
        return Check("image", "fail", f"unreachable: {url.split('/v2/')[0]}: {getattr(exc, 'reason', exc)}",
                     f"check DNS, the network and https_proxy{'; and ' + REGISTRY_ENV if override else ''}")
    return Check("image", "ok", f"present: {image} ({kind}, {digest}); the TPU VM pulls it with its own service "
                 "account, which needs roles/artifactregistry.reader", data={"digest": digest})
