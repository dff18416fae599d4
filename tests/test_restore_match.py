"""A restore is all or nothing (runner/rundir/matching.py): a model edited after its job saved weights is refused
by `run` (resuming, or finding the job complete), `evaluate` and `predict`, exit 2 naming each variable, under
both backends; the run folder is left as it was.

The edits are those a checkpoint matched by position and shape alone lets through: a layer added after the
last one the checkpoint knows (its variables come after every saved one, none clashes) and the last hidden
layer removed (the checkpoint has variables nothing claims). TensorFlow's `expect_partial()` restored such a
model in part, and Keras's `load_weights` of model.keras ignores the layers the model no longer has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

# The layers of the saved model, of the model with one added, and of the model with one removed.
SAVED, ADDED, REMOVED = (16, 10), (16, 10, 10), (16,)
TEMPLATE = (
    "import keras\n\n\n"
    "def build(params, features, inputs):\n"
    "    x = keras.Input((28, 28, 1))\n"
    "    y = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))\n"
    "    for units in {hidden}:\n"
    "        y = keras.layers.Dense(units, activation='relu')(y)\n"
    "    return keras.Model(x, keras.layers.Dense(10, activation='softmax', dtype='float32')(y))\n"
)


def files_of(run_dir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and "jax_cache" not in p.parts}


def refused(result, *said: str) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    text = " ".join(result.stderr.split())
    for words in said:
        assert words in text, text[-3000:]
    assert "--fresh" in text and "Nothing was restored" in text, text[-3000:]
    return text


def edited_model_is_refused_everywhere(mnist_job, small_mnist: Path, tmp_path: Path, backend: str) -> None:
    code = tmp_path / "layered.py"
    code.write_text(TEMPLATE.format(hidden=SAVED))
    spec = mnist_job(f"edited-{backend}", accelerator={"kind": "cpu", "backend": backend},
                     model={"name": "layered:build"}, data={"global_batch_size": 64},
                     train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True},
                     output={"tensorboard": False})
    first = run_cli("run", spec, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / f"edited-{backend}"
    before = files_of(run_dir)
    test = f"{small_mnist}/test-*.tfrecord"
    checkpoint = "ckpt-2" if backend == "tensorflow" else "ckpt_2"

    code.write_text(TEMPLATE.format(hidden=ADDED))
    resumed = refused(run_cli("run", spec, "--set", "train.epochs=2"), "the model changed since",
                      "(10, 10), which the checkpoint lacks")
    assert "failed after" not in resumed and "resuming" not in resumed
    complete = refused(run_cli("run", spec), "the job is complete, but the model changed since",
                       f"{run_dir}/model.keras")
    assert "already complete" not in complete
    refused(run_cli("evaluate", spec), f"{run_dir}/model.keras", "which the model.keras lacks")
    refused(run_cli("evaluate", spec, "--checkpoint", checkpoint), "which the checkpoint lacks")
    refused(run_cli("predict", spec, "--input", test, "--output", tmp_path / "p.npy"), "which the model.keras lacks")

    code.write_text(TEMPLATE.format(hidden=REMOVED))
    refused(run_cli("run", spec, "--set", "train.epochs=2"), "(10, 10), which the model lacks")
    refused(run_cli("run", spec), "the job is complete, but", "which the model lacks")
    refused(run_cli("evaluate", spec), "(10, 10), which the model lacks")
    refused(run_cli("predict", spec, "--input", test, "--output", tmp_path / "p.npy"), "which the model lacks")
    assert not (tmp_path / "p.npy").exists()
    assert files_of(run_dir) == before  # nothing written, nothing moved

    code.write_text(TEMPLATE.format(hidden=SAVED))  # the model it was: it resumes
    again = run_cli("run", spec, "--set", "train.epochs=2", timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert last_json(again.stdout)["resumed_from_step"] == 2

    # A finished job without its model.keras is judged by its checkpoint.
    (run_dir / "model.keras").unlink()
    code.write_text(TEMPLATE.format(hidden=ADDED))
    refused(run_cli("run", spec, "--set", "train.epochs=2"), "the job is complete, but the model changed since",
            f"checkpoints/{checkpoint[:-1]}4 was saved", "which the checkpoint lacks")


@pytest.mark.slow
def test_an_added_or_removed_layer_is_refused_by_run_evaluate_and_predict_under_tensorflow(
    mnist_job, small_mnist, tmp_path
):
    edited_model_is_refused_everywhere(mnist_job, small_mnist, tmp_path, "tensorflow")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # XLA on a busy 2-core CPU: the first run and the last compile
def test_an_added_or_removed_layer_is_refused_by_run_evaluate_and_predict_under_jax(mnist_job, small_mnist, tmp_path):
    edited_model_is_refused_everywhere(mnist_job, small_mnist, tmp_path, "jax")


# --- in one process, under TensorFlow: what the match compares ----------------------------------------------


def _layered(hidden: tuple[int, ...], train: dict | None = None):
    import keras

    from runner.spec.types import JobSpec
    from runner.train import build

    x = keras.Input((4,))
    y = x
    for units in hidden:
        y = keras.layers.Dense(units, activation="relu")(y)
    model = keras.Model(x, keras.layers.Dense(3, activation="softmax")(y))
    build.compile_model(model, JobSpec.model_validate({"train": train or {}}))
    return model


def tensorflow_restore(tmp_path: Path, model, path: str) -> int:
    """Restores a TensorFlow checkpoint through the run folder's store, as a resumed job does."""
    from runner.rundir.outputs import RunFolder
    from runner.train import store
    from runner.train.tf_store import TensorFlowStore

    return store.restore(TensorFlowStore(RunFolder(str(tmp_path / "run")), model, 1), model, path)


