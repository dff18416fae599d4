"""The package's shape, enforced: what may import what (docs/architecture.md draws it, README.md sums it up).

Every import counts: at the top of a file, inside a function, under `if TYPE_CHECKING:`. A package may import
its own modules and the layers below it, never a layer above, never a neighbour in its own layer:

    cli                                  the commands
    prepare  doctor  cloud  compare      the periphery: uses the core, never the CLI or each other
    job                                  the story of a job: train, evaluate/predict, matmul
    train                                the fit and what runs inside it
    rundir                               the run folder
    data  device                         the data a job reads; the device it runs on
    spec                                 the job spec
    models                               the built-in models' table
    runner (the package root)            the errors and exit codes every layer raises

Packages that must load without TensorFlow (`validate`, `--help`, `submit --dry-run`, the doctor's host checks)
are imported module by module in a fresh interpreter, which must leave TensorFlow unloaded.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "runner"

# Lowest first. `area` names a package (runner/<area>/), a top-level module (runner/<area>.py) or the root.
LAYERS: list[tuple[str, ...]] = [
    ("root",),
    ("models",),
    ("spec",),
    ("data", "device"),
    ("rundir",),
    ("train",),
    ("job",),
    ("prepare", "doctor", "cloud", "compare"),
    ("cli",),
    ("__main__",),
]
RANK = {area: rank for rank, areas in enumerate(LAYERS) for area in areas}

# Areas none of whose modules may load TensorFlow when imported; and, in areas that do need it, the modules a
# command imports before TensorFlow should load.
TENSORFLOW_FREE_AREAS = ("root", "models", "spec", "cli", "compare")
TENSORFLOW_FREE_MODULES = (
    "runner.data.storage", "runner.device.host", "runner.device.tpus", "runner.device.backend",
    "runner.rundir.timing", "runner.cloud.submit", "runner.cloud.request", "runner.cloud.logs", "runner.cloud.pricing",
    "runner.cloud.jobs", "runner.cloud.codepack", "runner.cloud.codefetch",
    "runner.doctor", "runner.doctor.checks", "runner.doctor.report",
    "runner.train.preemption", "runner.job.startup",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(RUNNER.rglob("*.py"))}


def _area(module: str) -> str:
    parts = module.split(".")
    return "root" if len(parts) == 1 else parts[1]


def _imports(path: Path) -> set[str]:
    """Every runner module a file imports, wherever the import stands (`from runner.x import y` counts as
    runner.x.y when y is a module, else as runner.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "runner"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "runner":
            assert not node.level, f"{path}: relative import"
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
    return found


GRAPH = {module: {t for t in _imports(path) if t != module} for module, path in MODULES.items()}


def test_every_import_names_a_module_that_exists() -> None:
    missing = [f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets if t not in MODULES]
    assert missing == []


def test_every_area_has_a_layer() -> None:
    unplaced = sorted({_area(m) for m in MODULES} - set(RANK))
    assert unplaced == [], f"add {unplaced} to LAYERS (and to docs/architecture.md)"


def test_imports_point_down_the_layers_only() -> None:
    offences = []
    for module, targets in GRAPH.items():
        mine = _area(module)
        for target in targets:
            theirs = _area(target)
            if theirs == mine or (mine == "root" and target == "runner"):
                continue
            if RANK[theirs] >= RANK[mine]:
                offences.append(
                    f"{module} ({mine}, layer {RANK[mine]}) imports {target} ({theirs}, layer {RANK[theirs]})"
                )
    assert offences == []


def test_no_import_cycles_counting_every_import() -> None:
    # A package's __init__ importing its own submodules is how a package exports; not a cycle of responsibilities.
    graph = {
        m: {t for t in targets if not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))}
        for m, targets in GRAPH.items()
    }
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


