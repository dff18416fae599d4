"""Every cloud error that tells the user what to do, followed as written: the suggestion is read out of the
message (a flag, a `--set`, a `runner` or `gcloud` command, a type or zone it lists), applied, and the command
then gets past that error. `runner submit --dry-run` reaches the checks made before any call, offline; the rest
run against the local fakes (tests/support/: the Cloud TPU API, the preflight reads, the engines' APIs) with the
real clients. A gcloud command the suite cannot run to its end is parsed by the real gcloud (its argument errors
exit 2); kubectl and sky commands are checked against the real CLIs' own parsers the same way. A message whose
advice is wrong, vague or leaves a placeholder the runner could have filled fails its test. Exit codes follow
README's table: 2 for a flag or spec to fix, 3 for a cloud check or service that refused."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from runner.doctor.cloud import parse_image
from tests.conftest import REPO, cli_env, last_json, run_cli
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke
from tests.support.preflight_fake import PreflightFake, start_preflight_fake

pytest_plugins = ["tests.support.cloud_fixtures"]

GCLOUD = shutil.which("gcloud")
REGION = ZONE.rsplit("-", 1)[0]
PLACEHOLDERS = re.compile(r"\b(PROJECT|ZONE|REGION|NAME|IMAGE|BUCKET|TYPE|JOB)\b|\.\.\.|<|>")


def _said(pattern: str, text: str) -> re.Match:
    text = " ".join(text.split())  # messages are wrapped on the terminal
    found = re.search(pattern, text)
    assert found, f"no suggestion matching {pattern!r} in:\n{text[-3000:]}"
    return found


def _filled(words: list[str]) -> list[str]:
    assert not any(PLACEHOLDERS.search(w) for w in words), f"a placeholder left to fill: {words}"
    return words


def _runner(text: str, starts: str) -> list[str]:
    """The first backticked `runner ...` command in `text` beginning with `starts`, as argv without `runner`."""
    words = shlex.split(_said(rf"`({re.escape(starts)}[^`]*)`", text).group(1))
    assert words[0] == "runner"
    return _filled(words)[1:]


def _offline(folder: Path, **extra: str) -> dict[str, str]:
    """The CLI's environment with gcloud's configuration empty: nothing but the flags says where."""
    env = cli_env(CLOUDSDK_CONFIG=str(folder / "gcloud"), RUNNER_STATE_DIR=str(folder / "state"))
    for key in ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT", "CLOUDSDK_COMPUTE_ZONE", "RUNNER_IMAGE"):
        env.pop(key, None)
    return {**env, **extra}


def _gcloud(command: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    assert GCLOUD, "gcloud is not installed on this machine"
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def _gcloud_parses(command: str, folder: Path, endpoint: str) -> None:
    """gcloud's own parser takes the command: every API it could call pointed at a fake that answers 404 at
    once, so it stops at its first call; an argument error would exit 2 before any."""
    words = shlex.split(command)
    assert words[0] == "gcloud"
    _filled([w for w in words if not w.startswith("--member=user:EMAIL")])  # the account is the user's own
    env = _offline(folder, CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token", CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
                   CLOUDSDK_CORE_DISABLE_PROMPTS="1", **{f"CLOUDSDK_API_ENDPOINT_OVERRIDES_{api}": f"{endpoint}/"
                                                         for api in ("TPU", "SERVICEUSAGE", "STORAGE",
                                                                     "CLOUDRESOURCEMANAGER", "CLOUDBUILD",
                                                                     "ARTIFACTREGISTRY", "CONTAINER")})
    ran = _gcloud(shlex.join(words), env, cwd=folder)
    assert ran.returncode != 2 and "unrecognized arguments" not in ran.stderr, (command, ran.stderr[-2000:])
    assert "Invalid choice" not in ran.stderr, (command, ran.stderr[-2000:])


@pytest.fixture
def gcloud_parses(engine_api, tmp_path: Path):
    """`_gcloud_parses` against the engines' fake (any path it does not serve is a 404)."""
    return lambda command: _gcloud_parses(command, tmp_path, engine_api.endpoint)


def _submit(spec: Path, env: dict[str, str], *args: str, tpu_type: str | None = "v5litepod-8", where: bool = True,
            image: str | None = IMAGE, allow: bool = False) -> subprocess.CompletedProcess:
    """`runner submit`; `allow`: with --allow-unverified (a --runtime-version no source names, docs/tpu.md)."""
    argv = ["submit", spec, *(["--tpu-type", tpu_type] if tpu_type else [])]
    argv += ["--zone", ZONE, "--project", PROJECT] if where else []
    argv += ["--image", image] if image else []
    argv += ["--allow-unverified"] if allow and "--allow-unverified" not in args else []
    return invoke(*argv, *args, env=env)


