"""Accelerator resolution: which TPU is tried and why, bounded failures with what to check, and the fallbacks."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from runner.device.strategy import tpu_target
from runner.spec.types import AcceleratorSpec
from tests.conftest import cli_env, last_json, run_cli


def test_tpu_target_order_spec_then_tpu_name_then_colab() -> None:
    env = {"TPU_NAME": "my-tpu", "COLAB_TPU_ADDR": "10.0.0.2:8470"}
    assert tpu_target(AcceleratorSpec(tpu="local"), env) == "local"
    assert tpu_target(AcceleratorSpec(), env) == "my-tpu"
    assert tpu_target(AcceleratorSpec(), {"COLAB_TPU_ADDR": "10.0.0.2:8470"}) == "grpc://10.0.0.2:8470"
    # This machine has no /dev/accel* or /dev/vfio devices: nothing points at a TPU, so none is tried.
    assert tpu_target(AcceleratorSpec(), {}) is None


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers: a TPU address that hangs the gRPC handshake."""

    def __init__(self, lifetime_s: float = 60):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._deadline = time.monotonic() + lifetime_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent_tpu():
    server = SilentServer()
    yield server
    server.close()


def quick_job(mnist_job, name: str, **accelerator) -> Path:
    return mnist_job(name, accelerator=accelerator, train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True},
                     data={"eval": None})


def test_tpu_address_with_nothing_listening_fails_fast_with_what_to_check(mnist_job) -> None:
    port = closed_port()
    result = run_cli("run", quick_job(mnist_job, "closed", kind="auto", backend="tensorflow", tpu=f"grpc://127.0.0.1:{port}",
                                      timeout_s=5))
    assert result.returncode == 0, result.stderr  # TensorFlow's TPU path (retired: docs/tpu.md) falls back to the CPU
    assert "no TPU, falling back" in result.stderr
    assert f"nothing answers at 127.0.0.1:{port}" in result.stderr
    assert ("tried: device API: stream executor (TensorFlow's default) for a remote TPU -> probe grpc://127.0.0.1"
            in result.stderr)
    assert "Check:" in result.stderr and "libtpu" in result.stderr


def test_tpu_address_that_never_answers_is_bounded_by_timeout(mnist_job, silent_tpu: SilentServer) -> None:
    spec = quick_job(mnist_job, "silent", kind="auto", backend="tensorflow",
                     tpu=f"grpc://127.0.0.1:{silent_tpu.port}", timeout_s=3)
    result = run_cli("run", spec, timeout=120)
    assert result.returncode == 3, result.stderr  # no fallback after a hung step: its thread stays inside TensorFlow
    assert "did not finish within accelerator.timeout_s (3 s)" in result.stderr
    assert silent_tpu.accepted, "the runner did knock on the TPU address"
    assert last_json(result.stdout)["timing"]["strategy_s"] < 60


def test_tpu_vm_mode_without_a_tpu_names_the_step_and_the_lockfile_hint(mnist_job) -> None:
    # A v4 keeps TensorFlow's default device API, so the CPU wheel gets as far as the TPU calls themselves.
    env = cli_env(TPU_ACCELERATOR_TYPE="v4-8", GCE_METADATA_HOST=f"127.0.0.1:{closed_port()}")
    spec = quick_job(mnist_job, "local", kind="auto", backend="tensorflow", tpu="local", timeout_s=20)
    result = run_cli("run", spec, env=env)
    assert result.returncode == 0, result.stderr
    assert "could not start the TPU 'local'" in result.stderr
    assert "tried: device API: stream executor for v4-8 (TPU_ACCELERATOR_TYPE) -> TPUClusterResolver" in result.stderr


def test_tpu_vm_mode_of_an_unknown_generation_needs_libtpu_for_pjrt(mnist_job) -> None:
    env = cli_env(GCE_METADATA_HOST=f"127.0.0.1:{closed_port()}")  # no metadata server, no TPU_ACCELERATOR_TYPE
    spec = quick_job(mnist_job, "unknown", kind="auto", backend="tensorflow", tpu="local", timeout_s=20)
    result = run_cli("run", spec, env=env)
    assert result.returncode == 0, result.stderr
    assert ("could not start the TPU 'local' (device API PJRT for an unknown TPU generation): PJRT needs libtpu, "
            "and the pip package `libtpu` is not installed here") in result.stderr


def test_auto_falls_back_from_an_unreachable_colab_tpu_to_the_cpu(mnist_job) -> None:
    spec = quick_job(mnist_job, "fallback", kind="auto", backend="tensorflow", timeout_s=5)
    env = cli_env(COLAB_TPU_ADDR=f"127.0.0.1:{closed_port()}")
    result = run_cli("run", spec, env=env)
    assert result.returncode == 0, result.stderr
    assert "no TPU, falling back" in result.stderr
    summary = last_json(result.stdout)
    assert summary["accelerator"]["kind"] == "cpu"
    assert summary["final_step"] == 2
    # The TPU it fell back from: a grpc:// address, so TensorFlow's default device API and nothing set.
    tried = summary["accelerator"]["tpu_runtime"]
    assert (tried["device_api"], tried["generation_from"], tried["settings"]) == (
        "stream_executor", "the TPU address", {})


def test_gpu_requested_on_a_machine_without_one(mnist_job) -> None:
    result = run_cli("run", quick_job(mnist_job, "gpu", kind="gpu"))
    assert result.returncode == 3
    assert "TensorFlow sees no GPU" in result.stderr


def test_tpu_requested_where_jax_finds_none(mnist_job) -> None:
    result = run_cli("run", quick_job(mnist_job, "notpu", kind="tpu"), env=cli_env(TPU_NAME="", COLAB_TPU_ADDR=""))
    assert result.returncode == 3
    assert "accelerator.kind is 'tpu' but JAX finds no TPU" in result.stderr
    assert last_json(result.stdout)["accelerator"] is None


def test_steps_per_execution_auto_is_32_on_tpu_and_1_elsewhere() -> None:
    from runner.spec.types import JobSpec
    from runner.train.build import steps_per_execution

    auto = JobSpec()
    assert steps_per_execution(auto, "tpu") == 32
    assert steps_per_execution(auto, "cpu") == steps_per_execution(auto, "gpu") == 1
    # With a step cadence, executions must end on checkpoint steps: the largest divisor up to 32.
    assert steps_per_execution(JobSpec(checkpoint={"every_steps": 100}), "tpu") == 25
    assert steps_per_execution(JobSpec(train={"steps_per_execution": 8}), "cpu") == 8


def test_batch_arithmetic_for_eight_tpu_cores(caplog) -> None:
    import tensorflow as tf

    from runner import SpecError
    from runner.device.strategy import Accelerator, per_replica_batch

    # What a v5litepod-8 presents: the arithmetic needs only the replica count and the device kind.
    eight_cores = Accelerator(tf.distribute.get_strategy(), "tpu", 8)
    assert per_replica_batch(1024, eight_cores) == 128
    assert "not a multiple of 8" not in caplog.text
    assert per_replica_batch(96, eight_cores) == 12
    assert "per-replica batch 12 is not a multiple of 8" in caplog.text
    with pytest.raises(SpecError, match=r"data.global_batch_size \(1001\) must be divisible by the number of replicas "
                                        r"\(8\): set it to 1000 or 1008"):
        per_replica_batch(1001, eight_cores)
