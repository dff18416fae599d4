"""`runner doctor --cloud`: what a cloud submission needs, asked of the APIs themselves before anything bills.

    cloud_credentials  an access token (CLOUDSDK_AUTH_ACCESS_TOKEN, else Application Default Credentials) and
                       the project (--project, GOOGLE_CLOUD_PROJECT, gcloud's configuration)
    tpu_api            the Cloud TPU API answers a list of nodes and of queued resources in the zone, through
                       the same client `runner submit` uses (runner/cloud/tpu_api.py, its endpoint override)
    tpu_type           the TPU type is among the zone's acceleratorTypes
    quota              said to be unknown: the TPU API reports no quota
    vm_permissions     (--on tpu-vm) the project's IAM policy (Cloud Resource Manager v1 getIamPolicy, as `gcloud
                       projects get-iam-policy` reads it) grants the service account the TPU VM runs as (the
                       --service-account, else the project's Compute Engine default) a role that holds the TPU
                       delete and get permissions its startup script uses to delete the slice (VM_ROLES)
    engine             (--on skypilot|gke|vertex) the engine's API answers its client's cheapest call
    bucket_read        data.train's folder lists objects (google-cloud-storage; STORAGE_EMULATOR_HOST honoured)
    bucket_write       a probe object is written, read back and deleted under output.dir
    image              the image's manifest is in its registry (Docker Registry HTTP API v2, the same token)

Every answer is one of: present (ok), missing, denied (HTTP 403), unreachable (connection refused, DNS), and
each check says the command that fixes it. Every call runs in a daemon thread bounded by `timeout` seconds
(runner/device/bounded.py): a DNS lookup ignores socket timeouts. No client retries: a preflight that
waited out a retry budget would be slower than the failure it predicts.

`RUNNER_REGISTRY_ENDPOINT` (tests, private mirrors) replaces the registry's https://HOST with another base URL;
gcloud's CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDRESOURCEMANAGER replaces https://cloudresourcemanager.googleapis.com/.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import uuid
from collections.abc import Callable
from typing import Any

from runner.device import tpus
from runner.doctor.answers import bounded, reason, region, status_of, unreachable
from runner.doctor.checks import Check
from runner.doctor.engine_checks import check_gke, check_skypilot, check_vertex, load_client
from runner.doctor.permissions import check_vm_permissions, vm_grant
from runner.doctor.registry import check_image, parse_image, push_action
from runner.spec.types import JobSpec

ENGINES = ("tpu-vm", "skypilot", "gke", "vertex")
_NOT_RUN = "not run: no credentials or no project (see cloud_credentials)"


@dataclasses.dataclass(frozen=True)
class CloudClients:
    """What `runner submit` itself uses, handed in by the command line (the doctor and the submit path are
    neighbours that do not import each other): its TPU client, its Vertex AI client for a region, gcloud's
    default project and the OAuth scope its credentials ask for."""

    tpu: Callable[[], Any]
    vertex: Callable[[str], Any]
    default_project: Callable[[], str | None]
    scope: str


@dataclasses.dataclass(frozen=True)
class Access:
    """What every cloud call uses: the credentials, an access token from them, and the project."""

    credentials: Any
    token: str
    project: str



def find_project(flag: str | None, environ: dict[str, str], gcloud_project: str | None,
                 credentials_project: str | None) -> tuple[str | None, str]:
    """The project and where it came from: --project, GOOGLE_CLOUD_PROJECT, gcloud's configuration, the key file."""
    for value, source in ((flag, "--project"), (environ.get("GOOGLE_CLOUD_PROJECT"), "GOOGLE_CLOUD_PROJECT"),
                          (gcloud_project, "gcloud config core/project"),
                          (credentials_project, "the credentials' own project")):
        if value:
            return value, source
    return None, ""


