"""The checks of `runner doctor` that import TensorFlow, run as `python -m runner.doctor.probe` in a child
process that the doctor kills by its PID when a step outlives its bound (an `import tensorflow` that aborts or
hangs, a bucket that never answers). TensorFlow never starts a TPU here: JAX's TPU check is jax_tpu.py's.

Protocol: one JSON request on stdin, {"steps": [...], "spec": {...}, "bounds": {step: seconds}}; one JSON line per
event on the stdout the process started with: {"begin": step}, {"check": {...}}, {"done": step}, then
{"idle": true}. Then one more stdin line, {"save": path, "report": {...}} (written with tf.io.gfile, so a
gs:// run folder works), or end of input.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from runner.data import storage
from runner.data.storage import is_gcs, split_gcs
from runner.doctor.checks import Check
from runner.spec.types import JobSpec

Step = Callable[[JobSpec, float], Iterator[Check]]


def _first_line(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return f"{type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"


def tensorflow_step(spec: JobSpec, bound: float) -> Iterator[Check]:
    began = time.monotonic()
    import keras
    import tensorflow as tf

    seconds = time.monotonic() - began
    gpus = len(tf.config.list_physical_devices("GPU"))
    yield Check(
        "tensorflow", "ok",
        f"TensorFlow {tf.__version__} and Keras {keras.__version__} imported in {seconds:.1f} s; "
        f"TensorFlow sees {len(tf.config.list_physical_devices('CPU'))} CPU and {gpus} GPU device(s)",
        data={"version": tf.__version__, "keras": keras.__version__, "import_s": round(seconds, 2), "gpus": gpus},
    )


def _read_manifest(folder: str) -> Check:
    """A gs:// data folder's manifest.json, read as the job reads it."""
    import tensorflow as tf

    from runner.data.pipeline import MANIFEST

    path, bucket = posixpath.join(folder, MANIFEST), f"gs://{split_gcs(folder)[0]}"
    began = time.monotonic()
    try:
        with tf.io.gfile.GFile(path, "rb") as handle:
            size = len(handle.read())
    except tf.errors.PermissionDeniedError as exc:
        action = f"give the job's identity (see credentials) roles/storage.objectViewer on {bucket}"
        return Check("storage_read", "fail", f"reading {path}: {_first_line(exc)}", action)
    except tf.errors.NotFoundError:
        if not tf.io.gfile.isdir(bucket):
            action = "fix the bucket in data.train / data.eval"
            return Check("storage_read", "fail", f"bucket {bucket} does not exist", action)
        action = f"your own TFRecords: runner manifest SPEC; a built-in dataset: runner prepare DATASET --out {folder}"
        return Check("storage_read", "fail", f"{path} not found", action)
    except tf.errors.OpError as exc:
        action = "see the gcs and credentials checks"
        return Check("storage_read", "fail", f"reading {path}: {_first_line(exc)}", action)
    evidence = f"read {path} ({size} bytes) in {time.monotonic() - began:.2f} s"
    return Check("storage_read", "ok", evidence, data={"path": path})


def _write_probe(folder: str) -> Check:
    """Create, read back and delete one object where checkpoints go: CheckpointManager deletes old ones too."""
    import tensorflow as tf

    probe = posixpath.join(folder.rstrip("/"), f".runner-doctor-{socket.gethostname()}-{os.getpid()}")
    payload = f"runner doctor write probe {time.time()}".encode()
    bucket = f"gs://{split_gcs(folder)[0]}" if is_gcs(folder) else None
    # Bucket first: tf.io.gfile.makedirs asks for a missing bucket again and again, without end.
    if bucket and not tf.io.gfile.isdir(bucket):
        evidence = f"bucket {bucket} does not exist (a job would hang creating its run folder)"
        return Check("storage_write", "fail", evidence, "fix output.dir, or create the bucket in the job's project")
    stage, began = "create the folder", time.monotonic()
    try:
        tf.io.gfile.makedirs(folder)
        stage = "write"
        with tf.io.gfile.GFile(probe, "wb") as handle:
            handle.write(payload)
        stage = "read back"
        with tf.io.gfile.GFile(probe, "rb") as handle:
            if handle.read() != payload:
                return Check("storage_write", "fail", f"{probe} read back different bytes", "check the bucket or disk")
        stage = "delete"
        tf.io.gfile.remove(probe)
    except tf.errors.OpError as exc:
        fault = None if bucket else storage.storage_error(exc, [folder], storage.DEFAULT_TIMEOUT_S)
        if fault is not None:  # a disk's refusal (full, read-only, a file in the way), in `runner run`'s words
            return Check("storage_write", "fail", str(fault), "the message says what to change (exit 3 for a run)")
        role = "roles/storage.objectCreator"
        if stage == "delete":
            role = "roles/storage.objectAdmin (old checkpoints are deleted)"
        action = f"give the job's identity {role} on {bucket}" if bucket else f"make {folder} writable"
        target = folder if stage == "create the folder" else probe
        return Check("storage_write", "fail", f"could not {stage} {target}: {_first_line(exc)}", action)
    evidence = f"wrote, read back and deleted {probe} in {time.monotonic() - began:.2f} s"
    return Check("storage_write", "ok", evidence, data={"path": folder})