def test_the_cycle_finder_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    """The test above would pass on a cycle hidden in a function if _imports read top-level imports only."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from runner.spec.types import JobSpec\n\nif False:\n    import runner.models\n")
    assert _imports(source) == {"runner.spec.types", "runner.models"}


def _tensorflow_free() -> list[str]:
    by_area = [m for m in MODULES if _area(m) in TENSORFLOW_FREE_AREAS and m != "runner.__main__"]
    return sorted(set(by_area) | set(TENSORFLOW_FREE_MODULES))


@pytest.mark.parametrize("area", sorted({_area(m) for m in _tensorflow_free()}))
def test_modules_loaded_before_tensorflow_do_not_import_it(area: str) -> None:
    modules = [m for m in _tensorflow_free() if _area(m) == area]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'tensorflow' in sys.modules:\n"
        "        print(name); break\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {result.stdout.strip()} loads TensorFlow"


def test_each_package_says_its_job_and_what_it_may_import() -> None:
    silent = [
        str(p.relative_to(REPO)) for p in sorted(RUNNER.glob("*/__init__.py"))
        if len(ast.get_docstring(ast.parse(p.read_text())) or "") < 40
    ]
    assert silent == []


def test_ls_runner_tells_the_story() -> None:
    """At most twelve entries beside __init__.py and __main__.py; no file longer than 450 lines."""
    entries = sorted(
        p.name for p in RUNNER.iterdir()
        if p.name not in ("__init__.py", "__main__.py", "__pycache__") and not p.name.endswith(".egg-info")
    )
    assert len(entries) <= 12, entries
    lengths = {p.relative_to(RUNNER): len(p.read_text().splitlines()) for p in RUNNER.rglob("*.py")}
    too_long = [f"{path} ({n} lines)" for path, n in lengths.items() if n > 450]
    assert too_long == []


def test_docs_draw_the_layers_this_file_enforces() -> None:
    """docs/architecture.md lists every module and names each area; README.md draws the layers in order."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    unlisted = [
        str(path.relative_to(REPO)) for module, path in MODULES.items()
        if path.name != "__init__.py" and module != "runner.__main__"
        and f"`{path.relative_to(RUNNER).as_posix()}`" not in doc and f"`{path.name}`" not in doc
    ]
    assert unlisted == [], "docs/architecture.md does not list these modules"
    readme = (REPO / "README.md").read_text()
    drawn = re.search(r"^runner/cli/\s+->\s+runner/\{([a-z,]+)\}/\s+->\s+runner/job/\s+->", readme, re.M)
    assert drawn, "README.md has no diagram of the layers"
    assert sorted(drawn.group(1).split(",")) == sorted(LAYERS[RANK["cloud"]])
    assert "tests/test_architecture.py" in readme and "docs/architecture.md" in readme


# The training core's modules that need nothing of TensorFlow but Keras: they import Keras 3 itself (on the job's
# backend), not `tf.keras`, so a JAX job's training loop is TensorFlow-free there.
KERAS_ONLY_MODULES = ("runner.train.progress", "runner.train.limits", "runner.train.preemption",
                      "runner.train.verdict", "runner.device.backend", "runner.rundir.orbax_store",
                      "runner.device.processes")