def check_credentials(project_flag: str | None, environ: dict[str, str],
                      clients: CloudClients) -> tuple[Check, Access | None]:
    """An access token from the credentials `runner submit` uses, and the project it would submit to."""
    import google.auth
    import google.auth.transport.requests
    from google.auth import exceptions as auth_exceptions
    from google.oauth2.credentials import Credentials

    login = "gcloud auth application-default login"
    credentials_project = None
    if environ.get("CLOUDSDK_AUTH_ACCESS_TOKEN"):
        credentials, source = Credentials(environ["CLOUDSDK_AUTH_ACCESS_TOKEN"]), "CLOUDSDK_AUTH_ACCESS_TOKEN"
    else:
        try:
            credentials, credentials_project = google.auth.default(scopes=[clients.scope])
        except auth_exceptions.DefaultCredentialsError as exc:
            return Check("cloud_credentials", "fail", f"missing: no Application Default Credentials ({reason(exc)})",
                         f"{login} (or set GOOGLE_APPLICATION_CREDENTIALS to a key file)"), None
        source = f"Application Default Credentials ({type(credentials).__module__.rsplit('.', 1)[-1]})"
        try:
            credentials.refresh(google.auth.transport.requests.Request())
        except auth_exceptions.RefreshError as exc:
            return Check("cloud_credentials", "fail", f"denied: {source} gave no access token: {reason(exc)}",
                         login), None
        except auth_exceptions.TransportError as exc:
            return Check("cloud_credentials", "fail", f"unreachable: the token endpoint: {reason(exc)}",
                         "check DNS, the network and https_proxy"), None
    project, where = find_project(project_flag, environ, clients.default_project(), credentials_project)
    if not project:
        return Check("cloud_credentials", "fail", f"credentials from {source}, but no project: none of --project, "
                     "GOOGLE_CLOUD_PROJECT, gcloud's core/project is set", "gcloud config set project PROJECT_ID "
                     "(or pass --project)"), None
    evidence = f"credentials from {source}; project {project} (from {where})"
    # `runner submit` reads the project from the same places (--project, GOOGLE_CLOUD_PROJECT, gcloud's).
    access = Access(credentials, credentials.token, project)
    return Check("cloud_credentials", "ok", evidence, data={"project": project, "source": where}), access



def _tpu_refusal(name: str, what: str, exc: BaseException, project: str) -> Check:
    status = status_of(exc)
    enable = f"gcloud services enable tpu.googleapis.com --project {project}"
    if unreachable(exc):
        return Check(name, "fail", f"unreachable: {what}: {reason(exc)}",
                     "check DNS, the network, https_proxy and CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU if set")
    if status in (401, 403):
        disabled = "SERVICE_DISABLED" in str(exc) or "has not been used" in str(exc)
        action = enable if disabled else (f"{enable}; if it is enabled, grant the account a Cloud TPU role: gcloud "
                                          f"projects add-iam-policy-binding {project} --member=user:EMAIL "
                                          "--role=roles/tpu.admin")
        return Check(name, "fail", f"denied ({status}): {what}: {reason(exc)}", action)
    if status == 404:
        return Check(name, "fail", f"missing ({status}): {what}: {reason(exc)}",
                     f"check --project and --zone (gcloud compute tpus locations list --project {project})")
    return Check(name, "fail", f"{what}: {reason(exc)}", enable)


def check_tpu_api(client: Any, access: Access, zone: str, timeout: float) -> Check:
    """One page of nodes and of queued resources: the two collections `runner submit` and `status` use."""
    parent = f"projects/{access.project}/locations/{zone}"
    counts = {}
    for kind, call in (("nodes", client.list_nodes), ("queued resources", client.list_queued_resources)):
        try:
            pager = call(request={"parent": parent, "page_size": 10}, timeout=timeout, retry=None)
            counts[kind] = len(list(itertools.islice(pager, 10)))
        except Exception as exc:
            return _tpu_refusal("tpu_api", f"the Cloud TPU API refused to list {kind} in {parent}", exc,
                                access.project)
    shown = ", ".join(f"{n}{'+' if n == 10 else ''} {kind}" for kind, n in counts.items())
    return Check("tpu_api", "ok", f"the Cloud TPU API answered for {parent}: {shown}", data=counts)


