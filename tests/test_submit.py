"""`runner submit`, `status`, `cancel` and `logs --summary` against a local fake of the Cloud TPU API (and the GCS
emulator for the run folder), and the dry run's gcloud script run by the real gcloud against the same fake:
both must send the same request, for every flag that reaches it. The runner commands run in this process
(Typer's CliRunner: the same exit codes, stdout and stderr); gcloud runs as its own process.

The startup script itself is tested in test_startup.py, the watcher in test_recovery.py."""

from __future__ import annotations

import base64
import json
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.spec.load import load_spec
from tests.conftest import last_json
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke

pytest_plugins = ["tests.support.cloud_fixtures"]

BUCKET = "runner-test"
GCLOUD = shutil.which("gcloud")
QR_PATH = f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources"


@pytest.fixture
def api(tpu_fake, gcs, bucket, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment that points the runner, gcloud and the bucket at the fakes (the bucket's run folders
    emptied)."""
    for name in gcs.objects(bucket, "runs/"):
        gcs.client().bucket(bucket).blob(name).delete()
    yield cloud_env(tpu_fake.endpoint, tmp_path, **gcs.env)


def submit(spec: Path, env: dict[str, str], *extra: str, where: bool = True, tpu_type: str = "v5litepod-8",
           zone: str = ZONE) -> subprocess.CompletedProcess:
    place = ("--zone", zone, "--project", PROJECT) if where else ()
    return invoke("submit", spec, "--tpu-type", tpu_type, *place, "--image", IMAGE, *extra, env=env)


def as_proto(body: dict[str, Any]):
    """A recorded body as the QueuedResource proto (enum and int64 spellings no longer matter)."""
    from google.cloud import tpu_v2
    from google.protobuf import json_format

    return json_format.ParseDict(body, tpu_v2.QueuedResource.pb(tpu_v2.QueuedResource()))


def creates(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in requests if r["method"] == "POST" and r["path"].endswith("/queuedResources")]


def node_of(body: dict[str, Any]) -> dict[str, Any]:
    return body["tpu"]["nodeSpec"][0]["node"]


def the_script(body: dict[str, Any]) -> str:
    return node_of(body)["metadata"]["startup-script"]


def setting(script: str, key: str) -> str:
    return next(line.split("=", 1)[1] for line in script.splitlines() if line.startswith(f"{key}="))


# --- submit ----------------------------------------------------------------------------------------


def test_submit_creates_a_queued_resource_whose_startup_script_runs_the_image(api, tpu_fake, cloud_spec, gcs):
    result = submit(cloud_spec, api, "--spot")
    assert result.returncode == 0, result.stderr
    printed = last_json(result.stdout)
    assert printed["name"] == "mnist-cnn"  # the job name as a queued-resource id
    assert printed["run_dir"] == "gs://runner-test/runs/mnist_cnn"
    assert printed["operation"].startswith(f"projects/{PROJECT}/locations/{ZONE}/operations/")
    assert printed["max_restarts"] == 3, "spot capacity is restarted after preemption by default"

    [request] = creates(tpu_fake.requests())
    assert request["path"] == QR_PATH
    assert request["query"]["queuedResourceId"] == ["mnist-cnn"]
    sent = as_proto(request["body"])
    assert sent.HasField("spot")
    [node_spec] = sent.tpu.node_spec
    assert (node_spec.parent, node_spec.node_id) == (f"projects/{PROJECT}/locations/{ZONE}", "mnist-cnn")
    assert node_spec.node.accelerator_type == "v5litepod-8"
    assert list(node_spec.node.service_account.scope) == ["https://www.googleapis.com/auth/cloud-platform"]
    assert dict(node_spec.node.labels) == {"runner-job": "mnist-cnn", "runner-submission": printed["submission"]}

    script = node_spec.node.metadata["startup-script"]
    assert "docker run" in script and "--net=host --privileged" in script and "-e TPU_NAME=local" in script
    assert f"RUNNER_IMAGE={IMAGE}" in script
    assert "RUNNER_RUN_DIR=gs://runner-test/runs/mnist_cnn" in script
    assert setting(script, "RUNNER_SUBMISSION") == printed["submission"]
    assert setting(script, "RUNNER_EPOCHS") == "2"
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr

    job = json.loads(gcs.read(BUCKET, "runs/mnist_cnn/job.json"))
    assert (job["name"], job["max_restarts"], job["request"]["spot"]) == ("mnist-cnn", 3, True)
    assert [w["id"] for w in job["submissions"]] == [printed["submission"]]
    assert job["restarts"] == [] and job["outcome"] is None


def test_the_startup_script_carries_the_resolved_spec_with_the_tpu_required(api, tpu_fake, cloud_spec, tmp_path):
    assert submit(cloud_spec, api, "--set", "train.epochs=5").returncode == 0
    script = the_script(creates(tpu_fake.requests())[0]["body"])
    shipped = tmp_path / "shipped.yaml"
    shipped.write_bytes(base64.b64decode(setting(script, "RUNNER_SPEC_B64")))
    on_vm = load_spec(shipped)
    expected = load_spec(cloud_spec, ["train.epochs=5", "accelerator.kind=tpu"])
    assert on_vm == expected  # a job that silently fell back to the CPU would still bill TPU hours


def test_the_same_name_cannot_be_submitted_twice_and_each_submission_has_its_own_id(api, tpu_fake, cloud_spec):
    first = submit(cloud_spec, api)
    assert first.returncode == 0
    again = submit(cloud_spec, api)
    assert again.returncode == 2
    assert "already exists" in again.stderr and "runner cancel mnist-cnn" in again.stderr
    assert invoke("cancel", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=api).returncode == 0
    third = submit(cloud_spec, api)
    assert third.returncode == 0, third.stderr
    ids = [node_of(c["body"])["labels"]["runner-submission"] for c in creates(tpu_fake.requests())]
    assert len(set(ids)) == 3, "the refused request had its own id too"
    assert [ids[0], ids[2]] == [last_json(first.stdout)["submission"], last_json(third.stdout)["submission"]]


def test_zone_and_project_default_to_gclouds_configuration_as_gcloud_reads_it(api, tpu_fake, cloud_spec, tmp_path):
    config = Path(api["CLOUDSDK_CONFIG"])
    (config / "configurations").mkdir(parents=True)
    (config / "active_config").write_text("work")
    (config / "configurations" / "config_work").write_text(f"[core]\nproject = {PROJECT}\n\n[compute]\nzone = {ZONE}\n")
    if GCLOUD:  # what we read is what gcloud itself answers, without a network call
        for key, expected in (("core/project", PROJECT), ("compute/zone", ZONE)):
            answer = subprocess.run([GCLOUD, "config", "get", key], capture_output=True, text=True, timeout=60, env=api)
            assert answer.stdout.strip() == expected, answer.stderr
    result = submit(cloud_spec, api, where=False)
    assert result.returncode == 0, result.stderr
    assert creates(tpu_fake.requests())[0]["path"] == QR_PATH

    (config / "active_config").write_text("empty")
    missing = submit(cloud_spec, api, where=False)
    assert missing.returncode == 2
    assert "missing --zone" in missing.stderr and "missing --project" in missing.stderr


# --- dry run and gcloud -------------------------------------------------------------------------


@pytest.mark.host
@pytest.mark.parametrize("flags", [
    ("--spot",),
    ("--name", "mnist-v6e", "--runtime-version", "v2-alpha-tpuv5-lite"),
    ("--network", "runner-net", "--subnetwork", "runner-subnet",
     "--service-account", "runner@runner-test.iam.gserviceaccount.com", "--valid-until", "6h"),
    # no external IP: gcloud leaves enableExternalIps out (false), and so does runner
    ("--internal-ips", "--service-account", "runner@runner-test.iam.gserviceaccount.com"),
    ("--reservation", PROJECT, "--valid-until", "2031-01-01T00:00:00Z"),
    ("--reservation", "shared-capacity", "--valid-until", "1h30m", "--keep"),
    # gcloud keeps the offset and cuts the fraction to milliseconds; runner sends the same instant
    ("--valid-until", "2031-01-01T00:00:00.123456789+05:30", "--max-run-duration", "6h", "--stall-timeout", "10m"),
    ("--spot", "--valid-until", "2031-06-01t12:30:00.5-08:00", "--max-run-duration", "none"),
    ("--runtime-version", "tpu-vm-tf-2.18.0-pjrt", "--allow-unverified", "--valid-until", "2d"),
])
def test_the_dry_run_sends_nothing_and_its_gcloud_script_sends_the_same_request(api, tpu_fake, cloud_spec, tmp_path,
                                                                               flags):
    assert GCLOUD, "gcloud is not installed on this machine"
    dry = submit(cloud_spec, api, *flags, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert tpu_fake.requests() == []

    by_gcloud, by_runner = sent_by_gcloud_then_runner(dry.stdout, api, tpu_fake, cloud_spec, tmp_path, flags)
    assert by_gcloud["path"] == by_runner["path"]
    assert by_gcloud["query"]["queuedResourceId"] == by_runner["query"]["queuedResourceId"]
    assert as_proto(by_gcloud["body"]) == as_proto(by_runner["body"])
    # the proto comparison reads a time's instant only: the text sent must be gcloud's too
    assert by_gcloud["body"].get("queueingPolicy") == by_runner["body"].get("queueingPolicy")


def sent_by_gcloud_then_runner(script: str, api, tpu_fake, cloud_spec, tmp_path: Path, flags: tuple[str, ...],
                               **where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The create request a gcloud script sends to the fake, then the one `runner submit FLAGS` sends (with the
    submission id gcloud's startup script carries, so that the two can be the same)."""
    launch = tmp_path / "launch.sh"
    launch.write_text(script)
    sent = subprocess.run(["bash", str(launch)], capture_output=True, text=True, timeout=120, env=api, cwd=tmp_path)
    assert sent.returncode == 0, sent.stderr
    [by_gcloud] = creates(tpu_fake.requests())

    tpu_fake.reset()
    same_id = setting(the_script(by_gcloud["body"]), "RUNNER_SUBMISSION")
    assert submit(cloud_spec, api, *flags, "--submission-id", same_id, **where).returncode == 0
    [by_runner] = creates(tpu_fake.requests())
    return by_gcloud, by_runner


def test_a_v6e_16_dry_run_shows_the_request_gcloud_sends_the_price_of_16_chips_and_the_4_workers(
        api, tpu_fake, cloud_spec, tmp_path):
    """The multi-host slice of Done-when: its request is the same body as gcloud's for the same flags; one node of
    type v6e-16 whose startup script runs on each of its 4 TPU VMs; the price is that of all 16 chips."""
    assert GCLOUD, "gcloud is not installed on this machine"
    where = {"tpu_type": "v6e-16", "zone": "us-central1-b"}
    dry = submit(cloud_spec, api, "--spot", "--dry-run", **where)
    assert dry.returncode == 0, dry.stderr
    assert tpu_fake.requests() == []
    said = " ".join(dry.stderr.split())
    assert "price: v6e-16 = 16 chips x $0.54421 per chip-hour Spot in us-central1 = $8.71 per hour" in said
    assert ("workers: 4 hosts of 4 chips: the startup script runs the container on each of the 4 TPU VMs (workers "
            "0-3), one JAX process per host") in said
    assert "worker 0 deletes the slice when its job ends, another worker if worker 0 is lost" in said
    assert "runtime: v2-alpha-tpuv6e" in said

    by_gcloud, by_runner = sent_by_gcloud_then_runner(dry.stdout, api, tpu_fake, cloud_spec, tmp_path, ("--spot",),
                                                      **where)
    assert as_proto(by_gcloud["body"]) == as_proto(by_runner["body"])
    node = node_of(by_runner["body"])
    assert (node["acceleratorType"], node["runtimeVersion"]) == ("v6e-16", "v2-alpha-tpuv6e")
    assert setting(the_script(by_runner["body"]), "RUNNER_HOSTS") == "4"


def test_a_multi_host_slice_refuses_a_local_run_folder_saying_its_hosts_share_no_disk(api, tmp_path):
    spec = tmp_path / "local.yaml"
    spec.write_text(yaml.safe_dump({"name": "mnist_cnn", "data": {"train": "gs://runner-test/data/train-*.tfrecord",
                                                                  "eval": None}, "output": {"dir": "runs"}}))
    refused = submit(spec, api, "--dry-run", tpu_type="v5p-16")
    assert refused.returncode == 2
    said = " ".join(refused.stderr.split())
    assert (f"output.dir is '{tmp_path / 'runs'}': the 2 hosts of a multi-host slice share no disk: process 0 "
            "writes the run folder, every host its own log and its part of each checkpoint, all in one place they "
            "can all reach; write to a bucket, e.g. --set output.dir=gs://runner-test/runs") in said


@pytest.mark.host
@pytest.mark.parametrize("given, sent", [
    ("2031-01-01T00:00:00Z", "2031-01-01T00:00:00.000Z"),
    ("2031-01-01T00:00:00.123456789+05:30", "2031-01-01T00:00:00.123+05:30"),
    ("2031-01-01T00:00-08:00", "2031-01-01T00:00:00.000-08:00"),
])
def test_a_valid_until_time_is_sent_as_the_text_the_real_gcloud_sends(api, tpu_fake, cloud_spec, tmp_path, given,
                                                                      sent):
    """Byte for byte, not only the same instant: gcloud keeps the offset and writes whole milliseconds, which the
    client's proto Timestamp (UTC, fraction trimmed: 2030-12-31T18:30:00.123Z) cannot. gcloud gets the text as
    typed, in the dry run's script in place of the text runner shows."""
    assert GCLOUD, "gcloud is not installed on this machine"
    flags = ("--valid-until", given)
    dry = submit(cloud_spec, api, *flags, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f'"validUntilTime": "{sent}"' in dry.stdout, "the request shown is the one sent"
    shown = f"--valid-until-time={sent}"
    assert shown in dry.stdout
    typed = dry.stdout.replace(shown, f"--valid-until-time={shlex.quote(given)}")

    by_gcloud, by_runner = sent_by_gcloud_then_runner(typed, api, tpu_fake, cloud_spec, tmp_path, flags)
    assert by_gcloud["body"]["queueingPolicy"] == {"validUntilTime": sent}
    assert by_runner["body"]["queueingPolicy"] == {"validUntilTime": sent}
    assert as_proto(by_gcloud["body"]) == as_proto(by_runner["body"])


def test_the_new_flags_reach_the_request(api, tpu_fake, cloud_spec):
    result = submit(
        cloud_spec,
        api,
        "--network",
        "runner-net",
        "--subnetwork",
        "runner-subnet",
        "--service-account",
        "runner@runner-test.iam.gserviceaccount.com",
        "--reservation",
        "shared-capacity",
        "--valid-until",
        "6h",
    )
    assert result.returncode == 0, result.stderr
    body = creates(tpu_fake.requests())[0]["body"]
    node = node_of(body)
    assert node["networkConfig"] == {"network": "runner-net", "subnetwork": "runner-subnet", "enableExternalIps": True}
    assert node["serviceAccount"]["email"] == "runner@runner-test.iam.gserviceaccount.com"
    assert body["reservationName"] == f"projects/shared-capacity/locations/{ZONE}/reservations/-"
    assert body["queueingPolicy"] == {"validUntilDuration": "21600s"}


@pytest.mark.host
def test_cancel_sends_what_gcloud_delete_sends_and_marks_the_submission_cancelled(api, tpu_fake, cloud_spec, gcs):
    assert GCLOUD, "gcloud is not installed on this machine"
    assert submit(cloud_spec, api).returncode == 0
    gcloud = subprocess.run(
        [
            GCLOUD,
            "compute",
            "tpus",
            "queued-resources",
            "delete",
            "mnist-cnn",
            f"--project={PROJECT}",
            f"--zone={ZONE}",
            "--force",
            "--quiet",
            "--async",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=api,
    )
    assert gcloud.returncode == 0, gcloud.stderr
    submitted = submit(cloud_spec, api)
    assert submitted.returncode == 0
    cancelled = invoke("cancel", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=api)
    assert cancelled.returncode == 0, cancelled.stderr
    doc = last_json(cancelled.stdout)
    assert doc["deleting"] is True and doc["submission"] == last_json(submitted.stdout)["submission"]
    assert f"runs/mnist_cnn/logs/{doc['submission']}/cancelled.json" in gcs.objects(BUCKET, "runs/")

    deletes = [r for r in tpu_fake.requests() if r["method"] == "DELETE"]
    assert len(deletes) == 2
    by_gcloud, by_runner = deletes
    assert by_gcloud["path"] == by_runner["path"] == f"{QR_PATH}/mnist-cnn"
    # gcloud spells the flag True, the client true: the API reads both as the boolean.
    assert (
        [v.lower() for v in by_gcloud["query"]["force"]] == [v.lower() for v in by_runner["query"]["force"]] == ["true"]
    )


# --- status, listing, cost --------------------------------------------------------------------------


def test_status_follows_the_job_by_its_name_until_and_after_cancel(api, tpu_fake, cloud_spec):
    assert submit(cloud_spec, api).returncode == 0
    where = ("--zone", ZONE, "--project", PROJECT)

    queued = invoke("status", "mnist-cnn", *where, env=api)
    assert queued.returncode == 0, queued.stderr
    doc = last_json(queued.stdout)
    assert (doc["state"], doc["node"], doc["accelerator_type"]) == ("ACCEPTED", None, "v5litepod-8")
    assert doc["run_dir"] == "gs://runner-test/runs/mnist_cnn"
    assert (doc["restarts"], doc["max_restarts"], doc["step"]) == ([], 0, None)

    tpu_fake.set_state("mnist-cnn", "ACTIVE", node_state="READY")
    running = last_json(invoke("status", "mnist-cnn", *where, env=api).stdout)
    assert running["state"] == "ACTIVE" and running["node"] == {"state": "READY", "health": "HEALTHY"}
    assert running["cost"]["hours"] >= 0 and running["cost"]["submissions"][0]["measured"].startswith("node createTime")

    assert invoke("cancel", "mnist-cnn", *where, env=api).returncode == 0
    gone = invoke("status", "mnist-cnn", *where, env=api)
    assert gone.returncode == 0, gone.stderr
    after = last_json(gone.stdout)
    assert (after["state"], after["queued_resource"]) == ("cancelled", None)

    unknown = invoke("status", "never-submitted", *where, env=api)
    assert unknown.returncode == 2
    assert "cannot find job 'never-submitted'" in unknown.stderr and "run folder" in unknown.stderr


def test_status_without_a_name_lists_the_runner_jobs_in_the_zone(api, tpu_fake, cloud_spec):
    assert submit(cloud_spec, api, "--spot").returncode == 0
    same_folder = submit(cloud_spec, api, "--name", "mnist-again")
    assert same_folder.returncode == 2, "one run folder, one live job"
    assert "belongs to job 'mnist-cnn'" in same_folder.stderr
    assert submit(cloud_spec, api, "--name", "mnist-again", "--set", "name=mnist_again").returncode == 0
    tpu_fake.set_state("mnist-cnn", "ACTIVE", node_state="READY")
    listing = invoke("status", "--zone", ZONE, "--project", PROJECT, env=api)
    assert listing.returncode == 0, listing.stderr
    rows = [json.loads(line) for line in listing.stdout.splitlines() if line.strip()]
    assert [(r["name"], r["state"], r["restarts"], r["spot"]) for r in rows] == [
        ("mnist-again", "ACCEPTED", 0, False),
        ("mnist-cnn", "ACTIVE", 0, True),
    ]
    assert all(r["usd"] is not None and r["usd"] >= 0 for r in rows)


def test_the_cost_is_chips_times_the_hours_the_node_existed_times_the_price():
    from runner.cloud import pricing, usage

    job = {
        "zone": "us-central1-a",
        "request": {"tpu_type": "v5p-8", "spot": False},
        "submissions": [
            {
                "id": "a",
                "created_at": "2026-11-22T09:00:00Z",
                "node_created_at": "2026-11-22T10:00:00.000000Z",
                "deleted_at": "2026-11-22T11:30:00.000000Z",
            },
            {"id": "b", "created_at": "2026-11-22T12:00:00Z", "gone_at": "2026-11-22T12:30:00Z"},
        ],
    }
    cost = usage.job_cost(job)
    price = pricing.price_per_chip_hour("v5p-8", "us-central1", False)
    assert cost["chips"] == 4  # v5p-8: 8 TensorCores, 4 chips
    assert [w["hours"] for w in cost["submissions"]] == [1.5, 0.5]  # from the node, not the queued resource
    assert "upper bound" in cost["submissions"][1]["measured"]
    if price.usd is None:
        assert cost["usd"] is None and cost["price"]["note"]
    else:
        assert cost["usd"] == pytest.approx(4 * 2.0 * price.usd, abs=1e-3)
        assert cost["price"]["source"] == price.source


def test_the_summary_comes_with_its_restarts_and_cost(api, tpu_fake, cloud_spec, gcs):
    assert submit(cloud_spec, api, "--spot").returncode == 0
    tpu_fake.set_state("mnist-cnn", "ACTIVE", node_state="READY")
    summary = json.loads((Path(__file__).parent / "data/summary_v1.json").read_text())
    gcs.write(BUCKET, "runs/mnist_cnn/summary.json", json.dumps(summary).encode())
    shown = invoke("logs", "mnist-cnn", "--summary", "--zone", ZONE, "--project", PROJECT, env=api)
    assert shown.returncode == 0, shown.stderr
    doc = last_json(shown.stdout)
    assert doc["status"] == summary["status"] and doc["timing"] == summary["timing"]
    assert doc["restarts"] == [] and len(doc["submissions"]) == 1
    assert doc["cost"]["accelerator_type"] == "v5litepod-8" and doc["cost"]["spot"] is True
    assert doc["cost"]["chips"] == 8


# --- bad input: refused before any call --------------------------------------------------------


@pytest.mark.parametrize(
    "flags, spec_change, message",
    [
        (["--zone", "us-central1"], {}, "is a region; give one of its zones (us-central1- and a letter)"),
        (["--zone", "central"], {}, "is not a zone name"),
        (["--image", ""], {}, "missing --image"),
        (["--image", "runner:tpu"], {}, "names no registry"),
        (["--tpu-type", "v5e-8"], {}, "the Cloud TPU API calls it v5litepod-8"),
        (["--tpu-type", "v5litepod-3"], {}, "v5litepod comes in sizes 1, 4, 8"),
        (["--tpu-type", "v9-8"], {}, "unknown TPU generation 'v9'"),
        (["--name", "Mnist_CNN"], {}, "cannot name a queued resource"),
        (["--valid-until", "soon"], {}, "--valid-until 'soon' is neither a duration"),
        (["--valid-until", "2020-01-01T00:00:00Z"], {}, "has already passed"),
        (["--service-account", "runner"], {}, "is not a service account's email"),
        (["--network", "Bad Net"], {}, "is not a network name"),
        (["--reservation", "projects/x/reservations/y"], {}, "must name the project that holds the reservation"),
        ([], {"output": {"dir": "runs"}}, "runs': a TPU VM's disk goes with the VM"),
        (
            [],
            {"data": {"train": "data/mnist/train-*.tfrecord", "eval": None}},
            "train-*.tfrecord': the TPU VM cannot see this machine's files",
        ),
        ([], {"accelerator": {"kind": "cpu"}}, "accelerator.kind is 'cpu'"),
    ],
)
def test_bad_input_is_refused_before_any_call(api, tpu_fake, cloud_spec, flags, spec_change, message):
    if spec_change:
        doc = yaml.safe_load(cloud_spec.read_text())
        for section, values in spec_change.items():
            doc[section].update(values) if section in doc else doc.update({section: values})
        cloud_spec.write_text(yaml.safe_dump(doc))
    args = {"--tpu-type": "v5litepod-8", "--zone": ZONE, "--image": IMAGE, "--project": PROJECT}
    args.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    result = invoke("submit", cloud_spec, *[x for pair in args.items() for x in pair], env=api)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert tpu_fake.requests() == []


def test_every_problem_is_listed_at_once(api, tpu_fake, cloud_spec):
    result = invoke("submit", cloud_spec, "--tpu-type", "v5e-8", "--zone", "us-central1", "--project", PROJECT, env=api)
    assert result.returncode == 2
    for message in ("v5litepod-8", "is a region", "missing --image"):
        assert message in result.stderr
    assert tpu_fake.requests() == []


def test_an_unreachable_api_is_an_infrastructure_error(api, cloud_spec):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    env = {**api, "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": f"http://127.0.0.1:{closed}/"}
    result = submit(cloud_spec, env, "--no-preflight")  # the create's own error; the preflight's: test_submit_preflight
    assert result.returncode == 3
    assert "could not reach the Cloud TPU API to create 'mnist-cnn'" in result.stderr


def test_internal_ips_are_kept_for_the_relaunch_after_a_preemption(api, tpu_fake, cloud_spec, gcs):
    """--internal-ips reaches the request (no enableExternalIps) and job.json, from which a watcher's relaunch
    (jobs.submission_from_job) sends the same network again."""
    from runner.cloud import jobs, request

    result = submit(cloud_spec, api, "--internal-ips")
    assert result.returncode == 0, result.stderr
    [create] = creates(tpu_fake.requests())
    assert node_of(create["body"])["networkConfig"] == {"network": "default"}
    job = json.loads(gcs.read(BUCKET, "runs/mnist_cnn/job.json"))
    assert job["request"]["internal_ips"] is True
    again = jobs.submission_from_job(job, "20260101-000000-abcd")
    assert node_of(request.request_json(again))["networkConfig"] == {"network": "default"}
