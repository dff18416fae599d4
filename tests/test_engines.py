"""`runner submit --on skypilot|gke|vertex`, each checked by the engine's own code, offline:

* SkyPilot: its task loader (`sky.Task.from_yaml_config`, which validates against SkyPilot's schema) reads
  the printed task; the job_recovery keys are ones SkyPilot's schema declares.
* GKE: the JobSet reads back unchanged through JobSet's own v1alpha2 types (kubeflow-trainer-api, pinned:
  every field at every level declared, strictly typed); it validates against
  tests/data/jobset_v1alpha2.schema.json (a hand-written subset of the JobSet CRD's v1alpha2 schema for what
  the types do not say: enums, required keys and the JobSet webhook's checks; its x-source names the CRD
  file, commit and release), which refuses unknown fields at every level, and its Job
  template against kubernetes-validate (Kubernetes 1.33, strict); xpk's own parser takes the
  printed `xpk workload create` line and xpk's own --dry-run makes the same JobSet from it; the kubernetes
  client sends the manifest to a local fake API server.
* Vertex AI: the printed request parses strictly into aiplatform_v1's proto, and the real JobServiceClient
  sends it to a local fake that records it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.cloud import engines, tpu_types
from runner.cloud.engines import gke, vertex
from runner.cloud.submit import prepare_submission
from runner.errors import SpecError
from runner.specfile import load_spec
from tests.conftest import REPO, cli_env, last_json, run_cli
from tests.support.engine_fake import EngineFake, start_engine_fake

pytest_plugins = ["tests.support.cloud_fixtures"]  # cloud_spec

PROJECT, ZONE = "runner-test", "us-central1-a"
IMAGE = "us-central1-docker.pkg.dev/runner-test/runner/runner:tpu"
KUBERNETES = "1.33.0"  # the Kubernetes version the Job template is validated for (GKE's regular channel, 2026)
XPK = REPO / ".venv-xpk" / "bin" / "python"
SCHEMA = Path(__file__).parent / "data" / "jobset_v1alpha2.schema.json"


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> Iterator[EngineFake]:
    with start_engine_fake(tmp_path_factory.mktemp("engines")) as server:
        yield server


def submit(spec: Path, *extra: str, tpu_type: str = "v5litepod-8", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_cli("submit", spec, "--tpu-type", tpu_type, "--zone", ZONE, "--image", IMAGE, "--project", PROJECT,
                   *extra, env=env, timeout=120)


def submission(spec: Path, tpu_type: str = "v5litepod-8", **flags: Any):
    return prepare_submission(spec, [], tpu_type=tpu_type, zone=ZONE, image=IMAGE, project=PROJECT, **flags)


def missing(what: str, made_from: str) -> None:
    """An engine's library `make test` installs is not here: a failure in CI, a skip on a developer's machine."""
    message = f"{what} is missing: `make test` installs it from {made_from}"
    pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)


def needs_xpk() -> None:
    if not XPK.exists():
        missing(str(XPK), "requirements-xpk.txt")


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


# --- GKE ---------------------------------------------------------------------------------------------


def gke_manifest(spec: Path, *extra: str, tpu_type: str = "v5litepod-8") -> dict[str, Any]:
    result = submit(spec, "--on", "gke", "--dry-run", *extra, tpu_type=tpu_type)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_jobset_validates_against_the_crd_fields_and_its_job_against_kubernetes(cloud_spec):
    jsonschema = pytest.importorskip("jsonschema")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

    manifest = gke_manifest(cloud_spec, "--queue", "team-a", "--spot", "--max-restarts", "4")
    jsonschema.validate(manifest, json.loads(SCHEMA.read_text()))
    (replicated,) = manifest["spec"]["replicatedJobs"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "slice-job"}, "spec": replicated["template"]["spec"]}
    kubernetes_validate.validate(job, KUBERNETES, strict=True)

    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 4
    assert manifest["spec"]["failurePolicy"]["rules"][0] == {
        "name": "FailOnNonRetryableExit", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    assert replicated["replicas"] == 1
    job_spec = replicated["template"]["spec"]
    assert (job_spec["parallelism"], job_spec["completions"], job_spec["backoffLimit"]) == (1, 1, 0)
    (rule,) = job_spec["podFailurePolicy"]["rules"]
    codes = rule["onExitCodes"]
    assert (rule["action"], codes["operator"], codes["containerName"]) == ("FailJob", "NotIn", "runner")
    assert {3, 75} <= set(codes["values"]) and not {1, 2} & set(codes["values"])  # 1, 2 fail; 3, 75 restart
    pod = job_spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "2x4", "cloud.google.com/gke-spot": "true"}
    (container,) = pod["containers"]
    assert container["resources"] == {"limits": {"google.com/tpu": 8}, "requests": {"google.com/tpu": 8}}
    assert container["image"] == IMAGE and container["command"] == ["bash", "-c", engines.COMMAND]


def test_jobset_refuses_what_the_crd_would_drop(cloud_spec):
    """The schema is strict where the API server would prune a field in silence."""
    jsonschema = pytest.importorskip("jsonschema")
    manifest = gke_manifest(cloud_spec)
    manifest["spec"]["failurePolicy"]["maxRestart"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxRestart"):
        jsonschema.validate(manifest, json.loads(SCHEMA.read_text()))



def jobset_types() -> Any:
    """JobSet's own v1alpha2 types (JobSet's Go API, generated into Kubeflow Trainer's published models)."""
    try:
        from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
    except ImportError:
        missing("kubeflow-trainer-api", "requirements-engines-nodeps.txt")
    return JobsetV1alpha2JobSet


