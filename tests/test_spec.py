"""The job spec: defaults declared once, every job file valid, every bad spec refused with file:line and key;
loading bounded whatever the input; every field held to the range it can run with; paths relative to the spec
file; a spec reaching only the code it declares; `runner validate` catching what `runner run` would refuse,
without importing TensorFlow or running any of the spec's code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from runner import SpecError
from runner.spec.load import MAX_BYTES, load_spec
from runner.spec.types import MODEL_NAMES, JobSpec
from runner.spec.usercode import CodeRoots, find_code, load_callable
from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke

BAD = sorted((Path(__file__).parent / "specs" / "bad").glob("*.yaml"))
# Time limits are on CPU seconds: on a shared machine wall time also measures the neighbours. A hang spends no
# CPU, so each check also bounds wall time, loosely.
CPU_S, WALL_S = 2.0, 20.0


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self.cpu, self.wall = time.process_time(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu, self.wall = time.process_time() - self.cpu, time.monotonic() - self.wall

    def check(self, what: str) -> None:
        assert self.cpu < CPU_S and self.wall < WALL_S, f"{what}: {self.cpu:.2f} s CPU, {self.wall:.2f} s"


def expected_message(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    return first.removeprefix("# expect: ")


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_spec_is_refused_with_its_expected_message(path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert expected_message(path) in str(caught.value).replace(str(path.parent) + "/", "")


@pytest.mark.parametrize("path", sorted((REPO / "jobs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_job_is_valid(path: Path) -> None:
    spec = load_spec(path)
    assert spec.name == path.stem
    # Relative to the job file: the repository's data/ and runs/, from wherever the command is run.
    assert spec.output.dir == str(REPO / "runs")
    if spec.kind == "train":
        assert spec.data.train.startswith(f"{REPO}/data/")


def test_make_demo_prepares_the_folder_the_mnist_job_reads() -> None:
    """`make demo` runs `runner prepare mnist --out $(DATA)` at the repository root, then the job."""
    makefile = (REPO / "Makefile").read_text()
    data = re.search(r"^DATA := (\S+)$", makefile, re.M).group(1)
    assert re.search(r"^\t\$\(BIN\)/runner run jobs/mnist_cnn\.yaml$", makefile, re.M)
    spec = load_spec(REPO / "jobs" / "mnist_cnn.yaml")
    assert os.path.dirname(spec.data.train) == str(REPO / data)


def test_a_file_holding_only_a_name_gets_every_default(tmp_path: Path) -> None:
    path = tmp_path / "minimal.yaml"
    path.write_text("name: minimal\n")
    spec = load_spec(path)
    paths = {"data": {"train", "eval"}, "output": {"dir"}, "code": {"folder"}}
    assert spec.model_dump(exclude={"name": True, **paths}) == JobSpec(name="minimal").model_dump(
        exclude={"name": True, **paths})
    # The default paths are relative to the spec file, as a spec's own paths are.
    assert spec.data.train == f"{tmp_path}/data/mnist/train-*.tfrecord"
    assert spec.run_dir == f"{tmp_path}/runs/minimal"
    assert spec.code.folder == str(tmp_path)


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: job\n")
    spec = load_spec(path, ["train.epochs=3", "data.train=gs://b/train-*.tfrecord", "accelerator.kind=cpu"])
    assert (spec.train.epochs, spec.data.train, spec.accelerator.kind) == (3, "gs://b/train-*.tfrecord", "cpu")
    with pytest.raises(SpecError,
                       match=r"--set 'train\.epohcs=3': train\.epohcs: unknown key 'epohcs'; did you mean 'epochs'"):
        load_spec(path, ["train.epohcs=3"])
    with pytest.raises(SpecError, match=r"--set 'train\.epochs=many': train\.epochs: Input should be a valid integer"):
        load_spec(path, ["train.epochs=many"])
    with pytest.raises(SpecError, match="must look like key.sub=value"):
        load_spec(path, ["epochs"])


def test_the_spec_is_frozen(tmp_path: Path) -> None:
    spec = JobSpec()
    with pytest.raises(Exception, match="frozen"):
        spec.train.epochs = 5  # type: ignore[misc]


def test_validate_cli_exit_codes_and_no_traceback(tmp_path: Path) -> None:
    # validate in this process (it imports no TensorFlow); run, sweep and doctor as the user runs them.
    ok = invoke("validate", REPO / "jobs" / "mnist_cnn.yaml", "--set", "train.epochs=2", "--no-data")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "" and "is ready to run (--show prints the resolved spec)" in ok.stderr
    shown = invoke("validate", REPO / "jobs" / "mnist_cnn.yaml", "--set", "train.epochs=2", "--no-data", "--show")
    assert json.loads(shown.stdout)["train"]["epochs"] == 2
    bad = invoke("validate", Path(__file__).parent / "specs" / "bad" / "typo_key.yaml")
    assert bad.returncode == 2
    assert "typo_key.yaml:4: train.epoch: unknown key 'epoch'; did you mean 'epochs'?" in bad.stderr
    assert "Traceback" not in bad.stderr + bad.stdout
    (tmp_path / "mnist.yaml").write_text("name: x\n")
    missing = invoke("validate", tmp_path / "mnsit.yaml")
    assert missing.returncode == 2
    # the runner's own message, on one line however long the path: the file, its folder and the close name
    assert f"{tmp_path / 'mnsit.yaml'}: no such file in {tmp_path}; did you mean 'mnist.yaml'?" in missing.stderr
    for command in (["run"], ["sweep", "--set", "train.epochs=1,2"], ["doctor"]):
        also = run_cli(*command, tmp_path / "mnsit.yaml", timeout=60)
        assert also.returncode == 2 and "did you mean 'mnist.yaml'?" in also.stderr, (command, also.stderr)


def test_a_missing_spec_names_the_folder_and_a_close_name(tmp_path: Path) -> None:
    (tmp_path / "mnist_cnn.yaml").write_text("name: x\n")
    with pytest.raises(SpecError,
                       match=rf"mnist_cnm\.yaml: no such file in {tmp_path}; did you mean 'mnist_cnn\.yaml'\?"):
        load_spec(tmp_path / "mnist_cnm.yaml")


def test_validate_never_imports_tensorflow(tmp_path: Path) -> None:
    """Nor the spec's own code: validate finds the module (the `code:` line names its file) but never imports it."""
    marker = tmp_path / "imported"
    (tmp_path / "mymodels.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef build(params, features, inputs): pass\n")
    spec = write_spec(tmp_path, {"name": "own", "model": {"name": "mymodels:build"}})
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from runner.cli import app\n"
        f"for spec in [{str(REPO / 'jobs' / 'mnist_cnn.yaml')!r}, {str(spec)!r}]:\n"
        "    result = CliRunner().invoke(app, ['validate', spec, '--no-data'])\n"
        "    assert result.exit_code == 0, result.output\n"
        "    print(result.stderr.strip())\n"  # mnist_cnn: a note when data/mnist is not prepared yet, else nothing
        "print('tensorflow' in sys.modules, 'mymodels' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert f"code: model.name mymodels:build is {tmp_path}/mymodels.py" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False False"
    assert not marker.exists()