def check_tpu_type(client: Any, access: Access, zone: str, tpu_type: str, timeout: float) -> Check:
    """The zone's acceleratorTypes (projects/P/locations/Z/acceleratorTypes) name the TPU type."""
    parent = f"projects/{access.project}/locations/{zone}"
    try:
        offered = sorted({item.type_ for item in client.list_accelerator_types(
            request={"parent": parent}, timeout=timeout, retry=None)})
    except Exception as exc:
        return _tpu_refusal("tpu_type", f"listing the acceleratorTypes of {parent}", exc, access.project)
    data = {"offered": offered}
    if tpu_type in offered:
        return Check("tpu_type", "ok", f"present: {zone} offers {tpu_type} ({len(offered)} types offered there)",
                     data=data)
    facts = tpus.generation_of(tpu_type)
    listed = f"; the TPU table lists {', '.join(facts.zones)}" if facts else ""
    generation = tpus.generation_name(tpu_type)
    near = [t for t in offered if tpus.generation_name(t) == generation] or offered
    return Check("tpu_type", "fail", f"missing: {zone} does not offer {tpu_type}; it offers "
                 f"{', '.join(near[:12]) or 'no TPU type at all'}{' ...' if len(near) > 12 else ''}",
                 f"pick a zone that offers it (gcloud compute tpus accelerator-types list --zone=ZONE "
                 f"--project={access.project}{listed}) or a type {zone} offers", data=data)


def quota_check(tpu_type: str, zone: str) -> Check:
    """The TPU API has no quota call: say so rather than guess."""
    return Check("quota", "ok", f"not checked: quota: not reported by the TPU API (for {tpu_type} in {zone}); "
                 "a queued resource without quota waits in ACCEPTED or fails, and `runner status` says which",
                 "the project's TPU quotas are on the console's Quotas page (IAM & Admin > Quotas)")



def _storage_client(access: Access):
    from google.cloud import storage

    return storage.Client(project=access.project, credentials=access.credentials)


def _storage_refusal(name: str, url: str, exc: BaseException, bucket: str, role: str, where: str) -> Check:
    """`where`: the TPU's region, where a missing bucket belongs (reads across regions are billed)."""
    status = status_of(exc)
    grant = (f"gcloud storage buckets add-iam-policy-binding gs://{bucket} --member=user:EMAIL --role={role} "
             "(and the same for the TPU VM's service account)")
    if unreachable(exc):
        return Check(name, "fail", f"unreachable: {url}: {reason(exc)}", "check DNS, the network and https_proxy")
    if status in (401, 403):
        return Check(name, "fail", f"denied ({status}): {url}: {reason(exc)}", grant)
    if status == 404:
        return Check(name, "fail", f"missing: bucket gs://{bucket} does not exist ({reason(exc)})",
                     f"gcloud storage buckets create gs://{bucket} --location={where}")
    return Check(name, "fail", f"{url}: {reason(exc)}", grant)


def check_bucket_read(access: Access, pattern: str, timeout: float, where: str = "REGION") -> Check:
    """data.train's folder lists at least one object."""
    from runner.data.storage import split_gcs

    bucket, path = split_gcs(pattern)
    prefix = path.split("*", 1)[0].rsplit("/", 1)[0]
    folder = f"gs://{bucket}/{prefix}"
    try:
        blobs = _storage_client(access).list_blobs(bucket, prefix=prefix + "/" if prefix else "", max_results=3,
                                                   timeout=timeout, retry=None)
        names = [blob.name for blob in blobs]
    except Exception as exc:
        return _storage_refusal("bucket_read", folder, exc, bucket, "roles/storage.objectViewer", where)
    if not names:
        return Check("bucket_read", "fail", f"missing: no objects under {folder}/ (data.train {pattern})",
                     f"runner prepare DATASET --out {folder}, or fix data.train")
    return Check("bucket_read", "ok", f"present: {folder}/ lists {names[0]}{' ...' if len(names) > 1 else ''}")


