"""`runner submit --on gke`, checked by JobSet's, Kubernetes's and xpk's own code, offline:

the JobSet reads back unchanged through JobSet's own v1alpha2 types (kubeflow-trainer-api, pinned: every field
at every level declared, strictly typed); it validates against tests/data/jobset_v1alpha2.schema.json (a
hand-written subset of the JobSet CRD's v1alpha2 schema for what the types do not say: enums, required keys
and the JobSet webhook's checks; its x-source names the CRD file, commit and release), which refuses unknown
fields at every level, and its Job template against kubernetes-validate (Kubernetes 1.33, strict); xpk's own
parser takes the printed `xpk workload create` line and xpk's own --dry-run makes the same JobSet from it; the
kubernetes client sends the manifest to a local fake API server.
"""

from __future__ import annotations

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

from runner.cloud import engines
from runner.cloud.engines import gke
from runner.device import tpus
from tests.conftest import REPO, cli_env, last_json
from tests.support.engine_fake import start_engine_fake
from tests.support.engines import IMAGE, missing, submission, submit

pytest_plugins = ["tests.support.cloud_fixtures"]  # cloud_spec, engine_api

KUBERNETES = "1.33.0"  # the Kubernetes version the Job template is validated for (GKE's regular channel, 2026)
XPK = REPO / ".venv-xpk" / "bin" / "python"
SCHEMA = Path(__file__).parent / "data" / "jobset_v1alpha2.schema.json"


def needs_xpk() -> None:
    if not XPK.exists():
        missing(str(XPK), "requirements-xpk.txt")


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
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "slice-job"},
           "spec": replicated["template"]["spec"]}
    kubernetes_validate.validate(job, KUBERNETES, strict=True)

    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 4
    assert manifest["spec"]["failurePolicy"]["rules"] == [
        {"name": "FailOnNonRetryableExit", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "FailAtTimeLimit", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]}]
    assert replicated["replicas"] == 1
    job_spec = replicated["template"]["spec"]
    assert (job_spec["parallelism"], job_spec["completions"], job_spec["backoffLimit"]) == (1, 1, 0)
    disrupted, failed = job_spec["podFailurePolicy"]["rules"]
    assert disrupted == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    codes = failed["onExitCodes"]
    assert (failed["action"], codes["operator"], codes["containerName"]) == ("FailJob", "NotIn", "runner")
    assert {3, 75} <= set(codes["values"]) and not {1, 2, 124} & set(codes["values"])  # 1, 2, 124 fail the Job
    assert job_spec["activeDeadlineSeconds"] == 24 * 3600 + engines.LIMIT_GRACE_S  # the default limit + grace
    pod = job_spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "2x4",
                                   "node.kubernetes.io/instance-type": "ct5lp-hightpu-8t",
                                   "cloud.google.com/gke-spot": "true"}
    (container,) = pod["containers"]
    assert container["resources"] == {"limits": {"google.com/tpu": 8}, "requests": {"google.com/tpu": 8}}
    assert container["image"] == IMAGE and container["command"] == ["bash", "-c", engines.command(submission(
        cloud_spec, spot=True))]


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
        return [lost for a, b in zip(made, read, strict=True) for lost in lost_on_read_back(a, b, f"{path}[]")]
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
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["ports"] = [{"port": 1}]
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


