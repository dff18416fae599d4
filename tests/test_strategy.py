"""Accelerator resolution: which TPU is pointed at, what is refused where it is missing, the batch arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.device.host import tpu_target
from tests.conftest import cli_env, last_json, run_cli


def test_tpu_target_order_spec_then_tpu_name_then_colab() -> None:
    env = {"TPU_NAME": "my-tpu", "COLAB_TPU_ADDR": "10.0.0.2:8470"}
    assert tpu_target("local", env) == "local"
    assert tpu_target(None, env) == "my-tpu"
    assert tpu_target(None, {"COLAB_TPU_ADDR": "10.0.0.2:8470"}) == "grpc://10.0.0.2:8470"
    # This machine has no /dev/accel* or /dev/vfio devices: nothing points at a TPU, so none is tried.
    assert tpu_target(None, {}) is None


def quick_job(mnist_job, name: str, **accelerator) -> Path:
    return mnist_job(name, accelerator=accelerator, train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True},
                     data={"eval": None})


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
