"""What makes two processes run the same job: the resolved spec, the user's code and the image's versions.

Every process of a job of several compares its fingerprint with process 0's right after the join
(runner/device/processes.py `agree`): a process given another batch size, a code folder that differs on one
host or a stale image on one worker would otherwise train a job of its own, hang in a collective of another
shape, or print an accuracy above 1. The code folder's path is left out of the spec (`runner run --code`
unpacks into a fresh folder on each host): its modules' content is compared instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Any

from runner.spec.types import JobSpec

# A code folder is the spec's folder unless set: it may hold run folders and data. Hashing stops here.
MAX_FILES = 5000


def of_job(spec: JobSpec) -> dict[str, Any]:
    """The fingerprint: {"spec": the validated spec as JSON, "code": a hash per code root, "versions": ...}."""
    doc = spec.to_dict()
    code: dict[str, Any] = {}
    if isinstance(doc.get("code"), dict):
        folder = doc["code"].pop("folder", None)
        if folder:
            code["folder"] = tree_hash(folder)
        for name in spec.code.packages:
            found = importlib.util.find_spec(name)
            origin = found.origin if found is not None else None
            code[f"package {name}"] = tree_hash(os.path.dirname(origin)) if origin else "not installed"
    return {"spec": doc, "code": code, "versions": versions()}


def versions() -> dict[str, str]:
    """The runner (its version and the hash of its own modules: a stale image shows), Python and the frameworks
    this process loaded."""
    import runner

    found = {"runner": f"{runner.__version__} ({tree_hash(os.path.dirname(runner.__file__))})",
             "python": sys.version.split()[0]}
    for name in ("jax", "keras", "tensorflow"):
        module = sys.modules.get(name)
        found[name] = getattr(module, "__version__", "loaded, version unknown") if module else "not loaded"
    return found


def tree_hash(folder: str) -> str:
    """The sha256 (first 16 hex digits) of every .py file under `folder`, by path relative to it and content;
    hidden folders and __pycache__ skipped."""
    digest, seen = hashlib.sha256(), 0
    for root, folders, files in os.walk(folder):
        folders[:] = sorted(f for f in folders if not f.startswith(".") and f != "__pycache__")
        for name in sorted(files):
            seen += 1
            if seen > MAX_FILES:
                return digest.hexdigest()[:16] + f" (first {MAX_FILES} files)"
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, folder).encode() + b"\0")
            try:
                with open(path, "rb") as handle:
                    digest.update(handle.read())
            except OSError as exc:
                digest.update(f"unreadable: {exc.strerror}".encode())
    return digest.hexdigest()[:16]
