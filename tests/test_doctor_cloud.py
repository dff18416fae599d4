"""`runner doctor --cloud`: each answer a cloud can give (present, missing, denied, unreachable) for each check,
against local servers that record what was asked: the read calls of the TPU API, Vertex AI, Kubernetes,
SkyPilot and the Docker registry (tests/support/preflight_fake.py) and a real GCS emulator (tests/support/gcs.py,
with its fault proxy for a 403). The clients are the real ones (google-cloud-tpu, google-cloud-storage,
google-cloud-aiplatform, kubernetes, SkyPilot's SDK), pointed at the fakes by their own overrides.

Plain `runner doctor`'s duplicate warning on a machine without a TPU is tested in test_doctor.py.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.doctor.cloud import parse_image
from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke
from tests.support.gcs import Gcs  # the gcs and gcs_faults fixtures come from tests/conftest.py
from tests.support.preflight_fake import PROJECT_NUMBER, PreflightFake, start_preflight_fake

PROJECT, ZONE, TOKEN = "runner-test", "us-central1-a", "fake-token"
REPOSITORY = f"{PROJECT}/runner/runner"
IMAGE = f"us-central1-docker.pkg.dev/{REPOSITORY}:tpu"
TIMEOUT = 10


@pytest.fixture(scope="module")
def _preflight_server(tmp_path_factory) -> Iterator[PreflightFake]:
    with start_preflight_fake(tmp_path_factory.mktemp("preflight")) as fake:
        yield fake


@pytest.fixture
def fake(_preflight_server: PreflightFake) -> PreflightFake:
    _preflight_server.reset()
    _preflight_server.image(REPOSITORY, "tpu")
    return _preflight_server


def closed_port() -> int:
    """A port nothing listens on: bound, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(tmp_path: Path, endpoint: str, storage: str | None = None, **extra: str) -> dict[str, str]:
    """Every client pointed at `endpoint` (and google-cloud-storage at `storage`), with a fixed access token."""
    env = cli_env()
    env.pop("GOOGLE_CLOUD_PROJECT", None)  # the project comes from --project unless a test says otherwise
    env.update(
        CLOUDSDK_AUTH_ACCESS_TOKEN=TOKEN,
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
        CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=f"{endpoint}/",
        CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDRESOURCEMANAGER=f"{endpoint}/",
        CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM=f"{endpoint}/",
        RUNNER_REGISTRY_ENDPOINT=endpoint,
        SKYPILOT_API_SERVER_ENDPOINT=endpoint,
        KUBECONFIG=str(tmp_path / "kubeconfig"),
        **extra,
    )
    if storage:
        env["STORAGE_EMULATOR_HOST"] = storage
    return env


def kubeconfig(path: Path, server: str) -> None:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "fake", "user": {"token": TOKEN}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))


def cloud_doctor(*args: Any, env: dict[str, str], child: bool = False) -> tuple[int, dict[str, dict[str, Any]]]:
    argv = ["doctor", "--cloud", "--json", "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT,
            "--timeout", str(TIMEOUT), *map(str, args)]
    # A child imports the engines' clients (SkyPilot's took 20 s on a busy 2-core machine): a generous bound.
    result = run_cli(*argv, env=env, timeout=600) if child else invoke(*argv, env=env)
    assert result.stdout.strip(), result.stderr
    report = last_json(result.stdout)
    return result.returncode, {check["name"]: check for check in report["checks"]}


@pytest.fixture
def spec_in(tmp_path: Path):
    def write(bucket: str, data: str = "data/mnist") -> Path:
        return write_spec(tmp_path, {
            "name": "mnist_cnn",
            "data": {"train": f"gs://{bucket}/{data}/train-*.tfrecord"},
            "output": {"dir": f"gs://{bucket}/runs"},
        })
    return write


# --- present ------------------------------------------------------------------------------------