def walk(value: Any, node: dict[str, Any], root: dict[str, Any],
         path: str = "") -> Iterator[tuple[str, Any, dict[str, Any]]]:
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
            assert node.get("additionalProperties") is False, \
                f"{path or 'the JobSet'}: the schema must refuse unknown keys"
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
    _, rule = replicated["template"]["spec"]["podFailurePolicy"]["rules"]
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
        "onExitCode": lambda m: job(m)["template"]["spec"]["podFailurePolicy"]["rules"][1].update(onExitCode={}),
        "nodeSelectors": lambda m: pod(m).update(nodeSelectors={}),
        "runAsRoot": lambda m: pod(m)["containers"][0]["securityContext"].update(runAsRoot=True),
        "generateName": lambda m: job(m)["template"]["spec"]["template"]["metadata"].update(generateName="x-"),
        # Job-level words in the JobSet's own failure policy: the CRD and the webhook refuse them.
        "'FailJob' is not one of": lambda m: spec(m)["failurePolicy"]["rules"][0].update(action="FailJob"),
        "'Evicted' is not one of":
            lambda m: spec(m)["failurePolicy"]["rules"][0].update(onJobFailureReasons=["Evicted"]),
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
    # xpk keeps --max-restarts a string
    assert (args["tpu_type"], args["docker_image"], args["max_restarts"]) == ("v6e-4", IMAGE, "2")
    assert args["restart_on_exit_codes"] == "3,75"
    assert args["command"] == engines.command(submission(cloud_spec, tpu_type="v6e-4"))

    # xpk's own dry run writes the manifest it would apply; ours must agree wherever both speak.
    out = tmp_path / "xpk.yaml"
    words = [*shlex.split(line)[1:], "--dry-run", "--skip-validation", "--quiet", "--output-manifest-file", str(out)]
    made = subprocess.run([str(XPK.parent / "xpk"), *words], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, check=False,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TELEMETRY_ENABLED": "false"})
    assert made.returncode == 0, made.stdout + made.stderr
    theirs = yaml.safe_load(out.read_text())
    ours = gke_manifest(cloud_spec, "--max-restarts", "2", tpu_type="v6e-4")
    assert ours["apiVersion"] == theirs["apiVersion"] and ours["kind"] == theirs["kind"]
    assert ours["spec"]["failurePolicy"]["maxRestarts"] == theirs["spec"]["failurePolicy"]["maxRestarts"] == 2
    # Ours adds one rule after xpk's: the Job's deadline (activeDeadlineSeconds, which xpk does not set) ends it.
    *shared, deadline = ours["spec"]["failurePolicy"]["rules"]
    assert [{k: v for k, v in r.items() if k != "name"} for r in shared] == theirs["spec"]["failurePolicy"]["rules"]
    assert deadline["onJobFailureReasons"] == ["DeadlineExceeded"] and "activeDeadlineSeconds" not in \
        their_job_spec(theirs)
    (our_job,), (their_job,) = ours["spec"]["replicatedJobs"], theirs["spec"]["replicatedJobs"]
    assert {k: our_job[k] for k in ("name", "replicas")} == {k: their_job[k] for k in ("name", "replicas")}
    our_spec, their_spec = our_job["template"]["spec"], their_job["template"]["spec"]
    for key in ("parallelism", "completions", "backoffLimit"):
        assert our_spec[key] == their_spec[key], key
    # Ours adds one rule before xpk's: a disrupted pod (preempted, drained) is replaced, not counted.
    ignore, *xpk_rules = our_spec["podFailurePolicy"]["rules"]
    assert ignore["action"] == "Ignore" and xpk_rules == their_spec["podFailurePolicy"]["rules"]
    our_pod, their_pod = our_spec["template"]["spec"], their_spec["template"]["spec"]
    # Ours also names the machine type (one host of all the chips); the rest of the selector is xpk's.
    assert {k: v for k, v in our_pod["nodeSelector"].items() if k != gke.INSTANCE_TYPE} == \
        {k: v for k, v in their_pod["nodeSelector"].items() if v is not None}
    for key in ("restartPolicy", "hostNetwork", "dnsPolicy", "tolerations"):
        assert our_pod[key] == their_pod[key], key
    (our_box,), (their_box,) = our_pod["containers"], their_pod["containers"]
    for key in ("name", "image", "env"):
        assert our_box[key] == their_box[key], key
    assert our_box["resources"]["limits"] == their_box["resources"]["limits"] == {"google.com/tpu": 4}
    assert engines.command(submission(cloud_spec, tpu_type="v6e-4")) in their_box["command"][-1]


def their_job_spec(jobset: dict[str, Any]) -> dict[str, Any]:
    (replicated,) = jobset["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]


def test_the_gke_host_table_agrees_with_xpks_catalog(tmp_path):
    needs_xpk()
    code = ("import json; from xpk.core.system_characteristics import UserFacingNameToSystemCharacteristics as U; "
            "print(json.dumps({k: [s.gke_accelerator, s.topology, s.chips_per_vm, s.vms_per_slice] "
            "for k, s in U.items()}))")
    done = xpk_run(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    catalog = json.loads(done.stdout)
    for name, host in gke.HOSTS.items():
        hosts = tpus.parse_tpu_type(name).hosts
        if host.xpk_hosts == 0:
            assert name not in catalog
        elif host.xpk_hosts == hosts:  # xpk runs it as the runner does: one host, or the slice's hosts
            assert catalog[name] == [host.accelerator, host.topology, host.chips, hosts], name
        else:  # xpk runs the type on several smaller hosts of the same accelerator and topology
            accelerator, topology, chips, xpk_hosts = catalog[name]
            assert (accelerator, topology, chips * xpk_hosts, xpk_hosts) == (host.accelerator, host.topology,
                                                                             host.chips, host.xpk_hosts), name


def test_xpk_runs_one_container_per_tpu7x_host_whatever_its_default(cloud_spec, tmp_path):
    """xpk runs two containers of half the chips on a tpu7x-standard-4t host when --use-parallel-containers is on
    (xpk 1.9.0-1.13.1's default); the printed line turns it off, so each host runs one `runner run`. xpk's own dry
    run is asked with the flag on before the printed words (argparse: the last one wins)."""
    needs_xpk()
    result = submit(cloud_spec, "--on", "gke", "--format", "xpk", "--cluster", "tpu-cluster", "--zone",
                    "us-central1-c", tpu_type="tpu7x-8")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip())
    assert "--no-use-parallel-containers" in words
    catalog = xpk_run("import json; from xpk.core.system_characteristics import UserFacingNameToSystemCharacteristics "
                      "as U; print(json.dumps(sorted({s.gke_accelerator + ' ' + s.gce_machine_type for s in U.values() "
                      "if s.parallel_containers > 1})))", cwd=tmp_path)
    assert catalog.returncode == 0, catalog.stderr
    assert {line.split()[1] for line in json.loads(catalog.stdout)} == gke.XPK_PARALLEL_CONTAINERS
    out = tmp_path / "xpk.yaml"
    made = subprocess.run([str(XPK.parent / "xpk"), *words[1:3], "--use-parallel-containers", *words[3:],
                           "--dry-run", "--skip-validation", "--quiet", "--output-manifest-file", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TELEMETRY_ENABLED": "false"})
    assert made.returncode == 0, made.stdout + made.stderr
    pod = their_job_spec(yaml.safe_load(out.read_text()))["template"]["spec"]
    assert [(box["name"], box["resources"]["limits"]) for box in pod["containers"]] == \
        [("runner", {"google.com/tpu": 4})]
    # The other types' lines are left as they were: xpk runs one container there anyway.
    other = submit(cloud_spec, "--on", "gke", "--format", "xpk", "--cluster", "tpu-cluster", tpu_type="v6e-4")
    assert "--no-use-parallel-containers" not in other.stdout


def test_xpk_format_refuses_a_type_xpk_runs_on_two_hosts(cloud_spec):
    result = submit(cloud_spec, "--on", "gke", "--format", "xpk", "--cluster", "c", tpu_type="v5litepod-8")
    assert result.returncode == 2
    assert "v5litepod-8 is 2 hosts of 4 chips in xpk's catalog" in result.stderr
    assert result.stdout == ""


def test_gke_submit_sends_the_manifest_with_the_kubernetes_client(cloud_spec, engine_api, tmp_path):
    pytest.importorskip("kubernetes")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": engine_api.endpoint}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
    }))
    env = cli_env(KUBECONFIG=str(kubeconfig))
    result = submit(cloud_spec, "--on", "gke", "--namespace", "ml", "--queue", "team-a", env=env)
    assert result.returncode == 0, result.stderr
    answer = last_json(result.stdout)
    assert (answer["on"], answer["name"], answer["namespace"]) == ("gke", "mnist-cnn", "ml") and answer["uid"]
    posts = [r for r in engine_api.requests() if r["path"] == "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets"]
    assert len(posts) == 1
    assert posts[0]["body"] == gke_manifest(cloud_spec, "--namespace", "ml", "--queue", "team-a")

    again = submit(cloud_spec, "--on", "gke", "--namespace", "ml", "--queue", "team-a", env=env)
    assert again.returncode == 2
    assert "a JobSet 'mnist-cnn' already exists in namespace 'ml'" in again.stderr




# --- restarts, single hosts, and the clusters that would refuse the pod ---------------------------------


def outcome(manifest: dict[str, Any], exit_code: int | None, disrupted: bool = False,
            reason: str = "BackoffLimitExceeded") -> str:
    """What the two layers do with one failed pod, read from the manifest by the rules Kubernetes (batch/v1
    podFailurePolicy: the first matching rule wins; no match counts against backoffLimit) and JobSet
    (failurePolicy.rules: the first rule whose onJobFailureReasons has the Job's reason; else RestartJobSet,
    counted against maxRestarts) document."""
    (replicated,) = manifest["spec"]["replicatedJobs"]
    job_spec = replicated["template"]["spec"]
    for rule in job_spec["podFailurePolicy"]["rules"]:
        conditions = [c["type"] for c in rule.get("onPodConditions", [])]
        codes = rule.get("onExitCodes")
        matched = (disrupted and "DisruptionTarget" in conditions) or (
            codes is not None and exit_code is not None
            and (exit_code in codes["values"]) == (codes["operator"] == "In"))
        if matched:
            if rule["action"] == "Ignore":
                return "replaced"
            if rule["action"] == "FailJob":
                reason = "PodFailurePolicy"
            break
    assert job_spec["backoffLimit"] == 0  # any counted pod failure fails the Job at once
    for rule in manifest["spec"]["failurePolicy"].get("rules", []):
        if reason in rule["onJobFailureReasons"]:
            return {"FailJobSet": "failed", "RestartJobSet": "restarted"}[rule["action"]]
    return "restarted" if manifest["spec"]["failurePolicy"]["maxRestarts"] > 0 else "failed"


@pytest.mark.parametrize("extra", [[], ["--spot"]])
def test_preemption_like_exits_and_disruptions_restart_with_or_without_spot_and_1_2_never(cloud_spec, extra):
    manifest = gke_manifest(cloud_spec, *extra)
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == gke.DEFAULT_RESTARTS == 3
    assert outcome(manifest, None, disrupted=True) == "replaced"  # preempted or drained node: a new pod
    assert outcome(manifest, 75, disrupted=True) == "replaced"  # SIGTERM of a drain, answered with 75
    for code in (75, 3, 137):
        assert outcome(manifest, code) == "restarted", code
    # 124: a time limit reached (saved). Never restarted, as on a TPU VM: a restart would start the clock again.
    for code in (1, 2, 124):
        assert outcome(manifest, code) == "failed", code
    assert outcome(manifest, None, reason="DeadlineExceeded") == "failed"  # the Job's own deadline


def test_max_restarts_as_given_bounds_the_jobset_restarts(cloud_spec):
    assert gke_manifest(cloud_spec, "--max-restarts", "5")["spec"]["failurePolicy"]["maxRestarts"] == 5
    # Through the command: an explicit 0 without --spot stays 0 (not the default of 3).
    assert gke_manifest(cloud_spec, "--max-restarts", "0")["spec"]["failurePolicy"]["maxRestarts"] == 0
    sub = submission(cloud_spec, max_restarts=0)
    manifest = gke.jobset(sub, engines.Options(max_restarts=0))  # the flag as given: 0 means none
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 0
    assert outcome(manifest, 75) == "failed" and outcome(manifest, None, disrupted=True) == "replaced"


@pytest.mark.parametrize("tpu_type, machine", [("v5litepod-8", "ct5lp-hightpu-8t"), ("v6e-8", "ct6e-standard-8t"),
                                               ("v6e-4", "ct6e-standard-4t"), ("v5p-8", "ct5p-hightpu-4t")])
def test_every_pod_asks_for_the_machine_type_that_holds_all_its_chips(cloud_spec, tpu_type, machine):
    manifest = gke_manifest(cloud_spec, tpu_type=tpu_type)
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"][gke.INSTANCE_TYPE] == machine
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == gke.HOSTS[tpu_type].chips


def kubeconfig_for(endpoint: str, folder: Path) -> dict[str, str]:
    path = folder / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": endpoint}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
    }))
    return cli_env(KUBECONFIG=str(path))


