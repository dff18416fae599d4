"""A model sharded over a mesh of 8 CPU devices (`accelerator.mesh`, `model.sharding`: runner/device/sharding.py),
as a user runs it: the loss falls, each device holds at most a third of a replicated copy and the summary says
so, a layout the mesh cannot divide is refused naming the variable, its shape and the axis. The model is a small
MLP of the suite's own (tests/support/sharded_mlp.py) on small_mnist; JAX compiles it once per mesh."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support import hub_preset
from tests.support.runs import finish, start_run, wait_for
from tests.test_language_model import tiny_preset  # noqa: F401  (the session's tiny KerasHub preset)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MESH = {"batch": 2, "model": 4}


def _job(mnist_job, name="sharded", sharding="fsdp", mesh=None, **sections):
    return mnist_job(
        name, accelerator=sections.pop("accelerator", {"kind": "cpu", "cpu_devices": 8, "mesh": mesh or MESH}),
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
    # The estimate `runner validate --tpu-type` makes, from the same counts, is within 10% of what the devices hold.
    estimated = sharding["estimate"]["bytes_per_device"]
    measured = held["parameters"] + held["optimizer"]
    assert abs(estimated["parameters"] + estimated["optimizer"] - measured) <= measured / 10, sharding


def test_a_rule_the_mesh_cannot_divide_is_refused_before_training_naming_variable_shape_and_axis(mnist_job):
    rules = {"wide/kernel": [None, "model"], "middle/kernel": ["model", None]}
    done = run_cli("run", _job(mnist_job, "indivisible", rules, model={"params": {"hidden": 250}}), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stderr
    assert "variable 'wide/kernel' of shape [784, 250]" in said and "mesh axis 'model' (4 devices)" in said, said
    assert last_json(done.stdout)["status"] == "failed"


def _orbax_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in folder.iterdir() if p.name.split("_")[-1].isdigit()) \
        if folder.is_dir() else []


def _held_run(spec: Path, tmp_path: Path, step: int) -> tuple[subprocess.Popen, Path]:
    held = tmp_path / f"held-{step}"
    process = start_run(spec, env=cli_env(HOLD_AT_STEP=str(step), HOLD_FILE=str(held)))
    wait_for(lambda: held.exists() or None, process, timeout=300)
    return process, held


def test_a_sharded_job_resumes_at_the_exact_step_after_sigterm_and_kill_9_on_the_same_mesh(mnist_job, tmp_path):
    spec = _job(mnist_job, "resumed", data={"eval": None}, train={"epochs": 3, "callbacks": ["sharded_mlp:Hold"]},
                checkpoint={"every_steps": 4}, output={"tensorboard": False})
    run_dir = tmp_path / "runs" / "resumed"
    process, held = _held_run(spec, tmp_path, 10)  # SIGTERM while step 10 is held: the save is of step 10
    process.send_signal(signal.SIGTERM)
    held.unlink()
    code, out, err = finish(process)
    assert code == 75, err[-3000:]
    saved = int(re.search(r"saved step (\d+) ", err).group(1))  # the step boundary after the notice
    assert last_json(out)["status"] == "preempted" and 10 <= saved <= 12 and saved in _orbax_steps(run_dir)

    process, held = _held_run(spec, tmp_path, 22)  # kill -9 while step 22 is held: the newest whole save stands
    wait_for(lambda: any(s >= 20 for s in _orbax_steps(run_dir)) or None, process, timeout=120)
    process.kill()
    finish(process)
    newest = max(_orbax_steps(run_dir))
    assert 20 <= newest <= 22

    done = run_cli("run", spec, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done.stdout)
    assert summary["resumed_from_step"] == newest and summary["final_step"] == 48
    attempts = sorted((run_dir / "attempts").iterdir())  # the killed attempt wrote none
    assert [json.loads(a.read_text())["status"] for a in attempts] == ["preempted", "succeeded"]
    assert summary["sharding"]["mesh"] == MESH
    losses = [e["loss"] for e in summary["epochs"] if not e["partial"]]
    assert losses[-1] < losses[0], losses


# Restores the newest checkpoint of RUN into the MLP laid out over a mesh of 4 x 2 (saved over 2 x 4) and prints
# how many arrays equal model.keras's (the same step) exactly, and the sharding of the first kernel.
_RESTORE_ON_ANOTHER_MESH = """
import json, sys
import jax, keras, numpy as np
sys.path.insert(0, sys.argv[2])
import sharded_mlp
from runner.device import sharding
from runner.rundir.orbax_store import OrbaxStore
sharding.distribution({"batch": 4, "model": 2}, "fsdp", None, jax.devices(), 1)
model = sharded_mlp.build({}, {}, ["image"])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
store = OrbaxStore(sys.argv[1] + "/checkpoints", model, 3)
step = store.restore(store.latest())
saved = keras.saving.load_model(sys.argv[1] + "/model.keras")
same = [bool(np.array_equal(np.asarray(a.value), np.asarray(b.value))) for a, b in zip(model.weights, saved.weights)]
print(json.dumps({"step": step, "same": same, "spec": str(model.weights[0].value.sharding.spec)}))
"""


def test_a_checkpoint_saved_over_one_mesh_restores_exactly_onto_another_and_the_job_resumes_on_it(
        mnist_job, tmp_path):
    spec = _job(mnist_job, "remeshed", data={"eval": None}, train={"epochs": 1}, output={"tensorboard": False})
    first = run_cli("run", spec, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "remeshed"
    env = cli_env(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", PYTHONPATH=str(REPO))
    restored = subprocess.run([sys.executable, "-c", _RESTORE_ON_ANOTHER_MESH, str(run_dir),
                               str(REPO / "tests" / "support")], env=env, capture_output=True, text=True, timeout=120)
    assert restored.returncode == 0, restored.stderr[-3000:]
    found = json.loads(restored.stdout.splitlines()[-1])
    assert found["step"] == 16 and found["same"] == [True] * 6, found
    assert "model" in found["spec"], found  # laid out over the new mesh's model axis

    again = run_cli("run", spec, "--set", "train.epochs=2", "--set", "accelerator.mesh={batch: 4, model: 2}",
                    timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = last_json(again.stdout)
    assert summary["resumed_from_step"] == 16 and summary["final_step"] == 32
    assert summary["sharding"]["mesh"] == {"batch": 4, "model": 2}


@pytest.mark.parametrize(("accelerator", "model", "said"), [
    ({"kind": "cpu", "cpu_devices": 8, "mesh": {"batch": 3, "model": 2}}, {"sharding": "fsdp"},
     "holds 6 devices, which is no whole number of processes of accelerator.cpu_devices (8)"),
    ({"kind": "cpu", "cpu_devices": 8, "mesh": {"batch": 8}}, {}, "must be divisible by accelerator.mesh's batch axis"),
    ({"kind": "cpu", "cpu_devices": 8, "mesh": MESH}, {"sharding": {"dense.*kernel": [None, "modle"]}},
     "names axis 'modle', which accelerator.mesh does not have (its axes: batch, model)"),
    ({"kind": "cpu", "cpu_devices": 8}, {"sharding": "fsdp"}, "model.sharding fsdp needs accelerator.mesh"),
    ({"kind": "cpu", "cpu_devices": 8, "mesh": MESH, "backend": "tensorflow"}, {}, "runs on JAX"),
    ({"mesh": {"batch": 0}}, {}, "axis 'batch' has size 0"),
    ({}, {"sharding": "fdsp"}, "'fdsp' is none of replicated, fsdp, hub"),
    ({}, {"sharding": {"(": [None]}}, "'(' is not a regular expression"),
])
def test_a_mesh_or_layout_that_cannot_work_is_refused_when_the_spec_loads(accelerator, model, said):
    from pydantic import ValidationError

    from runner.spec.types import JobSpec

    with pytest.raises(ValidationError, match=re.escape(said)):
        JobSpec.model_validate({"accelerator": accelerator, "model": model, "data": {"global_batch_size": 12}})


def _big_preset(folder: Path) -> Path:
    """The files `runner validate --tpu-type` reads of a preset, with Gemma-7B-like figures (8.5 billion parameters,
    28 layers, hidden 3072, 16 heads, a 256,000-token vocabulary, bfloat16 weights); no weights."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"class_name": "GemmaBackbone", "config": {
        "num_layers": 28, "hidden_dim": 3072, "num_query_heads": 16, "vocabulary_size": 256_000,
        "dtype": {"config": {"name": "bfloat16"}}}}))
    (folder / "metadata.json").write_text(json.dumps({"parameter_count": 8_537_680_896}))
    (folder / "preprocessor.json").write_text(json.dumps({"config": {"sequence_length": 512}}))
    return folder


