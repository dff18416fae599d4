"""`runner submit` checks the cloud before it creates anything: the checks of `runner doctor --cloud`
(runner/doctor/cloud.py) with the real clients, against the TPU API fake (which also answers the read calls
of the checks and serves an image registry, tests/support/tpu_fake.py), the GCS emulator as the bucket and,
for Vertex AI, the engines' fake. A failed check stops the submission with `runner doctor --cloud`'s exit
code (3), naming each failed check and its fix, and the fakes record no create; `--no-preflight` skips the
checks; a dry run runs them only with `--preflight`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from runner.doctor.cloud import parse_image
from tests.conftest import last_json
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke
from tests.support.preflight_fake import PROJECT_NUMBER

pytest_plugins = ["tests.support.cloud_fixtures"]

PARENT = f"/v2/projects/{PROJECT}/locations/{ZONE}"
CHECKS = ("cloud_credentials", "vm_permissions", "tpu_api", "tpu_type", "quota", "bucket_read", "bucket_write",
          "image")


@pytest.fixture
def api(tpu_fake, gcs, bucket, tmp_path: Path) -> dict[str, str]:
    for name in gcs.objects(bucket, "runs/"):
        gcs.client().bucket(bucket).blob(name).delete()
    return cloud_env(tpu_fake.endpoint, tmp_path, **gcs.env)


def submit(spec: Path, env: dict[str, str], *extra: str):
    return invoke("submit", spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT, "--image", IMAGE,
                  *extra, env=env)


def created(requests: list[dict]) -> list[dict]:
    """What was created: every POST but the IAM policy's read (Cloud Resource Manager's getIamPolicy is a POST)."""
    return [r for r in requests if r["method"] == "POST" and not r["path"].endswith(":getIamPolicy")]


def lose_the_image(tpu_fake) -> None:
    _, name, reference = parse_image(IMAGE)
    tpu_fake.lose_image(name, reference)


def test_a_submission_reads_what_the_doctor_reads_before_it_creates(api, tpu_fake, cloud_spec, gcs, bucket):
    result = submit(cloud_spec, api)
    assert result.returncode == 0, result.stderr
    assert f"preflight: {len(CHECKS)} checks passed" in result.stderr
    asked = [(r["method"], r["path"]) for r in tpu_fake.requests()]
    _, name, reference = parse_image(IMAGE)
    reads = [("GET", f"{PARENT}/nodes"), ("GET", f"{PARENT}/queuedResources"), ("GET", f"{PARENT}/acceleratorTypes"),
             ("GET", f"/v2/{name}/manifests/{reference}")]
    create = asked.index(("POST", f"{PARENT}/queuedResources"))
    assert all(read in asked[:create] for read in reads), asked
    assert last_json(result.stdout)["name"] == "mnist-cnn"
    # The bucket check's probe object was deleted again: the run folder holds only what the submission wrote.
    assert [n for n in gcs.objects(bucket, "runs/") if ".runner-doctor-" in n] == []


def test_a_missing_image_stops_the_submission_and_nothing_is_created(api, tpu_fake, cloud_spec, gcs, bucket):
    lose_the_image(tpu_fake)
    result = submit(cloud_spec, api)
    assert result.returncode == 3, result.stderr  # `runner doctor --cloud`'s exit for a failed cloud check
    stderr = " ".join(result.stderr.split())
    assert f"preflight: 1 of {len(CHECKS)} checks failed; nothing was created" in stderr
    assert f"image: missing (404 MANIFEST_UNKNOWN): {IMAGE} is not in us-central1-docker.pkg.dev" in stderr
    assert "fix: " in stderr and "--no-preflight skips the checks" in stderr
    assert created(tpu_fake.requests()) == []
    assert gcs.objects(bucket, "runs/") == []  # no job.json either
    assert result.stdout == ""


def test_a_data_folder_with_nothing_in_it_stops_the_submission(api, tpu_fake, cloud_spec):
    doc = yaml.safe_load(cloud_spec.read_text())
    doc["data"]["train"] = "gs://runner-test/data/never-uploaded/train-*.tfrecord"
    cloud_spec.write_text(yaml.safe_dump(doc))
    result = submit(cloud_spec, api)
    assert result.returncode == 3, result.stderr
    stderr = " ".join(result.stderr.split())
    assert "bucket_read: missing: no objects under gs://runner-test/data/never-uploaded/" in stderr
    assert "fix: runner prepare DATASET --out gs://runner-test/data/never-uploaded" in stderr
    assert created(tpu_fake.requests()) == []


def test_every_failed_check_is_listed_with_its_fix(api, tpu_fake, cloud_spec):
    lose_the_image(tpu_fake)
    doc = yaml.safe_load(cloud_spec.read_text())
    doc["data"]["train"] = "gs://runner-test/data/never-uploaded/train-*.tfrecord"
    cloud_spec.write_text(yaml.safe_dump(doc))
    result = submit(cloud_spec, api)
    assert result.returncode == 3
    failed = [line.strip() for line in result.stderr.splitlines() if line.strip().split(":")[0] in CHECKS]
    assert [line.split(":")[0] for line in failed] == ["bucket_read", "image"]
    assert result.stderr.count("fix: ") == 2


def test_no_preflight_skips_the_checks_and_submits(api, tpu_fake, cloud_spec):
    lose_the_image(tpu_fake)
    result = submit(cloud_spec, api, "--no-preflight")
    assert result.returncode == 0, result.stderr
    assert "preflight:" not in result.stderr and "not checked (--no-preflight)" in result.stderr
    paths = [r["path"] for r in tpu_fake.requests()]
    assert f"{PARENT}/acceleratorTypes" not in paths and not any("/manifests/" in p for p in paths)
    assert len(created(tpu_fake.requests())) == 1


def test_a_dry_run_stays_offline_unless_preflight_is_asked_for(api, tpu_fake, cloud_spec):
    lose_the_image(tpu_fake)
    offline = submit(cloud_spec, api, "--dry-run")
    assert offline.returncode == 0, offline.stderr
    assert tpu_fake.requests() == [] and "preflight:" not in offline.stderr  # no check ran
    checked = submit(cloud_spec, api, "--dry-run", "--preflight")
    assert checked.returncode == 3, checked.stderr
    assert "image: missing" in checked.stderr and checked.stdout == ""
    assert created(tpu_fake.requests()) == []


def test_an_unreachable_tpu_api_stops_the_submission_before_the_create(api, tpu_fake, cloud_spec):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    result = submit(cloud_spec, {**api, "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": f"http://127.0.0.1:{closed}/"})
    assert result.returncode == 3
    stderr = " ".join(result.stderr.split())
    assert "tpu_api: unreachable" in stderr and "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU" in stderr
    assert "could not reach the Cloud TPU API to create" not in stderr  # stopped before the create


def test_an_engine_submission_runs_the_same_checks_and_its_engines_own(api, tpu_fake, engine_api, cloud_spec):
    env = {**api, "CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM": f"{engine_api.endpoint}/"}
    jobs_path = f"/v1/projects/{PROJECT}/locations/us-central1/customJobs"
    before = len(engine_api.requests())
    lose_the_image(tpu_fake)
    refused = submit(cloud_spec, env, "--on", "vertex")
    assert refused.returncode == 3, refused.stderr
    assert "image: missing" in refused.stderr
    asked = engine_api.requests()[before:]
    assert [(r["method"], r["path"]) for r in asked] == [("GET", jobs_path)]  # the engine check; no create

    tpu_fake.reset()
    taken = submit(cloud_spec, env, "--on", "vertex")
    assert taken.returncode == 0, taken.stderr
    assert f"preflight: {len(CHECKS)} checks passed" in taken.stderr  # the engine check, not the VM's account
    assert last_json(taken.stdout)["on"] == "vertex"
    asked = engine_api.requests()[before:]
    assert [(r["method"], r["path"]) for r in asked][-2:] == [("GET", jobs_path), ("POST", jobs_path)]


def test_a_dry_run_of_a_slice_reads_nothing_remote_and_prints_the_same_bytes(cloud_spec, tmp_path):
    """Every way out of this machine leads to one recorder (a TPU API fake of this test's own, so that nothing an
    earlier test left running in this process can reach it): the metadata server Google's auth library asks for
    credentials, the bucket (STORAGE_EMULATOR_HOST) and any proxied request. A dry run of a 4-host slice records
    nothing there, says it did not read the previous run, and prints the same bytes twice."""
    from tests.support.tpu_fake import start_tpu_fake

    (tmp_path / "recorder").mkdir()
    with start_tpu_fake(tmp_path / "recorder", ttl_s=300) as tpu_fake:
        _dry_run_reads_nothing(tpu_fake, cloud_spec, tmp_path)


def _dry_run_reads_nothing(tpu_fake, cloud_spec, tmp_path):
    host = tpu_fake.endpoint.removeprefix("http://")
    env = cloud_env(tpu_fake.endpoint, tmp_path, STORAGE_EMULATOR_HOST=tpu_fake.endpoint, GCE_METADATA_HOST=host,
                    GCE_METADATA_IP=host, HTTP_PROXY=tpu_fake.endpoint, HTTPS_PROXY=tpu_fake.endpoint,
                    http_proxy=tpu_fake.endpoint, https_proxy=tpu_fake.endpoint)
    for key in ("CLOUDSDK_AUTH_ACCESS_TOKEN", "NO_PROXY", "no_proxy", "GOOGLE_APPLICATION_CREDENTIALS"):
        env.pop(key, None)
    args = ("submit", cloud_spec, "--tpu-type", "v6e-16", "--zone", "us-east1-d", "--project", PROJECT, "--image",
            IMAGE, "--dry-run", "--submission-id", "20260101-000000-abcd")
    first, second = invoke(*args, env=env), invoke(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert tpu_fake.requests() == []
    assert "previous run: not read (a dry run reads nothing remote; with --preflight it reads " \
           "gs://runner-test/runs/mnist_cnn/summary.json" in first.stderr
    assert (first.stdout, first.stderr) == (second.stdout, second.stderr)
    said = " ".join(first.stderr.split())
    assert ("permissions: the TPU VMs run as the project's Compute Engine default service account, which deletes "
            f"the slice when the job ends: it needs roles/tpu.admin (or Editor, Owner) in {PROJECT}; not checked now "
            "(a dry run reads nothing remote; --preflight checks it)") in said
    assert "at most: " in said and "+ delete 16.7 min" in said  # the bound, phase by phase (test_submit_billing)
    # With --preflight the dry run reads the cloud, the previous run's summary included.
    checked = invoke(*args, "--preflight", env={**env, "CLOUDSDK_AUTH_ACCESS_TOKEN": "fake-token"})
    assert any("summary.json" in r["path"] for r in tpu_fake.requests()), checked.stderr


_LABELS = """
import json, sys
from runner.cloud import request, submit
sub = submit.prepare_submission(sys.argv[1], tpu_type="v6e-16", zone="us-east1-d", image=sys.argv[2],
                                project="runner-test", submission_id="20260101-000000-abcd")
