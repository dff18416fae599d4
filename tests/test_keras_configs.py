"""`train.optimizer`, `train.loss`, `train.metrics` and `train.schedule` in Keras's own names and serialized form,
checked by `runner validate` without TensorFlow against runner/spec/keras_names.json, a table generated from the
installed Keras (and regenerated here to prove it still matches)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.spec.load import load_spec
from runner.spec.train import optimizer_identity
from tests.conftest import REPO, write_spec
from tests.support.cli import invoke

ADAMW = {"class_name": "AdamW", "config": {"learning_rate": 1e-3, "weight_decay": 0.01, "clipnorm": 1.0}}
COSINE = {"class_name": "CosineDecay",
          "config": {"initial_learning_rate": 1e-4, "decay_steps": 1000, "warmup_steps": 100, "warmup_target": 1e-3}}


def test_the_table_matches_the_installed_keras() -> None:
    """Regenerate and compare: a Keras upgrade that renames a class or an argument fails here, not in a run."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "keras_names.py"), "--check"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    import keras

    table = json.loads((REPO / "runner" / "spec" / "keras_names.json").read_text())
    assert table["keras"] == keras.__version__
    # What the table says Keras takes, Keras takes: every optimizer by name, AdamW's arguments.
    for name in table["optimizer_names"]:
        assert type(keras.optimizers.get(name)).__name__.lower() == name
    keras.optimizers.get({"class_name": "AdamW", "config": {k: v for k, v in ADAMW["config"].items()}})
    assert {"weight_decay", "clipnorm", "learning_rate"} <= set(table["optimizers"]["AdamW"])
    assert "label_smoothing" not in table["losses"]["SparseCategoricalCrossentropy"]
    assert "label_smoothing" in table["losses"]["CategoricalCrossentropy"]


def test_validate_accepts_keras_serialized_forms_without_tensorflow(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"name": "keras_forms", "train": {
        "optimizer": {"class_name": "AdamW", "config": {"weight_decay": 0.01}}, "schedule": COSINE,
        "loss": {"class_name": "CategoricalCrossentropy", "config": {"from_logits": True, "label_smoothing": 0.1}},
        "metrics": ["accuracy", {"class_name": "SparseTopKCategoricalAccuracy", "config": {"k": 2}}, "mae"],
    }})
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom runner.cli import app\n"
        f"r = CliRunner().invoke(app, ['validate', {str(spec)!r}, '--no-data', '--show'])\n"
        "print(r.exit_code, 'tensorflow' in sys.modules, 'keras' in sys.modules)\nprint(r.stdout)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    first, _, shown = done.stdout.partition("\n")
    assert first == "0 False False", done.stdout + done.stderr
    resolved = json.loads(shown)["train"]
    assert resolved["schedule"] == COSINE and resolved["metrics"][1]["config"] == {"k": 2}
    assert optimizer_identity(load_spec(spec).train) == "AdamW"


