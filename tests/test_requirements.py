"""`code.requirements`: extra pip packages a job's code imports (runner/spec/requirements.py). Each entry pinned,
none the runner pins; installed with the real pip, offline, from a wheel this test writes (`PIP_NO_INDEX=1`,
`PIP_FIND_LINKS=DIR`: pip's own settings, as a user's private index would be), into a folder cached per
requirements hash; `runner run` installs them before the job's code imports them; `submit --dry-run` names them."""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from runner import SpecError
from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke


def write_wheel(folder: Path, name: str = "tinyextra", version: str = "1.0", body: str = "OK = True\n") -> Path:
    """A pure-Python wheel of one module, as a build backend writes it (METADATA, WHEEL, RECORD)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def record(text: str) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        return f"sha256={digest},{len(text.encode())}"

    files[f"{dist}/RECORD"] = "".join(f"{path},{record(text)}\n" for path, text in files.items()) + f"{dist}/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


@pytest.fixture
def offline(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """pip pointed at a folder holding the wheel and at no index; the cache under the test's folder."""
    wheels = tmp_path / "wheels"
    write_wheel(wheels)
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def validate(tmp_path: Path, requirements: list[str]):
    spec = write_spec(tmp_path, {"name": "extra", "code": {"requirements": requirements}})
    return invoke("validate", spec, "--no-data")


@pytest.mark.parametrize("entry, said", [
    ("tinyextra", "'tinyextra' is not pinned: write NAME==VERSION"),
    ("tinyextra>=1.0", "'tinyextra>=1.0' is not pinned"),
    ("tinyextra @ https://example.invalid/t.whl", "is not pinned"),
    ("numpy==1.0", "'numpy==1.0' would replace numpy "),
    ("tensorflow-cpu==2.0", "would replace tensorflow-cpu "),
    ("jax==0.4.1", "would replace jax "),
    ("Keras==3.0.0", "would replace keras "),
    ("orbax_checkpoint==0.1", "would replace orbax-checkpoint "),
])
def test_an_unpinned_entry_or_one_the_runner_pins_is_refused_at_load(tmp_path, entry, said):
    refused = validate(tmp_path, [entry])
    assert refused.returncode == 2, refused.stderr
    assert "code.requirements" in refused.stderr and said in refused.stderr, refused.stderr


def test_hashes_on_some_entries_only_and_a_name_twice_are_refused(tmp_path):
    half = validate(tmp_path, ["tinyextra==1.0 --hash=sha256:" + "a" * 64, "other==2.0"])
    assert half.returncode == 2 and "other==2.0 has no --hash while another entry has one" in half.stderr
    twice = validate(tmp_path, ["tinyextra==1.0", "TinyExtra==1.1"])
    assert twice.returncode == 2 and "tinyextra listed more than once" in twice.stderr
    assert validate(tmp_path, ["tinyextra==1.0", "other===2.0"]).returncode == 0


def test_pip_installs_them_once_per_hash_and_they_join_the_path_after_the_image(offline, tmp_path):
    import sys

    from runner.spec import requirements

    folder, cached = requirements.install(("tinyextra==1.0",))
    assert not cached and folder.parent == Path(offline["XDG_CACHE_HOME"]) / "runner" / "requirements"
    assert (folder / "tinyextra" / "__init__.py").read_text() == "OK = True\n"
    again, cached = requirements.install(("tinyextra==1.0",))
    assert (again, cached) == (folder, True), "the same list is not installed twice"
    try:
        assert requirements.use(folder) == ("tinyextra",)
        assert sys.path[-1] == str(folder), "appended, never in front of the image's packages"
    finally:
        sys.path.remove(str(folder))
    wheel = next((tmp_path / "wheels").glob("*.whl"))
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()
    hashed, _ = requirements.install((f"tinyextra==1.0 --hash=sha256:{good}",))
    assert hashed != folder and (hashed / "tinyextra").is_dir()
    with pytest.raises(SpecError) as wrong:
        requirements.install((f"tinyextra==1.0 --hash=sha256:{'0' * 64}",))
    assert "pip could not install tinyextra==1.0 --hash=sha256:000" in str(wrong.value)
    assert "HASH" in str(wrong.value).upper() and wrong.value.exit_code == 2
    with pytest.raises(SpecError, match="pip could not install tinyextra==9.9"):
        requirements.install(("tinyextra==9.9",))


def test_runner_run_installs_them_before_the_jobs_code_imports_them(offline, mnist_job, tmp_path):
    (tmp_path / "prep.py").write_text("import tinyextra\n\n\ndef identity(batch):\n    assert tinyextra.OK\n"
                                      "    return batch\n")
    spec = mnist_job("extra", data={"preprocess": "prep:identity"}, train={"epochs": 1, "allow_chance": True},
                     code={"requirements": ["tinyextra==1.0"]})
    result = run_cli("run", spec, env=cli_env(**offline))
    assert result.returncode == 0, result.stderr
    assert last_json(result.stdout)["status"] == "succeeded"
    cache = f"{offline['XDG_CACHE_HOME']}/runner/requirements/"
    assert ("code.requirements: tinyextra==1.0 (version-pinned, without their dependencies), installed with pip from "
            f"no index and {offline['PIP_FIND_LINKS']} into {cache}") in result.stderr
    assert "code.requirements: installed in " in result.stderr and "tinyextra" in result.stderr
    without = run_cli("run", mnist_job("bare", data={"preprocess": "prep:identity"}), env=cli_env(**offline))
    assert without.returncode != 0 and "tinyextra" in without.stderr, "the job's code needs the extra package"


def test_submit_names_them_and_where_the_container_takes_them_from(tmp_path):
    from tests.support.cloud import IMAGE, PROJECT, ZONE

    spec = write_spec(tmp_path, {
        "name": "extra", "data": {"train": "gs://b/data/train-*.tfrecord", "eval": None},
        "output": {"dir": "gs://b/runs"}, "code": {"requirements": ["tinyextra==1.0"]},
    })
    dry = invoke("submit", spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT, "--image", IMAGE,
                 "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert ("code.requirements: tinyextra==1.0 (version-pinned, without their dependencies), installed in the job's "
            "container before the job starts, with pip from PyPI") in dry.stderr, dry.stderr


def test_a_package_python_imports_from_elsewhere_is_named_with_where(tmp_path):
    """code.requirements and code.packages both append a folder to sys.path and refuse a name Python would import
    from elsewhere (runner/spec/packages.py `put_on_path`): the stdlib's `json` is never replaced by a folder's."""
    from runner.spec.packages import put_on_path

    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    (tmp_path / "fresh_name_of_a_test.py").write_text("")
    try:
        assert put_on_path(str(tmp_path), ["fresh_name_of_a_test"]) == (None, "")
        name, where = put_on_path(str(tmp_path), ["fresh_name_of_a_test", "json"])
        assert name == "json" and where.endswith("json") and str(tmp_path) not in where, where
    finally:
        sys.path.remove(str(tmp_path))
