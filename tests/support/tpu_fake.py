"""A local fake of the Cloud TPU v2 REST API (with Cloud Logging's entries and Cloud Build's submit) that
records every request, moves queued resources through their states, and boots a simulated TPU VM.

Run as its own process (the fixture `tpu_api` does that and stops it by PID):

    python -m tests.support.tpu_fake --port 0 --ttl 900     prints `PORT <n>` once it serves on 127.0.0.1

What it serves, in the JSON form of the real APIs (proto3 JSON, camelCase):
    POST   /v2/projects/P/locations/Z/queuedResources?queuedResourceId=ID   -> Operation (done)
    GET    /v2/projects/P/locations/Z/queuedResources[/ID]
    DELETE /v2/projects/P/locations/Z/queuedResources/ID[?force=true]     -> Operation (done)
    GET    /v2/projects/P/locations/Z/nodes/ID                              (the node a queued resource made)
    GET    /v2/projects/P/locations/Z/operations[/OP]                       (metadata: createTime, endTime)
    POST   /v2/entries:write, /v2/entries:list                              Cloud Logging (a filter subset)
    POST   /v1/projects/P[/locations/L]/builds                             -> Operation carrying the Build
and what `runner submit`'s preflight reads (runner/doctor/cloud.py), so that a submission runs it for real:
    GET    /v2/projects/P/locations/Z/nodes | acceleratorTypes             the nodes; every type runner submits
    GET    /v2/NAME/manifests/REF                                          a registry holding every image but
                                                                           those POST /_fake/registry removes
    GET    /v1/projects/P, POST /v1/projects/P:getIamPolicy                Cloud Resource Manager: the project and
                                                                           its IAM policy (preflight_fake.iam_answer)
Errors use Google's error body ({"error": {"code", "message", "status"}}): 404 NOT_FOUND, 409 ALREADY_EXISTS,
400 FAILED_PRECONDITION (a delete without force of a queued resource whose node is up, as the API refuses).

States, as the API names them (QueuedResourceState.State, Node.State). A queued resource starts ACCEPTED
with no node. With a lifecycle configured it moves on by itself: ACCEPTED -> PROVISIONING (after
`provisioning_s`) -> ACTIVE with a READY, HEALTHY node (after `active_s`); a delete passes DELETING for
`deleting_s` before the resource is gone. Preemption (of an ACTIVE node): node PREEMPTED, queued resource
SUSPENDING (initiator SERVICE), the VM's processes get SIGTERM, and the queued resource is SUSPENDED once
they have all ended (the VM shuts down), or after `grace_s` with SIGKILL to what still runs. FAILED is set
through /_fake/state.

The simulated VM: with `boot` configured, a node that becomes READY runs its startup script (from the
request's metadata) with bash, once per worker, each in its own process group, with the configured
environment plus FAKE_BOOT (a fresh folder per boot), FAKE_NODE and RUNNER_WORKDIR; its output goes to
FAKE_BOOT/console.log. Deleting or failing the queued resource kills those processes (deleting after
`vm_linger_s`, so the VM's own delete request gets its answer first).

Control endpoints for the tests:
    GET  /_fake/requests            every API request so far: method, path, query, body (parsed JSON)
    POST /_fake/state               {"name": ID, "state": "ACTIVE", "node_state": "READY"} moves a resource on
    POST /_fake/config              {"lifecycle": {...}, "boot": {"env": {...}, "folder": DIR, "workers": N,
                                    "worker_env": [{...}, ...]}}: worker_env[i] adds to worker i's environment
    POST /_fake/preempt             {"name": ID, "grace_s": 20}
    POST /_fake/fail                {"count": N}: the next N TPU API requests answer 503 UNAVAILABLE (which gcloud
                                    retries for about 30 s); {"count": N, "status": 403}: 403 PERMISSION_DENIED
    GET  /_fake/boots               every VM boot so far: queued resource, node, folder, pids, exit codes
    GET  /_fake/entries             every Cloud Logging entry written
    POST /_fake/registry            {"missing": [[NAME, REF], ...]}: the images the registry does not hold
    POST /_fake/iam                 {"bindings": [...]}: every project's IAM policy ({}: the default)
    POST /_fake/reset               forgets requests, resources, entries and configuration (kills VMs)
    GET  /_fake/health              "ok"
The process exits by itself after --ttl seconds (killing its VMs), so a lost fixture never leaves it running.

From a test: `with start_tpu_fake(log_folder) as api:` gives `api.endpoint` (for
CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU and _LOGGING), `api.requests()`, `api.set_state(...)`, `api.configure(...)`,
`api.preempt(...)`, `api.boots()`, `api.entries()` and `api.reset()`; the process is stopped by its PID when
the block ends.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from runner.cloud.tpu_types import multi_host_types, single_host_types
from tests.support.fake_server import FakeClient, FakeHandler, Recorder, serve, start_fake
from tests.support.preflight_fake import iam_answer, manifest_answer

_MANIFEST = re.compile(r"^/v2/(?!projects/)(.+)/manifests/([^/]+)$")

_BUILDS = re.compile(r"^/v1/projects/([^/]+)(?:/locations/([^/]+))?/builds$")
_RESOURCE = re.compile(
    r"^/v2/projects/([^/]+)/locations/([^/]+)/(queuedResources|nodes|operations|acceleratorTypes)(?:/([^/:]+))?$"
)
# The Cloud Logging filter subset the fake understands: `FIELD OP "VALUE"` terms joined by AND.
_TERM = re.compile(r'^\s*(logName|jsonPayload\.container\.name|timestamp)\s*(=|>=|>)\s*"([^"]*)"\s*$')
_DEFAULT_LIFECYCLE = {"provisioning_s": None, "active_s": None, "deleting_s": 0.0, "vm_linger_s": 1.0}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str) -> datetime.datetime:
    """An RFC 3339 time with or without a fraction of a second."""
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


class Vm:
    """One boot of a node: a startup script per worker, each in its own session. A notice (SIGTERM) goes to
    the script's process group; the VM's end (SIGKILL) to everything its sessions hold, as the end of a real VM
    takes everything down: a `timeout` in the script puts its command in a process group of its own, and a
    deleted VM's `gcloud ... delete` left running would delete the next queued resource of the same name."""

    def __init__(self, resource: str, incarnation: int, node: str, folder: Path, processes: list[subprocess.Popen]):
        self.resource, self.incarnation, self.node = resource, incarnation, node
        self.folder, self.processes = folder, processes

    def members(self) -> list[int]:
        """The live processes of the VM's sessions (zombies left out: they run nothing)."""
        for process in self.processes:
            process.poll()  # reaps the script itself once it has ended
        sessions = {process.pid for process in self.processes}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getsid(int(entry)) not in sessions:
                    continue
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # ended meanwhile
            if state != "Z":
                found.append(int(entry))
        return found

    def signal(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            for pid in self.members():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
            return
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signum)

    def ended(self) -> bool:
        for process in self.processes:
            if process.poll() is None:
                return False
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            return False
        return True

    def doc(self) -> dict[str, Any]:
        return {
            "queued_resource": self.resource,
            "node": self.node,
            "folder": str(self.folder),
            "pids": [p.pid for p in self.processes],
            "exit_codes": [p.poll() for p in self.processes],
        }


