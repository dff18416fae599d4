"""bfloat16 mixed precision keeps the output float32; the same job behaves the same under Keras 3 and tf-keras."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import cli_env, last_json, run_cli

pytestmark = pytest.mark.slow


def test_bfloat16_computes_in_bf16_with_a_float32_output(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("bf16", train={"epochs": 1, "steps_per_epoch": 4, "mixed_precision": "bfloat16"}, data={"eval": None})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr
    assert last_json(result.stdout)["status"] == "succeeded"
    import tensorflow as tf

    model = tf.keras.models.load_model(tmp_path / "runs" / "bf16" / "model.keras")
    conv = next(layer for layer in model.layers if "conv" in layer.name)
    assert conv.compute_dtype == "bfloat16" and conv.variable_dtype == "float32"
    assert model.layers[-1].compute_dtype == "float32"
    assert model.output.dtype == "float32"


@pytest.mark.parametrize("legacy", ["0", "1"], ids=["keras3", "tf-keras"])
def test_the_same_job_under_either_keras(mnist_job, legacy: str) -> None:
    spec = mnist_job(f"flavour{legacy}", train={"epochs": 2})
    result = run_cli("run", spec, env=cli_env(TF_USE_LEGACY_KERAS=legacy))
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["accelerator"]["keras"].startswith("tf-keras" if legacy == "1" else "keras ")
    assert [e["steps"] for e in summary["epochs"]] == [16, 16]
    assert summary["final_step"] == 32
    assert summary["metrics"]["accuracy"] > 0.5
    assert set(summary["timing"]) >= {"first_epoch_s", "steady_epoch_s", "step_time_ms", "examples_per_sec"}
