"""Shared fixtures: tiny real datasets as TFRecords, job specs on disk, and the CLI run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

# The GCS rig's fixtures (an emulator on 127.0.0.1 behind TensorFlow's TLS proxy; a fault-injecting chain).
# Session fixtures are imported here once: imported by two test modules, pytest would make two sessions'
# worth of them (two emulators; two holders of the Docker engine's lock, which deadlock).
from tests.support.docker import docker_engine, runner_image, runner_tpu_image  # noqa: E402,F401
from tests.support.gcs import gcs, gcs_faults  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]

# pytest-xdist's workers inherit a COLUMNS and LINES of their own making: the CLI's output (Rich wraps to the
# terminal's width) must be what a user sees without a terminal, whichever way the suite runs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory) -> Path:
    """One XLA compilation cache for the session's JAX jobs, as a user's JAX_COMPILATION_CACHE_DIR gives (the
    runner then uses it instead of each run folder's jax_cache/): a job of a model another test compiled starts
    warm. The workers of one session share it; tests of the run folder's own cache take the variable away."""
    folder = tmp_path_factory.getbasetemp().parent / "jax-compile-cache"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(folder))
    return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


@pytest.fixture(autouse=True)
def _environment_put_back(shared_compile_cache):
    """Each test leaves this process's environment as it found it. A command run in this process (Typer's
    CliRunner: `runner verify` sets the gs:// client's GCS_* variables before TensorFlow loads) would otherwise
    hand its settings to every later test's commands, which keep a value already set as the user's."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "fresh: every `runner` command the test starts, starts fresh as a user's does "
        "(RUNNER_TEST_FRESH=1 for the test; docs/architecture.md, \"The test suite\"): run by every `make test`")


@pytest.fixture(autouse=True)
def _fresh_when_marked(request, _environment_put_back) -> None:
    """A test marked `fresh` starts its commands as users do, not forked from a zygote (tests/support/zygote.py):
    each `make test` then checks the runner's own start-up, which `RUNNER_TEST_FRESH=1 make test` does for all."""
    if request.node.get_closest_marker("fresh"):
        os.environ["RUNNER_TEST_FRESH"] = "1"  # put back after the test (_environment_put_back)


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_cli(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None, cwd: Path | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Runs `python -m runner ARGS` in a child process, as a user would, bounded in time; a child that outlives
    `timeout` fails the test naming the command, the bound and the last words it wrote.

    The child is forked from a process that has loaded TensorFlow as the runner's own start-up plan for the
    command says (tests/support/zygote.py) unless `fresh`, the command is one a zygote does not serve
    (`zygote.plan_for`), or RUNNER_TEST_FRESH=1 is set (a test marked `fresh` sets it)."""
    from tests.support import zygote

    argv = [str(arg) for arg in args]
    try:
        return zygote.run(argv, env=env or cli_env(), cwd=cwd or REPO, timeout=timeout,
                          plan=None if fresh else "auto")
    except subprocess.TimeoutExpired as expired:
        said = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr
        raise AssertionError(f"`runner {' '.join(argv)}` did not end within its {timeout:g} s bound "
                             f"(killed); its stderr ended: {(said or '')[-3000:]}") from None


def last_json(stdout: str) -> dict[str, Any]:
    """The summary: the last line of stdout, parsed."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no output on stdout"
    return json.loads(lines[-1])


def write_spec(folder: Path, doc: dict[str, Any], name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _mnist_cut(out: Path, train: int, test: int) -> Path:
    """The first `train` training and `test` test images of real MNIST, as 4 + 1 TFRecord shards with a manifest."""
    import numpy as np

    from runner.prepare import shards
    from runner.prepare.datasets import Dataset, load_dataset

    full = load_dataset("mnist")
    splits = {
        "train": {k: v[:train] for k, v in full.splits["train"].items()},
        "test": {k: v[:test] for k, v in full.splits["test"].items()},
    }
    small = Dataset(full.name, splits, full.features, full.inputs, full.label, full.source, full.license)
    entries = {
        "train": shards.write_split(small, "train", str(out), 4),
        "test": shards.write_split(small, "test", str(out), 1),
    }
    shards.write_manifest(str(out), shards.manifest_for(small, entries))
    assert np.sum(splits["train"]["label"] == 0) > 0
    return out


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory) -> Path:
    """Real MNIST, cut to 2,048 training and 512 test images, as 4 + 1 TFRecord shards with a manifest."""
    return _mnist_cut(tmp_path_factory.mktemp("mnist"), 2048, 512)


@pytest.fixture(scope="session")
def small_mnist(tmp_path_factory) -> Path:
    """The same with 512 training images (4 shards of 128) and the same 512 test images: `mnist_job`'s data. At
    its batch of 32 an epoch is 16 steps, as tiny_mnist's at 128, for a quarter of the computation: most of the
    suite's jobs only need a model that trains, and each step of the MNIST CNN costs in proportion to its batch."""
    return _mnist_cut(tmp_path_factory.mktemp("mnist-small"), 512, 512)


@pytest.fixture
def mnist_job(small_mnist: Path, tmp_path: Path):
    """Writes a small MNIST job spec into tmp_path (small_mnist's 512 training images at a batch of 32: 16 steps an
    epoch); keyword sections override the defaults."""

    def make(name: str = "tiny", **sections: dict[str, Any]) -> Path:
        doc: dict[str, Any] = {
            "name": name,
            "accelerator": {"kind": "cpu"},
            "data": {
                "train": f"{small_mnist}/train-*.tfrecord",
                "eval": f"{small_mnist}/test-*.tfrecord",
                "global_batch_size": 32,
                "shuffle_buffer": 512,
            },
            "train": {"epochs": 2},
            # No SavedModel unless a test asks (output={"saved_model": True}): its export is 2 s of each run.
            "output": {"dir": str(tmp_path / "runs"), "saved_model": False},
        }
        for section, values in sections.items():
            if isinstance(values, dict):
                doc.setdefault(section, {}).update(values)
            else:
                doc[section] = values
        return write_spec(tmp_path, doc, f"{name}.yaml")

    return make


# The private Docker engine takes one session at a time (tests/support/docker.py): under pytest-xdist
# (`--dist loadgroup`), every test that uses it runs on the same worker.
_DOCKER_FIXTURES = {"docker_engine", "runner_image", "runner_tpu_image"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With RUNNER_TEST_ZYGOTE_LOG set, a line per test: its wall seconds and the CPU seconds of the worker and
    of the children it waited for (forked commands report their own, tests/support/zygote.py): what the suite's
    time goes to, and which tests wait rather than compute."""
    if not os.environ.get("RUNNER_TEST_ZYGOTE_LOG"):
        yield
        return
    import resource
    import time

    from tests.support import zygote

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    began, own, children = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    zygote._trace("test", test=item.nodeid, seconds=round(time.monotonic() - began, 3),
                  own_cpu_s=round(cpu(resource.RUSAGE_SELF) - own, 3),
                  children_cpu_s=round(cpu(resource.RUSAGE_CHILDREN) - children, 3))


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook: see below
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _DOCKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("docker"))
    # pytest-xdist 3.8 sends a group to one worker by renaming each test `nodeid@group` through the old
    # `_nodeid` field, which pytest 9.2 no longer reads (pytest-dev/pytest-xdist#1386): every group would be
    # spread over the workers without a word. The same rename, on the field pytest reads.
    if getattr(config.option, "loadgroup", False):
        from _pytest.nodeid import coerce_node_id

        for item in items:
            marks = item.iter_markers("xdist_group")
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
            if names and not item.nodeid.endswith("@" + "_".join(names)):
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
        # A group is one unit of work for one worker, handed out in collection order: the longest (the Docker
        # builds and containers) go first, so that no worker is left alone with one at the end of the suite.
        items.sort(key=lambda item: 0 if item.nodeid.endswith("@docker") else 1)
