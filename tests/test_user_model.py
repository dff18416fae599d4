"""Your own model: the fashionnet example trained through the CLI, and every way an import path can be wrong.

A spec names user code only as `package.module:function`; the runner imports it and calls it with its
own arguments. Each failure (missing module, missing attribute, wrong signature, wrong return) is a
start-up error with exit code 2 that names the path and what was found.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from runner import SpecError
from runner.spec.usercode import CodeRoots, load_callable
from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke
from tests.support.docker import IMAGE_UID, Engine, folders_for_the_container

EXAMPLE = REPO / "examples" / "fashion"
BUILD_ARGS = ("params", "features", "inputs")


def example_env() -> dict[str, str]:
    """The example's package on PYTHONPATH, as a user's image has it installed (nothing goes into .venv)."""
    path = os.pathsep.join(p for p in (str(EXAMPLE / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return cli_env(PYTHONPATH=path)


def example_overrides(data: Path, runs: Path) -> list[str]:
    return [
        "--set", f"data.train={data}/train-*.tfrecord",
        "--set", f"data.eval={data}/eval-*.tfrecord",
        "--set", f"output.dir={runs}",
        "--set", "accelerator.kind=cpu",
    ]


@pytest.fixture(scope="module")
def fashion_data(tmp_path_factory) -> Path:
    """Steps 1 and 2 of docs/own-model.md: the example's prepare script writes PNG TFRecords, `runner manifest`
    indexes them."""
    out = tmp_path_factory.mktemp("fashion")
    prepared = subprocess.run(
        [sys.executable, "-m", "fashionnet.prepare", "--out", str(out), "--train", "1024", "--eval", "256"],
        capture_output=True, text=True, timeout=180, env=example_env(),
    )
    assert prepared.returncode == 0, prepared.stderr
    indexed = run_cli("manifest", EXAMPLE / "job.yaml", *example_overrides(out, out / "unused")[:4], env=example_env())
    assert indexed.returncode == 0, indexed.stderr
    assert indexed.stdout.strip() == f"{out}/manifest.json"
    return out


def standardize(pixels: np.ndarray) -> np.ndarray:
    """The example's own data.preprocess, loaded from its file (the package is not installed here)."""
    spec = importlib.util.spec_from_file_location("fashion_preprocess",
                                                  EXAMPLE / "src" / "fashionnet" / "preprocess.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.standardize({"image": tf.constant(pixels)})["image"].numpy()


def served_examples(summary: dict, data: Path) -> tuple[np.ndarray, np.ndarray]:
    """The run's SavedModel fed the eval shards' own PNG records: `serve_examples` decodes and preprocesses them
    as training did, so it answers as `serve` does on the standardized pixels (and not on the raw ones)."""
    loaded = tf.saved_model.load(str(Path(summary["model"]).parent / "saved_model"))
    records = [r.numpy() for r in tf.data.TFRecordDataset(sorted(map(str, data.glob("eval-*.tfrecord")))).take(6)]
    pngs = [tf.train.Example.FromString(r).features.feature["image"].bytes_list.value[0] for r in records]
    pixels = np.stack([tf.io.decode_png(png, channels=1).numpy() for png in pngs]).astype(np.float32)
    from_records = loaded.serve_examples(tf.constant(records)).numpy()
    np.testing.assert_allclose(from_records, loaded.serve(tf.constant(standardize(pixels))).numpy(), atol=1e-5)
    assert not np.allclose(from_records, loaded.serve(tf.constant(pixels)).numpy(), atol=1e-3)
    return pixels, from_records


@pytest.mark.slow
@pytest.mark.xdist_group("fashion_data")  # its tests share a worker, so the example's data is prepared once
def test_example_trains_through_the_cli(fashion_data: Path, tmp_path: Path):
    result = run_cli(
        "run", EXAMPLE / "job.yaml", *example_overrides(fashion_data, tmp_path / "runs"), "--set", "train.epochs=2",
        # Two logical CPU devices: MirroredStrategy is real, and the user's module is imported inside its scope.
        "--set", "accelerator.cpu_devices=2", env=example_env(),
    )
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded"
    assert summary["steps_per_epoch"] == 1024 // 256
    # Ten classes: chance is 0.1. The user's own metric (top-2) can never be below top-1.
    assert summary["metrics"]["accuracy"] > 0.5
    assert summary["metrics"]["top2_accuracy"] >= summary["metrics"]["accuracy"]
    import keras

    model = keras.models.load_model(summary["model"], compile=False)
    assert model.name == "fashionnet"
    assert model.output_shape == (None, 10)
    pixels, from_records = served_examples(summary, fashion_data)
    np.testing.assert_allclose(from_records, model.predict(standardize(pixels), verbose=0), atol=1e-4)


@pytest.mark.slow
@pytest.mark.host
def test_example_image_built_on_the_runner_image_trains_the_job(
    docker_engine: Engine, runner_image: str, fashion_data: Path, tmp_path: Path
):
    """Step 3 of docs/own-model.md: the example's Dockerfile, FROM the runner image built from this checkout."""
    tag = "fashionnet:under-test"
    built = docker_engine.docker(
        "build", "--network", "none", "--build-arg", f"RUNNER_IMAGE={runner_image}", "--tag", tag, str(EXAMPLE),
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    # The container runs as the image's uid 1000: it reads the data read-only and owns the run folder.
    data, runs = folders_for_the_container(fashion_data, tmp_path, "fashion")
    try:
        result = docker_engine.docker(
            "run", "--rm", "--network", "none",
            "--volume", f"{data}:/app/data/fashion:ro", "--volume", f"{runs}:/app/runs",
            tag, "run", "fashionnet.yaml", "--set", "train.epochs=1",
            timeout=300,
        )
    finally:
        docker_engine.docker("image", "rm", "--force", tag)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded" and summary["job"] == "fashionnet"
    # The user's metric ran inside the container: the package is installed in the image, not mounted.
    assert summary["metrics"]["top2_accuracy"] >= summary["metrics"]["accuracy"] > 0.3
    assert (runs / "fashionnet" / "model.keras").stat().st_uid == IMAGE_UID


def test_example_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(EXAMPLE / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- import paths that cannot work ---------------------------------------------------------------


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch) -> str:
    """A small package of the user's on sys.path, with one module per kind of mistake."""
    name = f"userpkg_{tmp_path.name.replace('-', '_')}"
    package = tmp_path / "src" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(textwrap.dedent("""
        SIZE = 3
        length = len

        def build(params, features, inputs):
            return {"not": "a model"}

        def one_arg(params):
            return None

        def _private(params, features, inputs):
            return None

        class Builder:
            pass
    """))
    (package / "needs_missing.py").write_text("import a_library_that_is_not_installed\n")
    (package / "broken.py").write_text("def build(params, features, inputs)\n    return None\n")
    (package / "raises.py").write_text("raise RuntimeError('no GPU config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    return name


@pytest.mark.parametrize(
    "attribute, expected",
    [
        ("nosuchpkg.models:build",
         ["cannot import 'nosuchpkg.models'", "'nosuchpkg' is not in the code folder", "code.packages"]),
        ("{pkg}.nosuchmodule:build",
         ["cannot import '{pkg}.nosuchmodule'", "has no module 'nosuchmodule'", "it holds: broken, models"]),
        ("{pkg}.needs_missing:build",
         ["importing '{pkg}.needs_missing'", "it needs 'a_library_that_is_not_installed'"]),
        ("{pkg}.broken:build", ["broken.py:1: syntax error in '{pkg}.broken'"]),
        ("{pkg}.raises:build", ["raised RuntimeError: no GPU config file"]),
        ("{pkg}.models:biuld", ["has no attribute 'biuld'", "it defines: Builder, build, one_arg"]),
        ("{pkg}.models:SIZE", ["'{pkg}.models:SIZE' is not callable (a int: 3)"]),
        ("{pkg}.models:length", ["is a builtin_function_or_method"]),
        ("{pkg}.models:one_arg", ["has signature one_arg(params)", "calls it as one_arg(params, features, inputs)"]),
        ("{pkg}.models:Builder", ["has signature Builder()"]),
    ],
)
def test_an_import_path_that_cannot_work_names_the_path_and_what_was_found(user_package, attribute, expected, tmp_path):
    with pytest.raises(SpecError) as caught:
        load_callable(attribute.format(pkg=user_package), "model.name", BUILD_ARGS, CodeRoots(str(tmp_path / "src")))
    message = str(caught.value)
    assert message.startswith("model.name: ")
    for part in expected:
        assert part.format(pkg=user_package) in message, message
    assert caught.value.exit_code == 2


def test_a_good_import_path_returns_the_function(user_package, tmp_path):
    build = load_callable(f"{user_package}.models:build", "model.name", BUILD_ARGS, CodeRoots(str(tmp_path / "src")))
    assert build({}, {}, ()) == {"not": "a model"}


def test_a_build_function_that_returns_no_model_stops_the_run_at_start_up(user_package, tiny_mnist, tmp_path):
    spec = write_spec(tmp_path, {
        "name": "not_a_model",
        "accelerator": {"kind": "cpu"},
        "data": {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": None, "global_batch_size": 128},
        "model": {"name": f"{user_package}.models:build"},
        "output": {"dir": str(tmp_path / "runs")},
        "code": {"folder": "src"},
    })
    result = run_cli("run", spec, env=cli_env(PYTHONPATH=str(tmp_path / "src")))
    assert result.returncode == 2, result.stderr
    assert (f"model.name: '{user_package}.models:build' returned a builtins.dict; "
            "return an uncompiled keras.Model") in result.stderr
    summary = last_json(result.stdout)
    assert summary["status"] == "failed"
    assert summary["epochs"] == [] and not summary["timing"].get("train_s")


def test_a_build_function_that_refuses_its_params_is_a_start_up_error(monkeypatch):
    from runner.data.schema import Feature
    from runner.spec.types import JobSpec
    from runner.train import build

    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    spec = JobSpec.model_validate(
        {"model": {"name": "fashionnet.model:build", "params": {"filtres": 8}}, "code": {"packages": ["fashionnet"]}}
    )
    with pytest.raises(SpecError, match=r"raised ValueError while building: unknown model.params \['filtres'\]"):
        build.build_model(spec, {"image": Feature("uint8", (28, 28, 1)), "label": Feature("int64", ())})


def test_a_preprocess_function_must_return_the_features(tiny_mnist, tmp_path, monkeypatch):
    from runner.data import pipeline

    module = tmp_path / "mnist_steps.py"
    module.write_text(textwrap.dedent("""
        def drops_label(batch):
            return {"image": batch["image"] / 255.0}

        def returns_tuple(batch):
            return batch["image"], batch["label"]

        def wrong_key(batch):
            return {**batch, "image": batch["pixels"]}

        def scales(batch):
            return {**batch, "image": batch["image"] / 255.0}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    shards = pipeline.find_shards(f"{tiny_mnist}/train-*.tfrecord")

    def dataset(name: str):
        fn = load_callable(f"mnist_steps:{name}", "data.preprocess", ("features",), CodeRoots(str(tmp_path)))
        return pipeline.make_dataset(shards, 16, ("image",), "label", training=False, preprocess=fn)

    with pytest.raises(SpecError, match=r"mnist_steps:drops_label returned no 'label' \(named by data.inputs"):
        dataset("drops_label")
    with pytest.raises(SpecError, match=r"returned a tuple; it must return the dict of features it was given"):
        dataset("returns_tuple")
    with pytest.raises(SpecError, match=r"wrong_key raised KeyError on a batch of image: float32\[None, 28, 28, 1\]"):
        dataset("wrong_key")
    images, labels = next(iter(dataset("scales")))
    assert 0.99 < float(images.numpy().max()) <= 1.0 and labels.shape == (16,)


# --- a spec is data, never code ----------------------------------------------------------------


@pytest.mark.parametrize(
    "doc, expected",
    [
        ({"model": {"name": "fashionnet.model.build"}},
         "model.name: 'fashionnet.model.build' looks like an import path: separate module and function with a "
         "colon, e.g. 'fashionnet.model:build'"),
        ({"model": {"name": "os:system"}}, "model.name: 'os:system' names the standard module 'os'"),
        ({"data": {"preprocess": "lambda x: x"}}, "data.preprocess: 'lambda x: x' is not an import path"),
        ({"train": {"loss": "my.losses:focal()"}}, "train.loss: 'my.losses:focal()' is not an import path"),
    ],
)
def test_import_paths_are_checked_at_spec_load(tmp_path, doc, expected):
    spec = write_spec(tmp_path, {"name": "paths", **doc})
    result = invoke("validate", spec)
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr
    assert f"{spec}:" in result.stderr


def test_a_yaml_python_tag_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    spec = tmp_path / "evil.yaml"
    spec.write_text(f"name: evil\nmodel:\n  name: !!python/object/apply:os.system ['touch {marker}']\n")
    result = invoke("validate", spec)
    assert result.returncode == 2
    assert "python/object/apply:os.system" in result.stderr
    assert not marker.exists()


_UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
_UNSAFE_MODULES = {"pickle", "marshal", "dill", "cloudpickle", "shelve", "joblib"}


def test_the_runner_never_evaluates_or_unpickles():
    """No eval/exec, no pickle-family import, no `allow_pickle=True`/`safe_mode=False`: only named imports run code."""
    found = []
    for path in sorted((REPO / "runner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _UNSAFE_CALLS:
                found.append(f"{where} calls {node.func.id}")
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names]
                names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                found += [f"{where} imports {n}" for n in names if n.split(".")[0] in _UNSAFE_MODULES]
            if isinstance(node, ast.keyword) and (node.arg, getattr(node.value, "value", None)) in {
                ("allow_pickle", True), ("safe_mode", False)
            }:
                found.append(f"{where} passes {node.arg}={node.value.value}")
    assert found == []
