"""`runner submit`, `status` and `cancel` against a local fake of the Cloud TPU API, and the dry run's gcloud
script run by the real gcloud against the same fake: both must send the same request."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from runner.specfile import load_spec
from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.tpu_fake import TpuFake, start_tpu_fake

PROJECT, ZONE = "runner-test", "us-central1-a"
IMAGE = "us-central1-docker.pkg.dev/runner-test/runner/runner:tpu"
GCLOUD = shutil.which("gcloud")


@pytest.fixture(scope="module")
def tpu_api(tmp_path_factory) -> Iterator[TpuFake]:
    with start_tpu_fake(tmp_path_factory.mktemp("tpu_api")) as fake:
        yield fake


@pytest.fixture
def api(tpu_api: TpuFake, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A clean fake and the environment that points both the runner and gcloud at it."""
    tpu_api.reset()
    yield cli_env(
        CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=f"{tpu_api.endpoint}/",
        CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token",
        CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
        CLOUDSDK_CORE_DISABLE_PROMPTS="1",
    )


@pytest.fixture
def cloud_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path, {
        "name": "mnist_cnn",
        "data": {"train": "gs://runner-test/data/mnist/train-*.tfrecord", "eval": "gs://runner-test/data/mnist/test-*.tfrecord"},
        "train": {"epochs": 2},
        "output": {"dir": "gs://runner-test/runs"},
    })


