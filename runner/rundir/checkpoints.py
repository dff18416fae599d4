"""The newest whole checkpoint of a run folder, whichever backend wrote it, read without TensorFlow, JAX or Orbax:
what `runner status`, `runner submit --watch` and the restart records (`step_reached`) show of a job's progress.

`<run>/checkpoints/` holds one of two formats:
  TensorFlow's (runner/rundir/outputs.py, tf.train.CheckpointManager): `ckpt-<step>.index` and
      `ckpt-<step>.data-*` per save, and the index file `checkpoint` (a text proto), which the manager rewrites
      (through `checkpoint.tmp<hex>`) only once a save's files are written. The step its `model_checkpoint_path`
      names is the newest whole one; data files the index does not name are a save cut short.
  Orbax's (runner/rundir/orbax_store.py, a JAX job): a folder `ckpt_<step>` per save. On a local disk Orbax
      writes into `ckpt_<step>.orbax-checkpoint-tmp-<n>` and renames it once whole, so the name alone says it is
      whole; on gs:// (no rename) it writes into `ckpt_<step>/` and puts `commit_success.txt` there last. These
      are the tests of Orbax's own `checkpoint_steps_paths` (orbax/checkpoint/_src/path/step.py, atomicity.py).
Both formats in one folder (which a run refuses: outputs.py, check_backend) give the newer step.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import NamedTuple

from runner import StorageError
from runner.data import storage

FOLDER = "checkpoints"
INDEX = "checkpoint"  # TensorFlow's index file
COMMIT = "commit_success.txt"  # Orbax's mark of a whole step on gs://
_INDEXED = re.compile(r'^model_checkpoint_path:\s*"(?:.*/)?ckpt-(\d+)"', re.MULTILINE)
_ORBAX_STEP = re.compile(r"^ckpt_(\d+)$")


class Saved(NamedTuple):
    """One whole checkpoint: its step, its path, and which store wrote it (`tensorflow` or `orbax`)."""

    step: int
    path: str
    store: str


def newest(run_dir: str, timeout_s: float = 60.0) -> Saved | None:
    """The newest whole checkpoint in `run_dir`'s checkpoints/ (local or gs://), None when there is none.
    StorageError when the bucket cannot be read."""
    folder = posixpath.join(run_dir.rstrip("/"), FOLDER) if storage.is_gcs(run_dir) else os.path.join(run_dir, FOLDER)
    found = _gcs(folder, timeout_s) if storage.is_gcs(folder) else _local(folder)
    return max(found, key=lambda saved: saved.step, default=None)


def newest_step(run_dir: str, timeout_s: float = 60.0) -> int | None:
    saved = newest(run_dir, timeout_s)
    return None if saved is None else saved.step


def _tensorflow(folder: str, index_text: str | None, join) -> list[Saved]:
    match = _INDEXED.search(index_text or "")
    return [Saved(int(match.group(1)), join(folder, f"ckpt-{match.group(1)}"), "tensorflow")] if match else []


def _local(folder: str) -> list[Saved]:
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    index_text = None
    if INDEX in names:
        try:
            with open(os.path.join(folder, INDEX), encoding="utf-8", errors="replace") as handle:
                index_text = handle.read()
        except FileNotFoundError:  # replaced meanwhile by the next save
            index_text = None
    found = _tensorflow(folder, index_text, os.path.join)
    for name in names:
        match = _ORBAX_STEP.match(name)
        if match and os.path.isdir(os.path.join(folder, name)):  # a temporary folder has another name
            found.append(Saved(int(match.group(1)), os.path.join(folder, name), "orbax"))
    return found


def _gcs(folder: str, timeout_s: float) -> list[Saved]:
    from google.api_core import exceptions as api

    bucket_name, prefix = storage.split_gcs(folder.rstrip("/") + "/")
    try:
        client = storage.make_client()
        bucket = client.bucket(bucket_name)
        listing = client.list_blobs(bucket_name, prefix=prefix, delimiter="/", timeout=timeout_s)
        names = {blob.name[len(prefix):] for blob in listing}  # the pages read: the prefixes are known too
        steps = sorted(
            (int(m.group(1)) for p in listing.prefixes if (m := _ORBAX_STEP.match(p[len(prefix):].rstrip("/")))),
            reverse=True,
        )
        index_text = None
        if INDEX in names:
            try:
                index_text = bucket.blob(prefix + INDEX).download_as_text(timeout=timeout_s)
            except api.NotFound:
                index_text = None
        found = _tensorflow(folder, index_text, posixpath.join)
        for step in steps:  # newest first: the first whole one is the answer
            if bucket.blob(f"{prefix}ckpt_{step}/{COMMIT}").exists(timeout=timeout_s):
                found.append(Saved(step, posixpath.join(folder, f"ckpt_{step}"), "orbax"))
                break
        return found
    except api.GoogleAPICallError as exc:
        raise StorageError(f"cannot read {folder}: {exc.code} {exc.message}") from None
    except StorageError as exc:  # no credentials
        raise StorageError(f"cannot read {folder}: {exc}") from None
    except Exception as exc:  # connection refused, DNS, timeouts: the bucket cannot be reached
        raise StorageError(f"cannot read {folder}: {type(exc).__name__}: {exc}") from None
