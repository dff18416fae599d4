"""The job spec: defaults declared once, every job file valid, every bad spec refused with file:line and key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.errors import SpecError
from runner.spec import JobSpec
from runner.specfile import load_spec
from tests.conftest import REPO, run_cli

BAD = sorted((Path(__file__).parent / "specs" / "bad").glob("*.yaml"))


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


def test_a_file_holding_only_a_name_gets_every_default(tmp_path: Path) -> None:
    path = tmp_path / "minimal.yaml"
    path.write_text("name: minimal\n")
    spec = load_spec(path)
    paths = {"data": {"train", "eval"}, "output": {"dir"}, "code": {"folder"}}
    assert spec.model_dump(exclude={"name": True, **paths}) == JobSpec(name="minimal").model_dump(exclude={"name": True, **paths})
    # The default paths are relative to the spec file, as a spec's own paths are.
    assert spec.data.train == f"{tmp_path}/data/mnist/train-*.tfrecord"
    assert spec.run_dir == f"{tmp_path}/runs/minimal"
    assert spec.code.folder == str(tmp_path)


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: job\n")
    spec = load_spec(path, ["train.epochs=3", "data.train=gs://b/train-*.tfrecord", "accelerator.kind=cpu"])
    assert (spec.train.epochs, spec.data.train, spec.accelerator.kind) == (3, "gs://b/train-*.tfrecord", "cpu")
    with pytest.raises(SpecError, match=r"--set 'train\.epohcs=3': train\.epohcs: unknown key 'epohcs'; did you mean 'epochs'"):
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
    ok = run_cli("validate", REPO / "jobs" / "mnist_cnn.yaml", "--set", "train.epochs=2", timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert '"epochs": 2' in ok.stdout
    bad = run_cli("validate", Path(__file__).parent / "specs" / "bad" / "typo_key.yaml", timeout=60)
    assert bad.returncode == 2
    assert "typo_key.yaml:4: train.epoch: unknown key 'epoch'; did you mean 'epochs'?" in bad.stderr
    assert "Traceback" not in bad.stderr + bad.stdout
    missing = run_cli("validate", tmp_path / "nope.yaml", timeout=60)
    assert missing.returncode == 2
    assert "nope.yaml" in missing.stderr


def test_validate_never_imports_tensorflow() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from runner.cli import app\n"
        f"result = CliRunner().invoke(app, ['validate', {str(REPO / 'jobs' / 'mnist_cnn.yaml')!r}])\n"
        "assert result.exit_code == 0, result.output\n"
        "print('tensorflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
