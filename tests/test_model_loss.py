"""The spec speaks Keras, end to end: optimizers, losses and schedules made by Keras's own deserialization; a
loss that disagrees with the model's output refused before training; the spec's learning rate after a restore.
Real tiny models, real compile, fit and checkpoints (no stand-ins)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from runner import SpecError
from runner.rundir.outputs import RunFolder
from runner.spec.types import JobSpec
from runner.train import build, store
from runner.train.tf_store import TensorFlowStore
from tests.conftest import last_json, run_cli

keras = tf.keras


def spec(train: dict | None = None) -> JobSpec:
    return JobSpec.model_validate({"train": train or {}})


def tiny(activation: str | None) -> keras.Model:
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(3, activation=activation, name="head")(inputs))


def compiled(model: keras.Model, train: dict | None = None) -> keras.Model:
    job = spec(train)
    build.compile_model(model, job)
    build.check_loss_agreement(model, model.loss)
    return model


def test_names_keep_their_meaning_and_serialized_forms_reach_keras() -> None:
    sgd = build.make_optimizer(spec({"optimizer": "sgd", "learning_rate": 0.05}).train)
    assert type(sgd).__name__ == "SGD" and sgd.momentum == 0.9  # `sgd` has always meant momentum 0.9 here
    assert float(sgd.learning_rate.numpy()) == pytest.approx(0.05)
    adamw = build.make_optimizer(spec({"optimizer": {"class_name": "AdamW", "config": {
        "learning_rate": 2e-3, "weight_decay": 0.01, "clipnorm": 1.0}}}).train)
    assert (type(adamw).__name__, adamw.weight_decay, adamw.clipnorm) == ("AdamW", 0.01, 1.0)
    assert float(adamw.learning_rate.numpy()) == pytest.approx(2e-3)
    nadam = build.make_optimizer(spec({"optimizer": "nadam"}).train)
    assert type(nadam).__name__ == "Nadam"


def test_a_schedule_replaces_the_learning_rate() -> None:
    train = spec({"optimizer": {"class_name": "AdamW", "config": {"weight_decay": 0.01}}, "schedule": {
        "class_name": "CosineDecay",
        "config": {"initial_learning_rate": 1e-4, "decay_steps": 100, "warmup_steps": 10, "warmup_target": 1e-3}}})
    optimizer = build.make_optimizer(train.train)
    schedule = optimizer._learning_rate
    assert type(schedule).__name__ == "CosineDecay"
    assert float(schedule(10)) == pytest.approx(1e-3)  # the warmup's target, reached at step 10
    assert float(schedule(0)) == pytest.approx(1e-4)


def test_a_logits_model_under_a_probability_loss_is_refused_and_with_from_logits_trains() -> None:
    with pytest.raises(SpecError) as caught:
        compiled(tiny(None))
    message = str(caught.value)
    assert "train.loss: sparse_categorical_crossentropy expects probabilities" in message
    assert "output layer 'head' (Dense, activation linear) gives logits" in message
    assert "`train.loss: {class_name: SparseCategoricalCrossentropy, config: {from_logits: true}}`" in message
    assert caught.value.exit_code == 2

    model = compiled(tiny(None), {"loss": {"class_name": "SparseCategoricalCrossentropy",
                                           "config": {"from_logits": True}}})
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0)
    history = model.fit(x, y, epochs=3, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_from_logits_on_a_softmax_output_is_refused() -> None:
    with pytest.raises(SpecError, match=r"has from_logits: true, but the model's output layer 'head' \(Dense, "
                                        r"activation softmax\) already gives probabilities"):
        compiled(tiny("softmax"), {"loss": {"class_name": "SparseCategoricalCrossentropy",
                                            "config": {"from_logits": True}}})
    compiled(tiny("softmax"))  # the default loss on a softmax: agreed
    compiled(tiny(None), {"loss": "mse", "metrics": ["mae"]})  # a loss that takes either: not judged


def test_the_first_batch_check_refuses_logits_where_the_activation_cannot_be_read() -> None:
    class Opaque(keras.Model):  # a subclassed model: no output layer to read
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x) * 10.0

    model = Opaque()
    build.compile_model(model, spec())
    build.check_loss_agreement(model, model.loss)  # nothing to read: passes here
    outputs = model(np.ones((8, 4), "float32"))
    with pytest.raises(SpecError, match=r"gave outputs from .* on the first batch \(logits\): set `train.loss: "
                                        r"\{class_name: SparseCategoricalCrossentropy, config: \{from_logits: true"):
        build.check_first_outputs(model, model.loss, outputs)
    build.check_first_outputs(model, model.loss, tf.nn.softmax(outputs))
    build.check_first_outputs(model, "mse", outputs)


def test_after_restore_the_spec_learning_rate_is_the_one_used(tmp_path: Path) -> None:
    """A checkpoint saved at 1e-3 restored under a spec of 3e-3: Keras would restore 1e-3."""
    saved = tiny("softmax")
    build.compile_model(saved, spec({"learning_rate": 1e-3}))
    saved.fit(np.ones((8, 4), "float32"), np.zeros(8, "int64"), verbose=0)
    path = tf.train.Checkpoint(model=saved, optimizer=saved.optimizer).save(str(tmp_path / "ckpt"))

    resumed = tiny("softmax")
    build.compile_model(resumed, spec({"learning_rate": 3e-3}))
    assert store.restore(TensorFlowStore(RunFolder(str(tmp_path)), resumed, 1), resumed, path) == 1
    assert float(resumed.optimizer.learning_rate.numpy()) == pytest.approx(3e-3)
    np.testing.assert_allclose(resumed.get_weights()[0], saved.get_weights()[0])
    # Keras's own restore, for contrast: the checkpoint's rate.
    plain = tiny("softmax")
    build.compile_model(plain, spec({"learning_rate": 3e-3}))
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).restore(path).expect_partial()
    assert float(plain.optimizer.learning_rate.numpy()) == pytest.approx(1e-3)


def test_run_refuses_a_logits_model_before_training(mnist_job, tmp_path: Path) -> None:
    """Through the CLI: a user's Dense(10) logits model under the default loss stops at start-up, exit 2."""
    (tmp_path / "logits.py").write_text(textwrap.dedent("""
        import tensorflow as tf

        def build(params, features, inputs):
            image = tf.keras.Input((28, 28, 1), name="image")
            x = tf.keras.layers.Flatten()(tf.keras.layers.Rescaling(1 / 255)(image))
            return tf.keras.Model(image, tf.keras.layers.Dense(10, name="logits")(x))
    """))
    job = mnist_job("logits", model={"name": "logits:build"}, data={"eval": None}, train={"epochs": 1})
    refused = run_cli("run", job)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "output layer 'logits' (Dense, activation linear) gives logits" in refused.stderr
    summary = last_json(refused.stdout)
    assert summary["status"] == "failed" and summary["epochs"] == []
    fixed = json.dumps({"class_name": "SparseCategoricalCrossentropy", "config": {"from_logits": True}})
    trained = run_cli("run", job, "--set", f"train.loss={fixed}", "--set", "output.dir=" + str(tmp_path / "r2"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert last_json(trained.stdout)["status"] == "succeeded"
