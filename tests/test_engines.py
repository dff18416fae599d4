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
from runner.cloud.engines import skypilot, vertex
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
    done = subprocess.run(["bash", "-c", engines.command(sub)], env=env, timeout=30, check=False)
    assert done.returncode == 75  # exec: the engine sees the runner's own exit code
    # The default limits (24h, 30m) on the `runner run` line, as the TPU VM's startup script passes them.
    assert (tmp_path / "args").read_text().split() == [
        "run", engines.SPEC_FILE, "--set", "train.max_duration=86400", "--set", "train.stall_timeout=1800"]
    assert load_spec(tmp_path / "spec.yaml") == sub.spec
    none = submission(cloud_spec, max_run_duration="none", stall_timeout="none")
    assert engines.command(none) == engines.COMMAND


@pytest.mark.parametrize("target", ["skypilot", "gke", "vertex"])
def test_every_engine_refuses_a_slice_the_table_gives_no_hosts_for_in_the_tpu_vms_words(cloud_spec, target):
    with pytest.raises(SpecError) as refused:
        tpu_types.refuse_unknown_slice("v5litepod-64")
    result = submit(cloud_spec, "--on", target, "--dry-run", tpu_type="v5litepod-64")
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
    from sky.provision.docker_utils import DockerLoginConfig
    from sky.skylet import constants
    from sky.utils import schemas

    result = submit(cloud_spec, "--on", "skypilot", "--spot", "--dry-run")
    assert result.returncode == 0, result.stderr
    doc = yaml.safe_load(result.stdout)
    task = sky.Task.from_yaml_config(json.loads(json.dumps(doc)))
    (resources,) = task.resources
    # Artifact Registry: empty user and password, the registry as server; SkyPilot then runs `gcloud auth
    # configure-docker` for it on the VM (sky/provision/docker_utils.py), with the VM's own service account.
    assert resources.docker_login_config == DockerLoginConfig("", "", "us-central1-docker.pkg.dev")
    assert resources.accelerators == {"tpu-v5litepod-8": 1}
    assert resources.accelerator_args["runtime_version"] == "v2-alpha-tpuv5-lite"  # Google's, for JAX on v5e
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
    assert task.run.strip() == engines.command(submission(cloud_spec))


def test_a_skypilot_slice_is_one_node_whose_every_host_runs_the_job_in_skypilots_own_code(cloud_spec):
    """SkyPilot runs `run` on every host of a TPU VM pod (a TPU type not ending in -8: gcp_utils.is_tpu_vm_pod;
    cloud_vm_ray_backend multiplies num_nodes by the pod's hosts), so a slice is one node, not one per host."""
    sky = pytest.importorskip("sky")
    from sky.clouds.utils import gcp_utils

    result = submit(cloud_spec, "--on", "skypilot", "--dry-run", "--zone", "us-central1-b", tpu_type="v6e-16")
    assert result.returncode == 0, result.stderr
    doc = yaml.safe_load(result.stdout)
    assert doc["num_nodes"] == 1
    assert "The slice's 4 hosts are one SkyPilot node (num_nodes: 1)" in result.stdout
    task = sky.Task.from_yaml_config(json.loads(json.dumps(doc)))
    (resources,) = task.resources
    assert task.num_nodes == 1 and resources.accelerators == {"tpu-v6e-16": 1}
    assert gcp_utils.is_tpu_vm_pod(resources), "SkyPilot runs the task on each of the pod's hosts"
    assert resources.accelerator_args["runtime_version"] == "v2-alpha-tpuv6e"
    # JAX finds the slice from the TPU VM's metadata: no KERAS_DISTRIBUTION_* in the task.
    assert not [key for key in task.envs if key.startswith("KERAS_DISTRIBUTION")]
    assert "workers: 4 hosts of 4 chips: SkyPilot runs the task on each of the slice's 4 hosts" in result.stderr
    assert "price: v6e-16 = 16 chips x $2.7 per chip-hour" in result.stderr


