"""A user's first jobs of their own: nothing ends in exit 0 with a meaningless answer, and every way out of a
stop is one that works. Real runs of `runner run` on tiny MNIST (tests/conftest.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec

SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())

# A model that cannot learn: its softmax sees only zeros, so every image gets the same 10% for each class.
CONSTANT_MODEL = '''
import tensorflow as tf


def constant(params, features, inputs):
    keras = tf.keras
    image = keras.Input(shape=features[inputs[0]].shape, name=inputs[0])
    flat = keras.layers.Flatten()(image)
    frozen = keras.layers.Dense(10, kernel_initializer="zeros", trainable=False, dtype="float32")(flat)
    # A trainable layer whose output is multiplied by zero: the optimizer has a variable, the output never moves.
    ignored = keras.layers.Dense(10, dtype="float32")(flat)
    logits = keras.layers.Add(dtype="float32")([frozen, keras.layers.Rescaling(0.0, dtype="float32")(ignored)])
    return keras.Model(image, keras.layers.Activation("softmax", dtype="float32")(logits))
'''


def _constant_job(mnist_job, tmp_path: Path, name: str, **train) -> Path:
    package = tmp_path / "code" / "flat"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(CONSTANT_MODEL)
    return mnist_job(
        name, model={"name": "flat.nets:constant"}, code={"folder": str(tmp_path / "code")},
        train={"epochs": 2, "steps_per_epoch": 4, "mixed_precision": "float32", **train},
        output={"tensorboard": False},
    )


@pytest.mark.slow
def test_a_run_that_learned_nothing_is_not_a_success(mnist_job, tmp_path: Path) -> None:
    spec = _constant_job(mnist_job, tmp_path, "flat")
    result = run_cli("run", spec)
    assert result.returncode == 4, result.stderr[-3000:]
    summary = last_json(result.stdout)
    jsonschema.validate(summary, SCHEMA)
    assert summary["status"] == "learned_nothing"
    warnings = summary["warnings"]
    assert any("at chance for 10 classes" in w for w in warnings), warnings
    assert any("never fell below its first epoch's" in w for w in warnings), warnings
    closing = [line for line in result.stderr.splitlines() if line.startswith("learned nothing: ")]
    assert closing and ", float32 (train.mixed_precision: float32)" in closing[0], result.stderr[-2000:]
    said = re.findall(r" runner\.\S+: precision: (.*)", result.stderr)
    assert said == ["float32 (train.mixed_precision: float32)"], "one precision line, the one the closing line says"
    assert "train.allow_chance: true" in result.stderr
    # The model is saved (the user may want to look at it); a run that expects chance says so in its spec.
    run_dir = tmp_path / "runs" / "flat"
    assert (run_dir / "model.keras").exists()
    allowed = run_cli("run", spec, "--set", "train.allow_chance=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    accepted = last_json(allowed.stdout)
    assert accepted["status"] == "succeeded" and accepted["warnings"]


@pytest.mark.slow
def test_a_start_refused_by_the_run_leaves_no_run_folder(mnist_job, tmp_path: Path) -> None:
    """A built-in model's unknown param is known without TensorFlow: `validate` names its line, `run` refuses it
    before anything is made (it once passed validate and was found only when the model was built)."""
    from tests.support.cli import invoke

    spec = mnist_job("typo", model={"name": "mnist_cnn", "params": {"clases": 10}})
    validated = invoke("validate", spec, "--no-data")
    assert validated.returncode == 2 and re.search(r"typo\.yaml:\d+: model\.params: mnist_cnn has no param 'clases'",
                                                   validated.stderr), validated.stderr
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "has no param 'clases'; did you mean 'classes'?" in result.stderr
    assert not (tmp_path / "runs" / "typo").exists(), "a refusal at start leaves nothing behind"


@pytest.mark.slow
def test_a_bucket_whose_host_cannot_be_resolved_is_storage_unreachable(tmp_path: Path) -> None:
    """No proxy and no network to Google here: curl cannot resolve TensorFlow's fixed GCS host (exit 3)."""
    spec = write_spec(tmp_path, {
        "name": "dns", "data": {"train": "gs://runner-dns-test/mnist/train-*.tfrecord"},
        "storage": {"timeout_s": 5}, "output": {"dir": str(tmp_path / "runs")},
    })
    env = {k: v for k, v in cli_env(GOOGLE_AUTH_TOKEN_FOR_TESTING="x", NO_GCE_CHECK="true").items()
           if k.lower() not in ("https_proxy", "http_proxy", "all_proxy")}
    result = run_cli("run", spec, env=env, timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "storage unreachable: gs://runner-dns-test cannot be reached from this machine" in result.stderr
    assert "cannot read the data" not in result.stderr
    assert not (tmp_path / "runs" / "dns").exists()


@pytest.mark.slow
def test_fresh_moves_the_finished_run_aside_and_starts_at_step_0(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("again", train={"epochs": 2, "steps_per_epoch": 3}, output={"tensorboard": False})
    first = run_cli("run", spec)
    assert first.returncode == 0, first.stderr[-3000:]
    # Every training summary says how close it came to the hardware (runner/train/flops.py, device/peak.py).
    throughput = last_json(first.stdout)["throughput"]
    assert throughput["model_flops_per_example"] == pytest.approx(13.78e6, rel=0.02), throughput
    assert throughput["flops_method"].startswith("tf_profiler")
    assert throughput["peak_tflops_per_device"] > 0 and "measured on this host" in throughput["peak_source"]
    assert 0 < throughput["mfu"] < 1 and f"MFU {throughput['mfu']:.1%}" in first.stderr
    shorter = run_cli("run", spec, "--set", "train.epochs=1")
    assert shorter.returncode == 2 and "--fresh" in shorter.stderr and not re.search(r"\bdelete\b", shorter.stderr)
    fresh = run_cli("run", spec, "--set", "train.epochs=1", "--fresh")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    summary = last_json(fresh.stdout)
    assert summary["resumed_from_step"] == 0 and summary["final_step"] == 3
    (aside,) = (tmp_path / "runs").glob("again.old-*")
    assert "--fresh: " in fresh.stderr and str(aside) in fresh.stderr
    old = json.loads((aside / "summary.json").read_text())
    assert old["train_epochs"] == 2 and (aside / "model.keras").exists()
    assert (aside / "checkpoints" / "checkpoint").exists(), "the old checkpoints moved whole, nothing deleted"
    assert not (aside / "lease.json").exists() and not (tmp_path / "runs" / "again" / "lease.json").exists()


@pytest.mark.slow
def test_a_time_limit_saves_and_the_next_attempt_reports_every_epoch(mnist_job, tmp_path: Path) -> None:
    """train.max_duration counts from the process start: a limit shorter than start-up stops at the first step,
    saved (exit 124); the rerun (no limit) continues, and its summary lists both attempts' epochs."""
    spec = mnist_job("limited", train={"epochs": 2, "steps_per_epoch": 6, "max_duration": 1},
                     data={"eval": None}, output={"tensorboard": False})
    # Started fresh, as a user starts it: loading TensorFlow alone takes longer than the limit. A command forked
    # from the suite's zygote (TensorFlow loaded already) can train all 12 steps within 1 s on a fast CPU.
    stopped = run_cli("run", spec, fresh=True)
    assert stopped.returncode == 124, stopped.stderr[-3000:]
    first = last_json(stopped.stdout)
    jsonschema.validate(first, SCHEMA)
    assert first["status"] == "time_limit" and first["time_limit"]["max_duration_s"] == 1
    assert first["epochs"][0]["partial"] and first["epochs"][0]["attempt"] == 1
    assert "interrupted after" in stopped.stderr and "time limit at step" in stopped.stderr
    saved = first["epochs"][0]["steps"]
    unlimited = mnist_job("limited", train={"epochs": 2, "steps_per_epoch": 6},
                          data={"eval": None}, output={"tensorboard": False})
    resumed = run_cli("run", unlimited)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = last_json(resumed.stdout)
    jsonschema.validate(summary, SCHEMA)
    assert summary["resumed_from_step"] == saved and summary["final_step"] == 12
    attempts = [(e["attempt"], e["epoch"], e["partial"]) for e in summary["epochs"]]
    assert attempts == [(1, 1, True), (2, 1, False), (2, 2, False)], attempts
    assert sum(e["steps"] for e in summary["epochs"]) == 12
    assert summary["timing"]["steady_epoch_s"] is not None


def test_a_job_that_hangs_before_its_first_step_is_ended_by_the_stall_guard(mnist_job, tmp_path: Path) -> None:
    """train.stall_timeout watches the whole job, not only fit: here a data.preprocess that blocks for 60 s
    while the input pipeline is built (a bucket that never answers, a TPU start that never returns, would do the
    same) ends with exit 124 after about the timeout, naming what it was doing."""
    (tmp_path / "slow.py").write_text("import time\n\n\ndef hang(batch):\n    time.sleep(60)\n    return batch\n")
    spec = mnist_job("hangs", data={"preprocess": "slow:hang", "eval": None},
                     train={"epochs": 1, "steps_per_epoch": 2, "stall_timeout": 10}, output={"tensorboard": False})
    stopped = run_cli("run", spec, timeout=600)
    assert stopped.returncode == 124, stopped.stderr[-3000:]
    said = re.search(r"stalled: nothing progressed for (\d+) s since data_init began \(train\.stall_timeout 10 s\)",
                     stopped.stderr)
    assert said, stopped.stderr[-2000:]
    # The guard's own count, not this test's clock (TensorFlow's import on a busy machine is not the job's stall).
    assert int(said.group(1)) < 40, f"the guard waited {said.group(1)} s for a 10 s stall timeout"


def test_the_exit_codes_table_in_the_readme_names_every_code_the_runner_uses() -> None:
    import runner

    codes = {v for k, v in vars(runner).items() if k.startswith("EXIT_")}
    readme = (REPO / "README.md").read_text()
    assert codes == {0, 1, 2, 3, 4, 75, 124, 130}
    assert all(f"\n| {code} |" in readme for code in codes), "README's exit-code table"


def test_dns_failures_map_to_exit_3_without_tensorflow() -> None:
    from runner.data.storage import storage_error

    message = "Error executing an HTTP request: libcurl code 6 meaning 'Couldn't resolve host name'"
    error = storage_error(RuntimeError(message), ["gs://b/x/train-*.tfrecord"], 5)
    assert error is not None and error.exit_code == 3 and "gs://b" in str(error)


def test_an_unusable_credentials_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """google-auth's own error for a file that is not JSON, read through the client the runner makes."""
    from runner import StorageError
    from runner.data.storage import make_client

    broken = tmp_path / "key.json"
    broken.write_text("{not json")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(broken))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    with pytest.raises(StorageError, match=rf"the credentials file {broken} \(GOOGLE_APPLICATION_CREDENTIALS\)"):
        make_client()


@pytest.mark.slow
def test_a_run_folder_resumes_only_under_the_keras_and_tensorflow_that_can_read_it(mnist_job, tmp_path: Path) -> None:
    """A run folder whose pins say tf-keras wrote its checkpoints (an older runner's, TF_USE_LEGACY_KERAS=1):
    refused, tf-keras named as no longer supported and `--fresh` as the way on; the TensorFlow version may rise
    between attempts, never fall."""
    spec = mnist_job("flavours", train={"epochs": 2, "steps_per_epoch": 3, "allow_chance": True},
                     data={"eval": None}, output={"tensorboard": False})
    first = run_cli("run", spec, "--set", "train.epochs=1")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "flavours"
    doc = json.loads((run_dir / "spec.json").read_text())
    assert doc["pinned"]["keras.flavour"] == "keras3" and doc["pinned"]["tensorflow.version"]

    doc["pinned"]["keras.flavour"] = "tf-keras"  # what an older runner under TF_USE_LEGACY_KERAS=1 wrote
    (run_dir / "spec.json").write_text(json.dumps(doc))
    refused = run_cli("run", spec)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"{run_dir}'s checkpoints were written by tf-keras" in refused.stderr, refused.stderr[-3000:]
    assert "tf-keras is no longer supported" in refused.stderr and "`runner run --fresh`" in refused.stderr
    # Under JAX the TensorFlow checkpoints are invisible, and still tf-keras is what is named: no backend restores
    # them, so `--set accelerator.backend=tensorflow` would be advice that fails next.
    under_jax = run_cli("run", spec, "--set", "accelerator.backend=jax")
    assert under_jax.returncode == 2, under_jax.stderr[-3000:]
    assert "tf-keras is no longer supported" in under_jax.stderr, under_jax.stderr[-3000:]
    assert "`--set accelerator.backend" not in under_jax.stderr

    # The same folder, as if an older TensorFlow had written it under Keras 3: this newer one resumes it.
    doc["pinned"].update({"keras.flavour": "keras3", "tensorflow.version": "2.0.0"})
    (run_dir / "spec.json").write_text(json.dumps(doc))
    resumed = run_cli("run", spec)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert last_json(resumed.stdout)["resumed_from_step"] == 3

    doc = json.loads((run_dir / "spec.json").read_text())
    doc["pinned"]["tensorflow.version"] = "9.0.0"
    (run_dir / "spec.json").write_text(json.dumps(doc))
    newer = run_cli("run", spec, "--set", "train.epochs=3")
    assert newer.returncode == 2, newer.stderr[-3000:]
    assert "written by TensorFlow 9.0.0" in newer.stderr and "reads checkpoints of older versions" in newer.stderr


CALLBACK = '''
import json
import os

import tensorflow as tf


class EpochMarks(tf.keras.callbacks.Callback):
    """Appends each finished epoch and the optimizer's learning rate to the file MARKS names."""

    def on_epoch_end(self, epoch, logs=None):
        rate = self.model.optimizer.learning_rate
        with open(os.environ["MARKS"], "a") as marks:
            marks.write(json.dumps({"epoch": epoch + 1, "lr": float(tf.convert_to_tensor(rate))}) + "\\n")
'''


@pytest.mark.slow
def test_a_keras_users_training_options_train_resume_and_report(mnist_job, tmp_path: Path) -> None:
    """AdamW with weight decay and clipnorm, a cosine schedule with warmup, label smoothing on class-id labels,
    balanced class weights from the manifest's label counts and a callback of the user's: trained, preempted
    mid-epoch, resumed, reported."""
    import signal

    from tests.support.runs import STEPS, finish, signal_in_second_epoch, start_run

    package = tmp_path / "code" / "mine"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "marks.py").write_text(CALLBACK)
    steps = STEPS  # as signal_in_second_epoch counts them
    spec = mnist_job(
        "keras_user", code={"folder": str(tmp_path / "code")}, output={"tensorboard": False},
        data={"eval": None, "global_batch_size": 32},
        train={
            "epochs": 3, "steps_per_epoch": steps, "mixed_precision": "float32", "learning_rate": None,
            "optimizer": {"class_name": "AdamW", "config": {"weight_decay": 0.01, "clipnorm": 1.0}},
            "schedule": {"class_name": "CosineDecay", "config": {
                "initial_learning_rate": 1e-4, "decay_steps": 3 * steps, "warmup_target": 0.002, "warmup_steps": 10,
            }},
            # The built-in CNN ends in a softmax: probabilities, from_logits false.
            "loss": {"class_name": "CategoricalCrossentropy",
                     "config": {"from_logits": False, "label_smoothing": 0.1}},
            "class_weight": "balanced", "callbacks": ["mine.marks:EpochMarks"],
        },
    )
    text = spec.read_text().replace("  learning_rate: null\n", "")
    spec.write_text(text)
    marks = tmp_path / "marks.jsonl"
    env = cli_env(MARKS=str(marks))
    run_dir = tmp_path / "runs" / "keras_user"
    process = start_run(spec, env=env, progress=True)
    signal_in_second_epoch(process, run_dir, signal.SIGTERM)
    code, out, err = finish(process)
    assert code == 75, err[-3000:]
    assert "train.class_weight balanced: 0: " in err
    assert "the class ids are one-hot encoded to 10 classes" in err
    resumed = run_cli("run", spec, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = last_json(resumed.stdout)
    jsonschema.validate(summary, SCHEMA)
    assert summary["status"] == "succeeded" and summary["final_step"] == 3 * steps
    epochs = [json.loads(line)["epoch"] for line in marks.read_text().splitlines()]
    assert epochs[0] == 1 and epochs[-2:] == [2, 3], epochs  # the user's callback ran in both attempts
    # The schedule continues from the restored step: past warmup, the rate decays towards 0 by the last step.
    rates = [json.loads(line)["lr"] for line in marks.read_text().splitlines()]
    assert 0 < rates[-1] < rates[-2] <= 0.002, rates


def test_a_user_callback_that_raises_leaves_a_true_account_of_what_was_saved(mnist_job, tmp_path: Path) -> None:
    """A callback of the user's that raises in epoch 2 ends the run (exit 1), after epoch 1's checkpoint: the
    summary and the closing line say that checkpoint exists, and the next run resumes from it."""
    package = tmp_path / "code" / "boom"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cb.py").write_text(
        "import tensorflow as tf\n\n\nclass Boom(tf.keras.callbacks.Callback):\n"
        "    def on_epoch_begin(self, epoch, logs=None):\n"
        "        if epoch == 1:\n            raise RuntimeError('boom in epoch 2')\n")
    spec = mnist_job("boom", code={"folder": str(tmp_path / "code")}, data={"eval": None},
                     train={"epochs": 2, "steps_per_epoch": 3, "allow_chance": True, "callbacks": ["boom.cb:Boom"]},
                     output={"tensorboard": False})
    failed = run_cli("run", spec)
    assert failed.returncode == 1, failed.stderr[-3000:]
    summary = last_json(failed.stdout)
    assert "boom in epoch 2" in summary["error"]
    assert summary["final_step"] == 3 and summary["checkpoint_saves"], summary
    assert "no checkpoint was saved" not in failed.stderr, failed.stderr[-2000:]
    again = run_cli("run", spec, "--set", "train.callbacks=[]")
    assert again.returncode == 0, again.stderr[-3000:]
    assert last_json(again.stdout)["resumed_from_step"] == 3