@pytest.mark.parametrize(
    "train, expected",
    [
        ({"optimizer": "adamm"}, "train.optimizer: 'adamm' is not an optimizer name keras.optimizers knows; "
                                 "did you mean 'adam'?"),
        ({"optimizer": {"class_name": "AdamWW"}}, "train.optimizer.class_name: 'AdamWW' is not a class "
                                                  "keras.optimizers can build; did you mean 'AdamW'?"),
        ({"optimizer": {"class_name": "AdamW", "config": {"weight_decy": 0.1}}},
         "config: AdamW takes no argument 'weight_decy'; did you mean 'weight_decay'?"),
        ({"optimizer": {"class_name": "AdamW", "confg": {}}}, "train.optimizer.confg: unknown key 'confg'; "
                                                              "did you mean 'config'?"),
        ({"loss": "sparse_categorical_crossentropyy"}, "did you mean 'sparse_categorical_crossentropy'?"),
        ({"loss": {"class_name": "SparseCategoricalCrossentropy", "config": {"label_smoothing": 0.1}}},
         "SparseCategoricalCrossentropy takes no label_smoothing (Keras 3.15.1): write {class_name: "
         "CategoricalCrossentropy, config: {label_smoothing: 0.1}}; the runner one-hot encodes class-id labels"),
        ({"metrics": ["accuracy", "acuracy"]}, "train.metrics.1: 'acuracy' is not a metric name keras.metrics "
                                               "knows; did you mean 'accuracy'?"),
        ({"schedule": {"class_name": "CosineDecai", "config": {}}}, "did you mean 'CosineDecay'?"),
        ({"schedule": {"class_name": "CosineDecay", "config": {"initial_learning_rate": 1e30, "decay_steps": 9}}},
         "config.initial_learning_rate is 1e+30: a learning rate is a number from 1e-12 to 1e+12"),
        # A rate of 0 only where a schedule starts a warmup from it or decays to it (below): never one to train at.
        ({"schedule": {"class_name": "CosineDecay", "config": {"initial_learning_rate": 0.0, "decay_steps": 9}}},
         "config.initial_learning_rate is 0: a learning rate is a number from 1e-12 to 1e+12"),
        ({"schedule": {"class_name": "CosineDecay", "config": {"initial_learning_rate": 0.0, "decay_steps": 9,
                                                               "warmup_steps": 3, "warmup_target": 0.0}}},
         "config.warmup_target is 0: a learning rate is a number from 1e-12 to 1e+12"),
        ({"optimizer": {"class_name": "Adam", "config": {"learning_rate": COSINE}}},
         "config.learning_rate is a mapping: a config holds plain values"),
        ({"optimizer": 3}, "train.optimizer: write an optimizer name (adam) or Keras's form"),
        ({"learning_rate": 0.01, "schedule": COSINE},
         "train.learning_rate (0.01) and train.schedule (CosineDecay) both set the learning rate: the schedule "
         "replaces it; remove train.learning_rate"),
        ({"learning_rate": 0.01, "optimizer": ADAMW},
         "train.learning_rate (0.01) and train.optimizer's config learning_rate (0.001) disagree: the optimizer's "
         "config wins; remove train.learning_rate"),
        ({"optimizer": ADAMW, "schedule": COSINE}, "train.optimizer's config sets learning_rate (0.001) and "
                                                   "train.schedule (CosineDecay) replaces it"),
        # Out of its range a Keras argument trains without an error and means nothing: label_smoothing 50 gave a
        # loss of -218 and an accuracy far below chance.
        ({"loss": {"class_name": "CategoricalCrossentropy", "config": {"label_smoothing": 50}}},
         "config.label_smoothing is 50: Keras takes it in [0, 1]"),
        ({"optimizer": {"class_name": "Adam", "config": {"clipnorm": -1.0}}},
         "config.clipnorm is -1: Keras takes it in (0, 1e+12]"),
        ({"optimizer": {"class_name": "SGD", "config": {"momentum": 1.5}}}, "config.momentum is 1.5"),
        # F1: a name too short for a ratio is offered by its prefix; the metric, as Keras's default, gives one score
        # per class (the summary holds numbers), and takes one-hot labels: each ran and failed after an epoch.
        ({"metrics": ["acc", "f1"]}, "'f1' is not a metric name keras.metrics knows; did you mean"),
        ({"metrics": ["f1_score"], "loss": "categorical_crossentropy"},
         "f1_score gives one score per class unless it averages them: write {class_name: F1Score, config: "
         "{average: macro}}"),
        ({"metrics": [{"class_name": "F1Score", "config": {"average": "macro"}}]},
         "F1Score takes one-hot labels, and with train.loss sparse_categorical_crossentropy the class ids reach"),
    ],
)
def test_validate_refuses_what_keras_would_not_build_naming_the_line(tmp_path: Path, train: dict, expected: str):
    spec = write_spec(tmp_path, {"name": "keras_bad", "train": train})
    result = invoke("validate", spec, "--no-data")
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr, result.stderr
    assert re.search(rf"^error: {re.escape(str(spec))}:\d+: train", result.stderr), result.stderr
    assert "Traceback" not in result.stderr


def test_a_warmup_from_zero_and_a_decay_to_zero_validate_as_keras_writes_them(tmp_path: Path) -> None:
    """CosineDecay's docstring warms up from `initial_learning_rate = 0` to `warmup_target`; PolynomialDecay may end
    at 0. Both validate, and Keras builds what validate passed."""
    warmup = {"class_name": "CosineDecay", "config": {"initial_learning_rate": 0, "decay_steps": 100,
                                                      "warmup_target": 0.1, "warmup_steps": 10}}
    to_zero = {"class_name": "PolynomialDecay", "config": {"initial_learning_rate": 0.1, "decay_steps": 100,
                                                           "end_learning_rate": 0.0}}
    for schedule in (warmup, to_zero):
        spec = write_spec(tmp_path, {"name": "keras_zero", "train": {"schedule": schedule}})
        result = invoke("validate", spec, "--no-data")
        assert result.returncode == 0, result.stderr
    # What the run builds from it: the int 0 goes to Keras as 0.0 (Keras's CosineDecay fails on an int rate).
    from runner.spec.types import JobSpec
    from runner.train.build import make_optimizer

    optimizer = make_optimizer(JobSpec.model_validate({"name": "keras_zero", "train": {"schedule": warmup}}).train)
    rates = optimizer._learning_rate  # the schedule itself (Keras's `learning_rate` property is its current value)
    assert float(rates(0)) == 0.0 and abs(float(rates(10)) - 0.1) < 1e-6


def test_a_set_takes_keras_forms_too(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"name": "keras_set"})
    result = invoke("validate", spec, "--no-data", "--show", "--set", f"train.optimizer={json.dumps(ADAMW)}",
                    "--set", "train.learning_rate=0.001")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["train"]["optimizer"] == ADAMW
    typo = invoke("validate", spec, "--no-data", "--set", "train.optimizer={class_name: Adm}")
    assert typo.returncode == 2
    assert "--set 'train.optimizer={class_name: Adm}': train.optimizer.class_name: 'Adm'" in typo.stderr
    assert "did you mean 'Adam'?" in typo.stderr