def _refused(result: subprocess.CompletedProcess, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    return result.stderr


def _works(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


# --- `runner submit --dry-run`: each flag and spec refusal, followed ------------------------------------------


@pytest.mark.host
def test_a_region_given_as_the_zone_names_where_the_zones_are_listed(gcloud_parses, cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--zone", "us-east1"))
    region = _said(r"--zone 'us-east1' is a region; give one of its zones \((\S+)- and a letter\)", said).group(1)
    gcloud_parses(_said(r"`(gcloud compute tpus locations list[^`]*)`", said).group(1))
    _works(_submit(cloud_spec, env, "--dry-run", "--zone", f"{region}-b"))  # us-east1 has b, c, d; no a


def test_a_name_no_queued_resource_can_have_takes_the_one_offered(cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--name", "9_My_Job"))
    offered = _said(r"--name '9_My_Job' cannot name a queued resource: .*\(e\.g\. (\S+)\)", said).group(1)
    _works(_submit(cloud_spec, env, "--dry-run", "--name", offered))


@pytest.mark.parametrize("given", [None, "runner:tpu"])
def test_an_image_missing_or_without_a_registry_is_the_one_cloudbuild_pushes_for_the_project(
        given, cloud_spec, tpu_fake, gcs, bucket, tmp_path) -> None:
    """The example is the image cloudbuild.yaml pushes for this project and region, so following it reaches a
    registry that holds it: the preflight's image check (the TPU API fake serves a registry) passes."""
    env = cloud_env(tpu_fake.endpoint, tmp_path, **gcs.env)
    said = _refused(_submit(cloud_spec, env, "--dry-run", image=given))
    offered = _filled(shlex.split(_said(r"e\.g\. (--image \S+)", said).group(1)))
    assert offered[1] == f"{REGION}-docker.pkg.dev/{PROJECT}/runner/runner:tpu"
    followed = _submit(cloud_spec, env, "--dry-run", "--preflight", *offered, image=None)
    _works(followed)
    assert "preflight: 8 checks passed" in followed.stderr


def test_a_local_output_folder_is_moved_to_the_bucket_the_spec_already_reads(cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--set", f"output.dir={tmp_path}/runs"))
    offered = _said(r"e\.g\. --set (output\.dir=\S+)", said).group(1)
    assert offered == "output.dir=gs://runner-test/runs"
    _works(_submit(cloud_spec, env, "--dry-run", "--set", f"output.dir={tmp_path}/runs", "--set", offered))


@pytest.mark.host
def test_local_data_is_copied_with_the_gcloud_command_named_and_then_set(gcloud_parses, cloud_spec, tmp_path) -> None:
    """The copy is parsed by the real gcloud (it does not reach the emulator's upload path); the target set."""
    shards = tmp_path / "mnist"
    shards.mkdir()
    (shards / "train-00000-of-00001.tfrecord").write_bytes(b"records")
    (shards / "manifest.json").write_text("{}")
    env = _offline(tmp_path)
    local = ["--set", f"data.train={shards}/train-*.tfrecord"]
    said = _refused(_submit(cloud_spec, env, "--dry-run", *local))
    copy = _said(r"`(gcloud storage cp [^`]+)`", said).group(1)
    target = _said(r"and --set (data\.train=\S+)", said).group(1)
    assert target == "data.train=gs://runner-test/data/mnist/train-*.tfrecord"
    gcloud_parses(copy)
    _works(_submit(cloud_spec, env, "--dry-run", *local, "--set", target))


def test_a_cpu_spec_is_set_to_the_tpu_as_said(cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--set", "accelerator.kind=cpu"))
    offered = _said(r"needs 'tpu' \(or 'auto'\): --set (accelerator\.kind=\w+)", said).group(1)
    _works(_submit(cloud_spec, env, "--dry-run", "--set", "accelerator.kind=cpu", "--set", offered))


@pytest.mark.parametrize("typed, pattern", [
    ("v5litepod8", r"must look like GENERATION-SIZE, e\.g\. (\S+) or"),
    ("v5e-8", r"the Cloud TPU API calls it (\S+)"),
    ("v5lp-8", r"did you mean (\S+)\?"),
    ("v5litepod-3", r"v5litepod comes in sizes (\d+),"),
    ("v5litepod-64", r"Single-host types work: .*?\b(v5litepod-\d+)\b"),
    ("v4-16", r"Single-host types work: .*?\b(v4-\d+)\b"),
])
def test_a_tpu_type_refused_takes_the_type_the_message_offers(typed, pattern, cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", tpu_type=typed))
    offered = _said(pattern, said).group(1)
    offered = offered if "-" in offered else f"v5litepod-{offered}"
    _works(_following_the_zone(cloud_spec, env, offered))


def _following_the_zone(spec: Path, env: dict[str, str], tpu_type: str, *args: str) -> subprocess.CompletedProcess:
    """A dry run of `tpu_type`; where the zone does not offer it (v4 is only in us-central2), again in the first
    zone the refusal offers."""
    result = _submit(spec, env, "--dry-run", *args, tpu_type=tpu_type)
    if result.returncode == 2 and "does not offer" in result.stderr:
        zone = _said(rf"--zone {ZONE} does not offer {tpu_type}: .*? offered in ([\w-]+)", result.stderr).group(1)
        result = _submit(spec, env, "--dry-run", *args, "--zone", zone, tpu_type=tpu_type)
    return result


@pytest.mark.parametrize("tpu_type, zone", [("v5p-8", "us-west1-c"), ("v6e-8", "us-central1-q")])
def test_a_zone_refused_takes_a_zone_the_message_offers(tpu_type, zone, cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--zone", zone, tpu_type=tpu_type))
    offered = _said(rf"does not offer {tpu_type}: .*? offered in ([\w-]+),", said).group(1)
    _works(_submit(cloud_spec, env, "--dry-run", "--zone", offered, tpu_type=tpu_type))


def test_an_unverified_runtime_is_allowed_or_dropped_for_the_one_google_names(cloud_spec, tmp_path) -> None:
    """Refused before any call (offline here); followed, the dry run says it is allowed or no longer unverified."""
    env = _offline(tmp_path)
    runtime = ["--runtime-version", "tpu-vm-tf-2.18.0-pjrt"]
    said = _refused(_submit(cloud_spec, env, "--no-preflight", *runtime, tpu_type="v6e-8"))
    allow = _said(r"Give (--allow-unverified) to submit it anyway", said).group(1)
    followed = _submit(cloud_spec, env, "--dry-run", *runtime, allow, tpu_type="v6e-8")
    _works(followed)
    assert "allowed by --allow-unverified" in followed.stderr

    said = _refused(_submit(cloud_spec, env, "--no-preflight", *runtime, tpu_type="v5p-8"))
    named = _said(r"the one named is (\S+) \(.*?(drop --runtime-version) to use it", said)
    followed = _submit(cloud_spec, env, "--dry-run", tpu_type="v5p-8")
    _works(followed)
    assert "unverified" not in followed.stderr and f"runtime: {named.group(1)}, " in followed.stderr


@pytest.mark.parametrize("flag, typed, pattern", [
    ("--max-run-duration", "6 hours", r"e\.g\. (\w+),"),
    ("--max-run-duration", "6 hours", r"\(or `(none)` for no limit\)"),
    ("--stall-timeout", "half an hour", r"e\.g\. (\w+),"),
    ("--valid-until", "tomorrow", r"neither a duration \((\w+),"),
    ("--valid-until", "tomorrow", r"a time with its offset \((\S+Z),"),
    ("--valid-until", "2020-01-01T00:00:00Z", r"has already passed: .*\(e\.g\. --valid-until (\w+)\)"),
])
def test_a_duration_or_time_refused_takes_the_form_offered(flag, typed, pattern, cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", flag, typed))
    offered = _said(pattern, said).group(1)
    if offered.startswith("20"):  # the example time: one in the future of the same form
        offered = "2099" + offered[4:]
    _works(_submit(cloud_spec, env, "--dry-run", flag, offered))


# --- the engines: flags they do not take, and what each refuses -----------------------------------------------


@pytest.mark.parametrize("on, extra", [
    ("skypilot", ["--keep"]), ("vertex", ["--max-restarts", "2"]), ("gke", ["--runtime-version", "v2-alpha-tpuv5"]),
    ("vertex", ["--queue", "team-a"]), ("tpu-vm", ["--namespace", "ml"]),
])
def test_a_flag_an_engine_does_not_take_is_dropped_as_said(on, extra, cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    where = ["--project", PROJECT] if on != "skypilot" else []
    given = ["--tpu-type", "v5litepod-8", "--zone", ZONE, *where, "--image", IMAGE, "--dry-run", "--on", on]
    said = _refused(invoke("submit", cloud_spec, *given, *extra, env=env))
    _said(rf"{extra[0]} does not apply to --on {on}.*[dD]rop ({extra[0]})\b", said)
    _works(invoke("submit", cloud_spec, *given, env=env))  # the flag and its value dropped


@pytest.mark.host
def test_skypilots_project_refusal_names_the_users_project_for_its_api_server(cloud_spec, tmp_path) -> None:
    """Dropped, the submission goes on; the gcloud command, run, sets that project in gcloud's configuration
    (as it would on the API server's host); `sky check gcp` is a command of the installed SkyPilot's CLI."""
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--on", "skypilot"))
    _said(r"Drop (--project) and", said)
    setting = _said(r"run `(gcloud config set project [^`]+)`", said).group(1)
    assert shlex.split(setting)[-1] == PROJECT
    configured = _gcloud(setting, env)
    assert configured.returncode == 0, configured.stderr
    assert _gcloud("gcloud config get-value project", env).stdout.strip() == PROJECT
    check = shlex.split(_said(r"then `(sky check gcp)`", said).group(1))
    sky = shutil.which("sky", path=str(REPO / ".venv" / "bin")) or shutil.which("sky")
    assert sky, "SkyPilot's CLI is not installed"
    helped = subprocess.run([sky, *check[1:], "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "INFRA_LIST" in helped.stdout, helped.stderr[-2000:]
    _works(invoke("submit", cloud_spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--image", IMAGE, "--dry-run",
                  "--on", "skypilot", env=env))


@pytest.mark.parametrize("args, pattern", [
    (["--on", "kubernetes"], r"--on 'kubernetes': choose one of ([\w-]+),"),
    (["--on", "gke", "--format", "helm"], r"--format 'helm': choose (\w+) or"),
])
def test_a_choice_refused_takes_one_of_those_listed(args, pattern, cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", *args))
    chosen = _said(pattern, said).group(1)
    followed = [chosen if a == args[-1] else a for a in args]
    _works(_submit(cloud_spec, env, "--dry-run", *followed))


@pytest.mark.parametrize("on, tpu_type, extra, pattern", [
    ("gke", "v3-8", [], r"types on GKE: ([\w-]+),"),
    ("gke", "v5litepod-8", ["--format", "xpk", "--cluster", "c"], r"a type xpk runs as this runner does: ([\w-]+),"),
    ("vertex", "v6e-8", [], r"or pick one of ([\w-]+),"),
    ("vertex", "v5p-8", [], r"or pick one of ([\w-]+),"),
])
def test_a_tpu_type_an_engine_does_not_run_takes_one_it_lists(on, tpu_type, extra, pattern, cloud_spec,
                                                               tmp_path) -> None:
    env = _offline(tmp_path)
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--on", on, *extra, tpu_type=tpu_type))
    _works(_following_the_zone(cloud_spec, env, _said(pattern, said).group(1), "--on", on, *extra))


def test_the_xpk_line_takes_the_cluster_and_the_queue_as_said(cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    xpk = ["--dry-run", "--on", "gke", "--format", "xpk"]
    said = _refused(_submit(cloud_spec, env, *xpk, tpu_type="v6e-4"))
    flag = _said(r"--format xpk needs (--cluster): the GKE cluster", said).group(1)
    said = _refused(_submit(cloud_spec, env, *xpk, flag, "tpu-cluster", "--queue", "team-a", tpu_type="v6e-4"))
    _said(r"drop (--queue), or", said)
    _works(_submit(cloud_spec, env, *xpk, flag, "tpu-cluster", tpu_type="v6e-4"))


@pytest.mark.host
def test_a_gke_name_too_long_for_its_pods_takes_the_shorter_one(cloud_spec, tmp_path) -> None:
    env = _offline(tmp_path)
    long = "a-very-long-job-name-for-a-jobset-on-gke-tpus"
    said = _refused(_submit(cloud_spec, env, "--dry-run", "--on", "gke", "--name", long))
    _works(_submit(cloud_spec, env, "--dry-run", "--on", "gke", "--name", _said(r"e\.g\. (\S+)$", said).group(1)))


def _kubeconfig(endpoint: str, folder: Path) -> dict[str, str]:
    path = folder / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": endpoint}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
    }))
    return _offline(folder, KUBECONFIG=str(path))


def _kubectl_parses(command: str, env: dict[str, str]) -> None:
    """kubectl's own parser takes the command: pointed at a port nothing listens on, it fails on the
    connection, never on a flag (kubectl reports unknown flags as `unknown flag` / `unknown shorthand flag`)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed on this machine"
    words = _filled(shlex.split(command))
    assert words[0] == "kubectl"
    ran = subprocess.run([kubectl, *words[1:], "--server=http://127.0.0.1:9", "--request-timeout=5s"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert ran.returncode != 0 and "unknown" not in ran.stderr and "connect" in ran.stderr, ran.stderr[-2000:]


@pytest.mark.host
def test_a_jobset_of_the_same_name_is_deleted_by_the_kubectl_line_or_renamed(cloud_spec, engine_api, tmp_path):
    pytest.importorskip("kubernetes")
    env = _kubeconfig(engine_api.endpoint, tmp_path)
    ns = ["--on", "gke", "--namespace", "hints", "--no-preflight"]
    # Its own process: the kubernetes client reads KUBECONFIG once, when it is imported.
    gke = ["submit", cloud_spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT, "--image", IMAGE,
           *ns]
    _works(run_cli(*gke, "--name", "twice", env=env))
    said = _refused(run_cli(*gke, "--name", "twice", env=env))
    _kubectl_parses(_said(r"\(`(kubectl delete jobset twice -n hints)`\)", said).group(1), env)
    _works(run_cli(*gke, "--name", _said(r"\(e\.g\. --name (\S+)\)", said).group(1), env=env))


# --- `runner submit` against the Cloud TPU API fake: a name already taken ------------------------------------


@pytest.fixture
def tpu_env(tpu_fake, gcs, bucket, tmp_path: Path) -> Iterator[dict[str, str]]:
    for name in gcs.objects(bucket, "runs/"):
        gcs.client().bucket(bucket).blob(name).delete()
    env = cloud_env(tpu_fake.endpoint, tmp_path, **gcs.env)
    for key in ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT", "CLOUDSDK_COMPUTE_ZONE"):
        env.pop(key, None)
    yield env


def test_a_queued_resource_of_the_same_name_is_freed_by_the_cancel_named_or_a_new_job_name(cloud_spec, tpu_env):
    _works(_submit(cloud_spec, tpu_env, "--no-preflight"))
    said = _refused(_submit(cloud_spec, tpu_env, "--no-preflight"))
    renamed = shlex.split(_said(r"own run folder \(`(--set name=[^`]+)`\)", said).group(1))
    _works(_submit(cloud_spec, tpu_env, "--no-preflight", *renamed))  # the first one still queued
    seen = invoke(*_runner(said, "runner status"), env=tpu_env)
    _works(seen)
    assert last_json(seen.stdout)["name"] == "mnist-cnn"
    _works(invoke(*_runner(said, "runner cancel"), env=tpu_env))
    _works(_submit(cloud_spec, tpu_env, "--no-preflight"))


def test_another_queued_resource_name_for_a_live_jobs_folder_is_cleared_by_the_cancel_named(cloud_spec, tpu_env):
    _works(_submit(cloud_spec, tpu_env, "--no-preflight"))
    said = _refused(_submit(cloud_spec, tpu_env, "--no-preflight", "--name", "other"))
    renamed = shlex.split(_said(r"another name \(`(--set name=[^`]+)`\)", said).group(1))
    _works(_submit(cloud_spec, tpu_env, "--no-preflight", *renamed))
    _works(invoke(*_runner(said, "runner cancel"), env=tpu_env))
    _works(_submit(cloud_spec, tpu_env, "--no-preflight", "--name", "other"))


@pytest.mark.host
def test_a_tpu_api_that_refuses_names_the_enable_command_for_the_project(gcloud_parses, cloud_spec, tpu_fake, tpu_env):
    tpu_fake.fail(1, status=403)
    said = _refused(_submit(cloud_spec, tpu_env, "--no-preflight"), code=3)
    gcloud_parses(_said(r"\(`(gcloud services enable tpu\.googleapis\.com --project \S+)`\)", said).group(1))
    assert f"--project {PROJECT}`" in " ".join(said.split())


@pytest.mark.host
def test_a_missing_project_and_zone_are_set_with_the_gcloud_commands_named(tpu_env, tmp_path) -> None:
    said = _refused(invoke("status", env=tpu_env))
    for command, value in ((r"gcloud config set project", PROJECT), (r"gcloud config set compute/zone", ZONE)):
        words = shlex.split(_said(rf"`({command} \w+)`", said).group(1))
        # the user's own value where it says which. gcloud asks the Compute API whether a zone exists and only
        # warns when it is told no: the fake answers 404 for it
        compute = tpu_env["CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU"] + "compute/v1/"
        configured = _gcloud(shlex.join([*words[:-1], value]),
                             {**tpu_env, "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": compute})
        assert configured.returncode == 0, configured.stderr
    _works(invoke("status", env=tpu_env))


def test_a_cloud_logging_source_for_a_job_that_logs_to_the_bucket_is_read_from_the_bucket(tmp_path) -> None:
    said = _refused(invoke("logs", "gs://runner-test/runs/x", "--follow", "--source", "cloudlogging",
                           env=_offline(tmp_path)))
    assert _said(r"--source 'cloudlogging': choose (\w+),", said).group(1) == "auto"


# --- `runner doctor --cloud`: each fix followed against the preflight fake -----------------------------------


@pytest.fixture(scope="module")
def _reads(tmp_path_factory) -> Iterator[PreflightFake]:
    with start_preflight_fake(tmp_path_factory.mktemp("hints_preflight")) as fake:
        yield fake


@pytest.fixture
def reads(_reads: PreflightFake) -> PreflightFake:
    _reads.reset()
    _, name, reference = parse_image(IMAGE)
    _reads.image(name, reference)
    return _reads


def _doctor_env(endpoint: str, folder: Path, **extra: str) -> dict[str, str]:
    return _offline(folder, CLOUDSDK_AUTH_ACCESS_TOKEN="fake-token", CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
                    CLOUDSDK_CORE_DISABLE_PROMPTS="1", CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=f"{endpoint}/",
                    CLOUDSDK_API_ENDPOINT_OVERRIDES_SERVICEUSAGE=f"{endpoint}/", RUNNER_REGISTRY_ENDPOINT=endpoint,
                    CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDRESOURCEMANAGER=f"{endpoint}/", **extra)


def _doctor(env: dict[str, str], *args: str, image: str = IMAGE) -> tuple[int, dict[str, dict]]:
    argv = ["doctor", "--cloud", "--json", "--tpu-type", "v5litepod-8", "--zone", ZONE, "--image", image, *args]
    result = run_cli(*argv, env=env) if "gke" in args else invoke(*argv, env=env)
    report = last_json(result.stdout)
    assert result.returncode == report["exit_code"]
    return result.returncode, {c["name"]: c for c in report["checks"]}


@pytest.mark.host
def test_a_disabled_tpu_api_is_enabled_by_the_gcloud_command_named(reads, tmp_path) -> None:
    """The real gcloud sends the named command to the fake's Service Usage API, which lifts the denial."""
    reads.deny("/v2/projects/", 403, reason="SERVICE_DISABLED", service="tpu.googleapis.com")
    env = _doctor_env(reads.endpoint, tmp_path)
    code, checks = _doctor(env, "--project", PROJECT)
    assert code == 3 and checks["tpu_api"]["status"] == "fail"
    command = checks["tpu_api"]["action"]
    _filled(shlex.split(command))
    enabled = _gcloud(command, env)
    assert enabled.returncode == 0, enabled.stderr[-2000:]
    assert any(r["path"].startswith(f"/v1/projects/{PROJECT}/services") for r in reads.requests())
    code, checks = _doctor(env, "--project", PROJECT)
    assert code == 0 and checks["tpu_api"]["status"] == "ok", checks["tpu_api"]


@pytest.mark.host
def test_an_account_the_tpu_api_refuses_is_granted_with_a_command_gcloud_parses(gcloud_parses, reads,
                                                                               tmp_path) -> None:
    reads.deny("/v2/projects/", 403)
    code, checks = _doctor(_doctor_env(reads.endpoint, tmp_path), "--project", PROJECT)
    assert code == 3
    for command in checks["tpu_api"]["action"].split("; if it is enabled, grant the account a Cloud TPU role: "):
        gcloud_parses(command)


@pytest.mark.host
def test_a_type_the_zone_does_not_offer_is_replaced_by_one_it_lists(gcloud_parses, reads, tmp_path) -> None:
    reads.offer(ZONE, ["v2-8", "v5litepod-4"])
    env = _doctor_env(reads.endpoint, tmp_path)
    code, checks = _doctor(env, "--project", PROJECT)
    assert code == 3
    offered = _said(rf"{ZONE} does not offer v5litepod-8; it offers ([\w-]+)", checks["tpu_type"]["evidence"]).group(1)
    listed = _said(r"\((gcloud compute tpus accelerator-types list [^)]+)\)", checks["tpu_type"]["action"]).group(1)
    gcloud_parses(listed.replace("--zone=ZONE", f"--zone={ZONE}"))  # the zone to try is the user's
    result = invoke("doctor", "--cloud", "--json", "--tpu-type", offered, "--zone", ZONE, "--image", IMAGE,
                    "--project", PROJECT, env=env)
    assert {c["name"]: c for c in last_json(result.stdout)["checks"]}["tpu_type"]["status"] == "ok"


@pytest.mark.host
def test_no_project_is_set_with_the_gcloud_command_named(reads, tmp_path) -> None:
    env = _doctor_env(reads.endpoint, tmp_path)
    code, checks = _doctor(env)
    assert code == 3
    command = _said(r"^(gcloud config set project) PROJECT_ID", checks["cloud_credentials"]["action"]).group(1)
    configured = _gcloud(f"{command} {PROJECT}", env)  # the user's own project, where the action says PROJECT_ID
    assert configured.returncode == 0, configured.stderr
    code, checks = _doctor(env)
    assert code == 0 and f"project {PROJECT} (from gcloud config core/project)" in checks["cloud_credentials"][
        "evidence"]


def test_the_project_from_google_cloud_project_is_the_one_submit_uses(reads, cloud_spec, tmp_path) -> None:
    """The doctor does not tell the user to repeat what `runner submit` reads itself."""
    env = _doctor_env(reads.endpoint, tmp_path, GOOGLE_CLOUD_PROJECT=PROJECT)
    code, checks = _doctor(env)
    assert code == 0 and checks["cloud_credentials"]["action"] == "", checks
    printed = invoke("submit", cloud_spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--image", IMAGE,
                     "--dry-run", env=env)
    _works(printed)
    assert f"--project={PROJECT}" in printed.stdout


def _built_image(words: list[str]) -> str:
    """The :tpu image a `gcloud builds submit` line makes, by cloudbuild.yaml's own tpu-variant step."""
    substitutions = dict(pair.split("=", 1) for pair in next(
        w for w in words if w.startswith("--substitutions=")).split("=", 1)[1].split(","))
    config = yaml.safe_load((REPO / "cloudbuild.yaml").read_text())
    [variant] = [step for step in config["steps"] if step["id"] == "tpu-variant"]
    made = re.search(r"image=(\S+)", " ".join(variant["args"])).group(1)
    for key, value in {**config["substitutions"], **substitutions}.items():
        made = made.replace("${" + key + "}", value)
    return f"{made}:tpu"


@pytest.mark.host
def test_a_missing_image_is_pushed_by_the_build_named_and_then_found(gcloud_parses, reads, tmp_path) -> None:
    """The build's substitutions make, by cloudbuild.yaml's own tag, exactly the image asked for; the fake's
    registry then holds it (its control endpoint stands for the push) and the check passes."""
    image = "europe-west4-docker.pkg.dev/team-project/models/trainer:tpu"
    env = _doctor_env(reads.endpoint, tmp_path)
    code, checks = _doctor(env, "--project", PROJECT, image=image)
    assert code == 3 and checks["image"]["evidence"].startswith("missing (404")
    build = _said(r"build and push it: (gcloud builds submit .*)$", checks["image"]["action"]).group(1)
    words = shlex.split(build.replace("$(git rev-parse --short HEAD)", "abc1234"))
    assert _built_image(words) == image
    shutil.copy(REPO / "cloudbuild.yaml", tmp_path / "cloudbuild.yaml")
    gcloud_parses(shlex.join(words))
    _, name, reference = parse_image(image)
    reads.image(name, reference)
    code, checks = _doctor(env, "--project", PROJECT, image=image)
    assert checks["image"]["status"] == "ok", checks["image"]


@pytest.mark.host
def test_an_image_the_registry_refuses_names_its_own_repository_and_location(gcloud_parses, reads, tmp_path) -> None:
    _, name, _ = parse_image(IMAGE)
    reads.deny(f"/v2/{name}/", 403)
    code, checks = _doctor(_doctor_env(reads.endpoint, tmp_path), "--project", PROJECT)
    assert code == 3
    grant, enable = _said(r"^(gcloud artifacts .*) \(Artifact Registry API: (gcloud services enable [^)]+)\)",
                          checks["image"]["action"]).groups()
    assert f"add-iam-policy-binding runner --location={REGION} " in grant and f"--project={PROJECT}" in grant
    for command in (grant, enable):
        gcloud_parses(command)


@pytest.mark.host
def test_a_cluster_without_jobset_is_given_a_real_release_to_install(reads, tmp_path) -> None:
    pytest.importorskip("kubernetes")
    reads.groups([])
    env = _kubeconfig(reads.endpoint, tmp_path)
    env.update(_doctor_env(reads.endpoint, tmp_path, KUBECONFIG=env["KUBECONFIG"]))
    code, checks = _doctor(env, "--project", PROJECT, "--on", "gke")
    assert code == 3 and checks["engine"]["status"] == "fail"
    install = checks["engine"]["action"]
    assert re.fullmatch(r"kubectl apply --server-side -f https://github\.com/kubernetes-sigs/jobset/releases/"
                        r"download/v\d+\.\d+\.\d+/manifests\.yaml", install), install
    _kubectl_parses(install, env)
    from tests.support.engine_fake import JOBSET_GROUP

    reads.groups([JOBSET_GROUP])  # what the install puts in the cluster's API groups
    code, checks = _doctor(env, "--project", PROJECT, "--on", "gke")
    assert checks["engine"]["status"] == "ok", checks["engine"]


@pytest.mark.host
def test_a_missing_bucket_is_created_by_the_gcloud_command_named(reads, gcs, tmp_path) -> None:
    """The real gcloud creates it on the GCS emulator (its Cloud Storage endpoint), in the TPU's region."""
    missing = f"hints-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "mnist_cnn", "data": {"train": f"gs://{missing}/data/train-*.tfrecord"},
                                    "output": {"dir": f"gs://{missing}/runs"}}))
    env = _doctor_env(reads.endpoint, tmp_path, STORAGE_EMULATOR_HOST=gcs.api, CLOUDSDK_CORE_PROJECT=PROJECT,
                      CLOUDSDK_API_ENDPOINT_OVERRIDES_STORAGE=f"{gcs.api}/storage/v1/")
    code, checks = _doctor(env, spec)
    assert code == 3 and checks["bucket_write"]["evidence"].startswith(f"missing: bucket gs://{missing} ")
    create = checks["bucket_write"]["action"]
    assert create == checks["bucket_read"]["action"]
    assert _filled(shlex.split(create))[-1] == f"--location={REGION}"
    created = _gcloud(create, env)
    assert created.returncode == 0, created.stderr[-2000:]
    code, checks = _doctor(env, spec)
    assert checks["bucket_write"]["status"] == "ok", checks["bucket_write"]
    assert checks["bucket_read"]["evidence"].startswith("missing: no objects under")  # the data is the next step


def test_a_job_this_machine_does_not_know_is_found_with_the_zone_and_project_said(cloud_spec, tpu_env,
                                                                                  tmp_path) -> None:
    _works(_submit(cloud_spec, tpu_env, "--no-preflight"))
    elsewhere = {**tpu_env, "RUNNER_STATE_DIR": str(tmp_path / "another-machine")}
    said = _refused(invoke("status", "mnist-cnn", env=elsewhere))
    flags = _said(r"or the (--zone) and (--project) it runs in", said).groups()
    found = invoke("status", "mnist-cnn", flags[0], ZONE, flags[1], PROJECT, env=elsewhere)
    _works(found)
    assert last_json(found.stdout)["name"] == "mnist-cnn"
    run_dir = _said(r"Give its run folder instead \(e\.g\. (gs://\S+)\)", said).group(1)
    assert re.fullmatch(r"gs://BUCKET/runs/JOB", run_dir)  # the form: the bucket and job are the user's
    _works(invoke("status", "gs://runner-test/runs/mnist_cnn", env=elsewhere))


@pytest.mark.host
def test_vertex_ai_refusing_the_account_is_enabled_or_granted_with_commands_gcloud_parses(gcloud_parses, reads,
                                                                                         tmp_path) -> None:
    reads.deny(f"/v1/projects/{PROJECT}/locations/{REGION}/customJobs", 403)
    env = _doctor_env(reads.endpoint, tmp_path, CLOUDSDK_API_ENDPOINT_OVERRIDES_AIPLATFORM=f"{reads.endpoint}/")
    code, checks = _doctor(env, "--project", PROJECT, "--on", "vertex")
    assert code == 3 and checks["engine"]["status"] == "fail"
    enable, grant = checks["engine"]["action"].split("; if it is enabled, grant the account Vertex AI's user role: ")
    for command in (enable, grant):
        gcloud_parses(command)


def test_submits_fix_line_for_a_missing_image_builds_the_image_asked_for(gcloud_parses, cloud_spec, tpu_fake,
                                                                         tpu_env) -> None:
    """The preflight's `fix:` under `runner submit`: the build it names tags exactly --image; once the
    registry holds it (the fake's control endpoint stands for the push), the same command submits."""
    _, name, reference = parse_image(IMAGE)
    tpu_fake.lose_image(name, reference)
    said = _refused(_submit(cloud_spec, tpu_env), code=3)
    build = _said(r"image: missing .*? fix: build and push it: (gcloud builds submit .*? \.)(?: |$)", said).group(1)
    assert _built_image(shlex.split(build.replace("$(git rev-parse --short HEAD)", "abc1234"))) == IMAGE
    tpu_fake.call("POST", "/_fake/registry", {"missing": []})  # pushed
    _works(_submit(cloud_spec, tpu_env))


@pytest.mark.host
def test_no_kubeconfig_names_the_get_credentials_command_for_the_project(gcloud_parses, cloud_spec, tmp_path):
    pytest.importorskip("kubernetes")
    env = _offline(tmp_path, KUBECONFIG=str(tmp_path / "no-kubeconfig"))
    said = _refused(run_cli("submit", cloud_spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT,
                            "--image", IMAGE, "--on", "gke", "--no-preflight", env=env), code=3)
    command = _said(r"run `(gcloud container clusters get-credentials [^`]+)`", said).group(1)
    assert command.endswith(f"--project {PROJECT}")
    gcloud_parses(command)  # CLUSTER and LOCATION: the user's cluster, which the runner cannot know
