"""A model sharded over a mesh of 8 CPU devices (`accelerator.mesh`, `model.sharding`: runner/device/sharding.py),
as a user runs it: the loss falls, each device holds at most a third of a replicated copy and the summary says
so, a layout the mesh cannot divide is refused naming the variable, its shape and the axis. The model is a small
MLP of the suite's own (tests/support/sharded_mlp.py) on small_mnist; JAX compiles it once per mesh."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, last_json, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MESH = {"batch": 2, "model": 4}


def _job(mnist_job, name="sharded", sharding="fsdp", mesh=None, **sections):
    return mnist_job(
        name, accelerator={"kind": "cpu", "cpu_devices": 8, "mesh": mesh or MESH},
        model={"name": "sharded_mlp:build", "sharding": sharding, **sections.pop("model", {})},
        code={"folder": str(REPO / "tests" / "support")}, **sections,
    )


def test_fsdp_over_8_cpu_devices_trains_and_each_device_holds_a_third_at_most(mnist_job):
    done = run_cli("run", _job(mnist_job), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done.stdout)
    losses = [e["loss"] for e in summary["epochs"]]
    assert losses[-1] < losses[0], losses
    sharding = summary["sharding"]
    assert sharding["mesh"] == MESH and sharding["layout"] == "fsdp"
    # The two big kernels split over the model axis; biases and the 2,560-value output kernel whole.
    assert sharding["variables_per_rule"] == {"fsdp": 2, "fsdp: whole (under 16,384 values)": 4}
    held, whole = sharding["bytes_per_device"], sharding["bytes_replicated"]
    assert held["parameters"] <= whole["parameters"] / 3, sharding
    assert held["optimizer"] <= whole["optimizer"] / 3, sharding
    assert "ModelParallel over mesh {batch: 2, model: 4}" in summary["accelerator"]["detail"]


def test_a_rule_the_mesh_cannot_divide_is_refused_before_training_naming_variable_shape_and_axis(mnist_job):
    rules = {"wide/kernel": [None, "model"], "middle/kernel": ["model", None]}
    done = run_cli("run", _job(mnist_job, "indivisible", rules, model={"params": {"hidden": 250}}), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stderr
    assert "variable 'wide/kernel' of shape [784, 250]" in said and "mesh axis 'model' (4 devices)" in said, said
    assert last_json(done.stdout)["status"] == "failed"