def test_everything_present_is_ok_and_each_api_was_asked_with_the_token(fake, gcs: Gcs, spec_in, tmp_path) -> None:
    bucket = gcs.bucket()
    gcs.write(bucket, "data/mnist/train-00000-of-00001.tfrecord", b"records")
    env = environment(tmp_path, fake.endpoint, gcs.api)
    code, checks = cloud_doctor(spec_in(bucket), "--image", IMAGE, env=env)
    assert code == 0, checks
    assert {name: check["status"] for name, check in checks.items()} == {
        "cloud_credentials": "ok", "vm_permissions": "ok", "tpu_api": "ok", "tpu_type": "ok", "quota": "ok",
        "bucket_read": "ok",
        "bucket_write": "ok", "image": "ok",
    }
    assert f"project {PROJECT} (from --project)" in checks["cloud_credentials"]["evidence"]
    assert checks["quota"]["evidence"].startswith("not checked: quota: not reported by the TPU API")
    assert checks["image"]["data"]["digest"].startswith("sha256:")
    asked = {(r["method"], r["path"]): r for r in fake.requests()}
    parent = f"/v2/projects/{PROJECT}/locations/{ZONE}"
    assert set(asked) == {("GET", f"{parent}/nodes"), ("GET", f"{parent}/queuedResources"),
                          ("GET", f"{parent}/acceleratorTypes"), ("GET", f"/v2/{REPOSITORY}/manifests/tpu"),
                          ("GET", f"/v1/projects/{PROJECT}"), ("POST", f"/v1/projects/{PROJECT}:getIamPolicy")}
    assert {r["authorization"] for r in asked.values()} == {f"Bearer {TOKEN}"}
    assert "application/vnd.oci.image.index.v1+json" in asked[("GET", f"/v2/{REPOSITORY}/manifests/tpu")]["accept"]
    # The probe object was deleted again: only the data is left.
    assert gcs.objects(bucket) == ["data/mnist/train-00000-of-00001.tfrecord"]


def test_the_project_comes_from_google_cloud_project_then_gclouds_configuration(fake, tmp_path) -> None:
    env = environment(tmp_path, fake.endpoint, GOOGLE_CLOUD_PROJECT="from-env")
    argv = ["doctor", "--cloud", "--json", "--tpu-type", "v5litepod-8", "--zone", ZONE, "--image", IMAGE]
    checks = {c["name"]: c for c in last_json(invoke(*argv, env=env).stdout)["checks"]}
    assert "project from-env (from GOOGLE_CLOUD_PROJECT)" in checks["cloud_credentials"]["evidence"]
    assert checks["cloud_credentials"]["action"] == ""  # `runner submit` reads GOOGLE_CLOUD_PROJECT too
    del env["GOOGLE_CLOUD_PROJECT"]
    env["CLOUDSDK_CORE_PROJECT"] = "from-gcloud"
    checks = {c["name"]: c for c in last_json(invoke(*argv, env=env).stdout)["checks"]}
    assert "project from-gcloud (from gcloud config core/project)" in checks["cloud_credentials"]["evidence"]
    assert any(r["path"].startswith("/v2/projects/from-gcloud/") for r in fake.requests())


# --- missing ------------------------------------------------------------------------------------


def test_missing_image_type_bucket_and_data_each_say_the_command_that_fixes_them(fake, gcs: Gcs, spec_in,
                                                                                 tmp_path) -> None:
    fake.offer(ZONE, ["v5litepod-1", "v5litepod-4", "v3-8"])
    empty = gcs.bucket()
    env = environment(tmp_path, fake.endpoint, gcs.api)
    code, checks = cloud_doctor(spec_in(empty), "--image", IMAGE.replace(":tpu", ":nope"), env=env)
    assert code == 3
    assert checks["tpu_type"]["status"] == "fail"
    assert "does not offer v5litepod-8; it offers v5litepod-1, v5litepod-4" in checks["tpu_type"]["evidence"]
    assert "gcloud compute tpus accelerator-types list" in checks["tpu_type"]["action"]
    assert checks["image"]["evidence"].startswith("missing (404 MANIFEST_UNKNOWN)")
    assert "gcloud builds submit --config cloudbuild.yaml" in checks["image"]["action"]
    assert checks["image"]["action"].endswith(f"pass --image {IMAGE}")  # the tag cloudbuild.yaml makes
    assert checks["bucket_read"]["evidence"].startswith(f"missing: no objects under gs://{empty}/data/mnist/")
    assert "runner prepare" in checks["bucket_read"]["action"]
    assert checks["bucket_write"]["status"] == "ok"  # the bucket exists and takes writes

    gone = f"no-such-bucket-{time.monotonic_ns()}"
    code, checks = cloud_doctor(spec_in(gone), "--image", IMAGE, env=env)
    assert code == 3
    for name in ("bucket_read", "bucket_write"):
        assert checks[name]["evidence"].startswith(f"missing: bucket gs://{gone} does not exist"), checks[name]
        region = ZONE.rsplit("-", 1)[0]  # the TPU's region: the bucket belongs beside it
        assert checks[name]["action"] == f"gcloud storage buckets create gs://{gone} --location={region}"