def lost_on_read_back(made: Any, read: Any, path: str = "") -> list[str]:
    """The paths of `made` that do not come back in `read`: fields the types do not have are dropped."""
    if isinstance(made, dict) and isinstance(read, dict):
        return [lost for key, value in made.items()
                for lost in (lost_on_read_back(value, read[key], f"{path}.{key}".lstrip(".")) if key in read
                             else [f"{path}.{key}".lstrip(".")])]
    if isinstance(made, list) and isinstance(read, list) and len(made) == len(read):
        return [lost for a, b in zip(made, read) for lost in lost_on_read_back(a, b, f"{path}[]")]
    return [] if made == read else [path]


def test_jobset_reads_back_unchanged_through_jobsets_own_types(cloud_spec):
    """Every field at every level, the Job and pod template included, is one JobSet's API declares, with its
    type (strict: a count given as text is refused); a field it does not declare would be dropped on read, as
    the API server prunes it."""
    types = jobset_types()
    for extra in ([], ["--queue", "team-a", "--spot", "--max-restarts", "4"]):
        manifest = gke_manifest(cloud_spec, *extra)
        assert lost_on_read_back(manifest, types.from_dict(manifest).to_dict()) == []

    manifest = gke_manifest(cloud_spec)
    manifest["spec"]["failurePolicy"]["maxRestart"] = 3
    manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"port": 1}]
    assert lost_on_read_back(manifest, types.from_dict(manifest).to_dict()) == [
        "spec.failurePolicy.maxRestart", "spec.replicatedJobs[].template.spec.template.spec.containers[].ports[].port"]
    manifest = gke_manifest(cloud_spec)
    manifest["spec"]["failurePolicy"]["maxRestarts"] = "3"
    with pytest.raises(ValueError, match="maxRestarts"):
        types.from_dict(manifest)


# What the JobSet CRD (and, where the CRD leaves it open, the JobSet webhook) takes on the paths the manifest
# uses, entered a second time here so that an edit of the schema file alone shows up.
CRD_RULE_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
WEBHOOK_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                           "PodFailurePolicy"}
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def jobset_schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


