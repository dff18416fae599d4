"""The Cloud TPU API calls behind `runner submit`, `status`, `cancel` and the watcher: one client (gcloud's
access token and endpoint override when set, else Application Default Credentials), every failure turned
into an error that names the queued resource and what to do (exit 2 for a name that does not exist or
already does, exit 3 when the API cannot be reached or refuses).

google-cloud-tpu is imported only when a call is made.
"""

from __future__ import annotations

import json
import os
from typing import Any

from runner import AcceleratorError, RunnerError, SpecError
from runner.cloud.request import SCOPE, request_json, settings_of
from runner.cloud.submit import Submission, check_zone

_CALL_TIMEOUT_S = 60.0


class TpuApiError(AcceleratorError):
    """The Cloud TPU API could not be reached, refused the credentials, or failed the request (exit 3)."""


# --- the API -------------------------------------------------------------------------------------


def credentials():
    """gcloud's access token when set (CLOUDSDK_AUTH_ACCESS_TOKEN), else Application Default Credentials."""
    import google.auth
    from google.auth import exceptions as auth_exceptions
    from google.oauth2.credentials import Credentials

    token = os.environ.get("CLOUDSDK_AUTH_ACCESS_TOKEN")
    if token:
        return Credentials(token)
    try:
        found, _ = google.auth.default(scopes=[SCOPE])
    except auth_exceptions.DefaultCredentialsError:
        raise TpuApiError(
            "no Google Cloud credentials found; run `gcloud auth application-default login` "
            "(or use --dry-run to see the request without sending it)"
        ) from None
    return found


def make_client():
    """A Cloud TPU v2 client: ADC credentials, or gcloud's access token and endpoint override when set."""
    from google.api_core.client_options import ClientOptions
    from google.cloud import tpu_v2

    endpoint = os.environ.get("CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU", "").rstrip("/")
    options = ClientOptions(api_endpoint=endpoint) if endpoint else None
    return tpu_v2.TpuClient(credentials=credentials(), transport="rest", client_options=options)


def _api_error(exc: Exception, action: str, name: str, project: str, zone: str) -> RunnerError:
    from google.api_core import exceptions as api

    where = f"in {zone} (project {project})"
    # The REST transport maps HTTP 409 to Conflict; the body's ALREADY_EXISTS says which conflict it is.
    if isinstance(exc, api.AlreadyExists) or (isinstance(exc, api.Conflict) and "already exists" in str(exc.message)):
        # Another --name alone would not do: the job's run folder (from its job name) still belongs to the
        # live queued resource, and jobs.refuse_a_second_job refuses that.
        at = f"--zone {zone} --project {project}"
        return SpecError(
            f"a queued resource {name!r} already exists {where}: see `runner status {name} {at}`, "
            f"free the name with `runner cancel {name} {at}`, or submit this as another job, with its own run "
            f"folder (`--set name={name}-2`)"
        )
    if isinstance(exc, api.NotFound):
        return SpecError(
            f"no queued resource {name!r} {where}: it was never submitted there, or its job ended and it was "
            f"deleted (read the job's output with `runner logs {name}`)"
        )
    # The REST transport maps HTTP 403 and 401 to Forbidden and Unauthorized (gRPC's codes to the other two).
    if isinstance(exc, (api.PermissionDenied, api.Unauthenticated, api.Forbidden, api.Unauthorized)):
        return TpuApiError(f"the Cloud TPU API refused to {action} {name!r} {where}: {exc.message}; check the "
                           "credentials (`runner doctor --cloud` names the fix) and that the TPU API is enabled "
                           f"(`gcloud services enable tpu.googleapis.com --project {project}`)")
    if isinstance(exc, api.GoogleAPICallError):
        return TpuApiError(f"the Cloud TPU API failed to {action} {name!r} {where}: {exc.code} {exc.message}")
    return TpuApiError(f"could not reach the Cloud TPU API to {action} {name!r}: {type(exc).__name__}: {exc}")


def _full_name(name: str, project: str, zone: str) -> str:
    return f"projects/{project}/locations/{check_zone(zone)}/queuedResources/{name}"


def _post_create(sub: Submission, client) -> str:
    """POSTs the create request as the client's REST transport would (its session, so its credentials, and its
    endpoint; the same URL, query and a bounded timeout), but with request_json's body: the client would write
    validUntilTime from a proto Timestamp (UTC, fraction trimmed: `...T18:30:00.123Z`), gcloud writes the time as
    given, in whole milliseconds (`...T00:00:00.123+05:30`); this sends gcloud's text. Returns the operation's name."""
    from google.api_core import exceptions as api

    transport = client.transport  # a TpuRestTransport (make_client): `_host` has the scheme, `_session` is authorized
    response = transport._session.post(
        f"{transport._host}/v2/{sub.parent}/queuedResources",
        params={"queuedResourceId": sub.name, "$alt": "json;enum-encoding=int"},
        data=json.dumps(request_json(sub), indent=2),
        headers={"Content-Type": "application/json"},
        timeout=_CALL_TIMEOUT_S,
    )
    if response.status_code >= 400:
        raise api.from_http_response(response)
    return response.json()["name"]


