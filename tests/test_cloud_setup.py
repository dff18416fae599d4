"""docs/cloud.md "From an empty project": every gcloud line of its block runs, as written, through the real
gcloud against a local fake that records the requests (tests/support/setup_fake.py), so gcloud's own parser
accepts each flag and each step sends what the text says it does. The `runner` lines have their own tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, cli_env
from tests.support.fake_server import FakeClient
from tests.support.setup_fake import PROJECT_NUMBER, start_setup_fake

DOC = REPO / "docs" / "cloud.md"
SA = f"serviceAccount:{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"


def setup_block() -> str:
    section = DOC.read_text().split("## From an empty project\n", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return block


def gcloud_script(block: str) -> str:
    """The block without its `runner` lines (and their continuations): variables, gcloud and shell only."""
    kept, skipping = [], False
    for line in block.splitlines():
        if line.startswith("runner "):
            skipping = True
        elif not skipping:
            kept.append(line)
        if skipping and not line.rstrip().endswith("\\"):
            skipping = False
    return "set -euo pipefail\n" + "\n".join(kept) + "\n"


@pytest.fixture(scope="module")
def setup_api(tmp_path_factory) -> Iterator[FakeClient]:
    with start_setup_fake(tmp_path_factory.mktemp("setup_api")) as fake:
        yield fake


def test_the_block_has_each_step_in_order() -> None:
    block = setup_block()
    steps = ["gcloud services enable", "gcloud artifacts repositories create", "gcloud storage buckets create",
             "gcloud projects describe", "gcloud artifacts repositories add-iam-policy-binding",
             "gcloud storage buckets add-iam-policy-binding", "gcloud projects add-iam-policy-binding",
             "gcloud builds submit", "runner prepare",
             "runner doctor --cloud", "runner submit"]
    positions = [block.index(step) for step in steps]
    assert positions == sorted(positions)


@pytest.mark.host
def test_every_gcloud_line_is_parsed_by_gcloud_and_sends_its_request(setup_api, tmp_path: Path) -> None:
    gcloud = shutil.which("gcloud")
    assert gcloud, "gcloud is not installed on this machine"
    # A small source folder: the build's config as the repository has it, in a git checkout of its own.
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(REPO / "cloudbuild.yaml", source / "cloudbuild.yaml")
    git = ["git", "-C", str(source), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "cloudbuild.yaml"], ["commit", "-qm", "source"]):
        subprocess.run([*git, *args], check=True, capture_output=True, timeout=30)
    short_sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True,
                               timeout=30).stdout.strip()
    endpoint = f"{setup_api.endpoint}/"
    env = cli_env(
        CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token",
        CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
        CLOUDSDK_CORE_DISABLE_PROMPTS="1",
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
        **{f"CLOUDSDK_API_ENDPOINT_OVERRIDES_{api}": endpoint
           for api in ("SERVICEUSAGE", "ARTIFACTREGISTRY", "STORAGE", "CLOUDRESOURCEMANAGER", "CLOUDBUILD")},
    )
    result = subprocess.run(["bash", "-c", gcloud_script(setup_block())], capture_output=True, text=True,
                            timeout=300, env=env, cwd=source)
    assert result.returncode == 0, result.stderr[-3000:]
    sent = [(r["method"], r["path"], r["query"], r["body"]) for r in setup_api.requests()]

    def one(method: str, path: str) -> tuple:
        found = [s for s in sent if s[0] == method and s[1] == path]
        assert len(found) == 1, f"{method} {path}: {len(found)} requests in {[s[:2] for s in sent]}"
        return found[0]

    project, region, bucket = "my-project", "us-central1", "my-project-runner"
    _, _, _, body = one("POST", f"/v1/projects/{project}/services:batchEnable")
    assert body["serviceIds"] == ["tpu.googleapis.com", "artifactregistry.googleapis.com",
                                  "cloudbuild.googleapis.com", "storage.googleapis.com"]
    repositories = f"/v1/projects/{project}/locations/{region}/repositories"
    _, _, query, body = one("POST", repositories)
    assert query["repositoryId"] == ["runner"] and body["format"] == "DOCKER"
    _, _, query, body = one("POST", "/storage/v1/b")
    assert query["project"] == [project] and body == {"name": bucket, "location": region}
    one("GET", f"/v1/projects/{project}")
    _, _, _, body = one("POST", f"{repositories}/runner:setIamPolicy")
    assert {"role": "roles/artifactregistry.reader", "members": [SA]} in body["policy"]["bindings"]
    _, _, _, body = one("PUT", f"/storage/v1/b/{bucket}/iam")
    assert {"role": "roles/storage.objectAdmin", "members": [SA]} in body["bindings"]
    # The TPU VM deletes its own slice: TPU Admin on the project (what the preflight's vm_permissions reads).
    _, _, _, body = one("POST", f"/v1/projects/{project}:setIamPolicy")
    assert {"role": "roles/tpu.admin", "members": [SA]} in body["policy"]["bindings"]
    # The build: the source uploaded to the staging bucket, then the Build naming it, with the substitutions.
    [upload] = [s for s in sent if s[0] == "POST" and s[1].endswith(f"/upload/storage/v1/b/{project}_cloudbuild/o")]
    uploaded = upload[2]["name"][0]
    assert uploaded.startswith("source/") and uploaded.endswith(".tgz") and upload[3]["bytes"] > 0
    _, _, _, build = one("POST", f"/v1/projects/{project}/locations/global/builds")
    assert build["source"]["storageSource"] == {"bucket": f"{project}_cloudbuild", "object": uploaded,
                                                "generation": "1"}
    config = yaml.safe_load((REPO / "cloudbuild.yaml").read_text())
    assert build["substitutions"] == {**config["substitutions"], "SHORT_SHA": short_sha, "_BUILD_TPU": "true"}
    assert [step["id"] for step in build["steps"]] == [step["id"] for step in config["steps"]]
