"""cloudbuild.yaml: a valid Cloud Build `Build`, internally consistent, and parsed by the real gcloud.

Cloud Build itself cannot run here; the Build proto (google-cloud-build) rejects unknown fields, wrong
types and bad enums, and the checks below are the ones the proto cannot make.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, cli_env
from tests.support.tpu_fake import TpuFake, start_tpu_fake

CONFIG = REPO / "cloudbuild.yaml"
# Cloud Build's own substitutions (https://cloud.google.com/build/docs/configuring-builds/substitute-variable-values).
BUILT_IN = {
    "PROJECT_ID", "PROJECT_NUMBER", "BUILD_ID", "LOCATION", "TRIGGER_NAME", "TRIGGER_BUILD_CONFIG_PATH",
    "COMMIT_SHA", "SHORT_SHA", "REVISION_ID", "REPO_NAME", "REPO_FULL_NAME", "BRANCH_NAME", "TAG_NAME",
    "REF_NAME", "SERVICE_ACCOUNT_EMAIL", "SERVICE_ACCOUNT",
}
_VARIABLE = re.compile(r"(?<!\$)\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
REGISTRY = "${_REGION}-docker.pkg.dev/${_PROJECT}/${_REPOSITORY}/${_IMAGE}"


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text())


def strings_in(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings_in(value)


def substituted(text: str, values: dict[str, str]) -> str:
    """What Cloud Build does to a string: $NAME and ${NAME} replaced, $$ left as a literal $."""
    text = _VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], text)
    return text.replace("$$", "$")


def as_build(doc: dict[str, Any]):
    from google.cloud.devtools import cloudbuild_v1
    from google.protobuf import json_format

    return json_format.ParseDict(doc, cloudbuild_v1.Build.pb(cloudbuild_v1.Build()))


def test_the_config_is_a_valid_build(config):
    build = as_build(config)  # raises on an unknown field, a wrong type or an unknown enum value
    assert [step.id for step in build.steps] == [step["id"] for step in config["steps"]]
    assert build.options.dynamic_substitutions  # _PROJECT defaults to ${PROJECT_ID}


def test_every_wait_is_for_an_earlier_step(config):
    seen: list[str] = []
    for step in config["steps"]:
        for target in step.get("waitFor", []):
            assert target == "-" or target in seen, f"step {step['id']!r} waits for {target!r}, not an earlier step"
        assert step["id"] not in seen, f"two steps are named {step['id']!r}"
        seen.append(step["id"])


def test_every_substitution_is_defined_and_every_defined_one_is_used(config):
    defined = set(config["substitutions"])
    used = {m.group(1) or m.group(2) for text in strings_in(config) for m in _VARIABLE.finditer(text)}
    assert used - defined - BUILT_IN == set(), "used but never defined"
    # Cloud Build refuses a build whose substitutions are not all used (unless ALLOW_LOOSE).
    assert defined - used == set(), "defined but never used"


def test_steps_run_images_only_after_the_step_that_builds_them(config):
    steps = {step["id"]: step for step in config["steps"]}

    def waits_for(step_id: str) -> set[str]:
        direct = {t for t in steps[step_id].get("waitFor", []) if t != "-"}
        return direct.union(*(waits_for(t) for t in direct)) if direct else set()

    built_by = {}
    for step in config["steps"]:
        args = step.get("args", [])
        if args[:1] == ["build"]:
            for arg in args:
                if arg.startswith("--tag="):
                    built_by[arg.removeprefix("--tag=")] = step["id"]
    runs_built_image = [step for step in config["steps"] if step["name"] in built_by]
    assert {step["id"] for step in runs_built_image} >= {"test", "smoke-data", "smoke-job"}
    for step in runs_built_image:
        assert built_by[step["name"]] in waits_for(step["id"]), f"{step['id']} may start before its image exists"


def test_the_pushed_images_are_the_tested_ones_tagged_short_sha_and_latest(config):
    assert config["images"] == [f"{REGISTRY}:$SHORT_SHA", f"{REGISTRY}:latest"]
    [build] = [s for s in config["steps"] if s["id"] == "build"]
    assert {f"--tag={image}" for image in config["images"]} <= set(build["args"])
    [smoke] = [s for s in config["steps"] if s["id"] == "smoke-job"]
    assert smoke["name"] == f"{REGISTRY}:$SHORT_SHA"


def test_the_files_and_stages_it_names_exist(config):
    dockerfile = (REPO / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, flags=re.MULTILINE))
    for step in config["steps"]:
        args = step.get("args", [])
        for arg in args:
            if arg.startswith("--file="):
                assert (REPO / arg.removeprefix("--file=")).is_file(), f"{step['id']}: no {arg}"
            if arg.startswith("--target="):
                assert arg.removeprefix("--target=") in stages, f"{step['id']}: no stage {arg} in the Dockerfile"
        if args[:1] == ["build"]:
            assert args[-1] == "." and (REPO / ".dockerignore").is_file()
    [smoke] = [s for s in config["steps"] if s["id"] == "smoke-job"]
    assert (REPO / smoke["args"][1]).is_file()
    assert smoke["args"][0] == "run"


def test_the_test_step_deselects_only_registered_markers(config):
    [test] = [s for s in config["steps"] if s["id"] == "test"]
    expression = test["args"][test["args"].index("-m") + 1]
    pyproject = (REPO / "pyproject.toml").read_text()
    for marker in re.findall(r"not (\w+)", expression):
        assert re.search(rf'"{marker}: ', pyproject), f"marker {marker!r} is not registered in pyproject.toml"


@pytest.mark.parametrize("build_tpu", ["false", "true"])
def test_the_tpu_step_builds_and_pushes_only_when_asked(config, tmp_path, build_tpu):
    [step] = [s for s in config["steps"] if s["id"] == "tpu-variant"]
    values = {**config["substitutions"], "_BUILD_TPU": build_tpu, "_PROJECT": "proj", "SHORT_SHA": "abc1234"}
    script = substituted(step["args"][1], values)
    # A docker that records its arguments: the step's own logic is what is under test here.
    (tmp_path / "docker").write_text('#!/bin/sh\necho "docker $*" >>"$CALLS"\n')
    (tmp_path / "docker").chmod(0o755)
    calls = tmp_path / "calls"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                            env={"PATH": f"{tmp_path}:/usr/bin:/bin", "CALLS": str(calls)})
    assert result.returncode == 0, result.stderr
    made = calls.read_text().splitlines() if calls.exists() else []
    if build_tpu == "false":
        assert made == [] and "not built" in result.stdout
        return
    image = "us-central1-docker.pkg.dev/proj/runner/runner"
    assert made == [
        f"docker build --build-arg=ACCELERATOR=tpu --tag={image}:tpu-abc1234 --tag={image}:tpu --file=Dockerfile .",
        f"docker push {image}:tpu-abc1234",
        f"docker push {image}:tpu",
    ]


@pytest.fixture(scope="module")
def build_api(tmp_path_factory) -> Iterator[TpuFake]:
    with start_tpu_fake(tmp_path_factory.mktemp("build_api")) as fake:
        yield fake


@pytest.mark.host
def test_gcloud_builds_submit_parses_it_and_sends_the_same_build(config, build_api, tmp_path):
    gcloud = shutil.which("gcloud")
    assert gcloud, "gcloud is not installed on this machine"
    build_api.reset()
    env = cli_env(
        CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBUILD=f"{build_api.endpoint}/",
        CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token",
        CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
    )
    result = subprocess.run(
        [gcloud, "builds", "submit", "--no-source", "--async", f"--config={CONFIG}", "--project=proj",
         "--substitutions=SHORT_SHA=abc1234,_BUILD_TPU=true"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    [request] = build_api.requests()
    assert (request["method"], request["path"]) == ("POST", "/v1/projects/proj/locations/global/builds")
    expected = dict(config)
    expected["substitutions"] = {**config["substitutions"], "SHORT_SHA": "abc1234", "_BUILD_TPU": "true"}
    assert as_build(request["body"]) == as_build(expected)
