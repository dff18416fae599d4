"""What the engine tests share: the submit flags they all use, the submit command, and the rule for an
engine library that is not installed (tests/test_engines.py, tests/test_engines_gke.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from runner.cloud.submit import prepare_submission
from tests.conftest import run_cli

PROJECT, ZONE = "runner-test", "us-central1-a"
IMAGE = "us-central1-docker.pkg.dev/runner-test/runner/runner:tpu"


def submit(spec: Path, *extra: str, tpu_type: str = "v5litepod-8", env: dict[str, str] | None = None,
           image: str = IMAGE, project: str | None = PROJECT, preflight: bool = False,
           allow: bool = False) -> subprocess.CompletedProcess:
    """`runner submit` with the flags every engine takes. SkyPilot gets no --project (it refuses one: its API
    server picks the project). A real submission skips the cloud checks unless `preflight`: these tests check
    what each engine is sent; test_submit_preflight.py runs the checks against fakes. `allow`: give
    --allow-unverified (for a --runtime-version no source names, docs/tpu.md)."""
    on = extra[extra.index("--on") + 1] if "--on" in extra else "tpu-vm"
    where = ["--project", project] if project and on != "skypilot" else []
    skip = [] if preflight or "--dry-run" in extra else ["--no-preflight"]
    allow = ["--allow-unverified"] if allow and "--allow-unverified" not in extra else []
    return run_cli("submit", spec, "--tpu-type", tpu_type, "--zone", ZONE, "--image", image, *where,
                   *extra, *skip, *allow, env=env, timeout=120)


def submission(spec: Path, tpu_type: str = "v5litepod-8", image: str = IMAGE, **flags: Any):
    return prepare_submission(spec, [], tpu_type=tpu_type, zone=ZONE, image=image, project=PROJECT, **flags)


def missing(what: str, made_from: str) -> None:
    """An engine's library `make test` installs is not here: a failure in CI, a skip on a developer's machine."""
    message = f"{what} is missing: `make test` installs it from {made_from}"
    pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