print(json.dumps(list(request.request_json(sub)["tpu"]["nodeSpec"][0]["node"]["labels"])))
"""


def test_the_request_lists_its_labels_in_one_order_in_every_process(cloud_spec):
    """google-cloud-tpu writes a proto map in an order that differs from process to process (two dry runs
    differed in 2 of 6): each of six fresh processes must list the labels sorted."""
    import subprocess
    import sys

    orders = {subprocess.run([sys.executable, "-c", _LABELS, str(cloud_spec), IMAGE], capture_output=True, text=True,
                             check=True, timeout=120).stdout for _ in range(6)}
    assert orders == {'["runner-job", "runner-submission"]\n'}


def test_a_vm_account_that_could_not_delete_its_slice_stops_the_submission_before_any_tpu_request(
        api, tpu_fake, cloud_spec, gcs, bucket):
    """An IAM policy where the VM's service account (the Compute Engine default, then --service-account) holds no
    role with the TPU delete permission: exit 3 with the grant that fixes it, no create, no job.json."""
    default = f"{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
    tpu_fake.iam([{"role": "roles/storage.objectAdmin", "members": [f"serviceAccount:{default}"]},
                  {"role": "roles/artifactregistry.reader", "members": [f"serviceAccount:{default}"]}])
    refused = submit(cloud_spec, api)
    assert refused.returncode == 3, refused.stderr
    stderr = " ".join(refused.stderr.split())
    assert "preflight: 1 of 8 checks failed; nothing was created" in stderr
    assert (f"vm_permissions: missing: {PROJECT}'s IAM policy grants the TPU VM's service account {default} none of "
            "roles/tpu.admin, roles/editor, roles/owner (it holds roles/artifactregistry.reader, "
            "roles/storage.objectAdmin)") in stderr
    assert (f"fix: gcloud projects add-iam-policy-binding {PROJECT} --member=serviceAccount:{default} "
            "--role=roles/tpu.admin") in stderr
    assert created(tpu_fake.requests()) == [] and gcs.objects(bucket, "runs/") == []
    asked = [(r["method"], r["path"]) for r in tpu_fake.requests()]
    assert asked.index(("POST", f"/v1/projects/{PROJECT}:getIamPolicy")) < asked.index(("GET", f"{PARENT}/nodes"))

    other = f"trainer@{PROJECT}.iam.gserviceaccount.com"
    named = submit(cloud_spec, api, "--service-account", other)
    assert named.returncode == 3
    assert f"--member=serviceAccount:{other} --role=roles/tpu.admin" in " ".join(named.stderr.split())
    assert created(tpu_fake.requests()) == []

    tpu_fake.iam([{"role": "roles/tpu.admin", "members": [f"serviceAccount:{other}"]}])
    taken = submit(cloud_spec, api, "--service-account", other)
    assert taken.returncode == 0, taken.stderr
    [create] = created(tpu_fake.requests())
    assert create["body"]["tpu"]["nodeSpec"][0]["node"]["serviceAccount"]["email"] == other


@pytest.mark.host
def test_the_policy_is_read_as_gcloud_reads_it(tpu_fake, tmp_path):
    """`gcloud projects get-iam-policy` against the same fake sends the request the preflight sends."""
    import shutil
    import subprocess

    assert shutil.which("gcloud"), "gcloud is not installed on this machine"
    env = cloud_env(tpu_fake.endpoint, tmp_path)
    done = subprocess.run(["gcloud", "projects", "get-iam-policy", PROJECT, "--format=json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [by_gcloud] = [r for r in tpu_fake.requests() if r["path"].endswith(":getIamPolicy")]
    assert (by_gcloud["method"], by_gcloud["path"]) == ("POST", f"/v1/projects/{PROJECT}:getIamPolicy")
    assert by_gcloud["body"] == {"options": {"requestedPolicyVersion": 3}}


def test_a_dry_run_without_a_submission_id_prints_the_same_bytes_and_its_script_makes_one_when_run(
        tpu_fake, cloud_spec, tmp_path):
    """The same inputs, the same bytes, with no --submission-id either: the printed script makes the id when it
    runs (as `runner submit` makes one when it sends), the same in the labels and in the startup script, and a
    new one at each run, so a second run of the script is a submission of its own."""
    import re
    import subprocess

    env = cloud_env(tpu_fake.endpoint, tmp_path)
    args = ("submit", cloud_spec, "--tpu-type", "v6e-16", "--zone", "us-east1-d", "--project", PROJECT, "--image",
            IMAGE, "--dry-run")
    first, second = invoke(*args, env=env), invoke(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    stub = tmp_path / "bin" / "gcloud"  # records the labels and the startup script's id instead of sending
    stub.parent.mkdir()
    stub.write_text('#!/bin/bash\nfor a in "$@"; do case "$a" in --labels=*) echo "$a";; '
                    '--metadata-from-file=startup-script=*) grep "^RUNNER_SUBMISSION=" "${a#*script=}";; esac; done\n')
    stub.chmod(0o755)
    (tmp_path / "launch.sh").write_text(first.stdout)
    ids = []
    for _ in range(2):
        ran = subprocess.run(["bash", str(tmp_path / "launch.sh")], capture_output=True, text=True, timeout=60,
                             env={"PATH": f"{stub.parent}:/usr/bin:/bin"})
        assert ran.returncode == 0, ran.stderr
        (made,) = set(re.findall(r"RUNNER_SUBMISSION=(\S+)", ran.stdout))
        assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", made), ran.stdout
        assert f"runner-submission={made}" in ran.stdout
        ids.append(made)
    assert ids[0] != ids[1]
