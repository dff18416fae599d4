"""The doctor's `versions` check: the installed engine against runner/doctor/known_good.json and jax's own pins.

Read from distribution metadata alone: nothing is imported, so a broken install cannot take the doctor down.
On a TPU the engine is Keras on JAX (the TPU image, docs/image.md): jax's `tpu` extra names the jaxlib and the
libtpu that jax release was built with, and those two must agree with it; TensorFlow is there for tf.data
only, as tensorflow-cpu. tensorflow-tpu is retired: Google's TensorFlow TPU runtimes stop at 2.18, TPU7x runs
no TensorFlow, and its libtpu beside jax's would fight over the TPU.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from runner.doctor.checks import Check

KNOWN_GOOD = Path(__file__).with_name("known_good.json")
TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow", "tensorflow-cpu", "tensorflow-tpu", "tensorflow-gpu", "tensorflow-intel",
    "tf-nightly", "tf-nightly-cpu", "tf-nightly-tpu",
)
RETIRED_ON_TPU = ("tensorflow-tpu", "tf-nightly-tpu")
# What jax's `tpu` extra pins beside jax itself.
TPU_EXTRA_PINS = ("jaxlib", "libtpu")
_WATCHED = (*TENSORFLOW_DISTRIBUTIONS, "keras", "jax", "jaxlib", "libtpu", "libtpu-nightly")


def installed_versions(paths: list[str] | None = None) -> dict[str, str]:
    """Versions of the distributions that decide whether the engine starts, read from their metadata."""
    found: dict[str, str] = {}
    dists = importlib.metadata.distributions(path=paths) if paths is not None else importlib.metadata.distributions()
    for dist in dists:
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name in _WATCHED and name not in found:  # the first on the path wins, as it does for imports
            found[name] = dist.version
    return found


def tpu_extra(paths: list[str] | None = None) -> list[str]:
    """What the installed jax's `tpu` extra requires of jaxlib and libtpu (its own Requires-Dist), [] without jax."""
    dists = importlib.metadata.distributions(name="jax", **({"path": paths} if paths is not None else {}))
    dist = next(iter(dists), None)
    wanted = []
    for text in (dist.requires or []) if dist else []:
        requirement = Requirement(text)
        marker = requirement.marker
        extra_only = marker is not None and marker.evaluate({"extra": "tpu"}) and not marker.evaluate({"extra": ""})
        if canonicalize_name(requirement.name) in TPU_EXTRA_PINS and extra_only:
            wanted.append(f"{requirement.name}{requirement.specifier}")
    return wanted


def _unmet(requirements: list[str], versions: dict[str, str]) -> list[str]:
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        have = versions.get(canonicalize_name(requirement.name))
        if have is None:
            problems.append(f"{requirement.name} is not installed (wants {text})")
        elif not requirement.specifier.contains(have, prereleases=True):
            problems.append(f"{requirement.name} {have} (wants {text})")
    return problems


def _jax_on_tpu(versions: dict[str, str], paths: list[str] | None, install: str) -> Check | None:
    """A fail when jax, jaxlib and libtpu cannot start a TPU together; None when they agree with jax's extra."""
    jax = versions.get("jax")
    if jax is None:
        return Check("versions", "fail", "a TPU job runs Keras on JAX, and jax is not installed",
                     f"run the TPU image, or pip install {install}")
    fix = f'pip install "jax[tpu]=={jax}" (its `tpu` extra pins the matching jaxlib and libtpu), or run the TPU image'
    wanted = tpu_extra(paths)
    if not any(Requirement(text).name == "libtpu" for text in wanted):
        return Check("versions", "fail", f"jax {jax}'s metadata names no libtpu in its `tpu` extra", fix)
    problems = _unmet(wanted, versions)
    if problems:
        evidence = f"{'; '.join(problems)}: jax {jax}'s `tpu` extra pins {', '.join(wanted)}"
        if "libtpu" not in versions:
            evidence += "; without libtpu JAX has no TPU runtime to load and runs on the CPU"
        return Check("versions", "fail", evidence, fix)
    return None


def check_versions(tpu_wanted: bool, paths: list[str] | None = None, table: Path = KNOWN_GOOD) -> Check:
    """Python, TensorFlow, Keras, jax, jaxlib and libtpu against the known-good table; a TPU needs JAX's TPU set."""
    versions = {**installed_versions(paths), "python": platform.python_version()}
    combos = json.loads(table.read_text())["combos"]
    shown = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    data: dict[str, Any] = {"versions": versions}
    tensorflows = [name for name in TENSORFLOW_DISTRIBUTIONS if name in versions]
    tpu_install = " or ".join(row["install"] for row in combos if row["platform"] == "tpu")
    every = " or ".join(f"pip install {row['install']}" for row in combos)
    retired = [name for name in tensorflows if name in RETIRED_ON_TPU]
    if retired:
        evidence = (f"{retired[0]} {versions[retired[0]]} is installed: TensorFlow no longer drives TPUs here "
                    "(Google's TensorFlow TPU runtimes stop at 2.18, TPU7x runs none); the TPU engine is Keras on JAX, "
                    f"with tensorflow-cpu for tf.data ({shown})")
        action = f"run the TPU image, or pip uninstall -y {' '.join(retired)}, then pip install {tpu_install}"
        return Check("versions", "fail", evidence, action, data=data)
    if not tensorflows:
        evidence = f"no TensorFlow distribution is installed; the input pipeline is tf.data ({shown})"
        return Check("versions", "fail", evidence, every, data=data)
    if len(tensorflows) > 1:
        return Check(
            "versions", "fail",
            f"{len(tensorflows)} TensorFlow distributions share one environment ({', '.join(tensorflows)}): "
            "the one installed last overwrote the other's files",
            f"pip uninstall -y {' '.join(tensorflows)}, then install one",
            data=data,
        )
    # libtpu installed means a TPU image, TPU or not: its set is judged as the TPU would see it.
    on_tpu = tpu_wanted or "libtpu" in versions
    if on_tpu and (broken := _jax_on_tpu(versions, paths, tpu_install)):
        broken.evidence, broken.data = f"{broken.evidence} ({shown})", data
        if tpu_wanted and "libtpu" not in versions:
            broken.evidence = f"a TPU is wanted, but {broken.evidence}"
        return broken
    name = tensorflows[0]
    rows = [row for row in combos if row["platform"] == ("tpu" if on_tpu else "cpu")]
    rows = [row for row in rows if not _unmet(row["requires"][:1], versions)]
    if not rows:
        return Check(
            "versions", "warn", f"{name} {versions[name]} is not in {table.name} ({shown})",
            f"{f'pip install {tpu_install}' if on_tpu else every}, or add this combination once a job has run on it",
            data=data,
        )
    row = min(rows, key=lambda r: len(_unmet(r["requires"], versions)))
    data["known_good"] = row["requires"]
    problems = _unmet(row["requires"], versions)
    if not problems:
        return Check("versions", "ok", f"{shown}: known good in {table.name} (checked {row['checked']})", data=data)
    evidence = f"{'; '.join(problems)} with {name} {versions[name]}: a combination nobody has tried yet"
    return Check("versions", "warn", evidence, f"pip install {row['install']} (see {table.name})", data=data)
