"""Reading what runs left behind, without TensorFlow: a summary (any schema version this runner knows,
upgraded to the current form) and the resolved spec.json beside it, local or gs:// (google-cloud-storage), so
`runner report` and a sweep's check for finished variants start in a second.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

from runner import DataError
from runner.data import storage
from runner.rundir.recorded import Recorded, TimingRead
from runner.rundir.timing import PHASES

READABLE_VERSIONS = (1, 2)
# Set by `upgrade` on a summary it brought from an older version: the version it was read from.
UPGRADED_FROM = "read_from_schema_version"


class SummaryError(DataError):
    """A path that holds no summary this runner can read; the message says which and why."""


def read_text(path: str) -> str:
    """A local file, or a gs:// object read with google-cloud-storage: no TensorFlow, so a report (and a
    sweep's check for finished variants) starts in a second. FileNotFoundError when there is none."""
    if not storage.is_gcs(path):
        return Path(path).read_text()
    from google.api_core import exceptions as api_exceptions

    bucket, name = storage.split_gcs(path)
    try:
        return storage.make_client().bucket(bucket).blob(name).download_as_text(timeout=_GCS_TIMEOUT_S)
    except api_exceptions.NotFound:
        raise FileNotFoundError(path) from None
    except api_exceptions.GoogleAPICallError as exc:  # permission, network: say so instead of a traceback
        raise SummaryError(f"{path}: cannot read from the bucket: {exc.message or exc}") from None


_GCS_TIMEOUT_S = 60.0


def is_dir(path: str) -> bool:
    if not storage.is_gcs(path):
        return Path(path).is_dir()
    bucket, name = storage.split_gcs(path)
    if not name:
        return True
    try:
        return bool(list(storage.make_client().list_blobs(bucket, prefix=name.rstrip("/") + "/", max_results=1)))
    except Exception:  # noqa: BLE001 - an unreadable bucket: reading the path says why
        return False


def summary_path(source: str) -> str:
    """A run folder's summary.json, or the file itself."""
    source = source.rstrip("/") or "/"
    return posixpath.join(source, "summary.json") if is_dir(source) else source


def read_summary(source: str) -> dict[str, Any]:
    """The summary at `source` in the current form (schema_version 2), upgraded if older."""
    path = summary_path(source)
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise SummaryError(
            f"{path}: no such file; pass a run folder (holding summary.json) or a summary file"
        ) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise SummaryError(f"{path}: cannot be read as a summary ({type(exc).__name__})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        # A saved stdout of `runner run`: the summary is its last line.
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            doc = json.loads(lines[-1])
        except (json.JSONDecodeError, IndexError):
            raise SummaryError(
                f"{path}: not JSON; a summary is summary.json or the last stdout line of `runner run`"
            ) from None
    return upgrade(doc, path)


def upgrade(doc: Any, path: str) -> dict[str, Any]:
    """Brings a summary of an older schema_version to the current form; refuses versions it does not know."""
    said = Recorded.of(doc)
    if said is None or said.timing is None or said.status is None:
        raise SummaryError(f"{path}: not a runner summary (no `status` and `timing`)")
    version = said.schema_version
    if version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and version > max(READABLE_VERSIONS)
        raise SummaryError(
            f"{path}: schema_version {version!r} cannot be read: this runner reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}" + ("; upgrade runner to read it" if newer else "")
        )
    if version == 1:
        doc = _from_v1(doc, said.times)
    return doc


def read_from_version(doc: dict[str, Any]) -> int | None:
    """The schema_version a summary was written in, before `upgrade` brought it to the current form."""
    return doc.get(UPGRADED_FROM, (Recorded.of(doc) or Recorded()).schema_version)


def _from_v1(doc: dict[str, Any], said: TimingRead) -> dict[str, Any]:
    """Version 1 had no import/run-folder phases and no input wait; its epoch seconds included
    checkpoint saves made inside the epoch. What it did not record stays None, never guessed."""
    doc = json.loads(json.dumps(doc))
    timing = doc["timing"]
    for name in PHASES:
        timing.setdefault(f"{name}_s", None)
    phases = [timing[f"{n}_s"] for n in PHASES if isinstance(timing[f"{n}_s"], (int, float))]
    total = said.total_s
    timing["unaccounted_s"] = None if total is None else round(total - sum(phases), 4)
    timing.update({"input_wait_s": None, "input_wait_fraction": None,
                   "input_wait_method": "not recorded (schema_version 1)"})
    train, first = said.train_s, said.first_epoch_s
    timing["steady_train_s"] = None if train is None or first is None else round(max(0.0, train - first), 4)
    timing["fit_overhead_s"] = None  # its epoch times held checkpoint saves: the difference would mislead
    for epoch in doc["epochs"] if isinstance(doc.get("epochs"), list) else []:
        if not isinstance(epoch, dict):
            continue  # left out by the reading (runner/rundir/recorded.py)
        epoch.setdefault("checkpoint_s", None)
        epoch.setdefault("input_wait_s", None)
    doc[UPGRADED_FROM] = 1
    doc["schema_version"] = 2
    return doc


def read_spec(source: str, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The resolved spec a run was made with: spec.json beside its summary.json, else in the run folder the
    summary names; None when there is none to read (the row then shows what the summary alone tells)."""
    path = summary_path(source)
    said = Recorded.of(doc) or Recorded()
    folders = [posixpath.dirname(path)] if posixpath.basename(path) == "summary.json" else []
    folders += [said.run_dir] if said.run_dir is not None else []
    for folder in folders:
        try:
            spec = json.loads(read_text(posixpath.join(folder, "spec.json")))
        except (OSError, ValueError, DataError):
            continue
        if isinstance(spec, dict) and spec.get("name") == said.job:
            spec.pop("pinned", None)
            return spec
    return None
