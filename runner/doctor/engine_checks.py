"""The engine check of `runner doctor --cloud --on ENGINE`: the cheapest call of the engine's own client (Vertex
AI: one page of custom jobs; GKE: the cluster's /version from kubeconfig, then its API groups for JobSet's;
SkyPilot: `sky api info`'s health call). An engine whose client is not installed is a warning, "not checked",
with the extra that installs it."""

from __future__ import annotations

import importlib
import itertools
import os
from collections.abc import Callable
from typing import Any

from runner.doctor.answers import reason, region, status_of, unreachable
from runner.doctor.checks import Check

# --- the engines --------------------------------------------------------------------------------


# The module of each engine's client, imported by load_client before its check is timed.
_CLIENTS = {"skypilot": "sky.client.sdk", "gke": "kubernetes.client", "vertex": "google.cloud.aiplatform_v1"}


def load_client(engine: str) -> None:
    """Imports the engine's client before its check's bound starts (the check's own import is then at once):
    --timeout bounds waiting for an answer, and an import is local work. SkyPilot's took 20 s on a busy
    2-core machine, which read as "unreachable: no answer within 10 s"."""
    try:
        importlib.import_module(_CLIENTS[engine])
    except (KeyError, ImportError):
        pass  # tpu-vm has no engine client; a client not installed is the check's to say


def _not_installed(engine: str, install: str) -> Check:
    return Check("engine", "warn", f"not checked: the {engine} client is not installed", install)


def check_vertex(make_client: Callable[[str], Any], project: str, zone: str, timeout: float) -> Check:
    """One page of custom jobs, through the client `runner submit --on vertex` uses (`make_client(region)`)."""
    try:
        client = make_client(region(zone))
    except ImportError:
        return _not_installed("Vertex AI", "pip install 'tpu-job-runner[vertex]'")
    parent = f"projects/{project}/locations/{region(zone)}"
    try:
        pager = client.list_custom_jobs(request={"parent": parent, "page_size": 1}, timeout=timeout, retry=None)
        list(itertools.islice(pager, 1))
    except Exception as exc:
        status = status_of(exc)
        if unreachable(exc):
            return Check("engine", "fail", f"unreachable: Vertex AI for {parent}: {reason(exc)}",
                         "check DNS, the network and CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM if set")
        return Check("engine", "fail", f"{'denied' if status in (401, 403) else 'refused'} ({status}): Vertex AI "
                     f"would not list the custom jobs of {parent}: {reason(exc)}",
                     f"gcloud services enable aiplatform.googleapis.com --project {project}; if it is enabled, "
                     f"grant the account Vertex AI's user role: gcloud projects add-iam-policy-binding {project} "
                     "--member=user:EMAIL --role=roles/aiplatform.user")
    return Check("engine", "ok", f"Vertex AI answered a list of the custom jobs of {parent}")


def check_gke(timeout: float) -> Check:
    try:
        from kubernetes import client, config
    except ImportError:
        return _not_installed("Kubernetes", "pip install 'tpu-job-runner[gke]'")
    get_credentials = "gcloud container clusters get-credentials CLUSTER --location LOCATION"
    try:
        # KUBECONFIG read now: the client reads it once, when it is first imported (kube_config.py's
        # KUBE_CONFIG_DEFAULT_LOCATION); a list of files (a:b) is merged by the client as kubectl does.
        api_client = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
    except Exception as exc:
        return Check("engine", "fail", f"missing: no Kubernetes cluster in kubeconfig: {reason(exc)}",
                     f"{get_credentials} (or set KUBECONFIG)")
    host = api_client.configuration.host
    try:
        version = client.VersionApi(api_client).get_code(_request_timeout=timeout)
    except Exception as exc:
        status = status_of(exc)
        if status in (401, 403):
            return Check("engine", "fail", f"denied ({status}): the cluster at {host} refused the credentials: "
                         f"{reason(exc)}", f"{get_credentials}; grant the account roles/container.developer")
        what = "unreachable" if unreachable(exc) else "refused" if status is None else f"refused ({status})"
        return Check("engine", "fail", f"{what}: the cluster at {host}: {reason(exc)}",
                     f"check the cluster is running and reachable from here; {get_credentials}")
    evidence = f"the Kubernetes API at {host} answered (version {version.git_version})"
    return _jobset_api(client, api_client, host, evidence, timeout)


# What `runner submit --on gke` creates (runner/cloud/engines/gke.py GROUP/VERSION), and the install command from
# JobSet's installation page (kubernetes-sigs/jobset site/content/en/docs/installation/_index.md).
JOBSET_GROUP, JOBSET_VERSION = "jobset.x-k8s.io", "v1alpha2"
JOBSET_RELEASE = "v0.10.1"  # the release xpk installs (runner/cloud/engines/gke.py); xpk clusters have it
JOBSET_INSTALL = ("kubectl apply --server-side -f https://github.com/kubernetes-sigs/jobset/releases/download/"
                  f"{JOBSET_RELEASE}/manifests.yaml")


def _jobset_api(client: Any, api_client: Any, host: str, evidence: str, timeout: float) -> Check:
    """The cluster's API groups (GET /apis/, Kubernetes API discovery): a cluster without JobSet's CRD would
    refuse the JobSet with a 404 only when `submit` sends it."""
    try:
        groups = client.ApisApi(api_client).get_api_versions(_request_timeout=timeout).groups or []
    except Exception as exc:
        status = status_of(exc)
        what = "unreachable" if unreachable(exc) else f"refused ({status})"
        return Check("engine", "fail", f"{evidence}, but its API groups were not listed: {what}: {reason(exc)}",
                     "grant the account roles/container.developer (it lists the cluster's APIs)")
    versions = {v.version for g in groups if g.name == JOBSET_GROUP for v in (g.versions or [])}
    if JOBSET_VERSION not in versions:
        found = f"only {', '.join(sorted(versions))}" if versions else "not installed"
        return Check("engine", "fail", f"missing: {evidence}, but JobSet's API {JOBSET_GROUP}/{JOBSET_VERSION} is "
                     f"{found}: `runner submit --on gke` creates a JobSet", JOBSET_INSTALL)
    return Check("engine", "ok", f"{evidence}; JobSet's API {JOBSET_GROUP}/{JOBSET_VERSION} is served")


def check_skypilot(timeout: float) -> Check:
    try:
        from sky.client import sdk
    except ImportError:
        return _not_installed("SkyPilot", "pip install 'tpu-job-runner[skypilot]'")
    try:
        health = sdk.api_info()  # `sky api info`: GET /api/health on the API server
    except Exception as exc:
        status = status_of(getattr(exc, "response", None) or exc)
        what = "unreachable" if status is None else f"{'denied' if status in (401, 403) else 'refused'} ({status})"
        return Check("engine", "fail", f"{what}: the SkyPilot API server: {reason(exc)}",
                     "sky api start (a local server), or `sky api login -e URL` / SKYPILOT_API_SERVER_ENDPOINT")
    status = str(getattr(health.status, "value", health.status))
    evidence = f"the SkyPilot API server answered: {status}, version {health.version or '?'}"
    if status != "healthy":
        return Check("engine", "fail", evidence, "sky api stop; sky api start (or ask the server's operator)")
    return Check("engine", "ok", evidence + "; `sky check gcp` on the server says whether it reaches GCP")
