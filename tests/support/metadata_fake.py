"""A local fake of the GCE metadata server a TPU VM's startup script asks (its worker number, its slice).

Run as its own process (`start_metadata_fake` does that and stops it by PID):

    python -m tests.support.metadata_fake --port 0 --ttl 900     prints `PORT <n>` once it serves on 127.0.0.1

What it serves, as the real server does (plain text, `Metadata-Flavor: Google` required and echoed):
    GET /computeMetadata/v1/instance/attributes/KEY    a TPU VM's attributes: agent-worker-number,
                                                       worker-network-endpoints, accelerator-type, ...
    GET /computeMetadata/v1/instance/zone              projects/NUMBER/zones/ZONE
    GET /computeMetadata/v1/instance/name, /id
    GET /computeMetadata/v1/project/project-id
A request without the header gets 403; an unknown key 404. Clients reach it through GCE_METADATA_HOST
(host:port), the variable Google's own clients (google-auth, Go's compute/metadata) honour.

Control endpoints for the tests:
    POST /_fake/attributes   {"KEY": "VALUE" | null, ...}   set (null: remove) attributes
    POST /_fake/fail         {"status": 503}                 every metadata read answers 503 from now on
                             {"status": 0}                   answer again
    GET  /_fake/requests     every metadata request so far: path and whether the header was sent
    GET  /_fake/health       "ok"
The process exits by itself after --ttl seconds.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.fake_server import FakeClient, FakeHandler, Recorder, serve, start_fake

_PREFIX = "/computeMetadata/v1/"


class Metadata(Recorder):
    def __init__(self, project: str = "runner-test", zone: str = "us-central1-a", name: str = "t1v-n-fake-w-0"):
        super().__init__()
        self.failing = 0
        self.values = {
            "instance/zone": f"projects/123456789/zones/{zone}",
            "instance/name": name,
            "instance/id": "4242424242424242",
            "project/project-id": project,
            "project/numeric-project-id": "123456789",
            "instance/attributes/agent-worker-number": "0",
            "instance/attributes/worker-network-endpoints": "unknown:unknown:10.0.0.2",
            "instance/attributes/accelerator-type": "v5litepod-8",
        }

    def answer(self, path: str, flavoured: bool) -> tuple[int, str]:
        self.requests.append({"path": path, "flavoured": flavoured})
        if not path.startswith(_PREFIX):
            return 404, "not found"
        if not flavoured:
            return 403, "Missing required header: Metadata-Flavor"
        if self.failing:
            return self.failing, "metadata server unavailable (fake)"
        key = path[len(_PREFIX):].rstrip("/")
        if key == "instance/attributes":
            names = sorted(k.rsplit("/", 1)[1] for k in self.values if k.startswith("instance/attributes/"))
            return 200, "\n".join(names) + "\n"
        return (200, self.values[key]) if key in self.values else (404, "not found")


class Handler(FakeHandler):
    state: Metadata
    text_type = "application/text"
    extra_headers = {"Metadata-Flavor": "Google"}

    def record(self, method: str, url: urllib.parse.SplitResult, body: Any) -> None:
        pass  # Metadata.answer keeps what the tests read: the path and whether the header came

    def answer(self, method: str, url: urllib.parse.SplitResult, body: Any) -> tuple[int, Any]:
        metadata = self.state
        if method == "GET":
            return metadata.answer(url.path, self.headers.get("Metadata-Flavor") == "Google")
        if method == "POST" and url.path == "/_fake/attributes":
            for key, value in (body or {}).items():
                full = key if "/" in key else f"instance/attributes/{key}"
                if value is None:
                    metadata.values.pop(full, None)
                else:
                    metadata.values[full] = str(value)
            return 200, {}
        if method == "POST" and url.path == "/_fake/fail":
            metadata.failing = int((body or {}).get("status") or 0)
            return 200, {}
        return 404, "no such control endpoint"


class MetadataFake(FakeClient):
    """The test side of a running fake: `host` for GCE_METADATA_HOST, and its controls."""

    def __init__(self, process: subprocess.Popen, port: int):
        super().__init__(process, port)
        self.host = f"127.0.0.1:{port}"

    def set(self, **attributes: Any) -> None:
        """Sets instance attributes; underscores in keyword names become dashes (agent_worker_number=1)."""
        self.call("POST", "/_fake/attributes", {k.replace("_", "-"): v for k, v in attributes.items()})

    def fail(self, status: int = 503) -> None:
        self.call("POST", "/_fake/fail", {"status": status})

    def recover(self) -> None:
        self.call("POST", "/_fake/fail", {"status": 0})


@contextlib.contextmanager
def start_metadata_fake(folder: Path, ttl_s: float = 900.0, **attributes: Any) -> Iterator[MetadataFake]:
    with start_fake(__spec__.name, folder, MetadataFake, ttl_s) as fake:
        if attributes:
            fake.set(**attributes)
        yield fake


def main(argv: list[str] | None = None) -> None:
    serve(Handler, Metadata(), argv, __doc__.splitlines()[0], default_ttl_s=900.0)


if __name__ == "__main__":
    sys.exit(main())