class Fake(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.queued: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.entries: list[dict[str, Any]] = []
        self.ids = itertools.count(1)
        self.lifecycle: dict[str, Any] = dict(_DEFAULT_LIFECYCLE)
        self.boot: dict[str, Any] | None = None
        self.vms: list[Vm] = []
        # A name comes back after a delete: each queued resource of a name is its own incarnation, so a timer
        # set for one (a preemption's grace, a delete's linger) never touches the next one's VM.
        self.incarnations: dict[str, int] = {}
        # (due, callable, or-sooner-when), run by tick() when due, or as soon as its condition holds
        self.timers: list[tuple[float, Any, Any]] = []
        self.failing = 0  # the next this many API requests answer `failing_status`
        self.failing_status = 503
        self.missing_images: set[tuple[str, str]] = set()  # what the registry does not hold (all else it does)
        self.iam: list[dict[str, Any]] | None = None  # every project's IAM bindings (None: the default)

    # --- time ---------------------------------------------------------------------------------

    def later(self, delay_s: float, action: Any, sooner_when: Any = None) -> None:
        self.timers.append((time.monotonic() + delay_s, action, sooner_when))

    def tick(self) -> None:
        with self.lock:
            now = time.monotonic()
            due = [t for t in self.timers if t[0] <= now or (t[2] is not None and t[2]())]
            self.timers = [t for t in self.timers if t not in due]
            for _, action, _ in due:
                action()

    # --- resources ----------------------------------------------------------------------------

    def operation(self, parent: str, verb: str, target: str, response: dict[str, Any] | None) -> dict[str, Any]:
        name = f"{parent}/operations/operation-{next(self.ids)}"
        stamp = _now()
        op: dict[str, Any] = {
            "name": name,
            "metadata": {
                "@type": "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata",
                "createTime": stamp,
                "endTime": stamp,
                "target": target,
                "verb": verb,
                "apiVersion": "v2",
            },
            "done": True,
        }
        op["response"] = (
            {"@type": "type.googleapis.com/google.protobuf.Empty"}
            if response is None
            else {"@type": "type.googleapis.com/google.cloud.tpu.v2.QueuedResource", **response}
        )
        self.operations[name] = op
        return op

    def find(self, short: str) -> dict[str, Any]:
        resource = next((r for n, r in self.queued.items() if n.endswith(f"/queuedResources/{short}")), None)
        if resource is None:
            raise KeyError(short)
        return resource

    def node_names(self, resource: dict[str, Any]) -> list[str]:
        return [f"{spec['parent']}/nodes/{spec['nodeId']}" for spec in resource.get("tpu", {}).get("nodeSpec", [])]

    def set_state(self, short: str, state: str, node_state: str | None, initiator: str | None = None) -> dict[str, Any]:
        resource = self.find(short)
        resource["state"] = {"state": state, **({"stateInitiator": initiator} if initiator else {})}
        if state in ("FAILED", "SUSPENDED"):
            self.stop_vms(self.incarnations[resource["name"]], signal.SIGKILL)
        if node_state:
            for spec in resource.get("tpu", {}).get("nodeSpec", []):
                node_name = f"{spec['parent']}/nodes/{spec['nodeId']}"
                old = self.nodes.get(node_name)
                node = dict(spec.get("node", {}))
                node.update(
                    {
                        "name": node_name,
                        "state": node_state,
                        "health": "HEALTHY",
                        "queuedResource": resource["name"],
                        "createTime": old["createTime"] if old else _now(),
                    }
                )
                self.nodes[node_name] = node
                if node_state == "READY" and (old is None or old["state"] != "READY"):
                    self.start_vm(resource, node_name, spec)
        return resource

    def advance(self, full: str, state: str, node_state: str | None = None) -> None:
        """A timed transition: skipped when the resource is gone or has moved on in the meantime."""
        resource = self.queued.get(full)
        expected = {"PROVISIONING": "ACCEPTED", "ACTIVE": "PROVISIONING"}[state]
        if resource is not None and resource["state"]["state"] == expected:
            self.set_state(full.rsplit("/", 1)[1], state, node_state)
            if state == "PROVISIONING" and self.lifecycle.get("active_s") is not None:
                self.later(self.lifecycle["active_s"], lambda: self.advance(full, "ACTIVE", "READY"))

    def created(self, full: str) -> None:
        if self.lifecycle.get("provisioning_s") is not None:
            self.later(self.lifecycle["provisioning_s"], lambda: self.advance(full, "PROVISIONING"))

    def delete(self, name: str, force: bool) -> tuple[int, Any]:
        resource = self.queued.get(name)
        if resource is None or resource["state"]["state"] == "DELETING":
            return (
                _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
                if resource is None
                else (200, self.operation(name.split("/queuedResources/")[0], "delete", name, None))
            )
        nodes_up = [n for n in self.node_names(resource) if n in self.nodes]
        if nodes_up and not force and resource["state"]["state"] not in ("ACCEPTED", "FAILED", "SUSPENDED"):
            return _error(
                400,
                "FAILED_PRECONDITION",
                f"Queued resource {name} has nodes ({', '.join(nodes_up)}); delete them first or set force",
            )
        resource["state"] = {"state": "DELETING", "stateInitiator": "USER"}
        incarnation = self.incarnations[name]
        linger = float(self.lifecycle.get("vm_linger_s") or 0.0)
        self.later(linger, lambda: self.stop_vms(incarnation, signal.SIGKILL))

        def gone() -> None:
            if self.queued.get(name) is resource:
                self.queued.pop(name)
                for node_name in self.node_names(resource):
                    self.nodes.pop(node_name, None)

        deleting = float(self.lifecycle.get("deleting_s") or 0.0)
        if deleting > 0:
            self.later(max(deleting, linger), gone)
        else:
            gone()
        return 200, self.operation(name.split("/queuedResources/")[0], "delete", name, None)

    def preempt(self, short: str, grace_s: float) -> dict[str, Any]:
        resource = self.find(short)
        if resource["state"]["state"] != "ACTIVE":
            raise ValueError(
                f"only an ACTIVE queued resource can be preempted, {short} is {resource['state']['state']}"
            )
        for node_name in self.node_names(resource):
            if node_name in self.nodes:
                self.nodes[node_name]["state"] = "PREEMPTED"
        resource["state"] = {"state": "SUSPENDING", "stateInitiator": "SERVICE"}
        incarnation = self.incarnations[resource["name"]]
        self.stop_vms(incarnation, signal.SIGTERM)

        def suspended() -> None:
            self.stop_vms(incarnation, signal.SIGKILL)
            if self.queued.get(resource["name"]) is resource and resource["state"]["state"] == "SUSPENDING":
                resource["state"] = {"state": "SUSPENDED", "stateInitiator": "SERVICE"}

        self.later(grace_s, suspended, sooner_when=lambda: self.vms_ended(incarnation))
        return resource

    # --- the simulated VM -----------------------------------------------------------------------

    def start_vm(self, resource: dict[str, Any], node_name: str, spec: dict[str, Any]) -> None:
        if not self.boot:
            return
        script = spec.get("node", {}).get("metadata", {}).get("startup-script")
        if not script:
            return
        base = Path(self.boot["folder"])
        processes = []
        count = len(self.vms) + 1
        folder = base / f"boot-{count}-{spec['nodeId']}"
        for worker in range(int(self.boot.get("workers", 1))):
            worker_folder = folder / f"w{worker}"
            worker_folder.mkdir(parents=True, exist_ok=True)
            own = self.boot.get("worker_env") or []
            env = {
                **self.boot.get("env", {}),
                **(own[worker] if worker < len(own) else {}),  # a slice's worker: its metadata server, its state
                "FAKE_BOOT": str(worker_folder),
                "FAKE_NODE": node_name,
                "FAKE_WORKER": str(worker),
                "RUNNER_WORKDIR": str(worker_folder / "work"),
            }
            with open(worker_folder / "console.log", "ab") as console:
                processes.append(
                    subprocess.Popen(
                        ["bash", "-c", script],
                        env=env,
                        stdout=console,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        cwd=worker_folder,
                    )
                )
        self.vms.append(Vm(resource["name"], self.incarnations[resource["name"]], node_name, folder, processes))

    def stop_vms(self, incarnation: int, signum: int) -> None:
        for vm in self.vms:
            if vm.incarnation == incarnation:
                vm.signal(signum)

    def vms_ended(self, incarnation: int) -> bool:
        """Whether every process of the incarnation's VMs has ended: each startup script's whole process group
        (the job it started goes on after the script's shell has gone)."""
        return all(vm.ended() for vm in self.vms if vm.incarnation == incarnation)

    def reap(self) -> None:
        for vm in self.vms:
            for process in vm.processes:
                process.poll()

    # --- Cloud Logging -------------------------------------------------------------------------

    def write_entries(self, body: dict[str, Any]) -> tuple[int, Any]:
        for entry in body.get("entries", []):
            entry = {"logName": body.get("logName"), "resource": body.get("resource"), **entry}
            entry.setdefault("timestamp", _now())
            entry["receiveTimestamp"] = _now()
            entry["insertId"] = entry.get("insertId") or f"fake-{next(self.ids)}"
            self.entries.append(entry)
        return 200, {}

    def list_entries(self, body: dict[str, Any]) -> tuple[int, Any]:
        terms = []
        for text in re.split(r"\s+AND\s+", (body.get("filter") or "").strip()) if body.get("filter") else []:
            match = _TERM.match(text)
            if not match:
                return _error(400, "INVALID_ARGUMENT", f"this fake does not understand the filter term {text!r}")
            if match.group(1) == "timestamp":
                try:
                    _parse_time(match.group(3))
                except ValueError:
                    return _error(400, "INVALID_ARGUMENT", f"{match.group(3)!r} is not an RFC 3339 time")
            terms.append(match.groups())
        if body.get("orderBy", "timestamp asc") != "timestamp asc":
            return _error(400, "INVALID_ARGUMENT", f"orderBy {body.get('orderBy')!r} is not supported by this fake")

        def field(entry: dict[str, Any], name: str) -> str:
            if name == "jsonPayload.container.name":
                return ((entry.get("jsonPayload") or {}).get("container") or {}).get("name", "")
            return entry.get(name, "")

        def keep(entry: dict[str, Any]) -> bool:
            for name, op, value in terms:
                have = field(entry, name)
                if op == "=" and have != value:
                    return False
                if name == "timestamp":  # compared as times, as the API does: 35.3Z is after 35Z
                    have_t, value_t = _parse_time(have), _parse_time(value)
                    if (op == ">" and not have_t > value_t) or (op == ">=" and not have_t >= value_t):
                        return False
            return True

        resources = body.get("resourceNames") or []
        found = [
            e for e in self.entries if keep(e) and any((e.get("logName") or "").startswith(r + "/") for r in resources)
        ]
        found.sort(key=lambda e: e["timestamp"])
        start = int(body.get("pageToken") or 0)
        size = int(body.get("pageSize") or 50)
        page = found[start : start + size]
        doc: dict[str, Any] = {"entries": page} if page else {}
        if start + size < len(found):
            doc["nextPageToken"] = str(start + size)
        return 200, doc

    def reset(self) -> None:
        for vm in self.vms:
            vm.signal(signal.SIGKILL)
        self.requests.clear(), self.queued.clear(), self.nodes.clear(), self.operations.clear()
        self.entries.clear(), self.vms.clear(), self.timers.clear(), self.incarnations.clear()
        self.lifecycle, self.boot, self.failing, self.failing_status = dict(_DEFAULT_LIFECYCLE), None, 0, 503
        self.missing_images: set[tuple[str, str]] = set()
        self.iam = None


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
        "metadata": {
            "@type": "type.googleapis.com/google.devtools.cloudbuild.v1.BuildOperationMetadata",
            "build": build,
        },
    }