def storage_step(spec: JobSpec, bound: float) -> Iterator[Check]:
    patterns = [p for p in (spec.data.train, spec.data.eval) if p]
    for folder in sorted({posixpath.dirname(p) for p in patterns if is_gcs(p)}):
        yield _read_manifest(folder)
    yield _write_probe(spec.output.dir)


def _data_check(spec: JobSpec, key: str, pattern: str, seconds: float) -> Check:
    from runner import DataError
    from runner.data import integrity, pipeline

    name = f"data_{key}"
    try:
        shards = pipeline.find_shards(pattern)
        pipeline.check_columns(shards, spec.data.inputs, spec.data.label)
        # What `runner run` refuses before training (exit 2) is a failure here too, in the run's own words.
        integrity.check_whole_splits(shards, f"data.{key}")
        integrity.check_labels(spec, shards)
    except DataError as exc:
        return Check(name, "fail", str(exc), "change what the message names: `runner run` refuses this data (exit 2)")
    entries = {e["file"]: e for info in shards.manifest["splits"].values() for e in info["shards"]}
    checked, bad, deadline = 0, [], time.monotonic() + seconds
    for path in shards.files:
        if time.monotonic() > deadline:
            break
        if pipeline.sha256_of(path) != entries[posixpath.basename(path)]["sha256"]:
            bad.append(path)
        checked += 1
    facts = {"records": shards.records, "files": len(shards.files), "hashed": checked}
    if bad:
        return Check(
            name, "fail", f"sha256 of {', '.join(bad)} does not match {posixpath.dirname(pattern)}/{pipeline.MANIFEST}",
            "re-run `runner prepare`, or copy the shard again from its source", data=facts,
        )
    evidence = f"{pattern}: {len(shards.files)} shard(s), {shards.records} records"
    evidence += f"; sha256 of {checked} match the manifest"
    if checked < len(shards.files):
        evidence += f" (stopped at the time bound; `runner verify {posixpath.dirname(pattern)}` checks all)"
    return Check(name, "ok", evidence, data=facts)


def data_step(spec: JobSpec, bound: float) -> Iterator[Check]:
    eval_ = spec.data.eval
    if eval_ and spec.data.eval_is_derived:  # unset: the test split beside data.train, when there is one
        import tensorflow as tf

        eval_ = eval_ if tf.io.gfile.glob(eval_) else None
    patterns = [("train", spec.data.train), ("eval", eval_)]
    patterns = [(key, pattern) for key, pattern in patterns if pattern]
    for key, pattern in patterns:
        # Hashing gets a share of the bound; what is left unhashed is said, not skipped silently.
        yield _data_check(spec, key, pattern, bound * 0.6 / len(patterns))


STEPS: dict[str, Step] = {"tensorflow": tensorflow_step, "storage": storage_step, "data": data_step}


def _save(spec: JobSpec, path: str, report: dict[str, Any]) -> Check:
    import tensorflow as tf

    from runner.rundir.outputs import RunFolder

    folder = RunFolder(posixpath.dirname(path))
    try:
        folder.write_json(posixpath.basename(path), report)
    except tf.errors.OpError as exc:
        return Check("save", "fail", f"could not write {path}: {_first_line(exc)}", "see the storage_write check")
    return Check("save", "ok", f"report written to {path}", data={"path": path})


def _emit(out: TextIO, event: dict[str, Any]) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever TensorFlow prints must not mix with the events
    request = json.loads(sys.stdin.readline())
    spec = JobSpec.model_validate(request["spec"])
    # Nothing of a TPU is set for TensorFlow: it feeds data on the host under both engines, and tensorflow-cpu
    # loads whatever TF_PLUGGABLE_DEVICE_LIBRARY_PATH names while it imports (libtpu, which JAX owns).
    for step in request["steps"]:
        _emit(out, {"begin": step})
        began = time.monotonic()
        try:
            for check in STEPS[step](spec, request["bounds"][step]):
                check.seconds, began = round(time.monotonic() - began, 3), time.monotonic()
                _emit(out, {"check": check.to_dict()})
        except Exception as exc:  # one broken step must not hide the others
            # A storage fault (DNS, an outage, a full disk) is what it is, with its own fix; anything else is ours.
            paths = [spec.data.train, spec.data.eval, spec.output.dir]
            fault = storage.storage_error(exc, paths, spec.storage.timeout_s)
            if fault is not None:
                broken = Check(step, "fail", str(fault), "see the message: storage unreachable is exit 3 for a run")
            else:
                broken = Check(step, "fail", _first_line(exc), "a bug in the doctor: report it with this line")
            _emit(out, {"check": broken.to_dict()})
        _emit(out, {"done": step})
    _emit(out, {"idle": True})
    line = sys.stdin.readline()
    if line.strip():
        command = json.loads(line)
        _emit(out, {"check": _save(spec, command["save"], command["report"]).to_dict()})
    if "libtpu" not in Path("/proc/self/maps").read_text():
        # Nothing of a TPU to release: skip TensorFlow's interpreter teardown (3 s on 2 busy cores). With
        # libtpu loaded the exit stays normal, so libtpu's exit hook releases the TPU and its lockfile.
        os._exit(0)


if __name__ == "__main__":
    main()