def test_optimizer_identity_is_the_keras_class() -> None:
    from runner.spec.types import JobSpec

    assert [optimizer_identity(JobSpec.model_validate({"train": {"optimizer": o}}).train)
            for o in ("adam", "sgd", "rmsprop", "adamw", ADAMW, {"class_name": "sgd"})] == [
        "Adam", "SGD", "RMSprop", "AdamW", "AdamW", "SGD"]


def test_optimizer_identity_names_the_settings_that_add_slots() -> None:
    from runner.spec.types import JobSpec

    def identity(optimizer: dict) -> str:
        return optimizer_identity(JobSpec.model_validate({"train": {"optimizer": optimizer}}).train)

    assert identity({"class_name": "Adam", "config": {"use_ema": True, "ema_momentum": 0.999}}) == "Adam+use_ema"
    assert identity({"class_name": "AdamW", "config": {"use_ema": True}}) == "AdamW+use_ema"
    assert identity({"class_name": "Adam", "config": {"use_ema": False, "clipnorm": 1.0}}) == "Adam"
    assert identity({"class_name": "SGD", "config": {"momentum": 0.9}}) == identity("sgd") == "SGD"


@pytest.mark.slow
def test_switching_on_ema_at_a_resume_is_refused_naming_both(mnist_job) -> None:
    """An exponential moving average switched on for a resumed run started from zeros and replaced the trained
    weights at the end: a model at chance, exit 0. The run folder pins it with the optimizer's class."""
    from tests.conftest import last_json, run_cli

    adam = {"class_name": "Adam", "config": {"learning_rate": 0.01}}
    spec = mnist_job("ema", train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True, "optimizer": adam},
                     output={"tensorboard": False})
    assert run_cli("run", spec).returncode == 0
    ema = json.dumps({"class_name": "Adam", "config": {"learning_rate": 0.01, "use_ema": True}})
    refused = run_cli("run", spec, "--set", "train.epochs=2", "--set", f"train.optimizer={ema}")
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = last_json(refused.stdout)["error"]
    assert "Adam" in error and "Adam+use_ema" in error, error


def test_what_keras_serialize_writes_validates_as_it_is(tmp_path: Path) -> None:
    """keras.*.serialize's output (module and registered_name beside class_name and config, every argument,
    epsilon as json.dumps writes it: 1e-07, a float in YAML 1.2 and JSON, text in YAML 1.1) is the form a Keras
    user has; pasted into a spec it validates, and the spec's dump keeps only class_name and config."""
    probe = (
        "import json, keras\n"
        "print(json.dumps({'optimizer': keras.optimizers.serialize(keras.optimizers.AdamW(weight_decay=0.01)),"
        " 'loss': keras.losses.serialize(keras.losses.SparseCategoricalCrossentropy()),"
        " 'metrics': [keras.metrics.serialize(keras.metrics.SparseCategoricalAccuracy())]}))\n"
    )
    serialized = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                           timeout=120, check=True).stdout.splitlines()[-1])
    assert serialized["optimizer"]["module"] == "keras.optimizers" and "1e-07" in json.dumps(serialized)
    spec = tmp_path / "pasted.yaml"
    spec.write_text("name: pasted\ntrain:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in serialized.items()))
    result = invoke("validate", spec, "--no-data", "--show")
    assert result.returncode == 0, result.stderr
    optimizer = json.loads(result.stdout)["train"]["optimizer"]
    assert set(optimizer) == {"class_name", "config"} and optimizer["config"]["epsilon"] == 1e-07
    custom = dict(serialized["optimizer"], module="mypkg.optim")
    spec.write_text(f"name: pasted\ntrain:\n  optimizer: {json.dumps(custom)}\n")
    refused = invoke("validate", spec, "--no-data")
    assert refused.returncode == 2 and "'mypkg.optim' is not one of Keras's modules" in refused.stderr


def test_1e_minus_4_is_a_number_and_quoted_it_is_refused_as_text(tmp_path: Path) -> None:
    """YAML 1.1 (libyaml) reads 1e-4, without a dot, as text; Keras got a string and failed mid-training. The
    spec reads it as YAML 1.2 and JSON do, a number; written quoted, it is text, refused with the number to write."""
    spec = tmp_path / "decay.yaml"
    spec.write_text("name: decay\ntrain:\n  optimizer: {class_name: AdamW, config: {weight_decay: 1e-4}}\n")
    shown = invoke("validate", spec, "--no-data", "--show")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["train"]["optimizer"]["config"]["weight_decay"] == 1e-4
    spec.write_text("name: decay\ntrain:\n  optimizer: {class_name: AdamW, config: {weight_decay: '1e-4'}}\n")
    refused = invoke("validate", spec, "--no-data")
    assert refused.returncode == 2 and "config.weight_decay is the text '1e-4'" in refused.stderr
