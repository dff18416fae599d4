"""The run folder `<output.dir>/<job name>/` (local or gs://): every write a job makes goes through here.

    spec.json            the resolved spec, written before training starts
    checkpoints/         tf.train.CheckpointManager files (`ckpt-<step>`), the newest `keep` kept
    summary.json         the latest attempt's summary; attempts/<n>.json keeps each attempt's own
    model.keras          the trained model, written once the job succeeds

Resume precedence, when a job name is run again:
  1. spec.json differs from the new spec in `data`, `model` or `train` (other than `train.epochs`):
     refused (exit 2), because the checkpoints belong to the other spec; choose a new job name.
     Accelerator, checkpoint cadence and output settings may change between attempts (a TPU job may
     resume on a CPU).
  2. summary.json says `succeeded` for at least `train.epochs` epochs: the job is complete; nothing
     trains and nothing is written. (Raising `train.epochs` continues a finished job.)
  3. The newest complete checkpoint (the one the CheckpointManager index names: the index is written
     after the checkpoint's data, so a checkpoint cut short by a kill is never chosen) restores weights,
     optimizer state and the step count; training continues from that step.
  4. Otherwise training starts from step 0.

How an attempt ends, and what the next one does (tests/test_resume.py, tests/test_faults.py):
  - kill -9, a crash, a lost VM: nothing more is written. The next attempt resumes from the newest
    complete checkpoint, so it loses at most one checkpoint interval (`checkpoint.every_steps`, else one
    epoch). Epoch and step counts continue from the restored optimizer step (a resumed partial epoch
    runs only its missing steps), so the final step is exactly epochs x steps_per_epoch. The data order
    is not replayed: the resumed attempt draws a fresh shuffle.
  - SIGTERM, a preemption notice: the job saves at the next step boundary, writes summary.json with
    status `preempted` and exits 75 (EX_TEMPFAIL: run it again), all within `checkpoint.grace_s`
    (default 30 s). A save still stuck at that deadline (storage that does not answer) is abandoned: the
    process exits 75 without it, and the next attempt resumes from the checkpoint before. A notice
    that comes before training began (TensorFlow still importing, the model being built) ends the
    attempt the same way, saving nothing: nothing new was trained.
  - A checkpoint cut short (a kill or the deadline during a save) has data files but no index entry;
    step 3 never chooses it, and a later save of the same step replaces it.
  - A failing attempt (a corrupt or truncated shard: exit 2 naming it; storage unreachable for longer
    than `storage.timeout_s`: exit 3 naming the bucket) saves no checkpoint as it fails, and its summary
    never replaces a `succeeded` one.
"""

from __future__ import annotations

import json
import posixpath
import tempfile
from typing import Any, Callable

import tensorflow as tf

from runner import serving, storage
from runner.errors import SpecError, StorageError
from runner.spec import JobSpec

# Spec sections that decide what the checkpoints mean; a resumed run must not change them.
_PINNED_SECTIONS = ("data", "model", "train")
_FREE_KEYS = {("train", "epochs")}


