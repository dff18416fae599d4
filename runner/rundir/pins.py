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
from runner.device import backend, flavour
from runner.spec.train import optimizer_identity
from runner.spec.types import JobSpec

# What the checkpoints mean (precedence 5): a resumed run must not change these.
PINNED_KEYS = (
    "model.name", "model.params",
    "train.optimizer_class", "train.loss", "train.mixed_precision", "train.steps_per_epoch",
    "data.global_batch_size", "data.inputs", "data.label", "data.features", "data.preprocess",
)
FINGERPRINT = "data.fingerprint"
# What wrote the checkpoints (runner/rundir/outputs.py `_check_software`): a tf-keras checkpoint does not restore
# under Keras 3 (ValueError, measured), so the flavour must match; TensorFlow reads checkpoints an older
# TensorFlow wrote, not the other way round, so its version may only rise.
FLAVOUR, TENSORFLOW = "keras.flavour", "tensorflow.version"
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
        FLAVOUR: flavour.active(), TENSORFLOW: tf.__version__, BACKEND: backend.active().name,
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
    """Why checkpoints that `previous` (spec.json) pins cannot be resumed by this process's backend, or None."""
    wrote, runs = (previous.get("pinned") or {}).get(BACKEND, "tensorflow"), backend.active()
    if wrote == runs.name:
        return None
    return (
        f"{path}'s checkpoints were written under the {wrote} backend and this run computes with {runs.name} "
        f"({runs.reason}): a checkpoint of one does not restore under the other. Resume it with "
        f"`--set accelerator.backend={wrote}`, or start this job over with `runner run --fresh` (the folder is "
        "moved aside, not deleted)"
    )


def software_problem(path: str, before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why checkpoints written with `before`'s Keras flavour or TensorFlow cannot be restored by `now`'s, or None."""
    wrote, runs = before.get(FLAVOUR), now[FLAVOUR]
    if wrote and wrote != runs:
        where = {"tf-keras": "TF_USE_LEGACY_KERAS=1 with tf-keras installed",
                 "keras3": "Keras 3, TensorFlow's default (unset TF_USE_LEGACY_KERAS)"}
        return (
            f"{path}'s checkpoints were written with {wrote} and this run trains with {runs}: a checkpoint of one "
            f"does not restore under the other. Resume it with {where[wrote]}, or start this job over with "
            "`runner run --fresh` (the folder is moved aside, not deleted)"
        )
    older = before.get(TENSORFLOW)
    if older and version(now[TENSORFLOW]) < version(older):
        return (
            f"{path}'s checkpoints were written by TensorFlow {older} and this run has {now[TENSORFLOW]}: "
            "TensorFlow reads checkpoints of older versions, not newer ones. Resume it where TensorFlow is "
            f"{older} or newer (docs/image.md), or start over with `runner run --fresh`"
        )
    return None