def schema_at(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = root["$defs"][node["$ref"].removeprefix("#/$defs/")]
    return node


def walk(value: Any, node: dict[str, Any], root: dict[str, Any], path: str = "") -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """Every value of the manifest with the schema that applies to it, by path (a.b[].c)."""
    node = schema_at(node, root)
    yield path, value, node
    if isinstance(value, dict):
        for key, item in value.items():
            child = node["properties"][key] if "properties" in node else node["additionalProperties"]
            yield from walk(item, child, root, f"{path}.{key}".lstrip("."))
    elif isinstance(value, list):
        for item in value:
            yield from walk(item, node["items"], root, f"{path}[]")


def test_jobset_schema_names_the_crd_it_was_written_from_and_is_not_a_copy():
    schema = jobset_schema()
    source = schema["x-source"]
    assert source["repository"] == "https://github.com/kubernetes-sigs/jobset"
    assert source["path"] == "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert "v0.9.0" in source["release"] and "hand-written subset" in source["kind"]
    # Written by hand for the manifest's paths: none of the CRD's wrapping, descriptions or extensions, and a
    # small fraction of its size (the CRD file is about 750,000 characters).
    text = SCHEMA.read_text()
    assert len(text) < 20_000
    for marker in ("openAPIV3Schema:", '"description"', "x-kubernetes-", "CustomResourceDefinition"):
        assert marker not in text, marker


def test_every_field_the_jobset_sets_is_declared_and_every_object_is_closed(cloud_spec):
    """The likeliest drift: gke.py sets a field, or a value, the schema (and so the CRD) was never checked for;
    or the schema stops refusing unknown keys."""
    schema = jobset_schema()
    manifest = gke_manifest(cloud_spec, "--queue", "team-a", "--spot")
    checked_enums = {}
    for path, value, node in walk(manifest, schema, schema):
        if isinstance(value, dict) and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or 'the JobSet'}: the schema must refuse unknown keys"
            assert set(value) <= set(node["properties"]), path
        elif isinstance(value, dict):  # a map: labels, annotations, nodeSelector, resource quantities
            assert isinstance(node["additionalProperties"], dict) and "properties" not in node, path
        if "enum" in node:
            assert value in node["enum"], (path, value)
            checked_enums[path] = set(node["enum"])
    assert checked_enums["spec.failurePolicy.rules[].action"] == CRD_RULE_ACTIONS
    assert checked_enums["spec.failurePolicy.rules[].onJobFailureReasons[]"] == WEBHOOK_FAILURE_REASONS
    assert {"spec.replicatedJobs[].template.spec.podFailurePolicy.rules[].action",
            "spec.replicatedJobs[].template.spec.podFailurePolicy.rules[].onExitCodes.operator"} <= set(checked_enums)
    (replicated,) = manifest["spec"]["replicatedJobs"]
    (rule,) = replicated["template"]["spec"]["podFailurePolicy"]["rules"]
    values = rule["onExitCodes"]["values"]
    assert values == sorted(set(values)) and 0 not in values and len(values) <= 255  # batch/v1's rules for the list