def check_bucket_write(access: Access, output_dir: str, timeout: float, where: str = "REGION") -> Check:
    """A probe object written under output.dir, read back and deleted (checkpoint rotation deletes too)."""
    from runner.data.storage import split_gcs

    bucket, path = split_gcs(output_dir)
    name = f"{path.rstrip('/') + '/' if path else ''}.runner-doctor-{uuid.uuid4().hex[:12]}"
    url = f"gs://{bucket}/{name}"
    payload = b"runner doctor --cloud probe"
    try:
        blob = _storage_client(access).bucket(bucket).blob(name)
        blob.upload_from_string(payload, timeout=timeout, retry=None)
        back = blob.download_as_bytes(timeout=timeout, retry=None)
        blob.delete(timeout=timeout, retry=None)
    except Exception as exc:
        return _storage_refusal("bucket_write", url, exc, bucket, "roles/storage.objectAdmin", where)
    if back != payload:
        return Check("bucket_write", "fail", f"{url} read back {len(back)} bytes, not the {len(payload)} written",
                     "check what sits between this machine and the bucket (a proxy, a mirror)")
    return Check("bucket_write", "ok", f"created, read back and deleted {url}")



def _spec_path(spec: JobSpec | None, key: str) -> str | None:
    if spec is None:
        return None
    section, field = key.split(".")
    return getattr(getattr(spec, section), field)


def _fixes_unasked(project: str, zone: str, tpu_type: str, on: str, spec: JobSpec | None,
                   image: str | None, service_account: str | None = None) -> dict[str, str]:
    """Per check not run (no credentials): the command that settles it, so one pass of the doctor lists every
    step and not only the first."""
    fixes = {
        "tpu_api": f"gcloud services enable tpu.googleapis.com --project {project}",
        "tpu_type": f"gcloud compute tpus accelerator-types list --zone={zone} --project={project} lists the types "
                    f"{zone} offers: {tpu_type} must be one of them",
        "quota": "the project's TPU quotas are on the console's Quotas page (IAM & Admin > Quotas)",
        "engine": {"vertex": f"gcloud services enable aiplatform.googleapis.com --project {project}",
                   "gke": "gcloud container clusters get-credentials CLUSTER --zone ZONE --project "
                          f"{project} (a cluster with JobSet installed)",
                   "skypilot": "sky api start (or set SKYPILOT_API_SERVER_ENDPOINT), then sky check gcp"}.get(on, ""),
        "image": f"pass --image REGION-docker.pkg.dev/{project}/runner/runner:tpu, as `runner submit` will",
        "vm_permissions": vm_grant(project, service_account or "PROJECT_NUMBER-compute@developer.gserviceaccount.com"),
    }
    for name, key in (("bucket_read", "data.train"), ("bucket_write", "output.dir")):
        path = _spec_path(spec, key)
        if path is None or not path.startswith("gs://"):
            fixes[name] = f"set {key} to a gs:// path in the spec (runner doctor --cloud SPEC checks it)"
            continue
        bucket, _, rest = path[len("gs://"):].partition("/")
        folder = f"gs://{bucket}/{rest.split('*', 1)[0].rsplit('/', 1)[0]}".rstrip("/")
        fixes[name] = (f"runner prepare DATASET --out {folder} if `gcloud storage ls {folder}/` lists nothing"
                       if key == "data.train" else
                       f"gcloud storage buckets create gs://{bucket} --location={region(zone)} if "
                       f"`gcloud storage buckets describe gs://{bucket}` finds none")
    if image:
        try:
            host, name, reference = parse_image(image)
            fixes["image"] = f"if `docker manifest inspect {image}` finds nothing: {push_action(host, name, reference)}"
        except ValueError as exc:
            fixes["image"] = f"{exc}: pass it as pushed, REGION-docker.pkg.dev/PROJECT/runner/runner:tpu"
    return fixes



