"""The runner image, built from the Dockerfile and run for real on a private Docker engine.

One build per session (tests/support/docker.py); the containers have no network. The base image is a
Debian bookworm stand-in tagged as the Dockerfile's real base, so the Dockerfile is built unchanged.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO, last_json
from tests.support.docker import IMAGE_UID, Engine, folders_for_the_container


def _locked(name: str) -> str:
    """The version requirements.lock pins for a package."""
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line.lower().replace("_", "-").startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise LookupError(f"{name} is not pinned in requirements.lock")


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.host
def test_image_runs_runner_as_an_unprivileged_user(docker_engine: Engine, runner_image: str):
    config = json.loads(docker_engine.docker("image", "inspect", runner_image, check=True).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["runner"]
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert config["Labels"]["runner.accelerator"] == "cpu"

    helped = docker_engine.docker("run", "--rm", "--network", "none", runner_image, check=True)
    for command in ("run", "validate", "submit", "status", "cancel", "logs"):
        assert f" {command} " in helped.stdout, f"`runner --help` in the image does not list {command!r}"
    whoami = docker_engine.docker("run", "--rm", "--network", "none", "--entrypoint", "id", runner_image, "-u",
                                  check=True)
    assert whoami.stdout.strip() == str(IMAGE_UID)


@pytest.mark.slow
@pytest.mark.host
def test_image_imports_the_pinned_tensorflow_with_tcmalloc(docker_engine: Engine, runner_image: str):
    probe = (
        "import importlib.metadata as m, tensorflow as tf;"
        "from runner.doctor.checks import check_allocator;"
        "print(tf.__version__, m.version('tensorflow-cpu'), m.version('keras'),"
        " ','.join(n for n in (d.metadata['Name'] for d in m.distributions()) if n in ('tf-keras', 'tf_keras')) or '-',"
        " check_allocator().data['allocator']);"
        # Sources without the bytecode the install compiled: each run would compile them again (below).
        "import importlib.util as u, pathlib as p, sys;"
        "tag = sys.implementation.cache_tag;"
        "roots = [p.Path(u.find_spec(n).origin).parent for n in ('tensorflow', 'keras', 'runner')];"
        "print(sum(not (f.parent / '__pycache__' / f'{f.stem}.{tag}.pyc').exists()"
        " for r in roots for f in r.rglob('*.py')))"
    )
    result = docker_engine.docker(
        "run", "--rm", "--network", "none", "--entrypoint", "python3", runner_image, "-c", probe, check=True,
        timeout=180,
    )
    tf_version, cpu_wheel, keras, tf_keras, allocator, uncompiled = result.stdout.split()
    assert tf_version == cpu_wheel == _locked("tensorflow-cpu")
    assert keras == _locked("keras")
    assert tf_keras == "-", "the runner trains with Keras 3 only: no tf-keras in the image"
    assert allocator == "tcmalloc", "the image preloads tcmalloc (Dockerfile: PRELOAD)"
    # The image sets PYTHONDONTWRITEBYTECODE, so nothing is compiled at run time: without the .pyc files pip
    # writes at install, every run would compile TensorFlow's sources again (an import of 7-8 s, not 3).
    assert uncompiled == "0", f"{uncompiled} .py files of tensorflow, keras and runner have no .pyc in the image"


@pytest.mark.slow
@pytest.mark.host
def test_image_trains_the_mnist_job_on_a_mounted_folder(
    docker_engine: Engine, runner_image: str, tiny_mnist: Path, tmp_path: Path
):
    # The image's own jobs/mnist_cnn.yaml, cut to a few steps, reads data/mnist and writes runs/ under /app.
    data, runs = folders_for_the_container(tiny_mnist, tmp_path, "mnist")
    result = docker_engine.docker(
        "run", "--rm", "--network", "none",
        "--volume", f"{data}:/app/data/mnist:ro", "--volume", f"{runs}:/app/runs",
        runner_image, "run", "jobs/mnist_cnn.yaml",
        "--set", "train.epochs=1", "--set", "train.steps_per_epoch=4",
        "--set", "data.global_batch_size=64", "--set", "data.shuffle_buffer=256",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded"
    assert summary["job"] == "mnist_cnn"
    assert summary["accelerator"]["kind"] == "cpu"
    assert summary["accelerator"]["allocator"] == "tcmalloc"
    assert summary["epochs"][0]["steps"] == 4
    assert summary["metrics"]["examples"] == 512  # the whole eval split, 8 batches of 64

    on_disk = json.loads((runs / "mnist_cnn" / "summary.json").read_text())
    assert on_disk["status"] == "succeeded"
    assert (runs / "mnist_cnn" / "model.keras").stat().st_uid == IMAGE_UID


# --- the TPU image: Keras on JAX ----------------------------------------------------------------


def _pins(lock: str) -> dict[str, str]:
    lines = [line for line in (REPO / lock).read_text().splitlines() if "==" in line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in (line.split("==", 1) for line in lines)}


def test_the_tpu_lock_is_jax_tpu_at_the_tests_jax_and_agrees_with_requirements_lock():
    tpu, runtime = _pins("requirements-tpu.lock"), _pins("requirements.lock")
    differ = {name: (version, runtime[name]) for name, version in tpu.items() if runtime.get(name, version) != version}
    assert differ == {}, "requirements-tpu.lock and requirements.lock pin these differently (tpu, runtime)"
    jax = importlib.metadata.version("jax")  # the jax the tests run, installed from requirements.lock
    assert tpu["jax"] == tpu["jaxlib"] == runtime["jax"] == jax
    # The libtpu jax's own `tpu` extra names, read from the installed jax's metadata.
    extra = [Requirement(r) for r in importlib.metadata.requires("jax") if "extra == \"tpu\"" in r]
    libtpu = next(r for r in extra if r.name == "libtpu")
    assert libtpu.specifier.contains(tpu["libtpu"]), f"libtpu {tpu['libtpu']} is not jax {jax}'s {libtpu}"
    for needed in ("keras", "orbax-checkpoint", "tensorflow-cpu"):
        assert tpu[needed] == runtime[needed], needed
    retired = {"tensorflow-tpu", "tf-keras", "tensorflow", "libtpu-nightly"} & set(tpu)
    assert retired == set(), f"requirements-tpu.lock still pins {retired}"


def test_pyprojects_tpu_extra_is_jax_tpu_and_the_cpu_tensorflow():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    runtime = _pins("requirements.lock")
    assert extras["tpu"] == [f"jax[tpu]=={runtime['jax']}", f"tensorflow-cpu=={runtime['tensorflow-cpu']}"]


@pytest.mark.slow
@pytest.mark.host
@pytest.mark.timeout(1800)  # a first build downloads about 1 GB of wheels (libtpu alone is 250 MB)
def test_the_tpu_image_holds_its_lock_and_says_there_is_no_tpu_here(docker_engine: Engine, runner_tpu_image: str):
    """Built with its check (scripts/image-install.sh check-tpu: the build fails when it does); here the image
    as shipped: exactly requirements-tpu.lock, root, no KERAS_BACKEND baked in, and `runner doctor` in a
    container with no TPU and no network naming the cause and the fix."""
    config = json.loads(docker_engine.docker("image", "inspect", runner_tpu_image, check=True).stdout)[0]["Config"]
    assert config["Labels"]["runner.accelerator"] == "tpu" and config["User"] == "0:0"
    assert config["Entrypoint"] == ["runner"]
    assert not [v for v in config["Env"] if v.startswith("KERAS_BACKEND=")], "the runner sets the backend per job"

    frozen = docker_engine.docker("run", "--rm", "--network", "none", "--entrypoint", "python3", runner_tpu_image,
                                  "-m", "pip", "freeze", "--all", check=True, timeout=120).stdout.splitlines()
    have = {canonicalize_name(n): v for n, v in (line.split("==", 1) for line in frozen if "==" in line)}
    have.pop("pip")
    assert {"jax", "jaxlib", "libtpu", "keras", "orbax-checkpoint", "tensorflow-cpu"} <= set(have)
    assert not {"tensorflow-tpu", "tensorflow", "tf-keras"} & set(have), "TensorFlow is tensorflow-cpu, for tf.data"
    assert have == _pins("requirements-tpu.lock"), "the TPU image installs other versions than its lock"

    doctor = docker_engine.docker("run", "--rm", "--network", "none", runner_tpu_image, "doctor", "--json",
                                  "--timeout", "60", timeout=300)
    assert "Traceback" not in doctor.stdout + doctor.stderr
    checks = {check["name"]: check for check in last_json(doctor.stdout)["checks"]}
    assert checks["versions"]["status"] == "ok", checks["versions"]
    assert f"libtpu {have['libtpu']}" in checks["versions"]["evidence"]
    jax = checks["jax"]
    assert jax["status"] == "warn" and jax["evidence"].startswith(f"no TPU here: JAX {have['jax']} loads libtpu from ")
    assert "No jellyfish device found" in jax["evidence"] and "--privileged --net=host" in jax["action"]
    assert jax["data"]["libtpu_path"] == jax["data"]["jax_library_path"], "JAX looks for libtpu where it is"
    assert checks["tensorflow"]["status"] == "ok" and checks["tensorflow"]["data"]["version"] == have["tensorflow-cpu"]

    # A TPU asked for (TPU_NAME=local, as on a TPU VM) and none there: a fail, with the same cause and fix.
    wanted = docker_engine.docker("run", "--rm", "--network", "none", "-e", "TPU_NAME=local", runner_tpu_image,
                                  "doctor", "--json", "--timeout", "60", timeout=300)
    wanted_jax = {check["name"]: check for check in last_json(wanted.stdout)["checks"]}["jax"]
    assert wanted.returncode == 3 and wanted_jax["status"] == "fail"
    assert wanted_jax["evidence"].startswith("no TPU here") and "TPU VM" in wanted_jax["action"]
