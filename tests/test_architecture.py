"""The package's shape, enforced: what may import what (docs/architecture.md draws it).

    runner/cli/        the commands                       may import anything
    runner/cloud/ doctor/ prepare/ compare/   the periphery   may import the core and runner/errors-level helpers,
                                                          never the CLI
    runner/*.py        the core (spec -> strategy -> data -> models -> train -> outputs)   imports no periphery

Modules a command must load without TensorFlow (`validate`, `--help`, `submit --dry-run`, the doctor's host
checks) are imported in a fresh interpreter and must leave TensorFlow unloaded.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "runner"
PERIPHERY = ("cli", "cloud", "doctor", "prepare", "compare")


def _module_name(path: Path) -> str:
    parts = path.relative_to(RUNNER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The runner modules a file imports (`from runner import x` counts as runner.x when x is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "runner"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "runner" and not node.level:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _exists(candidate) else node.module)
    return found


def _exists(module: str) -> bool:
    base = RUNNER.parent / Path(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


MODULES = {_module_name(p): p for p in sorted(RUNNER.rglob("*.py"))}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PERIPHERY) else "core"


def test_the_core_imports_nothing_from_the_periphery() -> None:
    offences = [
        f"{module} imports {target}"
        for module, path in MODULES.items()
        if _area(module) == "core" and module != "runner.__main__"
        for target in _imports(path)
        if _area(target) != "core"
    ]
    assert offences == []


def test_only_the_cli_imports_the_cli() -> None:
    offences = [
        f"{module} imports {target}"
        for module, path in MODULES.items()
        if _area(module) != "cli" and module not in ("runner.__main__",)
        for target in _imports(path)
        if _area(target) == "cli"
    ]
    assert offences == []


def test_no_import_cycles_at_module_level() -> None:
    graph = {m: {t for t in _imports(p, top_level_only=True) if t in MODULES and t != m} for m, p in MODULES.items()}
    # A package's __init__ importing its own submodules is how a package exports; not a cycle of responsibilities.
    for module in graph:
        graph[module] = {t for t in graph[module] if not (MODULES[module].name == "__init__.py" and t.startswith(module + "."))}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


TENSORFLOW_FREE = [
    "runner.spec.types", "runner.spec.load", "runner", "runner.device.host", "runner.rundir.timing", "runner.spec.usercode",
    "runner.cli", "runner.cloud.submit", "runner.cloud.logs", "runner.cloud.pricing",
    "runner.doctor", "runner.doctor.checks", "runner.doctor.report", "runner.compare.report",
]


@pytest.mark.parametrize("module", TENSORFLOW_FREE)
def test_modules_loaded_before_tensorflow_do_not_import_it(module: str) -> None:
    code = f"import sys, {module}; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"importing {module} loads TensorFlow"


def test_ls_runner_tells_the_story() -> None:
    """The core stays flat and short; the periphery lives in its packages."""
    packages = sorted(p.name for p in RUNNER.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert packages == sorted(PERIPHERY)
    too_long = [f"{p.relative_to(RUNNER)} ({n} lines)" for p in RUNNER.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450]
    assert too_long == []


def test_the_readme_draws_the_layers_this_file_enforces() -> None:
    """README's diagram: cli, then the other packages of the periphery, then the flat core, nothing else."""
    readme = (RUNNER.parent / "README.md").read_text()
    drawn = re.search(r"^runner/cli/\s+->\s+runner/\{([a-z,]+)\}/\s+->\s+runner/\*\.py", readme, re.M)
    assert drawn, "README.md has no diagram of the layers"
    assert sorted(["cli", *drawn.group(1).split(",")]) == sorted(PERIPHERY)
    assert "tests/test_architecture.py" in readme and "docs/architecture.md" in readme