# --- loading is bounded ------------------------------------------------------------------------------


def _alias_bomb(levels: int = 12) -> str:
    lines = ["name: bomb", "model:", "  params:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


PATHOLOGICAL = {
    # name: (file text, what the error says)
    "alias_bomb": (_alias_bomb(), "aliases expand to more than 5,000 values"),
    "deep_flow": (
        "name: x\nmodel: {params: {x: " + "[" * 200_000 + "]" * 200_000 + "}}\n", "nested more than 20 levels"
    ),
    "deep_block": ("".join(" " * i + "a:\n" for i in range(1000)), "nested more than 20 levels"),
    "wide_list": ("name: x\nmodel: {params: {x: [" + ",".join(["1"] * 200_000) + "]}}\n", "more than 5,000 values"),
    "many_keys": (
        "name: x\nmodel:\n  params:\n" + "".join(f"    k{i}: {i}\n" for i in range(50_000)), "more than 5,000 values"
    ),
    "long_scalar": ("name: " + "x" * 1_000_000 + "\n", "job name 'xxxx"),
    "long_key": ("x" * 1_000_000 + ": 1\n", "not valid YAML"),
    "huge_integer": ("name: x\ntrain:\n  seed: " + "9" * 900_000 + "\n", "an integer of 900,000 characters"),
    "too_big": ("name: x\n" + "#" * (10 << 20) + "\n", f"a job spec is at most {MAX_BYTES:,}"),
    "just_over": ("name: x\n" + "#" * MAX_BYTES + "\n", f"a job spec is at most {MAX_BYTES:,}"),
    "many_documents": ("---\n" * 200_000, "several YAML documents"),
    "many_errors": ("name: x\ntrain:\n" + "".join(f"  k{i}: 1\n" for i in range(2400)), "... and 2380 more problems"),
}


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_any_input_ends_in_under_two_seconds_and_little_memory(tmp_path: Path, name: str) -> None:
    text, expected = PATHOLOGICAL[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    with Stopwatch() as took, pytest.raises(SpecError) as caught:
        load_spec(path)
    tracemalloc.start()  # a second pass, traced: tracing slows allocation-heavy code several times over
    try:
        with pytest.raises(SpecError):
            load_spec(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert expected in message
    assert message.startswith(str(path)), message[:200]
    assert len(message) < 5000, "an error stays readable"
    took.check(name)
    assert peak < 200e6, f"{name}: {peak / 1e6:.0f} MB"


def test_a_pipe_or_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)  # opening it to read would wait forever for a writer
    result = run_cli("validate", fifo, timeout=60)
    assert result.returncode == 2 and "is not a regular file" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "override, expected",
    [
        ("name=\udcff\udcfe", "--set 'name=\\udcff\\udcfe': the value holds bytes that are not UTF-8 text"),
        ("model.params={? [a, b]: 1}", "a key must be a plain name, not a list"),
        ("model.params=" + "[" * 100 + "]" * 100, "nested more than 20 levels deep"),
        ("model.params=" + _alias_bomb().split("a0: ", 1)[1].replace("\n    ", ", ").replace(": &", "_: &"),
         "the value is not usable YAML"),
        ("model.params={classes: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], pixel_max: [*a, *a, *a, *a, *a, *a, *a, *a, *a, "
         "*a]}", None),
        ("train.seed=" + "9" * 5000, "an integer of 5,000 characters"),
        ("train.seed=" + "1" * 70_000, "characters; a --set is at most"),
        ("train.seed=true", "train.seed: Input should be a valid integer, not true/false"),
        ("train.seed=-1", "train.seed: Input should be greater than or equal to 0"),
        ("output.dir=", "output.dir: an empty path"),
        ("output.dir=runs[1]", "holds the glob characters [ ]"),
        ("output.dir=~/runs", None),
        ("train..epochs=3", "must look like key.sub=value"),
        ("name.x=3", "'name' is not a mapping"),
        ("train.epochs.x=3", "train.epochs: Input should be a valid integer"),
        ("a" + ".a" * 30 + "=1", "nested more than 20 levels deep"),
        ("name=!!binary aGk=", "!!binary values have no place"),
        ("name=!!python/object/apply:os.system ['true']", "could not determine a constructor"),
        ("model.name=mnist_cnnn", "did you mean 'mnist_cnn'?"),
        ("checkpoint.grace_s=.inf", "checkpoint.grace_s: Input should be a finite number"),
        ("storage.timeout_s=1e9", "storage.timeout_s: 1e+09 s is outside the range 0.01 s to 3600 s"),
        ("accelerator.timeout_s=1e-320", "accelerator.timeout_s: 1e-320 s is outside the range 0.01 s to 3600 s"),
        ("train.learning_rate=1e308", "train.learning_rate: 1e+308 is outside the range 1e-12 to 1e+12"),
        # A --set value is YAML only when YAML reads all of it: `--- x` would silently become `x`.
        ("name=--- x", "YAML reads this value as 'x', not as written; to mean the text, use --set 'name=\"--- x\"'"),
        ("name=x # comment", "YAML reads this value as 'x', not as written"),
        ("data.label=a\n  b", "YAML reads this value as 'a b', not as written"),
        ('name="--- x"', "job name '--- x' must be 1-128 letters"),
        ("data.label=label\u202e", "data.label: 'label\\u202e' holds U+202E (RIGHT-TO-LEFT OVERRIDE)"),
        ("data.inputs=[image, \"im\u2066age\"]", "holds U+2066 (LEFT-TO-RIGHT ISOLATE)"),
        ("data.label=\"a\\0b\"", "holds U+0000"),
    ],
)
def test_set_values_meet_the_same_bounds_and_are_named(tmp_path: Path, override: str, expected: str | None) -> None:
    path = write_spec(tmp_path, {"name": "job"})
    with Stopwatch() as took:
        if expected is None:
            load_spec(path, [override])
        else:
            with pytest.raises(SpecError) as caught:
                load_spec(path, [override])
            message = str(caught.value)
            assert expected in message, message
            assert message.startswith("--set "), message
    took.check(override[:40])


# --- every field has the range it can run with ------------------------------------------------------------


@pytest.mark.parametrize(
    "key, good, bad",
    [
        ("train.epochs", [1, 1_000_000], [0, 1_000_001, True, 1.0, "3", None]),
        ("train.seed", [0, 2**32 - 1], [-1, 2**32, False]),
        ("train.steps_per_epoch", [1, 2**31 - 1, None], [0, 2**31, True]),
        ("train.steps_per_execution", ["auto", 1, 2**31 - 1], [0, 2**31, True, "fast", 1.5]),
        ("train.learning_rate", [1e-12, 0.001, 1e12], [0, -1, 1e30, 1e308, 1e-320, 1e-13, ".inf", ".nan", True]),
        ("train.reduce_lr_factor", [0.1, 0.99], [0, 1, 1e-320, True]),
        ("train.loss", ["mse", "my.losses:focal", {"class_name": "Huber", "config": {"delta": 2.0}}],
         ["", " ", "mean squared", "os.path:join", "msee", {"class_name": "Huber", "config": {"delt": 2.0}}]),
        ("train.metrics", [[], ["accuracy", "mae"]], [[""], ["accuracy", "accuracy"], "accuracy"]),
        ("data.global_batch_size", [1, 2**31 - 1], [0, 2**31, True, 64.0]),
        ("data.shuffle_buffer", [0, 2**31 - 1], [-1, 2**31]),
        ("data.inputs", [["image"], ["a", "b"]], [[], [""], ["a", "a"]]),
        ("data.autotune", [True, False], [1, "yes please"]),
        ("accelerator.cpu_devices", [1, 64], [0, 65, True]),
        ("accelerator.timeout_s", [0.5, 3600], [0, 1e-320, 3601, ".inf", True]),
        ("accelerator.join_timeout_s", [1, 3600], [0.5, 0, 3601, ".inf", True]),
        ("accelerator.tpu", ["local", "grpc://10.0.0.2:8470", None], ["", " ", "a\nb"]),
        ("checkpoint.grace_s", [0.5, 3600], [0, 1e-320, 3600.5, ".inf"]),
        ("checkpoint.keep", [1, 10_000], [0, 10_001]),
        ("checkpoint.every_steps", [1, 2**31 - 1], [0, 2**31]),
        ("storage.timeout_s", [1, 3600], [0, 1e-320, 32_800, ".inf"]),
        ("data.label", ["label", "étiquette"], ["", "lab\u202eel", "a\u2069b", "a\x00b", "a\x85b", "\ufeffbom"]),
        ("data.inputs", [["image"]], [["im\u202aage"], ["a\nb"]]),
        ("output.dir", ["runs", "/abs/runs", "gs://bucket/runs"],
         ["", "a[1]", "r*", "r?", "s3://b/r", "gs://", "a\x00b"]),
        ("output.tensorboard", [True], [0, "on"]),
        ("profile.steps", [1, 1000], [0, 1001]),
        ("model.params", [{}, {"classes": [1, {"b": None}]}], [{"classes": ".inf"}, {"classes": {1: 2}}, {"a": 1}]),
        ("code.packages", [[], ["fashionnet"]], [["os"], ["runner"], ["a-b"], "fashionnet", ["setuptools"],
                                                  ["numpy"]]),
    ],
)
def test_every_field_has_the_range_it_can_run_with(tmp_path: Path, key: str, good: list, bad: list) -> None:
    section, field = key.split(".")

    def spec_with(value: object) -> Path:
        if value in (".inf", ".nan"):
            value = float(value[1:])
        elif isinstance(value, dict):
            value = {k: float("inf") if v == ".inf" else v for k, v in value.items()}
        doc = {"name": "ranges", section: {field: value}}
        return write_spec(tmp_path, doc)

    for value in good:
        load_spec(spec_with(value))
    for value in bad:
        path = spec_with(value)
        with pytest.raises(SpecError) as caught:
            load_spec(path)
        message = str(caught.value)
        assert message.startswith(f"{path}:") and key in message, (value, message)


def test_builtin_model_names_are_the_models_of_models_py() -> None:
    from runner import models

    assert set(MODEL_NAMES) == set(models.BUILTIN)


# --- paths are relative to the spec file ----------------------------------------------------------------


def test_relative_paths_resolve_against_the_spec_file_and_set_paths_against_the_current_folder(tmp_path: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "jobs").mkdir(parents=True)
    elsewhere.mkdir()
    spec = write_spec(project / "jobs", {
        "name": "rel", "data": {"train": "../data/d/train-*.tfrecord", "eval": None}, "output": {"dir": "../runs"},
    })
    args = ["validate", "../project/jobs/job.yaml", "--set", "data.validation=mine/v-*.tfrecord", "--show"]
    missing = run_cli(*args, cwd=elsewhere, timeout=60)
    assert missing.returncode == 2 and missing.stdout == "", "a spec that is not ready prints no resolved spec"
    # "Not found" quotes the pattern as written and names the folder it looked in.
    assert (f"data.train: nothing matches '../data/d/train-*.tfrecord': {project}/data/d does not exist"
            in missing.stderr)
    assert f"runner prepare DATASET --out {project}/data/d" in missing.stderr
    result = run_cli(*args, "--no-data", cwd=elsewhere, timeout=60)  # the data comes later
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["data"]["train"] == f"{project}/data/d/train-*.tfrecord"
    assert resolved["output"]["dir"] == f"{project}/runs"
    assert resolved["code"]["folder"] == f"{project}/jobs"
    assert resolved["data"]["validation"] == f"{elsewhere}/mine/v-*.tfrecord", "a --set path is the shell's"
    home = run_cli("validate", spec, "--set", "output.dir=~/runs", "--show", "--no-data",
                   env=cli_env(HOME=str(tmp_path / "home")), timeout=60)
    assert json.loads(home.stdout)["output"]["dir"] == f"{tmp_path}/home/runs"


def test_a_missing_data_folder_with_a_close_name_suggests_it_not_preparing_the_typo(tiny_mnist: Path,
                                                                                   tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "mnist").symlink_to(tiny_mnist, target_is_directory=True)
    spec = write_spec(tmp_path, {"name": "typo", "data": {"train": "data/mnsit/train-*.tfrecord", "eval": None,
                                                          "global_batch_size": 128}})
    result = invoke("validate", spec)
    assert result.returncode == 2
    assert (f"error: {spec}:3: data.train: nothing matches 'data/mnsit/train-*.tfrecord': {data}/mnsit does not "
            "exist; did you mean 'data/mnist/train-*.tfrecord'?") in result.stderr, result.stderr
    assert "runner prepare" not in result.stderr
    assert invoke("validate", spec, "--set", "data.train=" + str(data / "mnist/train-*.tfrecord")).returncode == 0


def test_a_spec_in_a_folder_named_with_glob_characters_needs_absolute_data_paths(tmp_path: Path) -> None:
    folder = tmp_path / "jobs[old]"
    folder.mkdir()
    spec = write_spec(folder, {"name": "g", "data": {"train": "data/train-*.tfrecord", "eval": None},
                               "output": {"dir": "/tmp/r"}})
    with pytest.raises(SpecError, match=r"job\.yaml:\d+: data\.train: 'data/train-\*\.tfrecord' is relative to "
                                        r".*jobs\[old\], whose name holds a glob"):
        load_spec(spec)
    load_spec(spec, [f"data.train={tmp_path}/train-*.tfrecord"])


# --- a spec reaches only the code it declares -----------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A spec's folder with a module of its own, a package in src/, and a module named like an installed one."""
    marker = tmp_path / "imported"
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(f"""
        open({str(marker)!r}, "a").write("mymodels ")

        def build(params, features, inputs):
            return "built"
    """))
    package = tmp_path / "src" / "ownpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "losses.py").write_text("def focal(y_true, y_pred):\n    return 0.0\n")
    (tmp_path / "yaml.py").write_text("def build(params, features, inputs):\n    return 'shadow'\n")
    return tmp_path


