"""A private Docker engine and the runner image, for tests that build and run the real container.

    docker_engine   session: an `Engine` on the dockerd that scripts/docker-rig.sh starts (its own data root
                    and socket; no bridge, no iptables). The stand-in base image is imported under the
                    Dockerfile's real base name. The engine is stopped, by PID, by the session that started
                    it. If it cannot start, the test fails with the rig's own words (no skip).
    runner_image    session: the image built from the repository's Dockerfile (default target, CPU), as a tag.
    runner_tpu_image  session: the same Dockerfile with --build-arg ACCELERATOR=tpu (Keras on JAX, libtpu), as a
                    tag; its build runs the image's own TPU check (scripts/image-install.sh check-tpu).

Import them in a test module: `from tests.support.docker import docker_engine, runner_image`.
Builds use `--network host` (pip reaches PyPI) and containers `--network none` unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.device.host import CPU_BF16_ENV

REPO = Path(__file__).resolve().parents[2]
RIG = REPO / "scripts" / "docker-rig.sh"
# Debian's client, installed by the rig with its engine: its BuildKit needs no buildx plugin.
DOCKER = "/usr/bin/docker"
IMAGE_TAG = "runner:under-test"
TPU_IMAGE_TAG = "runner:tpu-under-test"
# One session at a time may drive the private engine: a second one would stop it under the first.
_LOCK = Path(os.environ.get("RUNNER_DOCKER_LOCK", "/run/runner-docker.lock"))
_LOCK_WAIT_S = 900
_START_TIMEOUT_S = 420  # apt-get install docker.io on a clean machine, then dockerd start-up
_BASE_TIMEOUT_S = 600  # debootstrap of the stand-in base (about a minute; cached afterwards)
_BUILD_TIMEOUT_S = 900


class Engine:
    def __init__(self, host: str):
        self.host = host
        self.env = {**os.environ, "DOCKER_HOST": host, "DOCKER_BUILDKIT": "1"}

    def docker(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        if args and args[0] == "run":  # a container's job picks its precision as the suite's own jobs do
            args = ("run", "--env", CPU_BF16_ENV, *args[1:])  # (passed only when set: `docker run --env NAME`)
        try:
            result = subprocess.run(
                [DOCKER, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=self.env
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"docker {' '.join(map(str, args[:3]))} ... did not finish within {timeout:.0f}s")
        if check and result.returncode != 0:
            pytest.fail(f"docker {' '.join(map(str, args[:3]))} ... exited {result.returncode}:\n"
                        f"{result.stderr[-3000:]}")
        return result


def _ca_bundle() -> str | None:
    """The machine's CA bundle, handed to pip inside the build (a TLS-inspecting proxy sits in front of PyPI)."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@contextlib.contextmanager
def _exclusive(path: Path, wait_s: float) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another test session has held {path} (the private Docker engine) for {wait_s:.0f}s")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _rig(*args: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["bash", str(RIG), *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scripts/docker-rig.sh {' '.join(args)} did not finish within {timeout:.0f}s")


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Engine]:
    with _exclusive(_LOCK, _LOCK_WAIT_S):
        started = _rig("start", timeout=_START_TIMEOUT_S)
        if started.returncode != 0:
            pytest.fail(f"the Docker engine could not start: {started.stderr.strip()}")
        values = dict(line.split("=", 1) for line in started.stdout.split() if "=" in line)
        engine = Engine(values["DOCKER_HOST"])
        try:
            base = _rig("base", timeout=_BASE_TIMEOUT_S)
            if base.returncode != 0:
                pytest.fail(f"the stand-in base image could not be made: {base.stderr.strip()}")
            yield engine
        finally:
            if values.get("DOCKERD_STARTED") == "1":
                _rig("stop", timeout=60)


def build_image(engine: Engine, tag: str, log: Path, *build_args: str) -> float:
    """Builds the repository's Dockerfile as it stands; returns the seconds it took. The engine's layer cache
    persists between sessions, so an unchanged dependency layer is not installed again."""
    args = ["build", "--network", "host", "--progress", "plain", "--tag", tag, *build_args]
    ca = _ca_bundle()
    if ca:
        args += ["--secret", f"id=pip_cert,src={ca}"]
    began = time.monotonic()
    result = engine.docker(*args, str(REPO), timeout=_BUILD_TIMEOUT_S)
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        pytest.fail(f"docker build {' '.join(build_args)} failed (exit {result.returncode}; full log {log}):\n"
                    f"{result.stderr[-4000:]}")
    engine.docker("image", "prune", "--force")  # earlier builds' untagged images
    seconds = time.monotonic() - began
    print(f"{tag} built in {seconds:.0f}s; log {log}")
    return seconds


@pytest.fixture(scope="session")
def runner_image(docker_engine: Engine, tmp_path_factory) -> str:
    """Builds the Dockerfile as it stands (default target) once per session; returns its tag."""
    build_image(docker_engine, IMAGE_TAG, tmp_path_factory.mktemp("image") / "build.log")
    return IMAGE_TAG


@pytest.fixture(scope="session")
def runner_tpu_image(docker_engine: Engine, tmp_path_factory) -> str:
    """Builds the TPU image (--build-arg ACCELERATOR=tpu) once per session; returns its tag."""
    build_image(docker_engine, TPU_IMAGE_TAG, tmp_path_factory.mktemp("tpu-image") / "build.log",
                "--build-arg", "ACCELERATOR=tpu")
    return TPU_IMAGE_TAG


IMAGE_UID = 1000  # the runner image's unprivileged user (Dockerfile: USER 1000:1000)


def folders_for_the_container(source: Path, folder: Path, name: str) -> tuple[Path, Path]:
    """A copy of the data at `source` as folder/name, readable by all, and an empty folder/runs owned by the
    image's user: the container reads its data read-only and writes its run folder as uid 1000."""
    data = folder / name
    shutil.copytree(source, data)
    data.chmod(0o755)
    runs = folder / "runs"
    runs.mkdir()
    os.chown(runs, IMAGE_UID, IMAGE_UID)
    return data, runs