def test_no_credentials_or_no_project_stop_before_any_call(fake, spec_in, tmp_path) -> None:
    env = environment(tmp_path, fake.endpoint)
    del env["CLOUDSDK_AUTH_ACCESS_TOKEN"]
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    # google-auth's last resort is the GCE metadata server: here, a port nothing answers on.
    env.update(GCE_METADATA_HOST=f"127.0.0.1:{closed_port()}", GCE_METADATA_IP=f"127.0.0.1:{closed_port()}")
    code, checks = cloud_doctor("--image", IMAGE, env=env, child=True)
    assert code == 3
    assert checks["cloud_credentials"]["evidence"].startswith("missing: no Application Default Credentials")
    assert checks["cloud_credentials"]["action"].startswith("gcloud auth application-default login")
    assert all(c["evidence"].startswith("not run") for n, c in checks.items() if n != "cloud_credentials")
    assert fake.requests() == []

    # Each check not run still names the command that settles it: one pass lists every step, not the first.
    region = ZONE.rsplit("-", 1)[0]
    code, checks = cloud_doctor(spec_in("b"), "--image", IMAGE, "--on", "vertex", env=env, child=True)
    assert {n: c["action"].removeprefix("after cloud_credentials: ") for n, c in checks.items()} == {
        "cloud_credentials": checks["cloud_credentials"]["action"],
        "tpu_api": f"gcloud services enable tpu.googleapis.com --project {PROJECT}",
        "tpu_type": f"gcloud compute tpus accelerator-types list --zone={ZONE} --project={PROJECT} lists the types "
                    f"{ZONE} offers: v5litepod-8 must be one of them",
        "quota": "the project's TPU quotas are on the console's Quotas page (IAM & Admin > Quotas)",
        "engine": f"gcloud services enable aiplatform.googleapis.com --project {PROJECT}",
        "bucket_read": "runner prepare DATASET --out gs://b/data/mnist if `gcloud storage ls gs://b/data/mnist/` "
                       "lists nothing",
        "bucket_write": f"gcloud storage buckets create gs://b --location={region} if `gcloud storage buckets "
                        "describe gs://b` finds none",
        "image": f"if `docker manifest inspect {IMAGE}` finds nothing: "
                 + checks["image"]["action"].split("finds nothing: ", 1)[1],
    }
    assert "build and push it: gcloud builds submit" in checks["image"]["action"], checks["image"]
    assert fake.requests() == []

    env = environment(tmp_path, fake.endpoint)
    argv = ["doctor", "--cloud", "--json", "--tpu-type", "v5litepod-8", "--zone", ZONE, "--image", IMAGE]
    checks = {c["name"]: c for c in last_json(invoke(*argv, env=env).stdout)["checks"]}
    assert "no project" in checks["cloud_credentials"]["evidence"]
    assert checks["cloud_credentials"]["action"].startswith("gcloud config set project")
    assert fake.requests() == []