@pytest.mark.parametrize(
    "name, expected",
    [
        ("setuptools._distutils.spawn:spawn",
         "'setuptools' is not in the code folder {folder}, and code.packages does not list it"),
        ("pytest:main", "'pytest' is not in the code folder {folder}"),
        ("os:system", "names the standard module 'os'"),
        ("json.decoder:JSONDecoder", "names the standard module 'json.decoder'"),
        ("runner.models:mnist_cnn", "names the runner's own module 'runner.models'"),
        ("yaml:build", "'yaml' in the code folder {folder} has the name of an installed module"),
        ("mymodel:build", "'mymodel' is not in the code folder {folder} (did you mean 'mymodels'?)"),
        ("mymodels.sub:build", "'mymodels' ({folder}/mymodels.py) is a module, not a package"),
    ],
)
def test_an_import_path_outside_the_spec_code_is_refused_by_validate(
    project: Path, name: str, expected: str
) -> None:
    spec = write_spec(project, {"name": "boundary",
                                "model": {"name": name, "params": {"argv": ["touch", str(project / "ran")]}}})
    result = invoke("validate", spec)
    assert result.returncode == 2, result.stderr
    assert expected.format(folder=project) in result.stderr
    assert re.search(rf"{re.escape(str(spec))}:\d+: model\.name: ", result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    assert not (project / "ran").exists() and not (project / "imported").exists()


def test_code_folder_and_listed_packages_are_found_without_importing(project: Path, monkeypatch) -> None:
    spec = write_spec(project, {
        "name": "own", "model": {"name": "mymodels:build"},
        "train": {"loss": "ownpkg.losses:focal", "metrics": ["accuracy", "ownpkg.losses:focal"]},
        "code": {"packages": ["ownpkg"]},
    })
    refused = invoke("validate", spec, "--no-data")  # PYTHONPATH below reaches only a child process
    assert refused.returncode == 2
    assert "code.packages lists 'ownpkg', but it is not installed here" in refused.stderr
    installed = run_cli("validate", spec, "--no-data", env=cli_env(PYTHONPATH=str(project / "src")), timeout=60)
    assert installed.returncode == 0, installed.stderr
    assert f"code: train.loss ownpkg.losses:focal is {project}/src/ownpkg/losses.py" in installed.stderr
    as_folder = invoke("validate", spec, "--no-data", "--set", "code.packages=[]",
                       "--set", f"code.folder={project}/src", "--set", "model.name=mnist_cnn")
    assert as_folder.returncode == 0, as_folder.stderr
    assert not (project / "imported").exists()

    # a --set path: from the cwd
    missing = run_cli("validate", spec, "--no-data", "--set", "code.folder=nowhere", timeout=60)
    assert missing.returncode == 2 and f"the code folder {REPO}/nowhere does not exist" in missing.stderr
    wrong = run_cli("validate", spec, "--no-data", "--set", "train.loss=ownpkg.lossess:focal",
                    env=cli_env(PYTHONPATH=str(project / "src")))
    assert "package 'ownpkg' (" in wrong.stderr and "has no module 'lossess'; did you mean 'losses'?" in wrong.stderr


def test_load_callable_imports_from_the_code_folder_only(project: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the test's own interpreter: restored afterwards
    roots = CodeRoots(str(project))
    assert find_code("mymodels:build", "model.name", roots).origin == str(project / "mymodels.py")
    assert not (project / "imported").exists(), "finding runs nothing"
    build = load_callable("mymodels:build", "model.name", ("params", "features", "inputs"), roots)
    assert build({}, {}, ()) == "built" and (project / "imported").read_text() == "mymodels "
    assert sys.path[-1] == str(project), "the code folder is appended: it never shadows an installed module"
    with pytest.raises(SpecError, match="has the name of an installed module"):
        load_callable("yaml:build", "model.name", ("params", "features", "inputs"), roots)
    with pytest.raises(SpecError, match="'setuptools' is not in the code folder"):
        load_callable("setuptools._distutils.spawn:spawn", "model.name", ("cmd",), roots)


def test_run_refuses_code_outside_the_spec_and_runs_no_command(mnist_job, tmp_path: Path) -> None:
    """The boundary holds at run time too (a spec edited after validate, or never validated)."""
    marker = tmp_path / "ran"
    spec = mnist_job("spawn",
                     model={"name": "setuptools._distutils.spawn:spawn", "params": {"cmd": ["touch", str(marker)]}},
                     data={"eval": None})
    result = run_cli("run", spec, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "model.name: cannot import 'setuptools._distutils.spawn'" in result.stderr
    assert "'setuptools' is not in the code folder" in result.stderr
    assert not marker.exists()
    assert last_json(result.stdout)["status"] == "failed"


# --- validate catches what run would refuse ---------------------------------------------------------------


def test_validate_checks_the_local_data_in_under_two_seconds_without_tensorflow(
    tiny_mnist: Path, tmp_path: Path
) -> None:
    own = tmp_path / "own"
    own.mkdir()
    for shard in sorted(tiny_mnist.glob("train-*.tfrecord"))[:2]:
        shutil.copy(shard, own)
    spec = write_spec(tmp_path, {
        "name": "pre", "accelerator": {"kind": "cpu"},
        "data": {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": f"{tiny_mnist}/test-*.tfrecord",
                 "global_batch_size": 128},
    })
    cases = {
        "ok": [],
        "batch": ["data.global_batch_size=4096"],
        "devices": ["accelerator.cpu_devices=3"],
        "unlisted": [f"data.train={own}/train-*.tfrecord"],
        "typo": [f"data.train={tiny_mnist}/trian-*.tfrecord"],
        "model": ["model.name=mnist_cnnn"],
        "bucket": ["data.eval=gs://bucket/test-*.tfrecord"],
    }
    code = (
        "import json, sys, time\n"
        "from typer.testing import CliRunner\n"
        "from runner.cli import app\n"
        "out = {}\n"
        f"for name, sets in {cases!r}.items():\n"
        "    cpu, wall = time.process_time(), time.monotonic()\n"
        f"    r = CliRunner().invoke(app, ['validate', {str(spec)!r}, *[a for s in sets for a in ('--set', s)]])\n"
        "    out[name] = [r.exit_code, r.stderr, time.process_time() - cpu, time.monotonic() - wall]\n"
        "out['tensorflow'] = 'tensorflow' in sys.modules\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out.pop("tensorflow") is False
    for name, (exit_code, stderr, cpu, wall) in out.items():
        assert cpu < CPU_S and wall < WALL_S, f"{name}: {cpu:.2f} s CPU, {wall:.2f} s"
        assert "Traceback" not in stderr
        assert exit_code == (0 if name in ("ok", "bucket") else 2), (name, stderr)
    assert out["batch"][1].startswith(
        f"error: --set 'data.global_batch_size=4096': data.train: 2,048 records in {tiny_mnist}/train-*.tfrecord make "
        "no full batch of data.global_batch_size (4,096); set data.global_batch_size to at most 2,048"
    )
    assert (f"error: {spec}:7: data.global_batch_size (128) must be divisible by accelerator.cpu_devices (3)"
            in out["devices"][1])
    assert "set it to 126 or 129" in out["devices"][1]
    assert f"{own} holds 2 file(s) matching 'train-*.tfrecord' but no manifest.json" in out["unlisted"][1]
    assert f"run `runner manifest {spec}`" in out["unlisted"][1]
    assert f"no files match 'trian-*.tfrecord' in {tiny_mnist}; did you mean" in out["typo"][1]
    assert "did you mean 'mnist_cnn'?" in out["model"][1]
    assert "note: data in gs://bucket not checked" in out["bucket"][1]


@pytest.mark.slow
def test_the_quick_path_from_another_folder_reads_and_writes_beside_the_spec(tiny_mnist: Path, tmp_path: Path) -> None:
    """`runner run ../project/jobs/job.yaml` from elsewhere: data and runs are the project's; nothing lands in cwd.

    It trains, for one step: the checkpoint and model.keras a run writes beside its spec exist only once it has
    trained, and `evaluate` from a third folder reads that checkpoint. Where each relative path resolves is checked
    without TensorFlow by
    test_relative_paths_resolve_against_the_spec_file_and_set_paths_against_the_current_folder."""
    project, elsewhere, third = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "third"
    for folder in (project / "jobs", project / "data", elsewhere, third):
        folder.mkdir(parents=True)
    shutil.copytree(tiny_mnist, project / "data" / "mnist")
    write_spec(project / "jobs", {
        "name": "quick", "accelerator": {"kind": "cpu"},
        "data": {"train": "../data/mnist/train-*.tfrecord", "eval": "../data/mnist/test-*.tfrecord",
                 "global_batch_size": 128},
        "train": {"epochs": 1, "steps_per_epoch": 1, "allow_chance": True}, "output": {"dir": "../runs"},
    })
    result = run_cli("run", "../project/jobs/job.yaml", cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["run_dir"] == f"{project}/runs/quick"
    assert summary["metrics"]["examples"] == 512  # the run's own evaluation read the test split beside the spec
    assert (project / "runs" / "quick" / "model.keras").exists()
    assert list(elsewhere.iterdir()) == [], "no stray runs/ where the command was run"
    evaluated = run_cli("evaluate", project / "jobs" / "job.yaml", cwd=third)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert last_json(evaluated.stdout)["examples"] == 512  # the test split, found beside the spec
    assert list(third.iterdir()) == []


def test_submit_sends_code_from_the_spec_folder_without_importing_it(project: Path, tmp_path: Path) -> None:
    """A TPU VM runs the image: `runner submit` sends the code folder with the job (tests/test_sendcode.py), found
    as validate finds it, never imported; a listed package not installed here is left to the image."""
    spec = write_spec(project, {
        "name": "remote", "model": {"name": "mymodels:build"}, "train": {"loss": "ownpkg.losses:focal"},
        "code": {"packages": ["ownpkg"]},
        "data": {"train": "gs://b/train-*.tfrecord", "eval": None}, "output": {"dir": "gs://b/runs"},
    })
    result = run_cli(
        "submit", spec, "--tpu-type", "v5litepod-8", "--zone", "us-central1-a", "--project", "p",
        "--image", "us-central1-docker.pkg.dev/p/runner/runner:tpu", "--dry-run",
        env=cli_env(RUNNER_STATE_DIR=str(tmp_path / "state"), CLOUDSDK_CONFIG=str(tmp_path / "gcloud")), timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"from code.folder {project}" in result.stderr and "code:   folder/mymodels.py (" in result.stderr
    assert "code.packages 'ownpkg' is not installed here, so it is not sent: the image must have it" in result.stderr
    assert not (project / "imported").exists(), "found and packed, never imported"


@pytest.mark.parametrize(("name", "rule"), [
    (".hidden", "must start with a letter or digit, not '.' (try 'hidden')"),
    ("-job", "must start with a letter or digit, not '-' (try 'job')"),
])
def test_a_name_refused_for_its_first_character_says_so(tmp_path: Path, name: str, rule: str) -> None:
    """Every character of `.hidden` and `-job` is allowed; only where they stand is not: the message says which."""
    path = write_spec(tmp_path, {"name": name})
    result = invoke("validate", path, env=cli_env())
    assert result.returncode == 2, result.stdout
    assert f"{path}:1: name: job name '{name}' {rule}" in result.stderr