def test_an_autopilot_cluster_is_refused_before_anything_is_created(cloud_spec, tmp_path):
    pytest.importorskip("kubernetes")
    with start_engine_fake(tmp_path) as cluster:
        webhook = gke.AUTOPILOT_WEBHOOKS[1]
        cluster.put(f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{webhook}",
                    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                     "metadata": {"name": webhook}})
        result = submit(cloud_spec, "--on", "gke", env=kubeconfig_for(cluster.endpoint, tmp_path))
        assert result.returncode == 2, result.stderr
        said = " ".join(result.stderr.split())
        assert f"the cluster is GKE Autopilot (it has the mutating webhook {webhook})" in said
        assert not [r for r in cluster.requests() if r["method"] == "POST"]


def test_a_namespace_that_enforces_restricted_pod_security_is_refused(cloud_spec, tmp_path):
    pytest.importorskip("kubernetes")
    with start_engine_fake(tmp_path) as cluster:
        cluster.put("/api/v1/namespaces/ml", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": "ml", "labels": {gke.POD_SECURITY: "restricted"}}})
        env = kubeconfig_for(cluster.endpoint, tmp_path)
        refused = submit(cloud_spec, "--on", "gke", "--namespace", "ml", env=env)
        assert refused.returncode == 2
        assert "namespace 'ml' enforces the 'restricted' Pod Security Standard" in " ".join(refused.stderr.split())
        cluster.put("/api/v1/namespaces/ml", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": "ml", "labels": {gke.POD_SECURITY: "privileged"}}})
        taken = submit(cloud_spec, "--on", "gke", "--namespace", "ml", env=env)
        assert taken.returncode == 0, taken.stderr
        assert [r["path"] for r in cluster.requests() if r["method"] == "POST"] == [
            "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets"]


# --- a multi-host slice: one pod per host ----------------------------------------------------------------


def test_a_v6e_16_jobset_is_one_pod_per_host_with_the_slices_selector_and_dns_names(cloud_spec):
    """Checked as the single-host JobSet is: JobSet's schema subset, Kubernetes's Job validation, JobSet's own
    types; then its shape: parallelism = completions = 4 hosts, each pod on a 4x4 ct6e-standard-4t node asking
    for its 4 chips, and the headless service (network.enableDNSHostnames) through which the hosts meet."""
    jsonschema = pytest.importorskip("jsonschema")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    result = submit(cloud_spec, "--on", "gke", "--dry-run", "--zone", "us-central1-b", tpu_type="v6e-16")
    assert result.returncode == 0, result.stderr
    assert "workers: 4 hosts of 4 chips: the JobSet runs 4 pods, one per host" in result.stderr
    assert "price: v6e-16 = 16 chips x $2.7 per chip-hour" in result.stderr
    manifest = yaml.safe_load(result.stdout)
    jsonschema.validate(manifest, jobset_schema())
    (replicated,) = manifest["spec"]["replicatedJobs"]
    job_spec = replicated["template"]["spec"]
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "slice-job"},
                                  "spec": job_spec}, KUBERNETES, strict=True)
    assert lost_on_read_back(manifest, jobset_types().from_dict(manifest).to_dict()) == []
    assert (replicated["replicas"], job_spec["parallelism"], job_spec["completions"]) == (1, 4, 4)
    assert manifest["spec"]["network"] == {"enableDNSHostnames": True}
    pod = job_spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4",
                                   gke.INSTANCE_TYPE: "ct6e-standard-4t"}
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}
    assert pod["hostNetwork"] is True
    # The longest pod name of the slice (pod index 3) is one the JobSet webhook takes.
    longest = f"{'a' * gke.NAME_LIMIT}-{replicated['name']}-0-{job_spec['completions'] - 1}-abcde"
    assert len(longest) <= 63 and DNS_1035_LABEL.fullmatch(longest)


