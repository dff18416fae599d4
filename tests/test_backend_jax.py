"""The JAX backend (`accelerator.backend: jax`): the job's core under Keras 3 on JAX, run as a user runs it.

XLA on these CPUs is several times slower than TensorFlow (benchmarks/RESULTS.md, "Backends"), so each job here
is small: tiny MNIST at a batch of 64 and a few steps per epoch. The run folder keeps JAX's compiled programs
(`jax_cache/`), so a rerun of the same job skips the compile its first attempt paid for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

from runner.device import backend
from runner.spec.types import AcceleratorSpec
from tests.conftest import REPO, cli_env, last_json, run_cli
from tests.support.runs import finish, start_run, wait_for

JAX = ["--set", "accelerator.backend=jax"]
STEPS, EPOCHS = 6, 2


def jax_job(mnist_job, name: str, **sections):
    """A small MNIST job under JAX; `sections` override these (a section given replaces its defaults here)."""
    defaults = {
        "accelerator": {"kind": "cpu", "backend": "jax"},
        "data": {"global_batch_size": 64},
        "train": {"epochs": EPOCHS, "steps_per_epoch": STEPS, "allow_chance": True},
        "output": {"tensorboard": False},
    }
    return mnist_job(name, **{**defaults, **sections})


def tiny_model(folder) -> str:
    """A one-layer model in the spec's code folder: it compiles in seconds where the CNN takes tens under XLA
    on this CPU, for the tests that are about the run folder rather than the model."""
    (folder / "tinynet.py").write_text(
        "import keras\n\n\n"
        "def build(params, features, inputs):\n"
        "    x = keras.Input((28, 28, 1))\n"
        "    flat = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))\n"
        "    y = keras.layers.Dense(10, activation='softmax')(flat)\n"
        "    return keras.Model(x, y)\n"
    )
    return "tinynet:build"


def orbax_steps(run_dir) -> list[int]:
    """The whole Orbax checkpoints in the run folder (a save in progress is a `.orbax-checkpoint-tmp` folder)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in folder.iterdir() if p.name.split("_")[-1].isdigit())


# --- the choice, before anything heavy loads ----------------------------------------------------------------


def test_auto_is_jax_on_a_tpu_and_tensorflow_on_the_cpu_each_with_its_reason():
    on_cpu = backend.choose(AcceleratorSpec(kind="cpu"), environ={})
    assert on_cpu.name == "tensorflow" and "faster" in on_cpu.reason
    assert backend.choose(AcceleratorSpec(kind="tpu"), environ={}).name == "jax"
    named = backend.choose(AcceleratorSpec(), environ={"TPU_NAME": "my-v6e"})
    assert named.name == "jax" and "my-v6e" in named.reason
    assert backend.choose(AcceleratorSpec(), environ={}).name == "tensorflow"  # nothing points at a TPU
    asked = backend.choose(AcceleratorSpec(kind="cpu", backend="jax"), environ={})
    assert asked == backend.Backend("jax", "accelerator.backend: jax")


def test_a_tpu_with_the_retired_tensorflow_engine_is_refused_by_validate(mnist_job):
    spec = mnist_job("tf-on-tpu", accelerator={"kind": "tpu", "backend": "tensorflow"})
    result = run_cli("validate", spec)
    assert result.returncode == 2
    assert "accelerator" in result.stderr and "backend: jax" in result.stderr


def test_a_backend_that_does_not_exist_is_refused_naming_the_choices(mnist_job):
    result = run_cli("validate", mnist_job("typo"), "--set", "accelerator.backend=jaxx")
    assert result.returncode == 2
    assert "accelerator.backend" in result.stderr and "jax" in result.stderr


