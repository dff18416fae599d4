"""The JAX backend (`accelerator.backend: jax`): how it is chosen and refused, and what one job run through
(tests/test_jax_job.py) does not show: a TensorFlow run folder met under JAX, XLA's FLOPs count, a gs:// run
folder, a model that calls TensorFlow, the matmul benchmark.

XLA on these CPUs is several times slower than TensorFlow (benchmarks/RESULTS.md, "Backends"), so each job here
is small: tiny MNIST at a batch of 64, a one-layer model and a few steps. The run folder keeps JAX's compiled
programs (`jax_cache/`), so a rerun of the same job skips the compile its first attempt paid for.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from runner.device import backend
from runner.spec.types import AcceleratorSpec
from tests.conftest import REPO, cli_env, last_json, run_cli

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


# --- the choice, before anything heavy loads ----------------------------------------------------------------


def test_auto_is_jax_on_a_tpu_and_tensorflow_on_the_cpu_each_with_its_reason():
    on_cpu = backend.choose(AcceleratorSpec(kind="cpu"), environ={})
    assert on_cpu.name == "tensorflow" and "faster" in on_cpu.reason
    # The figure is named as what it is: one model on one machine, not this host's measurement.
    assert "6.7x on a 2-core AMD EPYC" in on_cpu.reason and "not of this model on this host" in on_cpu.reason
    assert backend.choose(AcceleratorSpec(kind="tpu"), environ={}).name == "jax"
    named = backend.choose(AcceleratorSpec(), environ={"TPU_NAME": "my-v6e"})
    assert named.name == "jax" and "my-v6e" in named.reason
    assert backend.choose(AcceleratorSpec(), environ={}).name == "tensorflow"  # nothing points at a TPU
    asked = backend.choose(AcceleratorSpec(kind="cpu", backend="jax"), environ={})
    assert asked.name == "jax" and asked.reason.startswith("accelerator.backend: jax, as the spec asks (on a CPU")
    on_tpu = backend.choose(AcceleratorSpec(kind="tpu", backend="jax"), environ={})
    assert on_tpu.reason == "accelerator.backend: jax, as the spec asks"


def test_a_tpu_with_the_retired_tensorflow_engine_is_refused_by_validate(mnist_job):
    spec = mnist_job("tf-on-tpu", accelerator={"kind": "tpu", "backend": "tensorflow"})
    result = run_cli("validate", spec)
    assert result.returncode == 2
    assert "accelerator" in result.stderr and "backend: jax" in result.stderr


def test_a_backend_that_does_not_exist_is_refused_naming_the_choices(mnist_job):
    result = run_cli("validate", mnist_job("typo"), "--set", "accelerator.backend=jaxx")
    assert result.returncode == 2
    assert "accelerator.backend" in result.stderr and "jax" in result.stderr


@pytest.fixture(scope="module")
def keras_on_jax() -> dict:
    """One Python process with Keras loaded on JAX, as a library user has it: a job that then asks for
    TensorFlow, and the built-in CNN's forward pass counted by XLA's cost analysis and by the per-layer arithmetic."""
    code = (
        "import json, os, sys, keras\n"
        "from runner import AcceleratorError\n"
        "from runner.device import backend\n"
        "from runner.spec.types import AcceleratorSpec\n"
        "seen = {}\n"
        "spec = AcceleratorSpec(kind='cpu', backend='tensorflow')\n"
        "try:\n"
        "    backend.apply(backend.choose(spec), spec)\n"
        "except AcceleratorError as exc:\n"
        "    seen['refused'] = str(exc)\n"
        "seen['after'] = [os.environ['KERAS_BACKEND'], 'tensorflow' in sys.modules]\n"
        "from runner.models import build\n"
        "from runner.data.schema import Feature\n"
        "from runner.train import flops\n"
        "features = {'image': Feature('uint8', (28, 28, 1)), 'label': Feature('int64', ())}\n"
        "model = build('mnist_cnn', {}, features, ('image',))\n"
        "from runner.device import engine\n"
        "seen['lowered'] = engine.active().count_forward(model, flops._input_specs(model, 8), 8)[0]\n"
        "seen['layers'], seen['unknown'] = flops._layer_forward(model)\n"
        "print(json.dumps(seen))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=cli_env(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.xdist_group("keras_on_jax")
def test_keras_already_loaded_with_another_backend_is_refused_not_used(keras_on_jax):
    """Keras on JAX, then a job asking for TensorFlow (the other way round is the same comparison)."""
    assert keras_on_jax.get("refused", "").startswith("Keras was imported with the jax backend before the job chose "
                                              "tensorflow"), keras_on_jax
    assert keras_on_jax["after"] == ["jax", False], "nothing was changed, and TensorFlow never loaded"


@pytest.mark.slow
@pytest.mark.xdist_group("keras_on_jax")
def test_xla_cost_analysis_and_the_per_layer_count_agree_on_the_built_in_cnn(keras_on_jax):
    assert not keras_on_jax["unknown"]
    # XLA counts the elementwise work (activations, pooling) the per-layer arithmetic leaves out: a few percent.
    assert keras_on_jax["layers"] <= keras_on_jax["lowered"] <= keras_on_jax["layers"] * 1.15


# --- what the job in tests/test_jax_job.py does not show ---------------------------------------------------
# (that module trains one JAX job, stops it every way a job stops, resumes it, evaluates, predicts and exports)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_a_tensorflow_run_folder_is_refused_under_jax_and_its_model_keras_evaluates_there(mnist_job, tmp_path):
    """The other way round (a JAX run folder under TensorFlow) is in tests/test_jax_job.py."""
    spec = mnist_job("pinned", data={"global_batch_size": 64}, model={"name": tiny_model(tmp_path)},
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
def test_a_gs_run_folder_under_jax_checkpoints_through_orbax_and_resumes(gcs, mnist_job, tmp_path):
    """Orbax writes the arrays through TensorStore's GCS client (pointed at the emulator with
    TENSORSTORE_GCS_HTTP_URL) and its metadata through TensorFlow's gs:// client (the rig's TLS proxy); the job
    computes in bfloat16, as on a TPU."""
    bucket = gcs.bucket()
    spec = jax_job(mnist_job, "jax-gcs", data={"eval": None, "global_batch_size": 64},
                   model={"name": tiny_model(tmp_path)},
                   train={"epochs": 1, "steps_per_epoch": 3, "allow_chance": True, "mixed_precision": "bfloat16"},
                   output={"dir": f"gs://{bucket}/runs", "tensorboard": False})
    env = cli_env(**gcs.env)
    env.pop("JAX_COMPILATION_CACHE_DIR")  # no cache of the user's own: the run folder keeps one
    first = run_cli("run", spec, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    # bfloat16 asked for (this CPU has no native bf16: `auto` would choose float32): computed, saved, resumed.
    assert last_json(first.stdout)["accelerator"]["precision"]["policy"] == "bfloat16"
    assert last_json(first.stdout)["compile_cache"] == f"gs://{bucket}/runs/jax-gcs/jax_cache"
    names = gcs.objects(bucket, "runs/jax-gcs/")
    assert "runs/jax-gcs/checkpoints/ckpt_3/commit_success.txt" in names  # Orbax's mark of a whole step on GCS
    assert any(n.startswith("runs/jax-gcs/jax_cache/jit_train_step") for n in names)

    again = run_cli("run", spec, "--set", "train.epochs=2", env=env, timeout=600)
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
def test_matmul_bench_under_jax_multiplies_the_chain_the_host_computes(tmp_path):
    """tests/test_workloads.py checks TensorFlow's chain the same way: both multiply the same operands."""
    import tensorflow as tf

    size, chain = 128, 4
    result = run_cli("run", REPO / "jobs" / "matmul_bench.yaml", *JAX, "--set", f"matmul.size={size}",
                     "--set", f"matmul.chain={chain}", "--set", "accelerator.cpu_devices=2",
                     "--set", f"output.dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["accelerator"]["backend"]["name"] == "jax"
    assert summary["matmul"]["replicas"] == 2
    assert summary["tflops"]["warm"] > 0
    a = tf.random.stateless_normal((size, size), seed=(0, 1)).numpy().astype(np.float64)
    b = (tf.random.stateless_normal((size, size), seed=(0, 2)) / np.sqrt(size)).numpy().astype(np.float64)
    product = a
    for _ in range(chain):
        product = product @ b
    assert summary["matmul"]["checksum"] == pytest.approx(2 * product.sum(), abs=1e-3 * size)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU
def test_a_profile_under_jax_is_traced_by_jax_and_holds_the_train_steps_computation(mnist_job, tmp_path):
    """TensorFlow's profiler under JAX records only tf.data's host events: the trace must be JAX's, and show the
    compiled train step (XLA's `jit_train_step`) running on the device."""
    spec = jax_job(mnist_job, "jax-profile", model={"name": tiny_model(tmp_path)},
                   train={"epochs": 2, "steps_per_epoch": 3, "allow_chance": True},
                   profile={"start_step": 3, "steps": 2})
    result = run_cli("run", spec, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    profile = last_json(result.stdout)["profile"]
    assert profile["profiler"] == "jax" and profile["error"] is None
    assert profile["traced_steps"] == [3, 4]  # across the epoch boundary: counted from the batches
    traces = list((tmp_path / "runs" / "jax-profile" / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
    assert b"jit_train_step" in traces[0].read_bytes()
