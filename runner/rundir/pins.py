"""What a run folder's checkpoints mean (runner/rundir/outputs.py, resume precedence 5): the spec keys a resumed
run must not change, and the training data's fingerprint.

The optimizer is pinned by its class (its slot variables are in the checkpoints), not by its hyperparameters:
a changed learning rate, schedule or weight decay is applied on resume (runner/train/build.py `restore`).
Folders written before that pinned `train.optimizer` and `train.learning_rate`; keys one side lacks are not
compared.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

import tensorflow as tf

from runner.data import pipeline
from runner.device import backend
from runner.spec.train import optimizer_identity
from runner.spec.types import JobSpec

# What the checkpoints mean (precedence 5): a resumed run must not change these.
PINNED_KEYS = (
    "model.name", "model.params",
    "train.optimizer_class", "train.loss", "train.mixed_precision", "train.steps_per_epoch",
    "data.global_batch_size", "data.inputs", "data.label", "data.features", "data.preprocess",
)
FINGERPRINT = "data.fingerprint"
# What wrote the checkpoints (runner/rundir/outputs.py `_check_software`). The Keras flavour is always keras3 now;
# older runners' folders may say tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1), whose checkpoints do not restore
# under Keras 3 (ValueError, measured): `backend_problem` refuses them. TensorFlow reads checkpoints an older
# TensorFlow wrote, not the other way round, so its version may only rise.
FLAVOUR, TENSORFLOW = "keras.flavour", "tensorflow.version"
KERAS3 = "keras3"
# The backend that wrote them (runner/device/backend.py): TensorFlow checkpoints and Orbax's are different
# formats of different variable sets. Folders written before backends were chosen are TensorFlow's.
BACKEND = "keras.backend"


def data_fingerprint(shards: pipeline.Shards) -> str:
    """The training data's identity: the manifest's sha256 and record count of each shard the glob
    matched, and the features; not where the shards are, nor the sizes (the sha256 fixes them, and a manifest
    that gains them through `runner verify --record-sizes` still describes the same data)."""
    entries = {e["file"]: e for split in shards.manifest.get("splits", {}).values() for e in split.get("shards", [])}
    listed = [
        {key: entries.get(posixpath.basename(f), {}).get(key) for key in ("file", "records", "sha256")}
        for f in shards.files
    ]
    identity = {"features": shards.manifest.get("features"), "shards": sorted(listed, key=lambda e: str(e["file"]))}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def pinned(spec: JobSpec, fingerprint: str | None) -> dict[str, Any]:
    doc = spec.to_dict()
    doc["train"]["optimizer_class"] = optimizer_identity(spec.train)  # its slots are in the checkpoints
    return {
        **{key: dotted(doc, key) for key in PINNED_KEYS}, FINGERPRINT: fingerprint,
        FLAVOUR: KERAS3, TENSORFLOW: tf.__version__, BACKEND: backend.active().name,
    }


def version(text: str) -> tuple[int, ...]:
    """'2.21.0' -> (2, 21, 0); a suffix such as 'rc1' or '+cpu' is ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def dotted(doc: dict[str, Any], key: str) -> Any:
    section, _, name = key.partition(".")
    return (doc.get(section) or {}).get(name)


def show(value: Any) -> str:
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return value[:12]
    return repr(value)


def backend_problem(path: str, previous: dict[str, Any]) -> str | None:
    """Why checkpoints that `previous` (spec.json) pins cannot be resumed by this process's Keras and backend, or
    None. tf-keras's are named first: no backend restores them, so `--set accelerator.backend` would not help."""
    pins = previous.get("pinned") or {}
    if pins.get(FLAVOUR) == "tf-keras":
        return (
            f"{path}'s checkpoints were written by tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1 under an older runner): "
            "tf-keras is no longer supported, and Keras 3 cannot restore its checkpoints. Start this job over "
            "with `runner run --fresh` (the folder is moved aside, not deleted), or choose a new job name"
        )
    wrote, runs = pins.get(BACKEND, "tensorflow"), backend.active()
    if wrote == runs.name:
        return None
    return (
        f"{path}'s checkpoints were written under the {wrote} backend and this run computes with {runs.name} "
        f"({runs.reason}): a checkpoint of one does not restore under the other. Resume it with "
        f"`--set accelerator.backend={wrote}`, or start this job over with `runner run --fresh` (the folder is "
        "moved aside, not deleted)"
    )


def software_problem(path: str, before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why checkpoints written with `before`'s TensorFlow cannot be restored by `now`'s, or None (their Keras and
    backend: `backend_problem`)."""
    older = before.get(TENSORFLOW)
    if older and version(now[TENSORFLOW]) < version(older):
        return (
            f"{path}'s checkpoints were written by TensorFlow {older} and this run has {now[TENSORFLOW]}: "
            "TensorFlow reads checkpoints of older versions, not newer ones. Resume it where TensorFlow is "
            f"{older} or newer (docs/image.md), or start over with `runner run --fresh`"
        )
    return None