def test_a_vm_account_without_the_tpu_role_fails_with_the_grant_that_fixes_it(fake, tmp_path) -> None:
    """The Compute Engine default service account (from the project's number) holds only Storage roles, as in a
    project whose organisation turned off its Editor grant: the TPU VM could not delete its own slice."""
    default = f"{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
    fake.iam([{"role": "roles/storage.objectAdmin", "members": [f"serviceAccount:{default}"]},
              {"role": "roles/tpu.admin", "members": ["user:someone@example.com"]}])
    env = environment(tmp_path, fake.endpoint)
    code, checks = cloud_doctor("--image", IMAGE, env=env)
    assert code == 3
    check = checks["vm_permissions"]
    assert check["status"] == "fail"
    assert check["evidence"].startswith(f"missing: {PROJECT}'s IAM policy grants the TPU VM's service account "
                                        f"{default} none of roles/tpu.admin, roles/editor, roles/owner "
                                        "(it holds roles/storage.objectAdmin)")
    assert check["action"] == (f"gcloud projects add-iam-policy-binding {PROJECT} --member=serviceAccount:{default} "
                               "--role=roles/tpu.admin")
    assert check["evidence"].endswith("(a grant on a folder or the organisation is not seen here: where yours is "
                                      "one, --no-preflight skips this check)")
    policy = [r for r in fake.requests() if r["path"] == f"/v1/projects/{PROJECT}:getIamPolicy"]
    assert [(r["method"], r["body"], r["authorization"]) for r in policy] == [
        ("POST", {"options": {"requestedPolicyVersion": 3}}, f"Bearer {TOKEN}")]

    fake.iam([{"role": "roles/tpu.admin", "members": [f"serviceAccount:{default}"]}])
    code, checks = cloud_doctor("--image", IMAGE, env=env)
    assert checks["vm_permissions"]["status"] == "ok", checks["vm_permissions"]
    assert checks["vm_permissions"]["data"] == {"service_account": default, "roles": ["roles/tpu.admin"]}
    named = f"trainer@{PROJECT}.iam.gserviceaccount.com"  # as `runner submit --service-account` will be given
    code, checks = cloud_doctor("--image", IMAGE, "--service-account", named, env=env)
    assert code == 3 and checks["vm_permissions"]["action"].endswith(f"--member=serviceAccount:{named} "
                                                                     "--role=roles/tpu.admin")


def test_the_tpu_role_granted_to_a_group_is_a_warning_not_a_refusal(fake, tmp_path) -> None:
    """Group membership is not in the project's policy: the account may hold the role through the group, so the
    submission is not refused for it; the warning names the group and the direct grant."""
    default = f"{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
    fake.iam([{"role": "roles/tpu.admin", "members": ["group:tpu-runners@example.com"]}])
    code, checks = cloud_doctor("--image", IMAGE, env=environment(tmp_path, fake.endpoint))
    check = checks["vm_permissions"]
    assert check["status"] == "warn", check
    assert "to group:tpu-runners@example.com but not to " + default in check["evidence"]
    assert check["action"].endswith(f"--member=serviceAccount:{default} --role=roles/tpu.admin")
    assert code == 0


def test_a_policy_that_cannot_be_read_is_not_checked_and_says_the_grant(fake, tmp_path) -> None:
    fake.deny(f"/v1/projects/{PROJECT}")
    code, checks = cloud_doctor("--image", IMAGE, env=environment(tmp_path, fake.endpoint))
    check = checks["vm_permissions"]
    assert check["status"] == "warn" and check["evidence"].startswith("not checked: denied (403)")
    assert "gcloud projects add-iam-policy-binding" in check["action"]


# --- denied -------------------------------------------------------------------------------------


def test_a_disabled_tpu_api_and_a_refused_image_are_denied_with_the_fix(fake, tmp_path) -> None:
    fake.deny("/v2/projects/", 403, reason="SERVICE_DISABLED")
    fake.deny(f"/v2/{REPOSITORY}/", 403)
    code, checks = cloud_doctor("--image", IMAGE, env=environment(tmp_path, fake.endpoint))
    assert code == 3
    for name in ("tpu_api", "tpu_type"):
        assert checks[name]["evidence"].startswith("denied (403)"), checks[name]
        assert checks[name]["action"] == f"gcloud services enable tpu.googleapis.com --project {PROJECT}"
    assert checks["image"]["evidence"].startswith("denied (403 DENIED)")
    assert "--role=roles/artifactregistry.reader" in checks["image"]["action"]


