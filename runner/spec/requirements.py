"""`code.requirements`: extra pip packages a job's own code imports, installed before the job runs, as SkyPilot's
`setup:` installs them (docs/specs.md, "Extra packages").

Each entry is one pinned requirement, `NAME==VERSION`, optionally with pip's hashes (`NAME==VERSION
--hash=sha256:HEX`; once one entry has a hash every entry needs one: pip's --require-hashes mode). Refused at
spec load, naming the entry: anything unpinned (`>=`, `~=`, no version, a URL, a marker) and any package the
runner's own environment pins (TensorFlow, JAX, Keras, Orbax, NumPy... every distribution tpu-job-runner
requires, with every extra, followed through their own installed requirements, and pip, setuptools, wheel;
read from the installed metadata, and from requirements.lock where the checkout has one): installed beside
them, another version would change what the runner runs on.

`install` runs `pip install --no-deps --target FOLDER` with the entries (so pip installs exactly what is
listed, never a new version of the runner's own packages: a package's own dependencies are listed too, as a
hash-pinned requirements file lists them), into a folder named by the sha256 of the entries under
$XDG_CACHE_HOME/runner/requirements (else ~/.cache/...): the same list is installed once per machine (in a
container, once per container). pip reads its own settings from the environment (PIP_INDEX_URL,
PIP_FIND_LINKS, PIP_NO_INDEX, pip.conf). `use` appends the folder to sys.path, never in front: it adds
packages, it replaces none; a package of the folder that Python would import from elsewhere is refused.
Imports no TensorFlow.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from runner import SpecError
from runner.spec.packages import _normalized, _runner_environment, put_on_path

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_PINNED = re.compile(rf"(?P<name>{_NAME})(?:\[[A-Za-z0-9._,\s-]*\])?\s*===?\s*(?P<version>[A-Za-z0-9.+!_-]+)"
                     r"(?P<hashes>(?:\s+--hash[=\s](?:sha256|sha384|sha512):[0-9a-fA-F]+)*)")
LOCK = Path(__file__).resolve().parents[2] / "requirements.lock"
INSTALL_TIMEOUT_S = 1800.0
MARKER = ".runner-requirements.json"  # written last: a folder without it is an install that did not finish


@functools.lru_cache(maxsize=1)
def runner_pins() -> dict[str, str]:
    """Normalized name -> where it is pinned: the runner's environment (installed metadata) and requirements.lock."""
    pins = {name: "the runner's environment (tpu-job-runner's requirements)" for name in _runner_environment()}
    if LOCK.is_file():
        for line in LOCK.read_text().splitlines():
            if found := re.match(rf"({_NAME})==", line.strip()):
                pins.setdefault(_normalized(found.group(1)), LOCK.name)
    return pins


def check_requirement(entry: str) -> str:
    """One entry of code.requirements, checked (ValueError for the spec loader), spaces normalized."""
    text = " ".join(entry.split())
    found = _PINNED.fullmatch(text)
    if found is None:
        raise ValueError(f"{entry!r} is not pinned: write NAME==VERSION (e.g. tinyextra==1.0), optionally with "
                         "--hash=sha256:HEX; ranges, URLs and markers are refused so that every run installs the "
                         "same code")
    name = _normalized(found.group("name"))
    if name in runner_pins():
        import importlib.metadata

        try:
            have = f" {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            have = ""
        raise ValueError(f"{entry!r} would replace {name}{have}, which {runner_pins()[name]} pins: the runner runs "
                         f"on its own {name}; remove it from code.requirements")
    return text


def check_requirements(entries: tuple[str, ...]) -> tuple[str, ...]:
    """The whole list: each entry pinned, no name twice, hashes on all entries or none."""
    names = [_normalized(_PINNED.fullmatch(e).group("name")) for e in entries]  # type: ignore[union-attr]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} listed more than once: keep one pinned entry each")
    hashed = [bool(_PINNED.fullmatch(e).group("hashes")) for e in entries]  # type: ignore[union-attr]
    if any(hashed) and not all(hashed):
        bare = [e for e, h in zip(entries, hashed, strict=True) if not h]
        raise ValueError(f"{', '.join(bare)} {'has' if len(bare) == 1 else 'have'} no --hash while another entry "
                         "has one: pip then requires a hash for every entry (--require-hashes); add them")
    return entries


def key(entries: tuple[str, ...]) -> str:
    """The sha256 of the list as installed (order kept): the cache folder's name."""
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "runner" / "requirements"


def describe(entries: tuple[str, ...], container: bool = False) -> str:
    """What `run` (and, `container`: `submit`, for the job's container) says about them: each entry, how it is
    pinned, where pip takes it from and where it goes."""
    hashed = "hash-checked" if _PINNED.fullmatch(entries[0]).group("hashes") else "version-pinned"  # type: ignore[union-attr]
    names = "; ".join(e.split(" --hash")[0] for e in entries)
    if container:
        source = ("in the job's container before the job starts, with pip from PyPI (the image's pip settings; none "
                  "of this machine's), into a folder cached per requirements hash: the TPU VM must reach PyPI "
                  "(with --internal-ips, through Cloud NAT)")
    else:
        index = os.environ.get("PIP_INDEX_URL") or ("no index" if os.environ.get("PIP_NO_INDEX") else "PyPI")
        links = f" and {os.environ['PIP_FIND_LINKS']}" if os.environ.get("PIP_FIND_LINKS") else ""
        source = f"with pip from {index}{links} into {cache_root()}/{key(entries)[:16]}, once per requirements hash"
    return (f"code.requirements: {names} ({hashed}, without their dependencies), installed {source}")


def install(entries: tuple[str, ...], root: Path | None = None) -> tuple[Path, bool]:
    """(the folder holding the entries installed, whether it was there already). SpecError (exit 2) when pip
    cannot install them, with pip's last lines."""
    root = root or cache_root()
    folder = root / key(entries)[:16]
    if (folder / MARKER).is_file():
        return folder, True
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # a container user without a home of its own: the temporary folder, for this container
        root = Path(tempfile.gettempdir()) / "runner" / "requirements"
        root.mkdir(parents=True, exist_ok=True)
        folder = root / folder.name
        if (folder / MARKER).is_file():
            return folder, True
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
    try:
        listed = work / "requirements.txt"
        listed.write_text("\n".join(entries) + "\n")
        target = work / "site"
        command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
                   "--target", str(target), "--requirement", str(listed)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SpecError(f"code.requirements: pip did not finish within {INSTALL_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            said = "\n    ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
            raise SpecError(f"code.requirements: pip could not install {'; '.join(entries)}:\n    {said}\n"
                            "  check each NAME==VERSION (and its --hash) on the index pip uses (PIP_INDEX_URL)")
        (target / MARKER).write_text(json.dumps({"requirements": list(entries)}))
        try:
            os.replace(target, folder)  # whole or not at all; another process may have won the race
        except OSError:
            if not (folder / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder, False


def use(folder: Path) -> tuple[str, ...]:
    """Appends the folder to sys.path; refuses a top-level package of it that Python imports from elsewhere."""
    place = str(folder)
    tops = sorted(p.name.removesuffix(".py") for p in folder.iterdir()
                  if not p.name.startswith((".", "_")) and not p.name.endswith((".dist-info", ".data"))
                  and (p.is_dir() or p.suffix == ".py") and p.name != "bin")
    top, where = put_on_path(place, tops)
    if top is not None:
        raise SpecError(f"code.requirements installed {top!r} in {place}, but Python imports {top!r} from "
                        f"{where}: a package of that name is already installed; remove the entry that brings it")
    return tuple(tops)