def submit(spec: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return run_cli("submit", spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--image", IMAGE,
                   "--project", PROJECT, *extra, env=env, timeout=120)


def as_proto(body: dict[str, Any]):
    """A recorded body as the QueuedResource proto (enum and int64 spellings no longer matter)."""
    from google.cloud import tpu_v2
    from google.protobuf import json_format

    return json_format.ParseDict(body, tpu_v2.QueuedResource.pb(tpu_v2.QueuedResource()))


def creates(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in requests if r["method"] == "POST" and r["path"].endswith("/queuedResources")]


def the_script(body: dict[str, Any]) -> str:
    return body["tpu"]["nodeSpec"][0]["node"]["metadata"]["startup-script"]


# --- submit ----------------------------------------------------------------------------------------


def test_submit_creates_a_queued_resource_whose_startup_script_runs_the_image(api, tpu_api, cloud_spec):
    result = submit(cloud_spec, api, "--spot")
    assert result.returncode == 0, result.stderr
    printed = last_json(result.stdout)
    assert printed["name"] == "mnist-cnn"  # the job name as a queued-resource id
    assert printed["run_dir"] == "gs://runner-test/runs/mnist_cnn"
    assert printed["operation"].startswith(f"projects/{PROJECT}/locations/{ZONE}/operations/")

    [request] = creates(tpu_api.requests())
    assert request["path"] == f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources"
    assert request["query"]["queuedResourceId"] == ["mnist-cnn"]
    sent = as_proto(request["body"])
    assert sent.HasField("spot")
    [node_spec] = sent.tpu.node_spec
    assert (node_spec.parent, node_spec.node_id) == (f"projects/{PROJECT}/locations/{ZONE}", "mnist-cnn")
    assert node_spec.node.accelerator_type == "v5litepod-8"
    assert node_spec.node.runtime_version == "v2-alpha-tpuv5-lite"
    assert list(node_spec.node.service_account.scope) == ["https://www.googleapis.com/auth/cloud-platform"]

    script = node_spec.node.metadata["startup-script"]
    assert "docker run" in script and "--net=host --privileged" in script and "-e TPU_NAME=local" in script
    assert f"RUNNER_IMAGE={IMAGE}" in script
    assert "RUNNER_RUN_DIR=gs://runner-test/runs/mnist_cnn" in script
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr


def test_the_startup_script_carries_the_resolved_spec_with_the_tpu_required(api, tpu_api, cloud_spec, tmp_path):
    assert submit(cloud_spec, api, "--set", "train.epochs=5").returncode == 0
    script = the_script(creates(tpu_api.requests())[0]["body"])
    encoded = next(line.split("=", 1)[1] for line in script.splitlines() if line.startswith("RUNNER_SPEC_B64="))
    shipped = tmp_path / "shipped.yaml"
    shipped.write_bytes(base64.b64decode(encoded))
    on_vm = load_spec(shipped)
    expected = load_spec(cloud_spec, ["train.epochs=5", "accelerator.kind=tpu"])
    assert on_vm == expected  # a job that silently fell back to the CPU would still bill TPU hours


def test_the_same_name_cannot_be_submitted_twice(api, cloud_spec):
    assert submit(cloud_spec, api).returncode == 0
    again = submit(cloud_spec, api)
    assert again.returncode == 2
    assert "already exists" in again.stderr and "runner cancel mnist-cnn" in again.stderr


# --- dry run and gcloud -------------------------------------------------------------------------


@pytest.mark.host
@pytest.mark.parametrize("flags", [("--spot",), ("--name", "mnist-v6e", "--runtime-version", "v2-alpha-tpuv5-lite")])
def test_the_dry_run_sends_nothing_and_its_gcloud_script_sends_the_same_request(api, tpu_api, cloud_spec, tmp_path, flags):
    assert GCLOUD, "gcloud is not installed on this machine"
    dry = submit(cloud_spec, api, *flags, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert tpu_api.requests() == []

    script = tmp_path / "launch.sh"
    script.write_text(dry.stdout)
    sent_by_gcloud = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, env=api, cwd=tmp_path)
    assert sent_by_gcloud.returncode == 0, sent_by_gcloud.stderr
    [by_gcloud] = creates(tpu_api.requests())

    tpu_api.reset()
    assert submit(cloud_spec, api, *flags).returncode == 0
    [by_runner] = creates(tpu_api.requests())
    assert by_gcloud["path"] == by_runner["path"]
    assert by_gcloud["query"]["queuedResourceId"] == by_runner["query"]["queuedResourceId"]
    assert as_proto(by_gcloud["body"]) == as_proto(by_runner["body"])


@pytest.mark.host
def test_cancel_sends_what_gcloud_delete_sends(api, tpu_api, cloud_spec):
    assert GCLOUD, "gcloud is not installed on this machine"
    assert submit(cloud_spec, api).returncode == 0
    gcloud = subprocess.run(
        [GCLOUD, "compute", "tpus", "queued-resources", "delete", "mnist-cnn", f"--project={PROJECT}", f"--zone={ZONE}",
         "--force", "--quiet", "--async"],
        capture_output=True, text=True, timeout=120, env=api,
    )
    assert gcloud.returncode == 0, gcloud.stderr
    assert submit(cloud_spec, api).returncode == 0
    cancelled = run_cli("cancel", "mnist-cnn", "--zone", ZONE, "--project", PROJECT, env=api, timeout=60)
    assert cancelled.returncode == 0, cancelled.stderr
    assert last_json(cancelled.stdout)["deleting"] is True

    deletes = [r for r in tpu_api.requests() if r["method"] == "DELETE"]
    assert len(deletes) == 2
    by_gcloud, by_runner = deletes
    assert by_gcloud["path"] == by_runner["path"] == f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources/mnist-cnn"
    # gcloud spells the flag True, the client true: the API reads both as the boolean.
    assert [v.lower() for v in by_gcloud["query"]["force"]] == [v.lower() for v in by_runner["query"]["force"]] == ["true"]


# --- status and cancel -----------------------------------------------------------------------------


def test_status_follows_the_queued_resource_until_cancel_deletes_it(api, tpu_api, cloud_spec):
    assert submit(cloud_spec, api).returncode == 0
    where = ("--zone", ZONE, "--project", PROJECT)

    queued = run_cli("status", "mnist-cnn", *where, env=api, timeout=60)
    assert queued.returncode == 0, queued.stderr
    doc = last_json(queued.stdout)
    assert (doc["state"], doc["node"], doc["accelerator_type"]) == ("ACCEPTED", None, "v5litepod-8")
    assert doc["run_dir"] == "gs://runner-test/runs/mnist_cnn"

    tpu_api.set_state("mnist-cnn", "ACTIVE", node_state="READY")
    running = last_json(run_cli("status", "mnist-cnn", *where, env=api, timeout=60).stdout)
    assert running["state"] == "ACTIVE" and running["node"]["state"] == "READY"

    assert run_cli("cancel", "mnist-cnn", *where, env=api, timeout=60).returncode == 0
    gone = run_cli("status", "mnist-cnn", *where, env=api, timeout=60)
    assert gone.returncode == 2
    assert "no queued resource 'mnist-cnn'" in gone.stderr and "runner logs" in gone.stderr


# --- bad input: refused before any call --------------------------------------------------------


@pytest.mark.parametrize("flags, spec_change, message", [
    (["--zone", "us-central1"], {}, "is a region; give one of its zones, e.g. us-central1-a"),
    (["--zone", "central"], {}, "is not a zone name"),
    (["--image", ""], {}, "missing --image"),
    (["--image", "runner:tpu"], {}, "names no registry"),
    (["--tpu-type", "v5e-8"], {}, "the Cloud TPU API calls it v5litepod-8"),
    (["--tpu-type", "v5litepod-3"], {}, "v5litepod comes in sizes 1, 4, 8"),
    (["--tpu-type", "v9-8"], {}, "unknown TPU generation 'v9'"),
    (["--name", "Mnist_CNN"], {}, "cannot name a queued resource"),
    ([], {"output": {"dir": "runs"}}, "output.dir is 'runs'"),
    ([], {"data": {"train": "data/mnist/train-*.tfrecord", "eval": None}}, "data.train is 'data/mnist/train-*.tfrecord'"),
    ([], {"accelerator": {"kind": "cpu"}}, "accelerator.kind is 'cpu'"),
])
def test_bad_input_is_refused_before_any_call(api, tpu_api, cloud_spec, flags, spec_change, message):
    if spec_change:
        doc = yaml.safe_load(cloud_spec.read_text())
        for section, values in spec_change.items():
            doc[section].update(values) if section in doc else doc.update({section: values})
        cloud_spec.write_text(yaml.safe_dump(doc))
    args = {"--tpu-type": "v5litepod-8", "--zone": ZONE, "--image": IMAGE, "--project": PROJECT}
    args.update(dict(zip(flags[::2], flags[1::2])))
    result = run_cli("submit", cloud_spec, *[x for pair in args.items() for x in pair], env=api, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert tpu_api.requests() == []


def test_every_problem_is_listed_at_once(api, tpu_api, cloud_spec):
    result = run_cli("submit", cloud_spec, "--tpu-type", "v5e-8", "--zone", "us-central1", "--project", PROJECT,
                     env=api, timeout=60)
    assert result.returncode == 2
    for message in ("v5litepod-8", "is a region", "missing --image"):
        assert message in result.stderr
    assert tpu_api.requests() == []


def test_an_unreachable_api_is_an_infrastructure_error(api, cloud_spec):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    env = {**api, "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": f"http://127.0.0.1:{closed}/"}
    result = submit(cloud_spec, env)
    assert result.returncode == 3
    assert "could not reach the Cloud TPU API to create 'mnist-cnn'" in result.stderr


# --- the startup script, run on this machine ----------------------------------------------------
# The TPU VM's docker, gcloud and metadata server cannot exist here: small executables on PATH stand in
# for them, record every call, and keep "gs://" objects in a local folder.

_SHIMS = {
    "curl": """#!/bin/sh
echo "curl $*" >>"$FAKE_CALLS"
case "$*" in
  *worker-network-endpoints*) echo "$FAKE_ENDPOINTS" ;;
  *) echo "$FAKE_WORKER" ;;
esac
""",
    "gcloud": """#!/bin/bash
echo "gcloud $*" >>"$FAKE_CALLS"
local_of() { echo "$FAKE_GCS/${1#gs://}"; }
case "$1 $2" in
  "storage ls") [ -e "$(local_of "${@: -1}")" ] ;;
  "storage cp") mkdir -p "$(dirname "$(local_of "${@: -1}")")" && cp "${@: -2:1}" "$(local_of "${@: -1}")" ;;
esac
""",
    "docker": """#!/bin/bash
echo "docker $*" >>"$FAKE_CALLS"
if [ "$1" = run ]; then
  for arg in "$@"; do case "$arg" in *:/job:ro) cp "${arg%%:/job:ro}/spec.yaml" "$FAKE_SEEN_SPEC" ;; esac; done
  echo "epoch 1/2: training"
  echo '{"status": "done"}'
  exit "$FAKE_EXIT"
fi
""",
}


def run_startup_script(
    script: str, folder: Path, worker: int = 0, exit_code: int = 0, hosts: int = 1
) -> tuple[list[str], Path]:
    """Runs a startup script as a TPU VM worker would at boot; returns the calls it made and the 'bucket'."""
    bin_dir, gcs_dir = folder / "bin", folder / "gcs"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in _SHIMS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = folder / "calls.txt"
    calls.unlink(missing_ok=True)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_CALLS": str(calls), "FAKE_GCS": str(gcs_dir),
        "FAKE_WORKER": str(worker), "FAKE_EXIT": str(exit_code),
        "FAKE_ENDPOINTS": ",".join(f"10.0.0.{n}:8470" for n in range(hosts)), "FAKE_SEEN_SPEC": str(folder / "seen.yaml"),
        "RUNNER_WORKDIR": str(folder / "work"),
    }
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return calls.read_text().splitlines() if calls.exists() else [], gcs_dir


def test_the_startup_script_runs_the_job_and_worker_0_deletes_the_queued_resource(api, tpu_api, cloud_spec, tmp_path):
    assert submit(cloud_spec, api, "--spot").returncode == 0
    script = the_script(creates(tpu_api.requests())[0]["body"])

    calls, gcs_dir = run_startup_script(script, tmp_path, worker=0)
    doctor, run = [c for c in calls if c.startswith("docker run")]
    assert doctor.endswith(f"{IMAGE} doctor --json --save /job/spec.yaml"), "the doctor checks the VM first"
    assert "--net=host --privileged" in run and "-e TPU_NAME=local" in run
    assert run.endswith(f"{IMAGE} run /job/spec.yaml")
    assert any(c == f"docker pull {IMAGE}" for c in calls)
    assert any(c.startswith("gcloud auth configure-docker us-central1-docker.pkg.dev") for c in calls)
    assert load_spec(tmp_path / "seen.yaml").accelerator.kind == "tpu"

    logs = gcs_dir / "runner-test/runs/mnist_cnn/logs"
    assert '{"status": "done"}' in (logs / "worker-0.log").read_text()
    record = json.loads((logs / "worker-0.exit.json").read_text())
    assert record["exit_code"] == 0 and record["worker"] == 0
    assert (record["accelerator_type"], record["spot"], record["usd_per_chip_hour"]) == ("v5litepod-8", True, 1.2)
    [delete] = [c for c in calls if "queued-resources delete" in c]
    assert f"delete mnist-cnn --project {PROJECT} --zone {ZONE} --force" in delete

    # At the next boot the finished job is not run again.
    again, _ = run_startup_script(script, tmp_path, worker=0)
    assert not [c for c in again if c.startswith("docker")]


def test_other_workers_and_kept_jobs_leave_the_queued_resource(api, tpu_api, cloud_spec, tmp_path):
    assert submit(cloud_spec, api).returncode == 0
    worker_1, _ = run_startup_script(the_script(creates(tpu_api.requests())[0]["body"]), tmp_path / "w1", worker=1)
    assert any(c.startswith("docker run") for c in worker_1)
    assert not [c for c in worker_1 if "delete" in c]

    tpu_api.reset()
    assert submit(cloud_spec, api, "--keep").returncode == 0
    kept, _ = run_startup_script(the_script(creates(tpu_api.requests())[0]["body"]), tmp_path / "kept", worker=0)
    assert not [c for c in kept if "delete" in c]


def test_a_multi_host_slice_is_driven_from_worker_0_with_the_slice_name(api, tpu_api, cloud_spec, tmp_path):
    assert submit(cloud_spec, api).returncode == 0
    script = the_script(creates(tpu_api.requests())[0]["body"])
    worker_1, _ = run_startup_script(script, tmp_path / "w1", worker=1, hosts=4)
    assert not [c for c in worker_1 if c.startswith("docker run")], "only worker 0 runs TensorFlow's client"
    worker_0, _ = run_startup_script(script, tmp_path / "w0", worker=0, hosts=4)
    [job] = [c for c in worker_0 if c.startswith("docker run") and c.endswith("run /job/spec.yaml")]
    assert "-e TPU_NAME=mnist-cnn -e TPU_LOAD_LIBRARY=0" in job and "TPU_NAME=local" not in job


# --- logs and the summary with its cost -------------------------------------------------------------


def test_logs_and_the_summary_with_its_cost_come_from_the_bucket(api, tpu_api, gcs, tmp_path):
    from runner.cloud import pricing

    bucket = gcs.bucket()
    spec = write_spec(tmp_path, {
        "name": "mnist_cnn",
        "data": {"train": f"gs://{bucket}/data/train-*.tfrecord", "eval": None},
        "output": {"dir": f"gs://{bucket}/runs"},
    })
    assert submit(spec, api, "--tpu-type", "v6e-8").returncode == 0
    _, gcs_dir = run_startup_script(the_script(creates(tpu_api.requests())[0]["body"]), tmp_path / "vm")
    run_dir = gcs.upload_folder(gcs_dir / bucket / "runs/mnist_cnn/logs", bucket, "runs/mnist_cnn/logs").rsplit("/logs", 1)[0]
    summary = json.loads((Path(__file__).parent / "data/summary_v1.json").read_text())
    gcs.write(bucket, "runs/mnist_cnn/summary.json", json.dumps(summary).encode())
    env = cli_env(**gcs.env)

    log = run_cli("logs", run_dir, env=env, timeout=60)
    assert log.returncode == 0, log.stderr
    assert log.stdout == (gcs_dir / bucket / "runs/mnist_cnn/logs/worker-0.log").read_text()

    with_cost = run_cli("logs", run_dir, "--summary", env=env, timeout=60)
    assert with_cost.returncode == 0, with_cost.stderr
    doc = last_json(with_cost.stdout)
    assert doc["status"] == summary["status"] and doc["timing"] == summary["timing"]
    record = json.loads(gcs.read(bucket, "runs/mnist_cnn/logs/worker-0.exit.json"))
    cost = doc["cost"]
    assert (cost["accelerator_type"], cost["chips"], cost["usd_per_chip_hour"]) == ("v6e-8", 8, 2.70)
    assert cost["hours"] >= 0 and cost["usd"] == pytest.approx(8 * cost["hours"] * 2.70, abs=1e-3)
    assert record["accelerator_type"] == "v6e-8"
    assert cost["price_table"]["date"] == pricing.price_table()["date"]


def test_the_cost_is_chips_times_hours_times_the_price(tmp_path):
    from runner.cloud import logs as joblogs

    record = {"worker": 0, "exit_code": 0, "started_at": "2026-11-22T10:00:00Z", "finished_at": "2026-11-22T11:30:00Z",
              "accelerator_type": "v5p-8", "spot": False, "usd_per_chip_hour": 4.2}
    cost = joblogs.cost_of(record)
    assert (cost["chips"], cost["hours"], cost["usd"]) == (4, 1.5, pytest.approx(4 * 1.5 * 4.2))  # v5p-8: 8 cores, 4 chips
    spot = joblogs.cost_of({**record, "spot": True})
    assert "upper bound" in spot["basis"]


def test_following_a_local_run_folder_ends_with_the_jobs_exit_code(api, tpu_api, cloud_spec, tmp_path):
    assert submit(cloud_spec, api).returncode == 0
    _, gcs_dir = run_startup_script(the_script(creates(tpu_api.requests())[0]["body"]), tmp_path, exit_code=75)
    run_dir = gcs_dir / "runner-test/runs/mnist_cnn"
    followed = run_cli("logs", run_dir, "--follow", "--interval", "1", timeout=60)
    assert followed.returncode == 75  # preempted: submit the same job again to resume it
    assert "job exited with code 75" in followed.stdout
    missing = run_cli("logs", tmp_path / "nowhere", timeout=60)
    assert missing.returncode == 2 and "no log at" in missing.stderr
