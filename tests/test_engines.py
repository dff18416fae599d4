"""`runner submit --on skypilot|gke|vertex`, each checked by the engine's own code, offline. GKE (JobSet, xpk,
the Kubernetes client) is tests/test_engines_gke.py; here, what every engine shares, SkyPilot and Vertex AI:

* SkyPilot: its task loader (`sky.Task.from_yaml_config`, which validates against SkyPilot's schema) reads
  the printed task; the job_recovery keys are ones SkyPilot's schema declares.
* Vertex AI: the printed request parses strictly into aiplatform_v1's proto, and the real JobServiceClient
  sends it to a local fake that records it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner import SpecError
from runner.cloud import engines, tpu_types
from runner.cloud.engines import vertex
from runner.spec.load import load_spec
from tests.conftest import REPO, cli_env, last_json
from tests.support.engines import IMAGE, PROJECT, ZONE, submission, submit

pytest_plugins = ["tests.support.cloud_fixtures"]  # cloud_spec, engine_api


# --- every engine -----------------------------------------------------------------------------------


def test_the_container_command_hands_runner_the_same_spec(cloud_spec, tmp_path):
    """The one command every engine runs: the spec from RUNNER_SPEC_B64 to a file, then `runner run FILE`
    (here a stand-in `runner` on PATH that keeps what it was given)."""
    sub = submission(cloud_spec)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "runner"
    stand_in.write_text(f'#!/bin/bash\necho "$@" >{tmp_path}/args\ncp "$2" {tmp_path}/spec.yaml\nexit 75\n')
    stand_in.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **engines.container_env(sub)}
    done = subprocess.run(["bash", "-c", engines.COMMAND], env=env, timeout=30, check=False)
    assert done.returncode == 75  # exec: the engine sees the runner's own exit code
    assert (tmp_path / "args").read_text().split() == ["run", engines.SPEC_FILE]
    assert load_spec(tmp_path / "spec.yaml") == sub.spec


@pytest.mark.parametrize("target", ["skypilot", "gke", "vertex"])
def test_every_engine_refuses_a_multi_host_slice_in_the_tpu_vms_words(cloud_spec, target):
    with pytest.raises(SpecError) as refused:
        tpu_types.refuse_multi_host("v5litepod-16")
    result = submit(cloud_spec, "--on", target, "--dry-run", tpu_type="v5litepod-16")
    assert result.returncode == 2, result.stderr
    assert str(refused.value) in " ".join(result.stderr.split()).replace("error: cannot submit: ", "")
    assert result.stdout == ""


@pytest.mark.parametrize("target, flag, says", [
    ("gke", "--keep", "--keep does not apply to --on gke"),
    ("vertex", "--queue=q", "--queue does not apply to --on vertex"),
    ("skypilot", "--max-restarts=5", "SkyPilot relaunches a preempted job (and exit 75) without limit"),
    ("tpu-vm", "--format=xpk", "--format does not apply to --on tpu-vm"),
])
def test_a_flag_the_engine_would_not_use_is_refused(cloud_spec, target, flag, says):
    result = submit(cloud_spec, "--on", target, flag, "--dry-run")
    assert result.returncode == 2
    assert says in " ".join(result.stderr.split())
    assert result.stdout == ""


# --- SkyPilot -----------------------------------------------------------------------------------------


def test_skypilot_task_is_read_by_skypilots_own_loader(cloud_spec):
    sky = pytest.importorskip("sky")
    from sky.skylet import constants
    from sky.utils import schemas

    result = submit(cloud_spec, "--on", "skypilot", "--spot", "--dry-run")
    assert result.returncode == 0, result.stderr
    doc = yaml.safe_load(result.stdout)
    task = sky.Task.from_yaml_config(json.loads(json.dumps(doc)))
    (resources,) = task.resources
    assert resources.accelerators == {"tpu-v5litepod-8": 1}
    assert resources.accelerator_args["runtime_version"] == tpu_types.parse_tpu_type("v5litepod-8").runtime_version
    assert resources.use_spot and resources.zone == ZONE
    assert list(resources.image_id.values()) == [f"docker:{IMAGE}"]
    # SkyPilot's client lets unknown job_recovery keys through to its server: check them against its schema here.
    declared = schemas.get_resources_schema()["properties"]["job_recovery"]["anyOf"][1]["properties"]
    recovery = doc["resources"]["job_recovery"]
    assert set(recovery) <= set(declared)
    assert recovery == {"max_restarts_on_errors": 0, "recover_on_exit_codes": [75]}
    assert ("docker", "run_options") in constants.OVERRIDEABLE_CONFIG_KEYS_IN_TASK
    assert task.envs["TPU_NAME"] == "local"
    assert load_spec_b64(task.envs["RUNNER_SPEC_B64"], cloud_spec.parent) == load_spec(
        cloud_spec, ["accelerator.kind=tpu"])
    assert task.run.strip() == engines.COMMAND


def test_skypilot_launch_without_skypilot_says_how_to_install_it(cloud_spec, tmp_path):
    """A Python path on which `import sky` fails, as where SkyPilot is not installed."""
    shadow = tmp_path / "no_sky" / "sky"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named sky')\n")
    env = cli_env(PYTHONPATH=f"{shadow.parent}{os.pathsep}{REPO}")
    result = submit(cloud_spec, "--on", "skypilot", env=env)
    assert result.returncode == 2
    assert "pip install 'tpu-job-runner[skypilot]'" in result.stderr
    assert result.stdout == ""


def load_spec_b64(text: str, folder: Path):
    path = folder / "decoded.yaml"
    path.write_bytes(base64.b64decode(text))
    return load_spec(path)


# --- Vertex AI -------------------------------------------------------------------------------------------


def test_vertex_request_parses_strictly_into_the_custom_job_proto(cloud_spec):
    aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
    from google.protobuf import json_format

    result = submit(cloud_spec, "--on", "vertex", "--spot", "--dry-run", tpu_type="v5litepod-4")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    request = aiplatform_v1.CreateCustomJobRequest.pb(aiplatform_v1.CreateCustomJobRequest())
    json_format.ParseDict(doc, request)  # unknown fields, wrong types and bad enums raise
    job = request.custom_job
    assert request.parent == f"projects/{PROJECT}/locations/us-central1"
    (pool,) = job.job_spec.worker_pool_specs
    assert (pool.machine_spec.machine_type, pool.machine_spec.tpu_topology, pool.replica_count) == ("ct5lp-hightpu-4t", "2x2", 1)
    assert (pool.container_spec.image_uri, list(pool.container_spec.args)) == (IMAGE, [engines.COMMAND])
    assert job.job_spec.scheduling.strategy == aiplatform_v1.Scheduling.Strategy.SPOT
    assert job.job_spec.scheduling.restart_job_on_worker_restart
    assert job.job_spec.base_output_directory.output_uri_prefix == "gs://runner-test/runs/mnist_cnn"


def test_vertex_refuses_v6e_where_it_does_not_run_tensorflow(cloud_spec):
    result = submit(cloud_spec, "--on", "vertex", "--dry-run", tpu_type="v6e-4")
    assert result.returncode == 2
    assert "Vertex AI does not support TensorFlow from TPU v6e on" in " ".join(result.stderr.split())


def custom_job_of(body: dict[str, Any]):
    from google.cloud import aiplatform_v1
    from google.protobuf import json_format

    return json_format.ParseDict(body, aiplatform_v1.CustomJob.pb(aiplatform_v1.CustomJob()))


def test_vertex_client_sends_the_custom_job_to_the_api(cloud_spec, engine_api):
    """The real JobServiceClient (REST, anonymous credentials) against the local fake."""
    aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials

    sub = submission(cloud_spec, spot=True)
    client = aiplatform_v1.JobServiceClient(credentials=AnonymousCredentials(), transport="rest",
                                            client_options=ClientOptions(api_endpoint=engine_api.endpoint))
    before = len(engine_api.requests())
    answer = vertex.create(sub, client=client)
    (sent,) = engine_api.requests()[before:]
    assert (sent["method"], sent["path"]) == ("POST", f"/v1/projects/{PROJECT}/locations/us-central1/customJobs")
    assert custom_job_of(sent["body"]) == vertex.build_job(sub)._pb
    assert answer["state"] == "JOB_STATE_QUEUED" and answer["job"].startswith(f"projects/{PROJECT}/locations/us-central1/customJobs/")


def test_vertex_submit_from_the_command_line_sends_what_the_dry_run_prints(cloud_spec, engine_api):
    pytest.importorskip("google.cloud.aiplatform_v1")
    printed = json.loads(submit(cloud_spec, "--on", "vertex", "--dry-run").stdout)
    env = cli_env(CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM=f"{engine_api.endpoint}/", CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token")
    before = len(engine_api.requests())
    result = submit(cloud_spec, "--on", "vertex", env=env)
    assert result.returncode == 0, result.stderr
    (sent,) = engine_api.requests()[before:]
    assert custom_job_of(sent["body"]) == custom_job_of(printed["customJob"])
    assert last_json(result.stdout)["run_dir"] == "gs://runner-test/runs/mnist_cnn"


def test_the_readme_tells_where_to_run_with_one_row_per_target():
    """README's "where to run" table: one row per `--on` target the CLI takes, each saying how it recovers,
    queues and accounts for cost, and the engines' page linked."""
    readme = (REPO / "README.md").read_text()
    head = "| `--on` | recovery | queueing | cost accounting |"
    assert head in readme
    table = readme[readme.index(head):].split("\n\n")[0].splitlines()[2:]
    rows = {re.match(r"\| `([a-z-]+)`", row).group(1): [cell.strip() for cell in row.strip("|").split("|")] for row in table}
    assert sorted(rows) == sorted(engines.TARGETS)
    assert all(len(cells) == 4 and all(cells) for cells in rows.values()), rows
    assert "--on WHERE" in readme and "(docs/engines.md)" in readme