def test_vertex_refuses_a_multi_host_slice_with_the_source_that_documents_none(cloud_spec):
    result = submit(cloud_spec, "--on", "vertex", "--dry-run", tpu_type="v5litepod-16")
    assert result.returncode == 2
    said = " ".join(result.stderr.split())
    assert ("--on vertex --tpu-type v5litepod-16: a slice of 4 hosts: Vertex AI documents no TPU slice of more than "
            "one VM for a custom container") in said
    assert "https://cloud.google.com/vertex-ai/docs/training/training-with-tpu-vm" in said
    assert "run it with --on tpu-vm, skypilot or gke" in said and result.stdout == ""


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


def test_a_gcr_image_logs_in_with_the_service_account_key_as_a_secret(cloud_spec, monkeypatch):
    """gcr.io has no keyless login in SkyPilot: `_json_key` and the key, in `secrets` (redacted by SkyPilot);
    SkyPilot's own loader turns them into its docker login."""
    sky = pytest.importorskip("sky")
    from sky.provision.docker_utils import DockerLoginConfig

    image = "gcr.io/runner-test/runner:tpu"
    sub = submission(cloud_spec, image=image)
    monkeypatch.setenv(skypilot.PASSWORD, '{"type": "service_account"}')
    doc = skypilot.task(sub, dry_run=False)
    assert not {skypilot.USERNAME, skypilot.PASSWORD, skypilot.SERVER} & set(doc["envs"])
    (resources,) = sky.Task.from_yaml_config(json.loads(json.dumps(doc))).resources
    assert resources.docker_login_config == DockerLoginConfig("_json_key", '{"type": "service_account"}', "gcr.io")

    printed = submit(cloud_spec, "--on", "skypilot", "--dry-run", image=image)
    assert printed.returncode == 0 and "service_account" not in printed.stdout  # the key is never printed
    assert yaml.safe_load(printed.stdout)["secrets"][skypilot.PASSWORD] == skypilot.KEY_PLACEHOLDER
    assert f'--secret {skypilot.PASSWORD}="$(cat KEY.json)"' in printed.stdout

    monkeypatch.delenv(skypilot.PASSWORD)
    refused = submit(cloud_spec, "--on", "skypilot", image=image, env=cli_env())
    assert refused.returncode == 2
    assert "SkyPilot logs in to gcr.io only with a service-account key" in " ".join(refused.stderr.split())


def test_skypilot_older_than_the_floor_is_refused_naming_both_versions(cloud_spec, tmp_path):
    """The floor is the first SkyPilot whose schema has recover_on_exit_codes; the installed one has it."""
    sky = pytest.importorskip("sky")
    from packaging.version import Version
    from sky.utils import schemas

    declared = schemas.get_resources_schema()["properties"]["job_recovery"]["anyOf"][1]
    assert "recover_on_exit_codes" in declared["properties"]
    assert Version(sky.__version__) >= Version(skypilot.MIN_VERSION) == Version("0.11.2")
    skypilot.check_version(sky.__version__)
    with pytest.raises(SpecError, match=r"SkyPilot 0\.11\.1 is installed; the task needs SkyPilot >= 0\.11\.2"):
        skypilot.check_version("0.11.1")

    # A Python path whose `sky` says 0.11.1: `runner submit` stops before it sends anything.
    old = tmp_path / "old_sky" / "sky"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("__version__ = '0.11.1'\n")
    env = cli_env(PYTHONPATH=f"{old.parent}{os.pathsep}{REPO}")
    result = submit(cloud_spec, "--on", "skypilot", env=env)
    assert result.returncode == 2
    assert "the task needs SkyPilot >= 0.11.2" in " ".join(result.stderr.split())


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
    machine = pool.machine_spec
    assert (machine.machine_type, machine.tpu_topology, pool.replica_count) == ("ct5lp-hightpu-4t", "2x2", 1)
    assert (pool.container_spec.image_uri, list(pool.container_spec.args)) == (
        IMAGE, [engines.command(submission(cloud_spec, tpu_type="v5litepod-4"))])
    # Vertex's own deadline: the default 24h limit plus the grace the job has to save and exit 124 itself.
    assert job.job_spec.scheduling.timeout.ToSeconds() == 24 * 3600 + engines.LIMIT_GRACE_S
    assert job.job_spec.scheduling.strategy == aiplatform_v1.Scheduling.Strategy.SPOT
    # No retry after the job has started (the proto: it also turns restart_job_on_worker_restart off).
    assert job.job_spec.scheduling.disable_retries and not job.job_spec.scheduling.restart_job_on_worker_restart
    assert job.job_spec.base_output_directory.output_uri_prefix == "gs://runner-test/runs/mnist_cnn"


