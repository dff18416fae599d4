"""What the tests of the Cloud TPU commands share (`runner submit`, `watch`, `status`, `cancel`, `logs` and
the VM's startup script): the names of the place they submit to, the environment that points runner and gcloud
at the fakes, and the CLI run in this process (tests/support/cli.py). Their fixtures are in
tests/support/cloud_fixtures.py."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import cli_env
from tests.support.cli import invoke  # noqa: F401  (the cloud tests import it from here)

PROJECT, ZONE = "runner-test", "us-central1-a"
IMAGE = "us-central1-docker.pkg.dev/runner-test/runner/runner:tpu"


def cloud_env(tpu_endpoint: str, folder: Path, **extra: str) -> dict[str, str]:
    """The environment of a `runner` (and gcloud) on this machine whose Cloud TPU API is the fake at
    `tpu_endpoint` (and whose image registry, for `runner submit`'s preflight); gcloud's configuration and runner's
    own state live in `folder`."""
    return cli_env(
        CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=f"{tpu_endpoint}/",
        # the preflight's IAM check (the project and its policy): the fake serves Cloud Resource Manager too
        CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDRESOURCEMANAGER=f"{tpu_endpoint}/",
        RUNNER_REGISTRY_ENDPOINT=tpu_endpoint,  # the preflight's image check: the fake serves a registry too
        CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token",
        CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
        CLOUDSDK_CONFIG=str(folder / "gcloud"),
        CLOUDSDK_CORE_DISABLE_PROMPTS="1",
        RUNNER_STATE_DIR=str(folder / "state"),
        **extra,
    )