def test_validate_estimates_the_memory_per_chip_and_refuses_a_model_too_big_naming_the_knobs(tmp_path):
    preset = _big_preset(tmp_path / "big")
    spec = write_spec(tmp_path, {"name": "big", "model": {"hub": str(preset)}, "data": {"global_batch_size": 8}})
    said = run_cli("validate", spec, "--no-data", "--tpu-type", "v6e-8")
    assert said.returncode == 2, said.stderr
    # 8.5e9 x (2 bytes + 4 x 2 Adam slots + 4 gradient) = 119 GB on one chip of 32 GB: every knob that helps is named.
    assert "of v6e-8's 32 GB per chip" in said.stderr and "It does not fit" in said.stderr, said.stderr
    assert "a bigger model axis" in said.stderr and "model.lora_rank" in said.stderr, said.stderr

    mesh = "accelerator.mesh={batch: 1, model: 8}"
    fits = run_cli("validate", spec, "--no-data", "--tpu-type", "v6e-8", "--set", mesh, "--set",
                   "model.sharding=fsdp", "--set", "model.lora_rank=8")
    assert fits.returncode == 0, fits.stderr
    line = next(x for x in fits.stderr.splitlines() if x.startswith(("memory per device", "warning: memory")))
    assert "parameters 1.99 GiB" in line, line  # 17.1 GB of bfloat16 weights over 8 devices

    wrong = run_cli("validate", spec, "--no-data", "--tpu-type", "v5p-8", "--set", mesh)
    assert wrong.returncode == 2 and "holds 8 devices but v5p-8 has 4" in wrong.stderr, wrong.stderr

    # The dry run of a submission says the same before anything else, and refuses what does not fit.
    cloud = ("--tpu-type", "v6e-8", "--zone", "us-central1-b", "--image", "gcr.io/p/runner:1", "--project", "p",
             "--dry-run", "--set", "output.dir=gs://b/runs", "--set", "data.train=gs://b/data/train-*.tfrecord")
    planned = run_cli("submit", spec, *cloud, "--set", mesh, "--set", "model.sharding=fsdp", "--set",
                      "model.lora_rank=8")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "of v6e-8's 32 GB per chip" in planned.stderr and "price: v6e-8" in planned.stderr, planned.stderr
    refused = run_cli("submit", spec, *cloud)
    assert refused.returncode == 2 and "It does not fit" in refused.stderr, refused.stderr[-3000:]