def test_vertex_refuses_v6e_whose_machine_types_the_table_does_not_hold(cloud_spec):
    result = submit(cloud_spec, "--on", "vertex", "--dry-run", tpu_type="v6e-4")
    assert result.returncode == 2
    said = " ".join(result.stderr.split())
    assert "--tpu-type v6e-4 cannot run --on vertex: the Vertex AI machine types for v6e are not in this table" in said
    assert "pick one of v5litepod-1, v5litepod-4, v5litepod-8, v3-8, v2-8" in said and result.stdout == ""


def test_vertex_refuses_v5p_which_its_tpu_training_page_does_not_name(cloud_spec):
    result = submit(cloud_spec, "--on", "vertex", "--dry-run", tpu_type="v5p-8")
    assert result.returncode == 2
    assert "names TPU v2, v3, v5e and v6e, not v5p" in " ".join(result.stderr.split())


def dockerfile_user(accelerator: str) -> str:
    """The user the runner image's final stage runs as, for --build-arg ACCELERATOR=...: its stages followed
    from `FROM deps-${ACCELERATOR} AS runner` down, ENV values carried from a stage to those built FROM it, and
    the USER instruction's ${...} filled in from them, as Docker does."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current = None
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            parts = rest.split()
            current = parts[-1] if "AS" in parts else parts[0]
            stages[current] = (parts[0], [])
        elif word in ("ENV", "USER") and current:
            stages[current][1].append((word, rest.strip()))

    def resolve(stage: str) -> tuple[dict[str, str], str | None]:
        parent, steps = stages[stage]
        parent = parent.replace("${ACCELERATOR}", accelerator)
        env, user = resolve(parent) if parent in stages else ({}, None)
        for word, rest in steps:
            if word == "ENV":
                env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
            else:
                user = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], rest)
        return env, user

    return resolve("runner")[1]


def test_the_tpu_image_runs_as_root_and_the_cpu_image_as_uid_1000():
    """Vertex AI runs the image as its own user (ContainerSpec has no user), and libtpu opens the TPU devices."""
    assert dockerfile_user("tpu") == "0:0"
    assert dockerfile_user("cpu") == "1000:1000"


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
    assert answer["state"] == "JOB_STATE_QUEUED"
    assert answer["job"].startswith(f"projects/{PROJECT}/locations/us-central1/customJobs/")


def test_vertex_submit_from_the_command_line_sends_what_the_dry_run_prints(cloud_spec, engine_api):
    pytest.importorskip("google.cloud.aiplatform_v1")
    printed = json.loads(submit(cloud_spec, "--on", "vertex", "--dry-run").stdout)
    env = cli_env(CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM=f"{engine_api.endpoint}/",
                  CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token")
    before = len(engine_api.requests())
    result = submit(cloud_spec, "--on", "vertex", env=env)
    assert result.returncode == 0, result.stderr
    (sent,) = engine_api.requests()[before:]
    assert custom_job_of(sent["body"]) == custom_job_of(printed["customJob"])
    assert last_json(result.stdout)["run_dir"] == "gs://runner-test/runs/mnist_cnn"


def test_the_engines_page_tells_where_to_run_with_one_row_per_target():
    """docs/engines.md's "where to run" table: one row per `--on` target the CLI takes, each saying what you get,
    how it recovers, queues and accounts for cost; README points at it."""
    page = (REPO / "docs" / "engines.md").read_text()
    head = "| where (`--on`) | what you get | recovery | queueing | cost accounting | command |"
    assert head in page
    table = page[page.index(head):].split("\n\n")[0].splitlines()[2:]
    rows = {re.match(r"\| `([a-z-]+)`", row).group(1): [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip("|"))]
            for row in table}
    assert sorted(rows) == sorted(engines.TARGETS)
    assert all(len(cells) == 6 and all(cells) for cells in rows.values()), rows
    readme = (REPO / "README.md").read_text()
    assert "--on skypilot|gke|vertex" in readme and "(docs/engines.md)" in readme