@pytest.mark.parametrize("module", KERAS_ONLY_MODULES)
def test_the_backend_seam_keeps_tensorflow_out_of_modules_that_need_only_keras(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {name for name in imported if name.split(".")[0] == "tensorflow"}


# --- the engine face: runner/device/engine.py ----------------------------------------------------------------------
# Only the engines and the checkpoint store import jax, jaxlib or orbax, ask Keras's global backend, read
# KERAS_BACKEND or compare a backend's name; every other module asks `accelerator.engine` (or `engine.active()`).
ENGINE_NAMES = frozenset({"jax", "tensorflow", "torch"})
ENGINE_PACKAGES = frozenset({"jax", "jaxlib", "orbax"})
ENGINE_MODULES = frozenset({
    "runner.device.engine", "runner.device.backend", "runner.device.jax_devices", "runner.device.tf_devices",
    "runner.device.processes", "runner.device.cluster",  # the join through JAX's runtime
    "runner.device.sharding", "runner.device.mesh", "runner.device.layout",  # the device mesh and model layout
})
# The checkpoint store's Orbax implementation; its face (rundir/checkpoints.py), the TensorFlow implementation
# (train/tf_store.py) and the module that opens the engine's (train/store.py) need no exemption.
CHECKPOINT_STORE = frozenset({"runner.rundir.orbax_store"})
# The spec validates the backend a user asks for (`accelerator.backend` is its key) before any engine exists.
SPEC_AREA = "spec"


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def engine_violations(source: str, name: str = "<source>") -> list[str]:
    """Where `source` imports an engine's package, asks Keras's global backend, reads KERAS_BACKEND or compares
    a backend's name (a string naming an engine, or anything's `backend.name`)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in ENGINE_PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in ENGINE_PACKAGES:
                found.append(f"{where} imports {node.module}")
        elif isinstance(node, ast.Call) and _dotted(node.func).endswith("backend.backend"):
            found.append(f"{where} asks Keras's global backend ({_dotted(node.func)}())")
        elif isinstance(node, ast.Constant) and node.value == "KERAS_BACKEND":
            found.append(f"{where} reads KERAS_BACKEND")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s for s in sides if isinstance(s, ast.Constant) and s.value in ENGINE_NAMES]
            for side in sides:
                if isinstance(side, (ast.Tuple, ast.List, ast.Set)):
                    named += [e for e in side.elts if isinstance(e, ast.Constant) and e.value in ENGINE_NAMES]
            if isinstance(node.left, ast.Constant) and all(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
                named = []  # "tensorflow" in sys.modules: whether a package is loaded, not which engine computes
            if named or any(_dotted(s).endswith("backend.name") for s in sides):
                found.append(f"{where} compares a backend's name")
    return found


def test_only_the_engines_and_the_checkpoint_store_name_an_engine() -> None:
    exempt = ENGINE_MODULES | CHECKPOINT_STORE
    offences = [
        v for module, path in MODULES.items() if module not in exempt and _area(module) != SPEC_AREA
        for v in engine_violations(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert offences == [], "ask accelerator.engine (runner/device/engine.py) instead"


def test_the_checkpoint_store_exemption_is_only_for_modules_that_need_it() -> None:
    """Each module exempted as the checkpoint store exists and imports orbax (or names an engine)."""
    stale = [m for m in CHECKPOINT_STORE if m not in MODULES or not engine_violations(MODULES[m].read_text())]
    assert stale == []


@pytest.mark.parametrize("planted", [
    "import jax\n",
    "def f():\n    from orbax.checkpoint import CheckpointManager\n",
    "import keras\nif keras.backend.backend() == 'jax':\n    pass\n",
    "import os\nname = os.environ.get('KERAS_BACKEND')\n",
    "def f(accelerator):\n    return accelerator.backend.name != 'jax'\n",
    "def f(accelerator):\n    return accelerator.backend.name in ('jax', 'tensorflow')\n",
    "def f(engine):\n    return 'tensorflow' == engine\n",
])
def test_the_face_rule_finds_a_planted_violation(planted: str) -> None:
    assert engine_violations(planted), planted


def test_the_face_rule_lets_engine_questions_and_loaded_packages_pass() -> None:
    asked = ("import sys\n"
             "def f(accelerator):\n"
             "    if 'tensorflow' in sys.modules and accelerator.engine.checkpoint_format == 'orbax':\n"
             "        return accelerator.engine.input_share(0, 1)\n")
    assert engine_violations(asked) == []


def test_each_engine_answers_the_whole_face_and_the_summary_names_it_as_before() -> None:
    """Every engine of backend.BACKENDS can be made (no question of the face left unanswered), and the accelerator
    carrying it reports `backend` as it always did, with JAX's version under JAX only."""
    import tensorflow as tf

    from runner.device import backend, engine
    from runner.device.accelerator import Accelerator

    for name in backend.BACKENDS:
        made = engine.of(backend.Backend(name, "asked"))
        summary = Accelerator(tf.distribute.get_strategy(), "cpu", 1, engine=made).to_dict()
        assert summary["backend"] == {"name": name, "reason": "asked"}
        assert ("jax" in summary) == made.joins_processes == (name == "jax")
        assert made.input_share(1, 2) == ((1, 2) if made.own_input_share else (0, 1))
        assert made.environment_before_keras(None, {}) == {"KERAS_BACKEND": name}  # what startup plans with
    assert Accelerator(tf.distribute.get_strategy(), "cpu", 1).to_dict()["backend"]["name"] == "tensorflow"