@pytest.fixture(scope="module")
def lm_data(tiny_preset, tmp_path_factory) -> Path:  # noqa: F811  (the fixture imported above)
    """The tiny preset's prompt/response records, prepared once for this module's language-model jobs."""
    folder = tmp_path_factory.mktemp("lm")
    chats = hub_preset.write_chats(folder / "chats.jsonl")
    prepared = run_cli("prepare", "text", chats, "--preset", tiny_preset, "--sequence-length",
                       hub_preset.SEQUENCE_LENGTH, "--out", folder / "data")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    return folder / "data"


def _lm_spec(tmp_path: Path, preset: Path, data: Path, accelerator: dict, sections: dict | None = None,
             **data_settings) -> Path:
    return write_spec(tmp_path, {
        "name": "lm", "accelerator": accelerator,
        "model": {"hub": str(preset), "lora_rank": 4, "sharding": "hub"},
        "data": {"train": str(data / "train-*.tfrecord"), "global_batch_size": 8, **data_settings},
        "train": {"epochs": 2, "learning_rate": 0.01},
        "output": {"dir": str(tmp_path / "runs"), "saved_model": False, "tensorboard": False},
        **(sections or {}),
    })


def test_a_kerashub_causal_lm_trains_with_lora_over_its_own_layout_and_an_indivisible_one_is_refused(
        tiny_preset, lm_data, tmp_path):  # noqa: F811  (the fixture imported above)
    spec = _lm_spec(tmp_path, tiny_preset, lm_data, {"kind": "cpu", "cpu_devices": 8, "mesh": MESH})
    ran = run_cli("run", spec, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = last_json(ran.stdout)
    losses = [e["loss"] for e in summary["epochs"]]
    assert losses[-1] < losses[0], losses
    sharding = summary["sharding"]
    assert sharding["layout"] == f"hub ({tiny_preset})"
    # GemmaBackbone.get_layout_map's rules, each with the variables it laid out (2 decoder blocks).
    assert sharding["variables_per_rule"]["'token_embedding/embeddings'"] == 1
    assert sharding["variables_per_rule"]["'decoder_block.*attention.*(query|key|value).kernel'"] == 6
    assert sharding["bytes_per_device"]["parameters"] <= sharding["bytes_replicated"]["parameters"] / 3, sharding

    # 4 key-value heads cannot be split over a model axis of 8: refused as the variable is made, by name.
    refused = run_cli("run", spec, "--set", "accelerator.mesh={batch: 1, model: 8}", "--set", "name=lm8",
                      timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    said = refused.stderr
    assert "cannot be split on its dimension" in said and "over mesh axis 'model' (8 devices)" in said, said[-3000:]
    assert re.search(r"variable 'decoder_block_0/attention/(key|value)/kernel' of shape \[4, ", said), said[-3000:]


def test_two_processes_of_4_cpu_devices_resume_a_sharded_kerashub_model_after_sigterm_and_kill_9(
        tiny_preset, lm_data, tmp_path, monkeypatch):  # noqa: F811  (the fixture imported above)
    """Gemma's layout splits its embedding over the batch axis too: no process holds it whole, so each save writes
    each process's shards, a restore reads them back (runner/rundir/orbax_store.py `_target`) and the export
    gathers them. SIGTERM to both processes saves the next step; kill -9 of both leaves the newest whole save;
    the run after them resumes there and ends at the exact step. It hung, every time the shared compile cache was
    warm, in the finiteness check before a save when that ran one small program per variable: process 0 loads its
    programs from the cache, process 1 (whose cache keys differ on CPU; JAX writes from process 0 only) compiles
    its own. One program for the check (runner/device/engine.py `Jax.weights_finite`) ends it."""
    from tests.test_multihost import finish as finish_all
    from tests.test_multihost import start as start_all

    accelerator = {"kind": "cpu", "cpu_devices": 4, "mesh": MESH, "join_timeout_s": 60, "heartbeat_s": 5}
    held_and_saved = {"code": {"folder": str(REPO / "tests" / "support")},  # sharded_mlp:Hold holds a step
                      "train": {"epochs": 2, "learning_rate": 0.01, "callbacks": ["sharded_mlp:Hold"]},
                      "checkpoint": {"every_steps": 3}}
    spec = _lm_spec(tmp_path, tiny_preset, lm_data, accelerator, held_and_saved, in_memory=False)
    run_dir = tmp_path / "runs" / "lm"
    held = tmp_path / "held"
    monkeypatch.setenv("HOLD_FILE", str(held))

    monkeypatch.setenv("HOLD_AT_STEP", "5")  # SIGTERM to both while step 5 is held: both save at JAX's sync point
    started = start_all(spec, 2)
    wait_for(lambda: held.exists() or None, started[0], timeout=240)
    for proc in started:
        proc.send_signal(signal.SIGTERM)
    held.unlink()
    ended = finish_all(started, timeout=240)
    assert [code for code, _, _ in ended] == [75, 75], [err[-2000:] for _, _, err in ended]
    saved = int(re.search(r"saved step (\d+) ", ended[0][2]).group(1))
    assert 5 <= saved < 12 and saved in _orbax_steps(run_dir), (saved, _orbax_steps(run_dir))  # a step both reach

    monkeypatch.setenv("HOLD_AT_STEP", "13")  # kill -9 of both while step 13 is held: the save of step 12 stands
    started = start_all(spec, 2)
    wait_for(lambda: held.exists() or None, started[0], timeout=240)
    wait_for(lambda: 12 in _orbax_steps(run_dir) or None, started[0], timeout=120)
    for proc in started:
        proc.kill()
    finish_all(started, timeout=30)
    held.unlink()
    assert max(_orbax_steps(run_dir)) == 12

    monkeypatch.delenv("HOLD_AT_STEP")
    ended = finish_all(start_all(spec, 2), timeout=300)
    for code, _, err in ended:
        assert code == 0, err[-3000:]
    summary = last_json(ended[0][1])
    assert summary["resumed_from_step"] == 12 and summary["final_step"] == 18
    assert "in 2 processes" in summary["accelerator"]["detail"]
    held_bytes, whole = summary["sharding"]["bytes_per_device"], summary["sharding"]["bytes_replicated"]
    assert held_bytes["parameters"] <= whole["parameters"] / 3, summary["sharding"]
    assert (run_dir / "model.keras").is_file()


def test_a_hub_layout_that_cannot_work_is_refused_before_launch(tiny_preset):  # noqa: F811
    """`model.sharding: hub` needs the backbone's get_layout_map (keras-hub 0.32.0's Gemma3Backbone has none,
    GemmaBackbone has) and, for Gemma's layout, head counts the model axis divides (the tiny preset has 4 key-value
    heads). A job would learn either only as it builds the model on the TPU VM, billing: validate --tpu-type and
    submit read them from keras_hub's files and a preset folder's config.json first."""
    from runner import SpecError
    from runner.device import memory
    from runner.spec.load import load_spec

    hub = ["output.dir=gs://b/runs", "data.train=gs://b/chats/train-*.tfrecord", "model.sharding=hub",
           "accelerator.mesh={batch: 4, model: 2}"]
    job = REPO / "jobs" / "gemma3_1b_lora.yaml"
    with pytest.raises(SpecError, match=r"'gemma3_instruct_1b' is a gemma3 model, whose backbone gives no layout "
                                        r"of its own \(no get_layout_map in the installed "
                                        r"keras_hub/src/models/gemma3/gemma3_backbone.py\)"):
        memory.check_for_tpu(load_spec(job, hub), "v6e-8")
    assert memory.check_for_tpu(load_spec(job, [*hub, "model.hub=gemma_2b_en"]), "v6e-8")[0] == "fits"
    assert memory.check_for_tpu(load_spec(job, hub[:2]), "v6e-8")[0] == "fits"  # replicated, the job's own

    folder = [*hub[:3], f"model.hub={tiny_preset}"]
    with pytest.raises(SpecError, match=r"config.json has num_key_value_heads 4, which mesh axis 'model' \(8 "
                                        r"devices\) cannot split"):
        memory.check_for_tpu(load_spec(job, [*folder, "accelerator.mesh={batch: 1, model: 8}"]), "v6e-8")
    assert memory.check_for_tpu(load_spec(job, [*folder, "accelerator.mesh={batch: 2, model: 4}"]), "v6e-8")[0] \
        == "fits"


def test_a_preset_known_by_name_is_estimated_from_keras_hubs_own_table_as_a_lower_bound() -> None:
    """jobs/gemma3_1b_lora.yaml names a preset downloaded only on the TPU VM: its parameters come from the preset
    table the installed keras_hub ships (read as text), and the line says what it leaves out; without LoRA every
    weight's slots and gradients count, and the serialized AdamW of the job is read for its two slots."""
    from runner.device import memory
    from runner.spec.load import load_spec

    assert memory.installed_preset_params("gemma3_instruct_1b")[0] == 999_885_952
    assert memory.installed_preset_params("no_such_preset")[0] is None
    remote = ["output.dir=gs://b/runs", "data.train=gs://b/chats/train-*.tfrecord"]
    lora = load_spec(REPO / "jobs" / "gemma3_1b_lora.yaml", remote)
    verdict, line = memory.check_for_tpu(lora, "v6e-8")
    assert verdict == "fits" and "at least: 999,885,952 parameters" in line and "LoRA rank 8's adapters" in line
    assert line.startswith("memory per device (mesh auto: the batch over 8 devices, each weight on every device)")
    full = load_spec(REPO / "jobs" / "gemma3_1b_lora.yaml", [*remote, "model.lora_rank=null"])
    verdict, line = memory.check_for_tpu(full, "v5litepod-4")
    assert "optimizer 7.45 GiB, gradients 3.72 GiB" in line, line  # AdamW: two float32 slots per weight
