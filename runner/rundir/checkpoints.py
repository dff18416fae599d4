"""The checkpoint store's face, read without TensorFlow, JAX or Orbax: the one `Store` interface its two formats
implement, the one parser of a checkpoint's step, and the newest whole checkpoint of a run folder whichever format
wrote it (`latest_step`): what `runner status`, `runner submit --watch`, the restart records (`step_reached`), the
weights evaluate and predict report and the tests read of a job's progress.

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

The two implementations of `Store`: runner/train/tf_store.py (TensorFlow's) and runner/rundir/orbax_store.py
(Orbax's); runner/train/saver.py is the one saver over either, runner/train/store.py opens the job's.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import NamedTuple, Protocol

from runner import StorageError
from runner.data import storage

FOLDER = "checkpoints"
INDEX = "checkpoint"  # TensorFlow's index file
COMMIT = "commit_success.txt"  # Orbax's mark of a whole step on gs://
PREFIX = "ckpt"
# A checkpoint's name: TensorFlow's prefix `ckpt-<step>`, Orbax's folder `ckpt_<step>`; the one step parser.
_NAME = re.compile(rf"{PREFIX}([-_])(\d+)")
SEPARATOR = {"tensorflow": "-", "orbax": "_"}
_INDEXED = re.compile(r'^model_checkpoint_path:\s*"([^"]*)"', re.MULTILINE)


def step_of(path: str, store: str | None = None) -> int | None:
    """The step a checkpoint's path names (`.../ckpt-12` or `.../ckpt_12/`), None when it names none; with `store`,
    only a name of that store's format."""
    match = _NAME.fullmatch(posixpath.basename(path.rstrip("/")))
    if match is None or (store is not None and SEPARATOR[store] != match.group(1)):
        return None
    return int(match.group(2))


def name_of(step: int, store: str) -> str:
    return f"{PREFIX}{SEPARATOR[store]}{step}"


class Store(Protocol):
    """One run folder's checkpoints of one model (its weights, optimizer state and step), in one format.

    `latest()` is the newest whole step's path (a save cut short is never one); `save(step)` starts a save and
    returns its path once the state is copied off the device (in the background when `asynchronous`, else whole),
    removing the oldest beyond the store's `keep`; `wait()` waits for the save in flight and raises its error,
    returning when its write ended (time.monotonic, None when not known); `restore(path)` is all or nothing: the
    model's variables and the checkpoint's are matched first (`check`, SpecError naming each difference), and
    nothing is assigned on a mismatch; `close()` ends what the store holds open."""

    name: str  # its format: `tensorflow` or `orbax`, as `Saved.store` and the engine's `checkpoint_format` say
    asynchronous: bool
    why_sync: str | None

    def latest(self) -> str | None: ...

    def save(self, step: int) -> str: ...

    def wait(self) -> float | None: ...

    def restore(self, path: str) -> int: ...

    def check(self, path: str, complete: bool = False) -> object: ...

    def close(self) -> None: ...


class Saved(NamedTuple):
    """One whole checkpoint: its step, its path, and which store wrote it (`tensorflow` or `orbax`)."""

    step: int
    path: str
    store: str


def newest(run_dir: str, timeout_s: float = 60.0, store: str | None = None) -> Saved | None:
    """The newest whole checkpoint in `run_dir`'s checkpoints/ (local or gs://), of either format or only of
    `store`'s (`tensorflow`, `orbax`); None when there is none. StorageError when the bucket cannot be read."""
    folder = posixpath.join(run_dir.rstrip("/"), FOLDER) if storage.is_gcs(run_dir) else os.path.join(run_dir, FOLDER)
    found = _gcs(folder, timeout_s) if storage.is_gcs(folder) else _local(folder)
    found = [saved for saved in found if store is None or saved.store == store]
    return max(found, key=lambda saved: saved.step, default=None)


def latest_step(run_dir: str, timeout_s: float = 60.0, store: str | None = None) -> int | None:
    """The step of the newest whole checkpoint in `run_dir` (of either format, or only `store`'s), None when there
    is none."""
    saved = newest(run_dir, timeout_s, store)
    return None if saved is None else saved.step


def indexed_step(index_text: str | None) -> int | None:
    """The step of the checkpoint TensorFlow's index (`checkpoints/checkpoint`'s text) names as the newest."""
    match = _INDEXED.search(index_text or "")
    return None if match is None else step_of(match.group(1), "tensorflow")


def _tensorflow(folder: str, index_text: str | None, join) -> list[Saved]:
    step = indexed_step(index_text)
    return [] if step is None else [Saved(step, join(folder, name_of(step, "tensorflow")), "tensorflow")]


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
        step = step_of(name, "orbax")
        if step is not None and os.path.isdir(os.path.join(folder, name)):  # a temporary folder has another name
            found.append(Saved(step, os.path.join(folder, name), "orbax"))
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
            (step for p in listing.prefixes if (step := step_of(p[len(prefix):], "orbax")) is not None),
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
            if bucket.blob(f"{prefix}{name_of(step, 'orbax')}/{COMMIT}").exists(timeout=timeout_s):
                found.append(Saved(step, posixpath.join(folder, name_of(step, "orbax")), "orbax"))
                break
        return found
    except api.GoogleAPICallError as exc:
        raise StorageError(f"cannot read {folder}: {exc.code} {exc.message}") from None
    except StorageError as exc:  # no credentials
        raise StorageError(f"cannot read {folder}: {exc}") from None
    except Exception as exc:  # connection refused, DNS, timeouts: the bucket cannot be reached
        raise StorageError(f"cannot read {folder}: {type(exc).__name__}: {exc}") from None