def test_jobset_schema_refuses_what_the_crd_or_the_jobset_webhook_would_not_take(cloud_spec):
    """Fields the CRD does not have (the API server would drop them without a word) and values the CRD or the
    JobSet webhook refuses, each at its own level of the manifest."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = jobset_schema()
    made = gke_manifest(cloud_spec)
    jsonschema.validate(made, schema)

    def spec(m):
        return m["spec"]

    def job(m):
        return m["spec"]["replicatedJobs"][0]

    def pod(m):
        return job(m)["template"]["spec"]["template"]["spec"]

    changes = {
        "replicaCount": lambda m: job(m).update(replicaCount=1),
        "completionsPerIndex": lambda m: job(m)["template"]["spec"].update(completionsPerIndex=1),
        "onExitCode": lambda m: job(m)["template"]["spec"]["podFailurePolicy"]["rules"][0].update(onExitCode={}),
        "nodeSelectors": lambda m: pod(m).update(nodeSelectors={}),
        "runAsRoot": lambda m: pod(m)["containers"][0]["securityContext"].update(runAsRoot=True),
        "generateName": lambda m: job(m)["template"]["spec"]["template"]["metadata"].update(generateName="x-"),
        # Job-level words in the JobSet's own failure policy: the CRD and the webhook refuse them.
        "'FailJob' is not one of": lambda m: spec(m)["failurePolicy"]["rules"][0].update(action="FailJob"),
        "'Evicted' is not one of": lambda m: spec(m)["failurePolicy"]["rules"][0].update(onJobFailureReasons=["Evicted"]),
        "'fail-on-exit' does not match": lambda m: spec(m)["failurePolicy"]["rules"][0].update(name="fail-on-exit"),
        "'1-mnist' does not match": lambda m: m["metadata"].update(name="1-mnist"),
    }
    for says, change in changes.items():
        manifest = json.loads(json.dumps(made))
        change(manifest)
        with pytest.raises(jsonschema.ValidationError) as refused:
            jsonschema.validate(manifest, schema)
        assert says in refused.value.message, (says, refused.value.message)


def test_the_longest_gke_name_makes_pod_names_the_jobset_webhook_takes(cloud_spec):
    """The webhook refuses a JobSet whose longest pod name (NAME-JOB-JOBINDEX-PODINDEX-xxxxx) is not a DNS-1035
    label of at most 63 characters."""
    jsonschema = pytest.importorskip("jsonschema")
    manifest = gke_manifest(cloud_spec, "--name", "a" * gke.NAME_LIMIT)
    jsonschema.validate(manifest, jobset_schema())
    (replicated,) = manifest["spec"]["replicatedJobs"]
    job_spec = replicated["template"]["spec"]
    pod_name = (f"{manifest['metadata']['name']}-{replicated['name']}-{replicated['replicas'] - 1}-"
                f"{job_spec['completions'] - 1}-abcde")
    assert len(pod_name) <= 63 and DNS_1035_LABEL.fullmatch(pod_name), pod_name


def xpk_run(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd), "TELEMETRY_ENABLED": "false"}
    return subprocess.run([str(XPK), "-c", code, *args], capture_output=True, text=True, timeout=180, env=env, cwd=cwd,
                          check=False)


_PARSE = """
import argparse, json, shlex, sys
from xpk.parser.core import set_parser
parser = argparse.ArgumentParser(prog="xpk"); set_parser(parser)
words = shlex.split(sys.argv[1])
args = parser.parse_args(words[1:])
print(json.dumps({k: v for k, v in vars(args).items() if isinstance(v, (str, int, list, type(None), bool))}))
"""


def test_xpk_parses_the_command_and_makes_the_same_jobset_from_it(cloud_spec, tmp_path):
    needs_xpk()
    result = submit(cloud_spec, "--on", "gke", "--format", "xpk", "--cluster", "tpu-cluster", "--max-restarts", "2",
                    tpu_type="v6e-4")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    parsed = xpk_run(_PARSE, line, cwd=tmp_path)
    assert parsed.returncode == 0, parsed.stderr
    args = json.loads(parsed.stdout)
    assert (args["tpu_type"], args["docker_image"], args["max_restarts"]) == ("v6e-4", IMAGE, "2")  # xpk keeps it a string
    assert args["restart_on_exit_codes"] == "3,75" and args["command"] == engines.COMMAND

    # xpk's own dry run writes the manifest it would apply; ours must agree wherever both speak.
    out = tmp_path / "xpk.yaml"
    words = [*shlex.split(line)[1:], "--dry-run", "--skip-validation", "--quiet", "--output-manifest-file", str(out)]
    made = subprocess.run([str(XPK.parent / "xpk"), *words], capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TELEMETRY_ENABLED": "false"})
    assert made.returncode == 0, made.stdout + made.stderr
    theirs = yaml.safe_load(out.read_text())
    ours = gke_manifest(cloud_spec, "--max-restarts", "2", tpu_type="v6e-4")
    assert ours["apiVersion"] == theirs["apiVersion"] and ours["kind"] == theirs["kind"]
    assert ours["spec"]["failurePolicy"]["maxRestarts"] == theirs["spec"]["failurePolicy"]["maxRestarts"] == 2
    assert [{k: v for k, v in r.items() if k != "name"} for r in ours["spec"]["failurePolicy"]["rules"]] == \
        theirs["spec"]["failurePolicy"]["rules"]
    (our_job,), (their_job,) = ours["spec"]["replicatedJobs"], theirs["spec"]["replicatedJobs"]
    assert {k: our_job[k] for k in ("name", "replicas")} == {k: their_job[k] for k in ("name", "replicas")}
    our_spec, their_spec = our_job["template"]["spec"], their_job["template"]["spec"]
    for key in ("parallelism", "completions", "backoffLimit", "podFailurePolicy"):
        assert our_spec[key] == their_spec[key], key
    our_pod, their_pod = our_spec["template"]["spec"], their_spec["template"]["spec"]
    assert our_pod["nodeSelector"] == {k: v for k, v in their_pod["nodeSelector"].items() if v is not None}
    for key in ("restartPolicy", "hostNetwork", "dnsPolicy", "tolerations"):
        assert our_pod[key] == their_pod[key], key
    (our_box,), (their_box,) = our_pod["containers"], their_pod["containers"]
    for key in ("name", "image", "env"):
        assert our_box[key] == their_box[key], key
    assert our_box["resources"]["limits"] == their_box["resources"]["limits"] == {"google.com/tpu": 4}
    assert engines.COMMAND in their_box["command"][-1]


def test_single_host_table_agrees_with_xpks_catalog(tmp_path):
    needs_xpk()
    code = ("import json; from xpk.core.system_characteristics import UserFacingNameToSystemCharacteristics as U; "
            "print(json.dumps({k: [s.gke_accelerator, s.topology, s.chips_per_vm, s.vms_per_slice] "
            "for k, s in U.items()}))")
    done = xpk_run(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    catalog = json.loads(done.stdout)
    for name, host in gke.HOSTS.items():
        if host.xpk_hosts == 0:
            assert name not in catalog
        elif host.xpk_hosts == 1:
            assert catalog[name] == [host.accelerator, host.topology, host.chips, 1], name
        else:  # xpk runs the type on several smaller hosts of the same accelerator and topology
            accelerator, topology, chips, hosts = catalog[name]
            assert (accelerator, topology, chips * hosts, hosts) == (host.accelerator, host.topology, host.chips,
                                                                     host.xpk_hosts), name


def test_xpk_format_refuses_a_type_xpk_runs_on_two_hosts(cloud_spec):
    result = submit(cloud_spec, "--on", "gke", "--format", "xpk", "--cluster", "c", tpu_type="v5litepod-8")
    assert result.returncode == 2
    assert "v5litepod-8 is 2 hosts of 4 chips in xpk's catalog" in result.stderr
    assert result.stdout == ""


def test_gke_submit_sends_the_manifest_with_the_kubernetes_client(cloud_spec, fake, tmp_path):
    pytest.importorskip("kubernetes")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake.endpoint}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
    }))
    env = cli_env(KUBECONFIG=str(kubeconfig))
    result = submit(cloud_spec, "--on", "gke", "--namespace", "ml", "--queue", "team-a", env=env)
    assert result.returncode == 0, result.stderr
    answer = last_json(result.stdout)
    assert (answer["on"], answer["name"], answer["namespace"]) == ("gke", "mnist-cnn", "ml") and answer["uid"]
    posts = [r for r in fake.requests() if r["path"] == "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets"]
    assert len(posts) == 1
    assert posts[0]["body"] == gke_manifest(cloud_spec, "--namespace", "ml", "--queue", "team-a")

    again = submit(cloud_spec, "--on", "gke", "--namespace", "ml", "--queue", "team-a", env=env)
    assert again.returncode == 2
    assert "a JobSet 'mnist-cnn' already exists in namespace 'ml'" in again.stderr


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


def test_vertex_client_sends_the_custom_job_to_the_api(cloud_spec, fake):
    """The real JobServiceClient (REST, anonymous credentials) against the local fake."""
    aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials

    sub = submission(cloud_spec, spot=True)
    client = aiplatform_v1.JobServiceClient(credentials=AnonymousCredentials(), transport="rest",
                                            client_options=ClientOptions(api_endpoint=fake.endpoint))
    before = len(fake.requests())
    answer = vertex.create(sub, client=client)
    (sent,) = fake.requests()[before:]
    assert (sent["method"], sent["path"]) == ("POST", f"/v1/projects/{PROJECT}/locations/us-central1/customJobs")
    assert custom_job_of(sent["body"]) == vertex.build_job(sub)._pb
    assert answer["state"] == "JOB_STATE_QUEUED" and answer["job"].startswith(f"projects/{PROJECT}/locations/us-central1/customJobs/")


def test_vertex_submit_from_the_command_line_sends_what_the_dry_run_prints(cloud_spec, fake):
    pytest.importorskip("google.cloud.aiplatform_v1")
    printed = json.loads(submit(cloud_spec, "--on", "vertex", "--dry-run").stdout)
    env = cli_env(CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM=f"{fake.endpoint}/", CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token")
    before = len(fake.requests())
    result = submit(cloud_spec, "--on", "vertex", env=env)
    assert result.returncode == 0, result.stderr
    (sent,) = fake.requests()[before:]
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