@pytest.mark.slow
def test_an_output_dir_that_is_a_file_says_what_to_move_and_promises_no_checkpoint(mnist_job, tmp_path: Path) -> None:
    in_the_way = tmp_path / "outputs"
    in_the_way.write_text("a file, not a folder")
    spec = mnist_job("blocked", output={"dir": str(in_the_way)})
    result = run_cli("run", spec)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "a file stands where a folder is needed: move that file away" in result.stderr
    assert str(in_the_way) in result.stderr and "Complete checkpoints are kept" not in result.stderr
    assert in_the_way.read_text() == "a file, not a folder"
    # The message's fix, followed: the file moved away, the same job runs.
    in_the_way.rename(tmp_path / "moved-away")
    again = run_cli("run", spec, "--set", "train.allow_chance=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (in_the_way / "blocked" / "model.keras").exists()



def test_a_file_where_the_run_folder_belongs_names_the_move_that_works(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("taken", train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True},
                     output={"tensorboard": False})
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "taken").write_text("a file where the run folder belongs")
    result = run_cli("run", spec)
    assert result.returncode == 3, result.stderr[-3000:]
    move = re.search(r"`(mv \S+ \S+)`", result.stderr)
    assert move and "a file stands where the job's run folder belongs" in result.stderr, result.stderr[-2000:]
    source, target = move.group(1).split()[1:]
    Path(source).rename(target)  # the message's fix, as written
    again = run_cli("run", spec)
    assert again.returncode == 0, again.stderr[-3000:]
    assert Path(target).read_text() == "a file where the run folder belongs", "nothing of the user's is lost"