def test_a_tpu_api_that_refuses_the_account_names_the_role(fake, tmp_path) -> None:
    fake.deny("/v2/projects/", 403)
    code, checks = cloud_doctor("--image", IMAGE, env=environment(tmp_path, fake.endpoint))
    assert code == 3 and checks["tpu_api"]["evidence"].startswith("denied (403)")
    assert "--role=roles/tpu.admin" in checks["tpu_api"]["action"]


def test_a_bucket_that_refuses_writes_is_denied_with_the_role_to_grant(fake, gcs_faults: Gcs, spec_in,
                                                                      tmp_path) -> None:
    bucket = gcs_faults.bucket()
    gcs_faults.write(bucket, "data/mnist/train-00000-of-00001.tfrecord", b"records")
    gcs_faults.faults.set([{"match": rf"^POST /upload/storage/v1/b/{bucket}/", "action": "status", "status": 403}])
    env = environment(tmp_path, fake.endpoint, gcs_faults.api)
    code, checks = cloud_doctor(spec_in(bucket), "--image", IMAGE, env=env)
    assert code == 3
    assert checks["bucket_read"]["status"] == "ok"
    assert checks["bucket_write"]["evidence"].startswith(f"denied (403): gs://{bucket}/runs/.runner-doctor-")
    assert f"gcloud storage buckets add-iam-policy-binding gs://{bucket}" in checks["bucket_write"]["action"]
    assert "--role=roles/storage.objectAdmin" in checks["bucket_write"]["action"]


# --- unreachable --------------------------------------------------------------------------------


def test_nothing_listening_and_an_unknown_host_are_unreachable_within_the_bound(spec_in, tmp_path) -> None:
    nowhere = f"http://127.0.0.1:{closed_port()}"
    env = environment(tmp_path, nowhere, nowhere)
    began = time.monotonic()
    code, checks = cloud_doctor(spec_in("some-bucket"), "--image", IMAGE, env=env)
    assert code == 3 and time.monotonic() - began < TIMEOUT
    for name in ("tpu_api", "tpu_type", "bucket_read", "bucket_write", "image"):
        assert checks[name]["evidence"].startswith("unreachable: "), checks[name]
    assert "Connection refused" in checks["image"]["evidence"]

    env = environment(tmp_path, "http://registry.invalid", "http://storage.invalid")
    code, checks = cloud_doctor(spec_in("some-bucket"), "--image", IMAGE, env=env)
    assert code == 3
    for name in ("tpu_api", "bucket_write", "image"):
        assert checks[name]["evidence"].startswith("unreachable: "), checks[name]


def test_a_bucket_that_never_answers_is_cut_at_the_bound(fake, gcs_faults: Gcs, spec_in, tmp_path) -> None:
    bucket = gcs_faults.bucket()
    gcs_faults.faults.set([{"match": rf"/b/{bucket}/o", "action": "stall", "delay_s": 3 * 3}])
    env = environment(tmp_path, fake.endpoint, gcs_faults.api)
    began = time.monotonic()
    code, checks = cloud_doctor(spec_in(bucket), "--image", IMAGE, "--timeout", 3, env=env)
    assert code == 3 and time.monotonic() - began < 3 * 3
    assert checks["bucket_read"]["evidence"].startswith("unreachable"), checks["bucket_read"]
    assert checks["bucket_read"]["seconds"] <= 3 + 1


# --- engines ------------------------------------------------------------------------------------