class RunFolder:
    def __init__(self, path: str):
        self.path = path.rstrip("/")
        self.checkpoints = f"{self.path}/checkpoints"

    def file(self, name: str) -> str:
        return posixpath.join(self.path, name)

    def read_json(self, name: str) -> dict[str, Any] | None:
        path = self.file(name)
        if not tf.io.gfile.exists(path):
            return None
        with tf.io.gfile.GFile(path, "r") as handle:
            return json.loads(handle.read())

    def write_json(self, name: str, doc: dict[str, Any]) -> None:
        """Writes whole-or-nothing: a temporary name, then a rename (a single-object copy on GCS)."""
        path, partial = self.file(name), self.file(name + ".partial")
        tf.io.gfile.makedirs(posixpath.dirname(path))
        with tf.io.gfile.GFile(partial, "w") as handle:
            handle.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")
        tf.io.gfile.rename(partial, path, overwrite=True)

    def completed_summary(self, epochs: int) -> dict[str, Any] | None:
        """The summary of a finished run that trained at least `epochs` epochs, if there is one."""
        summary = self.read_json("summary.json")
        if summary and summary.get("status") == "succeeded" and summary.get("train_epochs", 0) >= epochs:
            return summary
        return None

    def check_spec(self, spec: JobSpec) -> None:
        """Refuses a spec that differs from the one this folder's checkpoints were made with (precedence 1)."""
        try:
            self._check_bucket()
            tf.io.gfile.makedirs(self.path)
            previous = self.read_json("spec.json")
        except tf.errors.OpError as exc:
            raise StorageError(f"cannot use the run folder {self.path}: {exc.message}") from None
        current = spec.to_dict()
        if previous is not None:
            changed = [
                f"{section}.{key}: {previous.get(section, {}).get(key)!r} -> {current[section].get(key)!r}"
                for section in _PINNED_SECTIONS
                for key in sorted(set(previous.get(section, {})) | set(current[section]))
                if previous.get(section, {}).get(key) != current[section].get(key) and (section, key) not in _FREE_KEYS
            ]
            if changed:
                raise SpecError(
                    f"{self.path} holds checkpoints of job {spec.name!r} made with another spec ("
                    + "; ".join(changed)
                    + "); run it with the earlier settings or choose a new job name"
                )

    def _check_bucket(self) -> None:
        # TensorFlow's makedirs keeps retrying under a bucket that does not exist: ask about the bucket first.
        if storage.is_gcs(self.path):
            bucket, _ = storage.split_gcs(self.path)
            if not tf.io.gfile.isdir(f"gs://{bucket}"):
                raise StorageError(
                    f"bucket gs://{bucket} (output.dir) does not exist or this machine cannot read it: "
                    f"create it (gcloud storage buckets create gs://{bucket}) or set output.dir to another"
                )

    def record_spec(self, spec: JobSpec) -> None:
        self.write_json("spec.json", spec.to_dict())

    def next_attempt(self) -> int:
        folder = self.file("attempts")
        if not tf.io.gfile.isdir(folder):
            return 1
        numbers = [int(n.split(".")[0]) for n in tf.io.gfile.listdir(folder) if n.split(".")[0].isdigit()]
        return max(numbers, default=0) + 1

    def write_summary(self, summary: dict[str, Any], attempt: int, keep_succeeded: bool = True) -> None:
        """attempts/<n>.json, then summary.json; with `keep_succeeded`, an attempt that did not succeed never
        replaces a finished job's summary (a benchmark, measured afresh each time, passes False)."""
        self.write_json(f"attempts/{attempt:03d}.json", summary)
        previous = self.read_json("summary.json") if keep_succeeded else None
        if previous and previous.get("status") == "succeeded" and summary.get("status") != "succeeded":
            return
        self.write_json("summary.json", summary)

    def checkpoint_manager(
        self, checkpoint: tf.train.Checkpoint, keep: int, worker_index: int = 0
    ) -> tf.train.CheckpointManager:
        """Multi-worker saves are collective: every worker saves, only the chief (worker 0) into the run folder."""
        directory = self.checkpoints if worker_index == 0 else self._worker_scratch(worker_index, "checkpoints")
        return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=keep, checkpoint_name="ckpt")

    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint in the run folder (every worker restores from the chief's)."""
        return tf.train.latest_checkpoint(self.checkpoints)

    def save_model(self, model: Any, worker_index: int = 0, examples_to_inputs: Callable | None = None) -> str | None:
        """Writes model.keras whole-or-nothing, then saved_model/ (runner/serving.py: `examples_to_inputs`
        gives it the `serve_examples` endpoint); other workers take part in the save into scratch space."""
        if worker_index:
            scratch = self._worker_scratch(worker_index, "model.keras")
            model.save(scratch)
            tf.io.gfile.remove(scratch)
            return None
        path = self.file("model.keras")
        partial = self.file("model.partial.keras")
        model.save(partial)
        tf.io.gfile.rename(partial, path, overwrite=True)
        # A SavedModel too, for TF Serving and TensorFlow without Keras (written after model.keras, so an
        # interrupted export never leaves a run without its .keras file).
        serving.export(model, self.file("saved_model"), examples_to_inputs)
        return path

    def _worker_scratch(self, worker_index: int, name: str) -> str:
        folder = posixpath.join(tempfile.gettempdir(), f"runner-{posixpath.basename(self.path)}-worker{worker_index}")
        tf.io.gfile.makedirs(folder)
        return posixpath.join(folder, name)
