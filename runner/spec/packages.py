"""Installed code, as the spec-as-code boundary sees it, without importing it: the folders installed modules
live in (the standard library, site-packages), the distributions of the runner's own environment, and whether a
package a spec lists in code.packages is the user's own (`package_problem`: installed from a folder or a
checkout, or found outside site-packages) or third-party code (from a package index, or the runner's own
requirements). runner/spec/usercode.py asks; docs/specs.md, "A job spec is code", says what for.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import site
import sys
import sysconfig
from importlib.machinery import ModuleSpec

# Third-party packages a spec may list in code.packages, each with why it is trusted. None is: a library's
# functions are reached through a module of your own that imports it (one line), which keeps what a spec can
# call readable in the spec's own code (docs/specs.md, "A job spec is code").
TRUSTED_PACKAGES: dict[str, str] = {}
# Installed with every environment, though no requirement names them.
_BUILD_TOOLS = ("pip", "setuptools", "wheel")


@functools.lru_cache(maxsize=1)
def system_folders() -> tuple[str, ...]:
    """The real paths of the standard library and of every site-packages folder Python imports from."""
    paths = sysconfig.get_paths()
    found = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    found += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    found.append(site.getusersitepackages())
    found += [p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")]
    # Deepest first: a folder is named by the most specific one it lies in.
    return tuple(sorted({os.path.realpath(p) for p in found if p and os.path.isdir(p)}, key=len, reverse=True))


def inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def installed_spec(top: str) -> ModuleSpec | None:
    """The spec Python's own import system would use for the top-level name; finding it runs no module code."""
    try:
        return importlib.util.find_spec(top)
    except (ImportError, ValueError, AttributeError):
        return None


def put_on_path(folder: str, names: list[str]) -> tuple[str | None, str]:
    """Appends `folder` to sys.path; (the first of `names` that Python imports from elsewhere, where: a path or
    "nowhere"), or (None, "") when every name is imported from inside `folder`."""
    if folder not in sys.path:
        sys.path.append(folder)
    importlib.invalidate_caches()
    for name in names:
        spec = installed_spec(name)
        where = (list(spec.submodule_search_locations or []) or [spec.origin or ""]) if spec else [""]
        if spec is None or not inside(os.path.realpath(where[0]), os.path.realpath(folder)):
            return name, where[0] or "nowhere"
    return None, ""


@functools.lru_cache(maxsize=1)
def _runner_environment() -> frozenset[str]:
    """Normalized names of the distributions the runner's environment brings: its requirements with every
    extra, followed through theirs, and the build tools every environment has."""
    seen: set[str] = set()
    todo = ["tpu-job-runner", *_BUILD_TOOLS]
    while todo:
        name = _normalized(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [m.group(0) for r in requires if (m := re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r))]
    return frozenset(seen - {"tpu-job-runner"})


@functools.lru_cache(maxsize=1)
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party(top: str) -> str | None:
    """The distribution of the runner's environment that provides the top-level module `top`, or None."""
    if top in TRUSTED_PACKAGES:
        return None
    providers = _providers().get(top, [])
    return next((d for d in providers if _normalized(d) in _runner_environment()), None)


def package_problem(top: str) -> str | None:
    """Why code.packages may not list `top`, or None: a package of the user's own, or none installed here.

    Refused: a distribution of the runner's environment (third_party), and any other package an installer put
    in place from a package index: its dist-info has no direct_url.json (PEP 610), which pip and uv write for a
    package installed from a local folder, a file or a version-control checkout, never for one from an index.
    The user's own: a package installed from a folder or a checkout (`pip install PATH`, `pip install -e PATH`,
    its direct_url.json says so), or found outside site-packages with no installer's record (PYTHONPATH, a
    source folder). A package in site-packages with no record of how it came is refused too. Nothing is imported:
    Python's finders locate the package, and the metadata beside it is read."""
    if top in TRUSTED_PACKAGES:
        return None
    if (distribution := third_party(top)) is not None:
        return _third_party_reason(top, distribution)
    importlib.invalidate_caches()
    spec = installed_spec(top)
    entry = _search_entry(spec) if spec is not None else None
    if entry is None:
        return None  # not installed here: find_code says so when the spec names it
    installed = [d for d in importlib.metadata.distributions(path=[entry]) if top in _top_levels(d)]
    if any(_from_source(d) is True for d in installed):
        return None
    by_installer = [d for d in installed if d.read_text("INSTALLER") is not None]
    system = next((f for f in system_folders() if inside(os.path.realpath(entry), f)), None)
    if by_installer or (installed and system is not None):
        dist = (by_installer or installed)[0]
        name, version = dist.metadata["Name"], dist.version
        url, installer = _from_source(dist), (dist.read_text("INSTALLER") or "").strip()
        how = (
            f"downloaded from {url}" if isinstance(url, str)
            else f"installed{f' by {installer}' if installer else ''} from a package index (no direct_url.json)"
        )
        return (
            f"code.packages lists {top!r}, the distribution {name!r} {version} in {entry}, {how}: third-party "
            f"code, not yours. {_YOURS}"
        )
    if system is not None:
        return (
            f"code.packages lists {top!r}, in {system} with no record of how it was installed: not yours. {_YOURS}"
        )
    return None  # on PYTHONPATH or in a folder of the user's, not put there by an installer


_YOURS = (
    "Install your own package from its folder (`pip install --no-deps PATH`), or put that folder on PYTHONPATH "
    "or in code.folder; call a library from a module of your own there (docs/specs.md, \"A job spec is code\")"
)


def _search_entry(spec: ModuleSpec) -> str | None:
    """The folder of Python's search path a top-level module was found in (its package's or file's parent)."""
    locations = list(spec.submodule_search_locations or [])
    where = locations[0] if locations else spec.origin if spec.has_location else None
    return os.path.dirname(where) if where else None


def _top_levels(dist: importlib.metadata.Distribution) -> set[str]:
    """The top-level modules a distribution installs: its top_level.txt, else the first part of its files."""
    declared = (dist.read_text("top_level.txt") or "").split()
    if declared:
        return set(declared)
    found = set()
    for file in dist.files or []:
        if len(file.parts) > 1 and file.parts[0] != ".." and not file.parts[0].endswith((".dist-info", ".egg-info")):
            found.add(file.parts[0])
        elif len(file.parts) == 1 and (name := inspect.getmodulename(file.name)):
            found.add(name)
    return found


def _from_source(dist: importlib.metadata.Distribution) -> bool | str | None:
    """What a distribution's direct_url.json (PEP 610) says: True for a local folder or file, or a version
    control checkout; the URL for an archive downloaded from elsewhere; None when it has none (a package index)."""
    text = dist.read_text("direct_url.json")
    if text is None:
        return None
    try:
        direct = json.loads(text)
    except json.JSONDecodeError:
        return None
    url = str(direct.get("url", "")) if isinstance(direct, dict) else ""
    if url.startswith("file:") or isinstance(direct, dict) and "vcs_info" in direct:
        return True
    return url or None


def _third_party_reason(top: str, distribution: str) -> str:
    return (
        f"code.packages lists {top!r}, the third-party distribution {distribution!r} of the runner's own "
        "environment, not a package of yours: import it from a module of your own in code.folder and name that "
        "module's function instead"
    )


def check_package_is_yours(top: str) -> None:
    """ValueError (for the spec loader) when `top` is third-party code (package_problem)."""
    if (problem := package_problem(top)) is not None:
        raise ValueError(problem)