def test_vertex_is_asked_for_its_custom_jobs_and_a_refusal_is_denied(fake, tmp_path) -> None:
    env = environment(tmp_path, fake.endpoint)
    code, checks = cloud_doctor("--image", IMAGE, "--on", "vertex", env=env)
    assert code == 0 and checks["engine"]["status"] == "ok", checks["engine"]
    assert ("GET", f"/v1/projects/{PROJECT}/locations/us-central1/customJobs") in {
        (r["method"], r["path"]) for r in fake.requests()}
    fake.deny("/v1/projects/", 403)
    code, checks = cloud_doctor("--image", IMAGE, "--on", "vertex", env=env)
    assert code == 3 and checks["engine"]["evidence"].startswith("denied (403)")
    assert "aiplatform.googleapis.com" in checks["engine"]["action"]


def test_gke_asks_the_clusters_api_from_kubeconfig(fake, tmp_path) -> None:
    env = environment(tmp_path, fake.endpoint)
    code, checks = cloud_doctor("--image", IMAGE, "--on", "gke", env=env)
    assert code == 3 and checks["engine"]["evidence"].startswith("missing: no Kubernetes cluster in kubeconfig")
    assert "gcloud container clusters get-credentials" in checks["engine"]["action"]
    kubeconfig(tmp_path / "kubeconfig", fake.endpoint)
    code, checks = cloud_doctor("--image", IMAGE, "--on", "gke", env=env)
    failed = [check for check in checks.values() if check["status"] == "fail"]
    assert code == 0 and "version v1.31.0-fake" in checks["engine"]["evidence"], failed
    assert [r["authorization"] for r in fake.requests() if r["path"] == "/version/"] == [f"Bearer {TOKEN}"]
    assert "JobSet's API jobset.x-k8s.io/v1alpha2 is served" in checks["engine"]["evidence"]
    # A cluster without JobSet: the install command is the action, and it names the releases it comes from.
    fake.groups([{"name": "kueue.x-k8s.io", "versions": [{"groupVersion": "kueue.x-k8s.io/v1beta1",
                                                          "version": "v1beta1"}]}])
    code, checks = cloud_doctor("--image", IMAGE, "--on", "gke", env=env)
    assert code == 3 and checks["engine"]["evidence"].startswith("missing: "), checks["engine"]
    assert "jobset.x-k8s.io/v1alpha2 is not installed" in checks["engine"]["evidence"]
    assert checks["engine"]["action"].startswith("kubectl apply --server-side -f https://github.com/kubernetes-sigs/"
                                                 "jobset/releases/download/")
    fake.groups([{"name": "jobset.x-k8s.io", "versions": [{"groupVersion": "jobset.x-k8s.io/v1alpha1",
                                                           "version": "v1alpha1"}]}])
    code, checks = cloud_doctor("--image", IMAGE, "--on", "gke", env=env)
    assert code == 3 and "is only v1alpha1" in checks["engine"]["evidence"], checks["engine"]
    fake.deny("/version", 403)
    code, checks = cloud_doctor("--image", IMAGE, "--on", "gke", env=env)
    assert code == 3 and checks["engine"]["evidence"].startswith("denied (403)")
    kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{closed_port()}")
    code, checks = cloud_doctor("--image", IMAGE, "--on", "gke", env=env)
    assert code == 3 and checks["engine"]["evidence"].startswith("unreachable")



def test_tpu7x_on_gke_is_not_asked_of_the_cloud_tpu_api_which_does_not_know_it(fake, tmp_path) -> None:
    env = environment(tmp_path, fake.endpoint)
    kubeconfig(tmp_path / "kubeconfig", fake.endpoint)
    code, checks = cloud_doctor("--image", IMAGE, "--on", "gke", "--tpu-type", "tpu7x-8", "--zone", "us-central1-c",
                                env=env)
    assert code == 0, checks
    for name in ("tpu_api", "tpu_type"):
        assert checks[name]["status"] == "warn", checks[name]
        assert "not in the Cloud TPU API" in checks[name]["evidence"]
        assert "gcloud container node-pools list" in checks[name]["action"]
    assert not [r for r in fake.requests() if "/locations/" in r["path"]], "the Cloud TPU API was not asked"

