"""The time limits, the unverified runtime versions and the project on the engines (`runner submit --on skypilot|gke|
vertex`), checked with each engine's own code, offline: SkyPilot's task loader and config constants, the JobSet
schema (tests/data/jobset_v1alpha2.schema.json) and kubernetes-validate for the Job, aiplatform_v1's CustomJob.

The limits reach the container as on a TPU VM (`runner run ... --set train.max_duration=S --set
train.stall_timeout=S`: the job saves and exits 124); GKE's Job and Vertex AI's CustomJob also get their own
deadline at the limit plus the grace period; exit 124 is never restarted, as on a TPU VM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from runner.cloud import engines
from tests.conftest import cli_env
from tests.support.engines import IMAGE, ZONE, submission, submit

pytest_plugins = ["tests.support.cloud_fixtures"]  # cloud_spec

SCHEMA = Path(__file__).parent / "data" / "jobset_v1alpha2.schema.json"
KUBERNETES = "1.33.0"  # as tests/test_engines_gke.py validates the Job
SIX_HOURS, TEN_MINUTES = 6 * 3600, 600


def limits_on_the_run_line(line: str) -> dict[str, str]:
    words = line.split()
    return dict(words[i + 1].split("=", 1) for i, word in enumerate(words) if word == "--set")


def dry(spec: Path, target: str, *extra: str, tpu_type: str = "v5litepod-8") -> str:
    result = submit(spec, "--on", target, "--dry-run", *extra, tpu_type=tpu_type)
    assert result.returncode == 0, result.stderr
    return result.stdout


# --- the limits -------------------------------------------------------------------------------------


def test_skypilot_runs_the_job_with_its_limits_through_skypilots_loader(cloud_spec):
    sky = pytest.importorskip("sky")
    doc = yaml.safe_load(dry(cloud_spec, "skypilot", "--max-run-duration", "6h", "--stall-timeout", "10m"))
    task = sky.Task.from_yaml_config(json.loads(json.dumps(doc)))
    assert limits_on_the_run_line(task.run) == {"train.max_duration": str(SIX_HOURS),
                                                "train.stall_timeout": str(TEN_MINUTES)}
    (resources,) = task.resources
    # 124 ends the job: only 75 relaunches it, and no other failure is retried.
    assert doc["resources"]["job_recovery"] == {"max_restarts_on_errors": 0, "recover_on_exit_codes": [75]}
    assert resources.use_spot is False


def test_gke_sets_the_jobs_deadline_at_the_limit_plus_grace_and_ends_the_jobset_there(cloud_spec):
    jsonschema = pytest.importorskip("jsonschema")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    manifest = yaml.safe_load(dry(cloud_spec, "gke", "--max-run-duration", "6h", "--stall-timeout", "10m"))
    jsonschema.validate(manifest, json.loads(SCHEMA.read_text()))
    (replicated,) = manifest["spec"]["replicatedJobs"]
    job_spec = replicated["template"]["spec"]
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "slice-job"},
                                  "spec": job_spec}, KUBERNETES, strict=True)
    assert job_spec["activeDeadlineSeconds"] == SIX_HOURS + engines.LIMIT_GRACE_S
    (container,) = job_spec["template"]["spec"]["containers"]
    assert limits_on_the_run_line(container["command"][-1]) == {"train.max_duration": str(SIX_HOURS),
                                                               "train.stall_timeout": str(TEN_MINUTES)}
    # A Job failed by its deadline (reason DeadlineExceeded) or by exit 124 (the pod failure policy's FailJob:
    # reason PodFailurePolicy) fails the JobSet: no restart starts the clock again.
    ends = {reason for rule in manifest["spec"]["failurePolicy"]["rules"] if rule["action"] == "FailJobSet"
            for reason in rule["onJobFailureReasons"]}
    assert ends == {"DeadlineExceeded", "PodFailurePolicy"}
    restart_codes = job_spec["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"]
    assert 124 not in restart_codes and job_spec["podFailurePolicy"]["rules"][1]["action"] == "FailJob"


def test_the_xpk_line_carries_the_limits_in_its_command(cloud_spec):
    line = dry(cloud_spec, "gke", "--format", "xpk", "--cluster", "c", "--max-run-duration", "6h",
               tpu_type="v6e-4").strip()
    assert f"train.max_duration={SIX_HOURS}" in line and "--restart-on-exit-codes 3,75 " in line


def test_vertex_sets_its_job_timeout_at_the_limit_plus_grace(cloud_spec):
    aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
    from google.protobuf import json_format

    doc = json.loads(dry(cloud_spec, "vertex", "--max-run-duration", "6h", "--stall-timeout", "10m"))
    request = aiplatform_v1.CreateCustomJobRequest.pb(aiplatform_v1.CreateCustomJobRequest())
    json_format.ParseDict(doc, request)
    scheduling = request.custom_job.job_spec.scheduling
    assert scheduling.timeout.ToSeconds() == SIX_HOURS + engines.LIMIT_GRACE_S
    (pool,) = request.custom_job.job_spec.worker_pool_specs
    assert limits_on_the_run_line(pool.container_spec.args[0]) == {"train.max_duration": str(SIX_HOURS),
                                                                   "train.stall_timeout": str(TEN_MINUTES)}


def test_no_limit_leaves_every_deadline_out(cloud_spec):
    flags = ("--max-run-duration", "none", "--stall-timeout", "none")
    (replicated,) = yaml.safe_load(dry(cloud_spec, "gke", *flags))["spec"]["replicatedJobs"]
    assert "activeDeadlineSeconds" not in replicated["template"]["spec"]
    vertex_job = json.loads(dry(cloud_spec, "vertex", *flags))["customJob"]
    assert "timeout" not in vertex_job["jobSpec"]["scheduling"]  # Vertex's own default: 7 days
    assert vertex_job["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["args"] == [engines.COMMAND]
    assert yaml.safe_load(dry(cloud_spec, "skypilot", *flags))["run"].strip() == engines.COMMAND


def test_the_default_limits_are_the_tpu_vms(cloud_spec):
    sub = submission(cloud_spec)
    assert (sub.max_run_s, sub.stall_timeout_s) == (24 * 3600, 30 * 60)
    assert limits_on_the_run_line(engines.command(sub)) == {"train.max_duration": "86400",
                                                            "train.stall_timeout": "1800"}


# --- unverified types ---------------------------------------------------------------------------------


def test_skypilot_creates_a_tpu_vm_on_an_unverified_runtime_only_when_allowed(cloud_spec):
    # Refused before SkyPilot is called (an API server would be needed to get further).
    tf_runtime = ("--runtime-version", "tpu-vm-tf-2.18.0-pjrt")
    refused = submit(cloud_spec, "--on", "skypilot", *tf_runtime, tpu_type="v6e-8")
    assert refused.returncode == 2 and "is unverified" in refused.stderr and "--allow-unverified" in refused.stderr
    assert refused.stdout == ""
    shown = submit(cloud_spec, "--on", "skypilot", "--dry-run", *tf_runtime, tpu_type="v6e-8")
    assert shown.returncode == 0 and "without --dry-run, submit refuses it unless --allow-unverified" in shown.stderr
    allowed = yaml.safe_load(dry(cloud_spec, "skypilot", "--allow-unverified", *tf_runtime, tpu_type="v6e-8"))
    assert allowed["resources"]["accelerator_args"]["runtime_version"] == "tpu-vm-tf-2.18.0-pjrt"
    named = yaml.safe_load(dry(cloud_spec, "skypilot", tpu_type="v6e-8"))
    assert named["resources"]["accelerator_args"]["runtime_version"] == "v2-alpha-tpuv6e"


@pytest.mark.parametrize("target", ["gke", "vertex"])
def test_engines_that_choose_the_hosts_software_take_no_allow_unverified(cloud_spec, target):
    """GKE and Vertex AI pick the host's software: there is no runtime version to judge, and the flag that
    allows an unverified one is refused there rather than dropped."""
    shown = submit(cloud_spec, "--on", target, "--dry-run")
    assert shown.returncode == 0 and shown.stdout, shown.stderr
    assert "unverified" not in shown.stderr and "price: v5litepod-8 = 8 chips" in shown.stderr
    refused = submit(cloud_spec, "--on", target, "--dry-run", "--allow-unverified")
    assert refused.returncode == 2
    assert f"--allow-unverified does not apply to --on {target}" in " ".join(refused.stderr.split())


def test_gke_runs_v5p_and_v6e_with_nothing_unverified(cloud_spec):
    for tpu_type in ("v5p-8", "v6e-8"):
        shown = submit(cloud_spec, "--on", "gke", "--dry-run", tpu_type=tpu_type)
        assert shown.returncode == 0, shown.stderr
        assert "unverified" not in shown.stderr and f"price: {tpu_type} = " in shown.stderr


# --- SkyPilot and the project -----------------------------------------------------------------------


def test_skypilot_refuses_project_and_says_how_it_picks_one(cloud_spec):
    result = submit(cloud_spec, "--on", "skypilot", "--project", "other-project", "--dry-run", project=None)
    assert result.returncode == 2
    said = " ".join(result.stderr.split())
    assert "--project does not apply to --on skypilot" in said
    assert "gcp.project_id" in said and "gcloud config set project other-project" in said  # the project given
    assert result.stdout == ""


def test_skypilot_takes_the_project_from_the_environment_without_complaint(cloud_spec):
    """GOOGLE_CLOUD_PROJECT fills --project for the other targets; it is no reason to refuse SkyPilot."""
    env = cli_env(GOOGLE_CLOUD_PROJECT="from-env")
    result = submit(cloud_spec, "--on", "skypilot", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["resources"]["infra"] == f"gcp/us-central1/{ZONE}"
    bare = submit(cloud_spec, "--on", "skypilot", "--dry-run",
                  env={k: v for k, v in cli_env(CLOUDSDK_CONFIG="/nonexistent").items()
                       if k not in ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT")})
    assert bare.returncode == 0, bare.stderr  # no project anywhere: SkyPilot's server has its own


def test_skypilots_own_code_gives_a_task_no_way_to_name_a_project():
    """Why --project is refused: a task's `config:` may override only OVERRIDEABLE_CONFIG_KEYS_IN_TASK, and the
    project is read from the workspace's gcp.project_id (sky/clouds/gcp.py GCP.get_project_id)."""
    sky = pytest.importorskip("sky")
    from sky import exceptions
    from sky.skylet import constants

    assert ("gcp", "project_id") not in constants.OVERRIDEABLE_CONFIG_KEYS_IN_TASK
    assert not any(key[0] == "workspaces" for key in constants.OVERRIDEABLE_CONFIG_KEYS_IN_TASK)
    with pytest.raises(exceptions.InvalidSkyPilotConfigError, match="project_id"):
        sky.Task.from_yaml_config({"name": "x", "run": "true", "config": {"gcp": {"project_id": "p"}}})


def test_the_image_and_limits_travel_together_in_one_submission(cloud_spec):
    """The helper's own image is the one every engine is given (a guard for the tests above)."""
    assert submission(cloud_spec).image == IMAGE