def test_keras_already_loaded_with_another_backend_is_refused_not_used():
    code = (
        "import os, keras\n"
        "from runner import AcceleratorError\n"
        "from runner.device import backend\n"
        "from runner.spec.types import AcceleratorSpec\n"
        "spec = AcceleratorSpec(kind='cpu', backend='jax')\n"
        "try:\n"
        "    backend.apply(backend.choose(spec), spec)\n"
        "except AcceleratorError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = {k: v for k, v in cli_env().items() if k != "KERAS_BACKEND"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=600)
    assert "refused: Keras was imported with the tensorflow backend" in result.stdout, result.stderr[-2000:]


# --- a job, end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_a_jax_job_trains_evaluates_predicts_and_exports_with_its_backend_in_the_summary(mnist_job, tmp_path):
    spec = jax_job(mnist_job, "jax-e2e")
    result = run_cli("run", spec, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["accelerator"]["backend"] == {"name": "jax", "reason": "accelerator.backend: jax"}
    assert "jax" in summary["accelerator"]
    assert "backend jax" in result.stderr or "on jax" in result.stderr  # the accelerator line says it too
    assert summary["final_step"] == EPOCHS * STEPS
    assert summary["metrics"]["examples"] == 512  # every test record, once
    assert summary["checkpoint_saves"]["store"] == "orbax" and summary["checkpoint_saves"]["mode"] == "async"
    assert summary["throughput"]["flops_method"].startswith("xla:")
    assert summary["throughput"]["mfu"] > 0
    run_dir = tmp_path / "runs" / "jax-e2e"
    assert orbax_steps(run_dir) == [STEPS, EPOCHS * STEPS]
    assert any((run_dir / "jax_cache").iterdir())
    assert (run_dir / "model.keras").is_file()

    # evaluate restores the Orbax checkpoint and measures what the run measured
    evaluated = run_cli("evaluate", spec, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    again = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert again["examples"] == 512
    assert again["metrics"]["accuracy"] == pytest.approx(summary["metrics"]["accuracy"], abs=1e-6)

    # predict on rows, with its input checks
    from runner.prepare.datasets import load_dataset

    digits = tmp_path / "digits.npy"
    np.save(digits, load_dataset("mnist").splits["test"]["image"][:5])
    predicted = run_cli("predict", spec, "--input", digits, timeout=600)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert len([line for line in predicted.stdout.splitlines() if line.startswith("{")]) == 5

    # the SavedModel serves records through the runner's own parser, converted from JAX
    import tensorflow as tf

    loaded = tf.saved_model.load(str(run_dir / "saved_model"))
    pattern = yaml.safe_load(spec.read_text())["data"]["eval"]
    records = [r.numpy() for r in tf.data.TFRecordDataset(tf.io.gfile.glob(pattern)).take(3)]
    outputs = loaded.serve_examples(tf.constant(records)).numpy()
    assert outputs.shape == (3, 10)
    np.testing.assert_allclose(outputs.sum(axis=1), 1.0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_sigterm_under_jax_saves_exits_75_and_the_rerun_ends_at_the_planned_step(mnist_job, tmp_path):
    spec = jax_job(mnist_job, "jax-term", train={"epochs": 3, "steps_per_epoch": STEPS, "allow_chance": True},
                   checkpoint={"every_steps": 2}, data={"eval": None, "global_batch_size": 64})
    run_dir = tmp_path / "runs" / "jax-term"
    process = start_run(spec)
    wait_for(lambda: (s := orbax_steps(run_dir)) and s[-1] >= 2 or None, process, timeout=600)
    process.send_signal(signal.SIGTERM)
    code, out, err = finish(process, timeout=300)
    assert code == 75, err[-3000:]
    first = last_json(out)
    assert first["status"] == "preempted"
    assert first["preemption"]["saved_after_notice_s"] is not None
    saved = orbax_steps(run_dir)[-1]
    assert 2 <= saved < 3 * STEPS

    result = run_cli("run", spec, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["resumed_from_step"] == saved
    assert summary["final_step"] == 3 * STEPS
    mine = [e for e in summary["epochs"] if e["attempt"] == summary["attempt"]]
    assert sum(e["steps"] for e in mine) == 3 * STEPS - saved  # none twice, none skipped


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_kill_9_under_jax_resumes_from_the_newest_whole_checkpoint(mnist_job, tmp_path):
    spec = jax_job(mnist_job, "jax-kill", train={"epochs": 3, "steps_per_epoch": STEPS, "allow_chance": True},
                   checkpoint={"every_steps": 2}, data={"eval": None, "global_batch_size": 64})
    run_dir = tmp_path / "runs" / "jax-kill"
    process = start_run(spec)
    wait_for(lambda: (s := orbax_steps(run_dir)) and s[-1] >= 4 or None, process, timeout=600)
    os.kill(process.pid, signal.SIGKILL)
    code, _, _ = finish(process)
    assert code == -signal.SIGKILL
    latest = orbax_steps(run_dir)[-1]

    result = run_cli("run", spec, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["resumed_from_step"] == latest
    assert summary["final_step"] == 3 * STEPS
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]  # leftovers cleaned


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_a_run_folder_pins_its_backend_both_ways(mnist_job, tmp_path):
    spec = mnist_job("pinned", data={"global_batch_size": 64},
                     train={"epochs": 1, "steps_per_epoch": 3, "allow_chance": True}, output={"tensorboard": False})
    first = run_cli("run", spec)
    assert first.returncode == 0, first.stderr[-3000:]
    assert last_json(first.stdout)["accelerator"]["backend"]["name"] == "tensorflow"
    run_dir = tmp_path / "runs" / "pinned"
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    moved = run_cli("run", spec, "--set", "train.epochs=2", *JAX)
    assert moved.returncode == 2, moved.stderr[-3000:]
    assert "written under the tensorflow backend" in moved.stderr and "computes with jax" in moved.stderr
    assert "--set accelerator.backend=tensorflow" in moved.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing written

    # A finished job's model.keras is Keras's own format, the same under either backend: evaluate under JAX
    # measures the weights the TensorFlow run reported.
    evaluated = run_cli("evaluate", spec, *JAX, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert report["accelerator"]["backend"]["name"] == "jax" and report["checkpoint"].endswith("model.keras")
    assert report["metrics"]["accuracy"] == pytest.approx(last_json(first.stdout)["metrics"]["accuracy"], abs=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_xla_cost_analysis_and_the_per_layer_count_agree_on_the_built_in_cnn():
    code = (
        "import json\n"
        "from runner.models import build\n"
        "from runner.data.schema import Feature\n"
        "from runner.train import flops\n"
        "features = {'image': Feature('uint8', (28, 28, 1)), 'label': Feature('int64', ())}\n"
        "model = build('mnist_cnn', {}, features, ('image',))\n"
        "lowered, _ = flops._lowered_forward(model, 8)\n"
        "layers, unknown = flops._layer_forward(model)\n"
        "print(json.dumps([lowered, layers, unknown]))\n"
    )
    env = cli_env(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lowered, layers, unknown = json.loads(result.stdout.strip().splitlines()[-1])
    assert not unknown
    # XLA counts the elementwise work (activations, pooling) the per-layer arithmetic leaves out: a few percent.
    assert layers <= lowered <= layers * 1.15


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_a_gs_run_folder_under_jax_checkpoints_through_orbax_and_resumes(gcs, mnist_job, tmp_path):
    """Orbax writes the arrays through TensorStore's GCS client (pointed at the emulator with
    TENSORSTORE_GCS_HTTP_URL) and its metadata through TensorFlow's gs:// client (the rig's TLS proxy)."""
    bucket = gcs.bucket()
    spec = jax_job(mnist_job, "jax-gcs", data={"eval": None, "global_batch_size": 64},
                   model={"name": tiny_model(tmp_path)},
                   train={"epochs": 1, "steps_per_epoch": 3, "allow_chance": True},
                   output={"dir": f"gs://{bucket}/runs", "tensorboard": False})
    first = run_cli("run", spec, env=cli_env(**gcs.env), timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert last_json(first.stdout)["compile_cache"] == f"gs://{bucket}/runs/jax-gcs/jax_cache"
    names = gcs.objects(bucket, "runs/jax-gcs/")
    assert "runs/jax-gcs/checkpoints/ckpt_3/commit_success.txt" in names  # Orbax's mark of a whole step on GCS
    assert any(n.startswith("runs/jax-gcs/jax_cache/jit_train_step") for n in names)

    again = run_cli("run", spec, "--set", "train.epochs=2", env=cli_env(**gcs.env), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = last_json(again.stdout)
    assert summary["resumed_from_step"] == 3 and summary["final_step"] == 6
    assert "runs/jax-gcs/checkpoints/ckpt_6/commit_success.txt" in gcs.objects(bucket, "runs/jax-gcs/")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_a_model_that_calls_tensorflow_is_refused_under_jax_before_training(mnist_job, tmp_path):
    (tmp_path / "tfmodel.py").write_text(
        "import keras\n"
        "import tensorflow as tf\n\n\n"
        "class Scale(keras.layers.Layer):\n"
        "    def call(self, x):\n"
        "        return tf.math.multiply(x, 1.0 / 255)\n\n\n"
        "def build(params, features, inputs):\n"
        "    x = keras.Input((28, 28, 1))\n"
        "    y = keras.layers.Dense(10, activation='softmax')(keras.layers.Flatten()(Scale()(x)))\n"
        "    return keras.Model(x, y)\n"
    )
    spec = jax_job(mnist_job, "tf-inside", model={"name": "tfmodel:build"})
    result = run_cli("run", spec, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "'tfmodel:build'" in result.stderr and "cannot run under the jax backend" in result.stderr
    assert "keras.ops" in result.stderr and "accelerator.backend: tensorflow" in result.stderr
    assert "before training" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_matmul_bench_under_jax_multiplies_the_same_chain_as_under_tensorflow(tmp_path):
    runs = {}
    for name in ("tensorflow", "jax"):
        result = run_cli("run", REPO / "jobs" / "matmul_bench.yaml", "--set", f"accelerator.backend={name}",
                         "--set", "matmul.size=128", "--set", "accelerator.cpu_devices=2", "--set",
                         f"output.dir={tmp_path}", "--set", f"name=mm-{name}", timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = last_json(result.stdout)
    assert runs["jax"]["accelerator"]["backend"]["name"] == "jax"
    assert runs["jax"]["matmul"]["replicas"] == runs["tensorflow"]["matmul"]["replicas"] == 2
    assert runs["jax"]["matmul"]["checksum"] == pytest.approx(runs["tensorflow"]["matmul"]["checksum"], rel=1e-3)
    assert runs["jax"]["tflops"]["warm"] > 0