def _saved(tmp_path: Path, hidden: tuple[int, ...], train: dict | None = None) -> tuple[object, str]:
    import numpy as np
    import tensorflow as tf

    model = _layered(hidden, train)
    model.fit(np.ones((8, 4), "float32"), np.zeros(8, "int64"), verbose=0)
    return model, tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))


SCHEDULE = {"schedule": {"class_name": "CosineDecay", "config": {"initial_learning_rate": 1e-3, "decay_steps": 100}}}


@pytest.mark.parametrize("then, now", [(None, SCHEDULE), (SCHEDULE, None)], ids=["constant-then", "schedule-then"])
def test_a_rate_resumed_as_a_schedule_or_the_reverse_restores_every_learned_variable(tmp_path, then, now):
    """The optimizer's learning rate is a setting, left out of the match: a constant rate keeps it in a variable
    and a schedule does not, which numbers the optimizer's slots one apart."""
    import numpy as np


    def learned(optimizer) -> list:
        return [v.numpy() for v in optimizer.variables if not v.path.endswith("/learning_rate")]

    saved, path = _saved(tmp_path, SAVED, then)
    resumed = _layered(SAVED, now)
    assert tensorflow_restore(tmp_path, resumed, path) == 1
    for before, after in zip(saved.weights, resumed.weights, strict=True):
        np.testing.assert_array_equal(before.numpy(), after.numpy())
    for before, after in zip(learned(saved.optimizer), learned(resumed.optimizer), strict=True):
        np.testing.assert_array_equal(before, after)  # the step and every slot


def test_the_match_names_every_variable_on_either_side_and_restores_nothing(tmp_path):
    import numpy as np

    from runner import SpecError

    _, path = _saved(tmp_path, SAVED)
    added = _layered(ADDED)
    fresh = [w.numpy() for w in added.weights]
    with pytest.raises(SpecError) as refusal:
        tensorflow_restore(tmp_path, added, path)
    said = str(refusal.value)
    assert "12 variables differ" in said and said.count("which the checkpoint lacks") == 6, said
    assert "(optimizer/_trainable_variables/6) (10, 3), which the checkpoint lacks" in said, said
    assert "(optimizer/_trainable_variables/4) is (10, 10) in the model and (10, 3) in the checkpoint" in said, said
    assert int(added.optimizer.iterations.numpy()) == 0  # nothing restored, not even the step
    for before, after in zip(fresh, added.weights, strict=True):
        np.testing.assert_array_equal(before, after.numpy())

    removed = _layered(REMOVED)
    with pytest.raises(SpecError, match=r"the checkpoint has optimizer/_trainable_variables/5 \(3,\), which the "
                                        r"model lacks"):
        tensorflow_restore(tmp_path, removed, path)