def handle(fake: Fake, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
    if path.startswith("/v1/"):
        return handle_build(fake, method, path, body)
    if path == "/v2/entries:write" and method == "POST":
        return fake.write_entries(body or {})
    if path == "/v2/entries:list" and method == "POST":
        return fake.list_entries(body or {})
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
            fake.incarnations[full] = next(fake.ids)
            fake.created(full)
            return 200, fake.operation(parent, "create", full, resource)
        if method == "GET" and short is None:
            items = [r for n, r in fake.queued.items() if n.startswith(parent + "/")]
            return 200, ({"queuedResources": items} if items else {})
        if method == "GET":
            return (
                (200, fake.queued[name])
                if name in fake.queued
                else _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
            )
        if method == "DELETE":
            force = [v.lower() for v in query.get("force", [])] == ["true"]
            return fake.delete(name, force)
    if collection == "acceleratorTypes" and method == "GET" and short is None:
        return 200, {"acceleratorTypes": [{"name": f"{parent}/acceleratorTypes/{t}", "type": t}
                                          for t in [*single_host_types(), *multi_host_types()]]}
    if collection == "nodes" and method == "GET" and short is None:
        items = [n for key, n in fake.nodes.items() if key.startswith(parent + "/")]
        return 200, ({"nodes": items} if items else {})
    if collection == "nodes" and method == "GET" and short:
        return (
            (200, fake.nodes[name])
            if name in fake.nodes
            else _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
        )
    if collection == "operations" and method == "GET" and short:
        return (
            (200, fake.operations[name])
            if name in fake.operations
            else _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
        )
    if collection == "operations" and method == "GET":
        items = [op for n, op in fake.operations.items() if n.startswith(parent + "/")]
        return 200, ({"operations": items} if items else {})
    return _error(405, "UNIMPLEMENTED", f"{method} {path} is not part of this fake")


class Handler(FakeHandler):
    state: Fake

    def record(self, method: str, url: urllib.parse.SplitResult, body: Any) -> None:
        if url.path != "/v2/entries:write":  # the VM's log lines are not requests under test
            super().record(method, url, body)

    def answer(self, method: str, url: urllib.parse.SplitResult, body: Any) -> tuple[int, Any]:
        fake = self.state
        self.extra_headers, self.text_type = {}, "text/plain"  # one handler serves a keep-alive connection
        if url.path.startswith("/_fake/"):
            return self._control(method, url.path, body)
        if fake.failing > 0 and url.path.startswith("/v2/projects/"):
            fake.failing -= 1
            if fake.failing_status == 403:
                return _error(403, "PERMISSION_DENIED", "Permission 'tpu.queuedResources.delete' denied (fake)")
            return _error(503, "UNAVAILABLE", "the service is unavailable (fake)")
        if method == "GET" and (match := _MANIFEST.match(url.path)):
            return manifest_answer(self, *match.groups(), present=tuple(match.groups()) not in fake.missing_images)
        if (found := iam_answer(method, url.path, fake.iam)) is not None:
            return found
        return handle(fake, method, url.path, urllib.parse.parse_qs(url.query), body)

    def _control(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        fake = self.state
        if path == "/_fake/entries" and method == "GET":
            return 200, fake.entries
        if path == "/_fake/boots" and method == "GET":
            fake.reap()
            return 200, [vm.doc() for vm in fake.vms]
        if path == "/_fake/reset" and method == "POST":
            fake.reset()
            return 200, {}
        if path == "/_fake/config" and method == "POST":
            fake.lifecycle.update(body.get("lifecycle") or {})
            if "boot" in body:
                fake.boot = body["boot"]
            return 200, {"lifecycle": fake.lifecycle, "boot": fake.boot}
        if path == "/_fake/registry" and method == "POST":
            fake.missing_images = {tuple(image) for image in body.get("missing", [])}
            return 200, {}
        if path == "/_fake/iam" and method == "POST":
            fake.iam = body.get("bindings")
            return 200, {}
        if path == "/_fake/state" and method == "POST":
            try:
                return 200, fake.set_state(body["name"], body["state"], body.get("node_state"), body.get("initiator"))
            except KeyError:
                return 404, {"error": f"no queued resource {body.get('name')!r}"}
        if path == "/_fake/fail" and method == "POST":
            fake.failing = int(body.get("count", 0))
            fake.failing_status = int(body.get("status", 503))
            return 200, {"failing": fake.failing, "status": fake.failing_status}
        if path == "/_fake/preempt" and method == "POST":
            try:
                return 200, fake.preempt(body["name"], float(body.get("grace_s", 30)))
            except KeyError:
                return 404, {"error": f"no queued resource {body.get('name')!r}"}
            except ValueError as error:
                return 409, {"error": str(error)}
        return 404, {"error": f"no control endpoint {method} {path}"}


class TpuFake(FakeClient):
    """The test side of a running fake: its endpoint and its control endpoints."""

    def set_state(
        self, name: str, state: str, node_state: str | None = None, initiator: str | None = None
    ) -> dict[str, Any]:
        return self.call(
            "POST", "/_fake/state", {"name": name, "state": state, "node_state": node_state, "initiator": initiator}
        )

    def configure(self, lifecycle: dict[str, Any] | None = None, boot: dict[str, Any] | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {"lifecycle": lifecycle or {}}
        if boot is not None:
            doc["boot"] = boot
        return self.call("POST", "/_fake/config", doc)

    def preempt(self, name: str, grace_s: float = 30.0) -> dict[str, Any]:
        return self.call("POST", "/_fake/preempt", {"name": name, "grace_s": grace_s})

    def fail(self, count: int, status: int = 503) -> None:
        """The next `count` TPU API requests answer 503 UNAVAILABLE (or 403 PERMISSION_DENIED)."""
        self.call("POST", "/_fake/fail", {"count": count, "status": status})

    def boots(self) -> list[dict[str, Any]]:
        return self.call("GET", "/_fake/boots")

    def entries(self) -> list[dict[str, Any]]:
        return self.call("GET", "/_fake/entries")

    def lose_image(self, name: str, reference: str) -> None:
        """The registry no longer holds NAME:REF (its manifest answers 404 MANIFEST_UNKNOWN)."""
        self.call("POST", "/_fake/registry", {"missing": [[name, reference]]})

    def iam(self, bindings: list[dict[str, Any]] | None) -> None:
        """Every project's IAM bindings from now on (None: the default, preflight_fake.default_bindings)."""
        self.call("POST", "/_fake/iam", {"bindings": bindings})

    def reset(self) -> None:
        self.call("POST", "/_fake/reset", {})


def start_tpu_fake(
    folder: Path, ttl_s: float = 900.0, start_timeout_s: float = 20.0
) -> contextlib.AbstractContextManager[TpuFake]:
    return start_fake(__spec__.name, folder, TpuFake, ttl_s, start_timeout_s)


def main(argv: list[str] | None = None) -> None:
    fake = Fake()

    def kill_vms() -> None:
        with fake.lock:
            for vm in fake.vms:
                vm.signal(signal.SIGKILL)

    serve(Handler, fake, argv, __doc__.splitlines()[0], default_ttl_s=900.0, tick=fake.tick, on_stop=kill_vms)


if __name__ == "__main__":
    sys.exit(main())