def create(sub: Submission, client=None) -> dict[str, Any]:
    """Sends the create request; returns what was asked for and the operation that tracks it."""
    client = client or make_client()
    try:
        operation = _post_create(sub, client)
    except Exception as exc:  # every failure of the call becomes an error the CLI can print
        raise _api_error(exc, "create", sub.name, sub.project, sub.zone) from exc
    return {
        "name": sub.name,
        "submission": sub.submission_id,
        "project": sub.project,
        "zone": sub.zone,
        "accelerator_type": sub.tpu.name,
        "spot": sub.spot,
        "max_restarts": sub.max_restarts,
        "image": sub.image,
        "run_dir": sub.spec.run_dir,
        "operation": operation,
    }


def get_queued_resource(name: str, project: str, zone: str, client=None):
    """The queued resource, or None when the API has none of that name."""
    from google.api_core import exceptions as api

    client = client or make_client()
    try:
        return client.get_queued_resource(name=_full_name(name, project, zone), timeout=_CALL_TIMEOUT_S)
    except api.NotFound:
        return None
    except Exception as exc:
        raise _api_error(exc, "read", name, project, zone) from exc


def list_queued_resources(project: str, zone: str, client=None) -> list:
    client = client or make_client()
    parent = f"projects/{project}/locations/{check_zone(zone)}"
    try:
        return list(client.list_queued_resources(parent=parent, timeout=_CALL_TIMEOUT_S))
    except Exception as exc:
        raise _api_error(exc, "list the queued resources of", parent, project, zone) from exc


def _stamp(value) -> str | None:
    if not value:
        return None
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if hasattr(value, "strftime") else str(value)


def describe(resource, client=None) -> dict[str, Any]:
    """A queued resource's state, its node's state and health, its submission label and its timestamps."""
    specs = list(resource.tpu.node_spec)
    doc = {
        "state": resource.state.state.name,
        "initiator": resource.state.state_initiator.name if resource.state.state_initiator else None,
        "node_state": None,
        "node_health": None,
        "submission": specs[0].node.labels.get("runner-submission") if specs else None,
        "created_at": _stamp(resource.create_time),
        "node_created_at": None,
        "failure": resource.state.failed_data.error.message if "failed_data" in resource.state else None,
    }
    if specs and doc["state"] in ("ACTIVE", "SUSPENDING", "SUSPENDED", "DELETING"):
        from google.api_core import exceptions as api

        client = client or make_client()
        try:
            node = client.get_node(name=f"{specs[0].parent}/nodes/{specs[0].node_id}", timeout=_CALL_TIMEOUT_S)
        except api.NotFound:  # the node comes with ACTIVE and goes before the queued resource does
            return doc
        except Exception as exc:
            raise _api_error(exc, "read the node of", specs[0].node_id, *specs[0].parent.split("/")[1::2]) from exc
        doc.update(node_state=node.state.name, node_health=node.health.name if node.health else None,
                   node_created_at=_stamp(node.create_time))
    return doc


def job_name_of(resource) -> str | None:
    specs = list(resource.tpu.node_spec)
    return specs[0].node.labels.get("runner-job") if specs else None


def run_dir_of(resource) -> str | None:
    specs = list(resource.tpu.node_spec)
    return settings_of(specs[0].node.metadata.get("startup-script", "")).get("RUNNER_RUN_DIR") if specs else None


def cancel(name: str, project: str, zone: str, client=None) -> dict[str, Any]:
    """Deletes the queued resource and its VM (force: even while the job runs)."""
    client = client or make_client()
    try:
        operation = client.delete_queued_resource(request={"name": _full_name(name, project, zone), "force": True},
                                                  timeout=_CALL_TIMEOUT_S)
    except Exception as exc:
        raise _api_error(exc, "delete", name, project, zone) from exc
    ended = None
    try:
        if operation.done():
            ended = _stamp(operation.metadata.end_time) if operation.metadata else None
    except Exception:  # the end time is for the cost; the delete itself has been accepted
        ended = None
    return {"name": name, "project": project, "zone": zone, "deleting": True, "operation": operation.operation.name,
            "deleted_at": ended}


def deletion_time(name: str, project: str, zone: str, client=None, after: str | None = None) -> str | None:
    """The end time of the newest delete operation on the queued resource (how long it billed)."""
    from google.cloud import tpu_v2

    client = client or make_client()
    target = _full_name(name, project, zone)
    newest = None
    try:
        where = {"name": f"projects/{project}/locations/{zone}"}
        answer = client.list_operations(request=where, timeout=_CALL_TIMEOUT_S)
        for operation in answer.operations:
            metadata = tpu_v2.OperationMetadata.pb(tpu_v2.OperationMetadata())
            if not operation.metadata.Unpack(metadata) or metadata.target != target or metadata.verb != "delete":
                continue
            if not metadata.HasField("end_time"):
                continue
            ended = metadata.end_time.ToDatetime().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            if (after is None or ended >= after) and (newest is None or ended > newest):
                newest = ended
    except Exception:  # an answer the cost can do without: the watcher's own observation stands in
        return None
    return newest
