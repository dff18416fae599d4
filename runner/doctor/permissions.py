"""The TPU VM's own permissions, read from the project's IAM policy before anything bills: the service account
the VM runs as must be allowed to delete the slice it runs on, which its startup script does when the job ends.

Cloud Resource Manager v1 (`projects.get` for the project number, `projects.getIamPolicy` as `gcloud projects
get-iam-policy` reads it); gcloud's CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDRESOURCEMANAGER replaces its endpoint.
Only grants on the project itself are seen: a grant to a group or domain is a warning (its members are not in
the policy), one on a folder or the organisation is not seen at all (the fix says how to skip the check).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from runner.doctor.answers import reason
from runner.doctor.checks import Check

RESOURCE_MANAGER_ENV = "CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDRESOURCEMANAGER"
RESOURCE_MANAGER = "https://cloudresourcemanager.googleapis.com/"
# The role the TPU VM's service account needs to delete its own slice and read its state (the startup script's
# `gcloud compute tpus queued-resources delete --force` and `describe`): Google's "Cloud TPU roles and
# permissions" page (https://cloud.google.com/iam/docs/roles-permissions/tpu) gives TPU Admin `tpu.*`, among them
# tpu.nodes.delete, tpu.nodes.get, tpu.operations.get, and lists no separate queued-resource permission, so
# whatever the queued-resource calls check, it holds it. Editor and Owner hold every tpu.* permission as well.
VM_ROLE = "roles/tpu.admin"
VM_ROLES = (VM_ROLE, "roles/editor", "roles/owner")


def _resource_manager(access: Any, environ: dict[str, str], path: str, body: dict[str, Any] | None,
                      timeout: float) -> dict[str, Any]:
    """One Cloud Resource Manager v1 call with the access token (GET, or POST of `body`); raises urllib's errors."""
    base = (environ.get(RESOURCE_MANAGER_ENV) or RESOURCE_MANAGER).rstrip("/")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}/v1/{path}", data=data, method="GET" if body is None else "POST",
                                      headers={"Authorization": f"Bearer {access.token}",
                                               "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read() or b"{}")


def vm_grant(project: str, account: str) -> str:
    """The command that lets the TPU VM's service account delete its own slice."""
    return (f"gcloud projects add-iam-policy-binding {project} --member=serviceAccount:{account} "
            f"--role={VM_ROLE}")


def check_vm_permissions(access: Any, service_account: str | None, environ: dict[str, str],
                         timeout: float) -> Check:
    """The project's IAM policy grants the TPU VM's service account one of VM_ROLES (a grant on a folder, the
    organisation or a group is not seen here: such a setup passes with --no-preflight)."""
    project = access.project
    account = service_account
    try:
        if account is None:  # the Compute Engine default: PROJECT_NUMBER-compute@developer.gserviceaccount.com
            number = _resource_manager(access, environ, f"projects/{project}", None, timeout).get("projectNumber")
            account = f"{number}-compute@developer.gserviceaccount.com"
        policy = _resource_manager(access, environ, f"projects/{project}:getIamPolicy",
                                   {"options": {"requestedPolicyVersion": 3}}, timeout)
    except urllib.error.HTTPError as exc:
        what = "read the project's IAM policy" if account else "read the project's number"
        shown = account or "the Compute Engine default service account"
        return Check("vm_permissions", "warn", f"not checked: denied ({exc.code}): could not {what} for "
                     f"{project}: {exc.read()[:200].decode(errors='replace').strip()}",
                     f"make sure the TPU VM's service account ({shown}) holds {VM_ROLE}: "
                     f"{vm_grant(project, account or 'PROJECT_NUMBER-compute@developer.gserviceaccount.com')}")
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return Check("vm_permissions", "fail", f"unreachable: Cloud Resource Manager: {reason(exc)}",
                     f"check DNS, the network and https_proxy (and {RESOURCE_MANAGER_ENV} if set)")
    member = f"serviceAccount:{account}"
    held = sorted({binding.get("role", "?") for binding in policy.get("bindings", [])
                   if member in binding.get("members", [])})
    data = {"service_account": account, "roles": held}
    granted = [role for role in held if role in VM_ROLES]
    if granted:
        return Check("vm_permissions", "ok", f"present: {project} grants the TPU VM's service account {account} "
                     f"{', '.join(granted)}, which holds the TPU delete and get permissions: the slice can delete "
                     "itself", data=data)
    groups = sorted({m for binding in policy.get("bindings", []) if binding.get("role") in VM_ROLES
                     for m in binding.get("members", []) if m.split(":")[0] in ("group", "domain")})
    if groups:  # membership of a group or domain is not in the policy: it cannot be told here
        return Check("vm_permissions", "warn", f"not checked: {project}'s IAM policy grants {', '.join(VM_ROLES)} "
                     f"to {', '.join(groups)} but not to {account} itself; whether the account is a member is not "
                     "in the policy", f"if it is not a member, {vm_grant(project, account)}", data=data)
    return Check("vm_permissions", "fail", f"missing: {project}'s IAM policy grants the TPU VM's service account "
                 f"{account} none of {', '.join(VM_ROLES)} (it holds {', '.join(held) or 'no role there'}): the "
                 "VM could not delete its own slice when the job ends, which would bill until `runner cancel` (a "
                 "grant on a folder or the organisation is not seen here: where yours is one, --no-preflight skips "
                 "this check)", vm_grant(project, account), data=data)