def test_skypilot_asks_its_api_servers_health_and_an_absent_client_is_not_checked(fake, tmp_path) -> None:
    env = environment(tmp_path, fake.endpoint, HOME=str(tmp_path))
    code, checks = cloud_doctor("--image", IMAGE, "--on", "skypilot", env=env, child=True)
    assert code == 0 and checks["engine"]["evidence"].startswith("the SkyPilot API server answered: healthy")
    assert "/api/health" in {r["path"] for r in fake.requests()}
    env["SKYPILOT_API_SERVER_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
    code, checks = cloud_doctor("--image", IMAGE, "--on", "skypilot", env=env, child=True)
    assert code == 3 and checks["engine"]["evidence"].startswith("unreachable"), checks["engine"]
    # A `sky` package without SkyPilot's client in it: what an environment without the extra imports.
    (tmp_path / "shadow" / "sky").mkdir(parents=True)
    (tmp_path / "shadow" / "sky" / "__init__.py").write_text("")
    env["PYTHONPATH"] = str(tmp_path / "shadow")
    code, checks = cloud_doctor("--image", IMAGE, "--on", "skypilot", env=env, child=True)
    assert code == 0 and checks["engine"]["status"] == "warn"
    assert checks["engine"]["evidence"] == "not checked: the SkyPilot client is not installed"
    assert checks["engine"]["action"] == "pip install 'tpu-job-runner[skypilot]'"


def test_a_client_slower_to_import_than_the_timeout_is_not_read_as_no_answer(fake, tmp_path) -> None:
    """--timeout bounds waiting for an answer; an engine's client is imported before it starts. Here a client
    whose import takes 3 s, against --timeout 2, answers healthy at once."""
    client = tmp_path / "shadow" / "sky" / "client"
    client.mkdir(parents=True)
    (client.parent / "__init__.py").write_text("")
    (client / "__init__.py").write_text("")
    (client / "sdk.py").write_text(
        "import time\nimport types\n\ntime.sleep(3)  # longer than --timeout 2\n\n\n"
        "def api_info():\n    return types.SimpleNamespace(status='healthy', version='slow-import')\n")
    env = environment(tmp_path, fake.endpoint, HOME=str(tmp_path), PYTHONPATH=str(tmp_path / "shadow"))
    argv = ["doctor", "--cloud", "--json", "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT,
            "--timeout", "2", "--image", IMAGE, "--on", "skypilot"]
    result = run_cli(*argv, env=env, timeout=600)
    engine = {c["name"]: c for c in last_json(result.stdout)["checks"]}["engine"]
    assert engine["evidence"].startswith("the SkyPilot API server answered: healthy, version slow-import"), engine
    assert engine["seconds"] < 2, "the import is not inside the bound"


# --- the command line ---------------------------------------------------------------------------


def test_cloud_flags_without_cloud_and_cloud_without_a_tpu_type_are_usage_errors(tmp_path) -> None:
    env = cli_env(CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
    result = invoke("doctor", "--zone", ZONE, "--image", IMAGE, env=env)
    assert result.returncode == 2 and "--zone, --image apply only with --cloud" in result.stderr
    result = invoke("doctor", "--cloud", "--zone", ZONE, env=env)
    assert result.returncode == 2 and "--cloud needs --tpu-type" in result.stderr
    result = invoke("doctor", "--cloud", "--tpu-type", "v5litepod-8", "--zone", "us-central1", env=env)
    assert result.returncode == 2 and "is a region" in result.stderr
    result = invoke("doctor", "--cloud", "--tpu-type", "v5litepod-8", "--zone", ZONE, "--on", "slurm", env=env)
    assert result.returncode == 2 and "choose one of tpu-vm, skypilot, gke, vertex" in result.stderr


def test_image_references_are_split_as_docker_does() -> None:
    assert parse_image(IMAGE) == ("us-central1-docker.pkg.dev", REPOSITORY, "tpu")
    assert parse_image("gcr.io/p/runner") == ("gcr.io", "p/runner", "latest")
    assert parse_image("localhost:5000/r@sha256:ab") == ("localhost:5000", "r", "sha256:ab")
    with pytest.raises(ValueError, match="names no registry host"):
        parse_image("runner:tpu")