def preflight(
    *,
    tpu_type: str,
    zone: str,
    image: str | None = None,
    project: str | None = None,
    on: str = "tpu-vm",
    spec: JobSpec | None = None,
    timeout: float = 30.0,
    clients: CloudClients,
    service_account: str | None = None,
) -> list[Check]:
    """The cloud checks, in order, each bounded by `timeout` seconds; never raises for a failed check.

    `spec` gives the buckets (data.train's folder is read, output.dir written); without it they are not
    checked. `service_account`: the TPU VM's (--service-account; None: the project's Compute Engine default),
    whose roles are checked for --on tpu-vm. Credentials come from CLOUDSDK_AUTH_ACCESS_TOKEN, else Application
    Default Credentials, as `runner submit`'s own calls get them (runner/cloud/tpu_api.py), and every endpoint
    override is read from the environment as the clients themselves read it."""
    environ = dict(os.environ)
    if on not in ENGINES:
        raise ValueError(f"--on {on!r}: choose one of {', '.join(ENGINES)}")
    found: list[Check] = []
    holder: dict[str, Access | None] = {}

    def credentials() -> Check:
        check, holder["access"] = check_credentials(project, environ, clients)
        return check

    found.append(bounded("cloud_credentials", timeout, credentials))
    access = holder.get("access")
    names = [*(["vm_permissions"] if on == "tpu-vm" else []), "tpu_api", "tpu_type", "quota",
             *(["engine"] if on != "tpu-vm" else []), "bucket_read", "bucket_write", "image"]
    if access is None:
        fixes = _fixes_unasked(project or "PROJECT", zone, tpu_type, on, spec, image, service_account)
        return found + [Check(name, "fail", _NOT_RUN, f"after cloud_credentials: {fixes[name]}") for name in names]

    load_client(on)  # made outside the bounds, as the TPU client is: they time answers, not imports
    facts = tpus.generation_of(tpu_type)
    no_api = facts.refusal("tpu_vm") if facts else None
    if no_api:  # TPU7x: GKE's node pools hold it; the Cloud TPU API does not know it
        found += [Check(name, "warn", f"not checked: {tpu_type} is not in the Cloud TPU API: {no_api}",
                        "check the cluster's TPU node pool: gcloud container node-pools list --cluster CLUSTER "
                        f"--location {region(zone)}") for name in ("tpu_api", "tpu_type")]
    else:
        if on == "tpu-vm":  # only a TPU VM deletes its own slice, with its own service account
            found.append(bounded("vm_permissions", timeout,
                                 lambda: check_vm_permissions(access, service_account, environ, timeout)))
        client = clients.tpu()
        found.append(bounded("tpu_api", timeout, lambda: check_tpu_api(client, access, zone, timeout)))
        found.append(bounded("tpu_type", timeout, lambda: check_tpu_type(client, access, zone, tpu_type, timeout)))
    found.append(quota_check(tpu_type, zone))
    if on == "vertex":
        found.append(bounded("engine", timeout, lambda: check_vertex(clients.vertex, access.project, zone, timeout)))
    elif on == "gke":
        found.append(bounded("engine", timeout, lambda: check_gke(timeout)))
    elif on == "skypilot":
        found.append(bounded("engine", timeout, lambda: check_skypilot(timeout)))
    for name, key, check in (("bucket_read", "data.train", check_bucket_read),
                             ("bucket_write", "output.dir", check_bucket_write)):
        path = _spec_path(spec, key)
        if path is not None and path.startswith("gs://"):
            found.append(bounded(name, timeout, lambda check=check, path=path: check(access, path, timeout,
                                                                                       region(zone))))
        elif spec is None or path is None:
            # Not checked is not a pass: the bucket a job will use is unknown here.
            found.append(Check(name, "warn", f"not checked: {'no SPEC' if spec is None else key + ' is not set'}",
                               "runner doctor --cloud SPEC (the job's spec) checks the buckets it names" if spec is None
                               else f"set {key} to a gs:// path in the spec"))
        else:  # `runner submit` refuses it too, before any call
            found.append(Check(name, "fail", f"{key} is {path!r}, not a gs:// path: a TPU VM sees neither this "
                               "machine's files nor its own disk once it is gone", f"--set {key}=gs://BUCKET/..."))
    if image:
        found.append(bounded("image", timeout, lambda: check_image(access, image, environ, timeout)))
    else:
        found.append(Check("image", "fail", "missing: no --image", "pass --image REGION-docker.pkg.dev/PROJECT/"
                           "runner/runner:tpu, as `runner submit` will"))
    return found