def test_the_v6e_16_jobset_has_the_shape_xpk_makes_for_the_same_slice(cloud_spec, tmp_path):
    needs_xpk()
    result = submit(cloud_spec, "--on", "gke", "--format", "xpk", "--cluster", "tpu-cluster", "--zone",
                    "us-central1-b", tpu_type="v6e-16")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "xpk.yaml"
    words = [*shlex.split(result.stdout.strip())[1:], "--dry-run", "--skip-validation", "--quiet",
             "--output-manifest-file", str(out)]
    made = subprocess.run([str(XPK.parent / "xpk"), *words], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, check=False,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TELEMETRY_ENABLED": "false"})
    assert made.returncode == 0, made.stdout + made.stderr
    theirs = yaml.safe_load(out.read_text())
    ours = yaml.safe_load(submit(cloud_spec, "--on", "gke", "--dry-run", "--zone", "us-central1-b",
                                 tpu_type="v6e-16").stdout)
    our_spec, their_spec = their_job_spec(ours), their_job_spec(theirs)
    for key in ("parallelism", "completions", "backoffLimit"):
        assert our_spec[key] == their_spec[key], key
    assert their_spec["parallelism"] == 4
    our_pod, their_pod = our_spec["template"]["spec"], their_spec["template"]["spec"]
    assert {k: v for k, v in our_pod["nodeSelector"].items() if k != gke.INSTANCE_TYPE} == \
        {k: v for k, v in their_pod["nodeSelector"].items() if v is not None}
    for key in ("restartPolicy", "hostNetwork", "dnsPolicy", "tolerations"):
        assert our_pod[key] == their_pod[key], key
    assert our_pod["containers"][0]["resources"]["limits"] == their_pod["containers"][0]["resources"]["limits"]
    assert ours["metadata"]["annotations"] == theirs["metadata"]["annotations"]  # all pods on one node pool
    # xpk leaves network out: JobSet's webhook makes it enableDNSHostnames: true, which ours says outright.
    assert "network" not in theirs["spec"] and ours["spec"]["network"] == {"enableDNSHostnames": True}


@pytest.mark.parametrize("tpu_type, hosts, topology", [("v5litepod-16", 4, "4x4"), ("v5litepod-32", 8, "4x8"),
                                                       ("v6e-32", 8, "4x8"), ("v5p-16", 2, "2x2x2"),
                                                       ("v5p-32", 4, "2x2x4")])
def test_every_multi_host_type_has_one_pod_per_host_of_its_chips(cloud_spec, tpu_type, hosts, topology):
    manifest = gke_manifest(cloud_spec, tpu_type=tpu_type)
    job_spec = their_job_spec(manifest)
    assert (job_spec["parallelism"], job_spec["completions"]) == (hosts, hosts)
    pod = job_spec["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
    chips = pod["containers"][0]["resources"]["limits"]["google.com/tpu"]
    assert chips * hosts == tpus.parse_tpu_type(tpu_type).chips
