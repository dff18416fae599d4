"""The run folder `<output.dir>/<job name>/` (local or gs://): every write a job makes goes through here.

    lease.json           held by the run in progress (runner/rundir/lease.py); gone when no run is in progress
    spec.json            the resolved spec, written with the first checkpoint of an attempt; its `pinned`
                         part is what the checkpoints mean
    checkpoints/         the newest `keep` checkpoints: tf.train.CheckpointManager's `ckpt-<step>` files, or
                         Orbax's `ckpt_<step>/` folders under JAX (runner/rundir/orbax_store.py)
    summary.json         the latest attempt's summary; attempts/<n>.json keeps each attempt's own
    model.keras          the trained model, written once the job succeeds

Resume precedence, when a job name is run again (docs/resume.md tells what each exit leaves behind):
  1. The folder cannot be used (a read-only or full disk, a file where it or `checkpoints/` belongs, a
     bucket that does not exist): exit 3 naming the path and what to do, nothing written.
  2. Another run holds the folder's lease: refused (exit 2), naming the holder and since when. A stale
     lease (its process gone from this host, or not renewed within its expiry) is taken over and logged.
     Of a multi-worker run only the chief (worker 0) takes the lease.
  3. summary.json says `succeeded`: for exactly `train.epochs` epochs the job is complete (if the spec
     agrees with its checkpoints, step 5), nothing trains and nothing is written; for more epochs than
     `train.epochs` the run is refused (exit 2, naming the epochs the folder holds: train.epochs never
     shrinks a job). Raising `train.epochs` continues it.
  4. Leftovers of a save cut short (`ckpt-<step>_temp*` folders, data files of a checkpoint without its
     `.index`, `checkpoint.tmp*`) are removed and the removal logged; complete checkpoints are never touched.
  5. A checkpoint exists: the spec must agree with spec.json's `pinned` part, what the checkpoints mean:
     the model (name, params), the optimizer, learning rate, loss and mixed precision, the global batch
     and steps per epoch, the inputs, label, features and preprocessing, and the training data by its
     fingerprint (the manifest's sha256 and record count of every training shard, not the path: data
     copied to another folder or bucket resumes). Anything else (epochs, accelerator, checkpoint cadence,
     `data.autotune`, shuffle buffer, eval data, output settings) may change between attempts. A
     difference is refused (exit 2) naming each key with both values and how to go on. A checkpoint
     further than `train.epochs` is refused too (exit 2, naming the epochs it holds).
     Without a checkpoint nothing is pinned: a start that failed (a typo in data.train, a bad model
     name, a batch too large) is fixed and run again under the same name.
  6. The newest complete checkpoint (the one the CheckpointManager index names: the index is written
     after the checkpoint's data, so a checkpoint cut short by a kill is never chosen) restores weights,
     optimizer state and the step count; training continues from that step.
  7. Otherwise training starts from step 0.

How an attempt ends, and what the next one does (tests/test_resume.py, tests/test_faults.py,
tests/test_run_folder.py, tests/test_lease.py):
  - kill -9, a crash, a lost VM: nothing more is written and the lease stays behind; the next attempt
    takes it over (at once on the same host, after its expiry from another) and resumes from the newest
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
    step 6 never chooses it, and step 4 of the next attempt removes it.
  - A failing attempt (a corrupt or truncated shard: exit 2 naming it; storage unreachable for longer
    than `storage.timeout_s`, a full or read-only disk: exit 3 naming the path) saves no checkpoint as it
    fails, and its summary never replaces a `succeeded` one. A refused attempt (steps 2, 3, 5) writes
    nothing at all.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import re
import tempfile
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from runner import DataError, SpecError, StorageError
from runner.data import pipeline, storage
from runner.device import engine
from runner.rundir import orbax_store, serving, stalled
from runner.rundir.checkpoints import step_of as _step_of
from runner.rundir.lease import Lease
from runner.rundir.pins import (
    BACKEND,
    FINGERPRINT,
    FLAVOUR,
    PINNED_KEYS,
    TENSORFLOW,
    backend_problem,
    data_fingerprint,
    dotted,
    pinned,
    show,
    software_problem,
)
from runner.rundir.timing import Recorded, completion
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)

# Leftovers of a save cut short (precedence 4): TensorFlow writes `<prefix>_temp/part-*` and merges them into
# `<prefix>.index` + `<prefix>.data-*`; the index file `checkpoint` is replaced through `checkpoint.tmp<hex>`.
_TEMP = re.compile(r"^ckpt-\d+_temp")
_DATA = re.compile(r"^(ckpt-\d+)\.data-\d{5}-of-\d{5}$")
_STATE_TEMP = re.compile(r"^checkpoint\.tmp[0-9a-f]+$")


class RunFolder:
    def __init__(self, path: str):
        self.path = path.rstrip("/")
        self.checkpoints = f"{self.path}/checkpoints"
        self.attempt = 0
        self._spec: JobSpec | None = None
        self._pin: dict[str, Any] | None = None  # spec.json, written just before the attempt's first save
        self._pin_written = False
        self._reader = False  # set by open(): a process that is not process 0 writes none of the folder's own files
        self._lease: Lease | None = None
        self._refused = False  # a refused attempt writes nothing, its summary included
        self._created = False  # this attempt made the folder: a refusal at start removes it again

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


    def open(self, spec: JobSpec, worker_index: int = 0) -> dict[str, Any] | None:
        """Opens an attempt (precedence 1-4): the folder usable, the lease taken (chief only), a finished
        job's summary returned (nothing to do; the lease released) or a shrunk one refused, leftovers of an
        interrupted save removed, the attempt numbered (self.attempt). Raises SpecError, LeaseHeld (exit 2)
        or StorageError (exit 3) having written nothing."""
        self._spec = spec
        try:
            self.check_bucket()
            self._created = not tf.io.gfile.exists(self.path) or not tf.io.gfile.listdir(self.path)
            if not storage.is_gcs(self.path):  # a bucket has no folders to make: the lease object is the first write
                tf.io.gfile.makedirs(self.path)
            if tf.io.gfile.exists(self.checkpoints) and not tf.io.gfile.isdir(self.checkpoints):
                raise StorageError(
                    f"{self.checkpoints} is a file, not a folder: this job's checkpoints cannot be written there; "
                    "move that file away, then run the same job again"
                )
        except tf.errors.OpError as exc:
            raise self.storage_fault(exc) from None
        self._reader = worker_index != 0  # another process of the job writes the folder's own files
        if worker_index == 0:
            self._lease = Lease.take(self.path, spec.name, spec.storage.timeout_s)
        try:
            done = self._completed(spec)
            if done is None:
                if worker_index == 0:
                    self.remove_leftovers()
                    stalled.clear(self.path)
                self.attempt = self.next_attempt()
        except tf.errors.OpError as exc:
            self.close()
            raise self.storage_fault(exc) from None
        except BaseException:
            self.close()
            raise
        if done is not None:
            self.close()
        return done

    def close(self) -> None:
        """Ends the attempt: releases the lease (whatever the run's status)."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def refuse_start(self) -> None:
        """A start refused before training (a spec or data fault only the run could find): the attempt writes
        nothing, and a folder this attempt made is removed again once its lease is released (see `close`)."""
        self._refused = True

    def remove_if_refused(self) -> bool:
        """After `close`: removes the folder a refused start made, if it holds nothing but empty folders; True
        when it was removed (the attempt's summary then names no run folder)."""
        if not (self._refused and self._created) or self._lease is not None:
            return False
        try:
            leftovers = [f for _, _, files in tf.io.gfile.walk(self.path) for f in files]
            if not leftovers:
                tf.io.gfile.rmtree(self.path)
                return True
        except tf.errors.OpError as exc:  # the refusal is what the user must read; this is housekeeping
            log.warning("could not remove the empty run folder %s: %s", self.path, exc)
        return False

    def _completed(self, spec: JobSpec) -> dict[str, Any] | None:
        """The summary of the finished job when it trained exactly `train.epochs` (precedence 3)."""
        summary = self.read_json("summary.json")
        state = completion(summary, spec.train.epochs)  # the rule `runner sweep` also reads, without TensorFlow
        if state == "open":
            return None  # nothing finished, or more epochs: the job continues
        trained = Recorded.of(summary).train_epochs or 0
        if state == "shrunk":
            raise SpecError(
                f"{self.path} holds job {spec.name!r} finished after {trained} epochs (summary.json); "
                f"train.epochs ({spec.train.epochs}) is lower, and a job never shrinks: set train.epochs to "
                f"{trained} to see it, or above to train it further; for a shorter run choose a new job name "
                f"(`--set name={spec.name}-{spec.train.epochs}ep`) or start over with `runner run --fresh` (the "
                "folder is moved aside, not deleted)"
            )
        latest = self.latest_checkpoint()
        if latest is not None:  # complete, but only for the spec it was made with
            try:
                fingerprint = data_fingerprint(pipeline.find_shards(spec.data.train))
            except DataError:
                fingerprint = None  # the data is gone: nothing trains, so only the spec is compared
            self._check_pinned(spec, pinned(spec, fingerprint), latest)
        return summary

    def check_bucket(self) -> None:
        # TensorFlow's makedirs keeps retrying under a bucket that does not exist: ask about the bucket first.
        if storage.is_gcs(self.path):
            bucket, _ = storage.split_gcs(self.path)
            if not tf.io.gfile.isdir(f"gs://{bucket}"):
                raise StorageError(
                    f"bucket gs://{bucket} (output.dir) does not exist or this machine cannot read it: "
                    f"create it with `gcloud storage buckets create gs://{bucket}` or set output.dir to another"
                )

    def storage_fault(self, exc: tf.errors.OpError) -> StorageError:
        timeout_s = self._spec.storage.timeout_s if self._spec else storage.DEFAULT_TIMEOUT_S
        first_line = exc.message.splitlines()[0] if exc.message else type(exc).__name__
        if storage.is_file(self.path):  # a file where the run folder belongs: TensorFlow says only "could not find"
            first_line = (f"a file stands where the job's run folder belongs; move it away (e.g. `mv {self.path} "
                          f"{self.path}.moved`), or give the job another name (`--set name=...`)")
        return storage.storage_error(exc, [self.path], timeout_s) or StorageError(
            f"cannot use the run folder {self.path}: {first_line}")

    def remove_leftovers(self) -> list[str]:
        """Removes what a save cut short left in checkpoints/ (precedence 4); returns the names removed."""
        if not tf.io.gfile.isdir(self.checkpoints):
            return []
        names = [name.rstrip("/") for name in tf.io.gfile.listdir(self.checkpoints)]
        state = tf.train.get_checkpoint_state(self.checkpoints)
        indexed = {posixpath.basename(p) for p in state.all_model_checkpoint_paths} if state else set()
        if state:
            indexed.add(posixpath.basename(state.model_checkpoint_path))
        complete = {name[: -len(".index")] for name in names if name.endswith(".index")}
        leftovers = [
            name for name in names
            if _TEMP.match(name) or _STATE_TEMP.match(name)
            or ((match := _DATA.match(name)) and match.group(1) not in complete | indexed)
        ]
        for name in leftovers:
            path = posixpath.join(self.checkpoints, name)
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            else:
                tf.io.gfile.remove(path)
        if leftovers:
            log.info(
                "removed %d leftover(s) of a checkpoint save that was cut short from %s: %s",
                len(leftovers), self.checkpoints, ", ".join(sorted(leftovers)),
            )
        return leftovers


    def check_checkpoints(self, spec: JobSpec, train: pipeline.Shards, steps_per_epoch: int) -> None:
        """Refuses (precedence 5) a spec that differs from what this folder's checkpoints were made with, or
        asks for fewer epochs than they hold; remembers spec.json to write with the attempt's first save."""
        now = pinned(spec, data_fingerprint(train))
        self._pin = {**spec.to_dict(), "pinned": now}
        latest = self.latest_checkpoint()
        if latest is None:
            self.check_backend()  # checkpoints of the other backend are invisible to this one
            return  # nothing pinned yet: a failed start never locks the job name
        self._check_pinned(spec, now, latest)
        step = _step_of(latest)
        if step is not None and step > spec.train.epochs * steps_per_epoch:
            held = step / steps_per_epoch
            self._refuse(
                f"{self.checkpoints} already holds {held:g} epochs ({posixpath.basename(latest)}: step {step}, "
                f"{steps_per_epoch} steps per epoch); train.epochs ({spec.train.epochs}) is lower, and a job "
                f"never shrinks: set train.epochs to at least {math.ceil(held)} to continue it; for a shorter "
                f"run choose a new job name (`--set name={spec.name}-{spec.train.epochs}ep`) or start over with "
                "`runner run --fresh` (the folder is moved aside, not deleted)"
            )

    def _check_pinned(self, spec: JobSpec, now: dict[str, Any], latest: str) -> None:
        previous = self.read_json("spec.json")
        if previous is None:
            log.warning("%s has checkpoints but no spec.json: cannot tell what they were made with", self.path)
            return
        before = previous.get("pinned") or {key: dotted(previous, key) for key in PINNED_KEYS}  # older folders
        self._check_software(spec, before, now)
        # A fingerprint not known on either side (older folders; data no longer readable) is not compared.
        known = [
            key for key in now if key in before and key not in (FLAVOUR, TENSORFLOW, BACKEND)
            and (key != FINGERPRINT or None not in (before[key], now[key]))
        ]
        changed = [f"{key}: {show(before[key])} -> {show(now[key])}" for key in known if before[key] != now[key]]
        if changed == [f"{FINGERPRINT}: {show(before[FINGERPRINT])} -> {show(now[FINGERPRINT])}"]:
            manifest = posixpath.join(posixpath.dirname(spec.data.train), pipeline.MANIFEST)
            self._refuse(
                f"the training data changed since {self.path}'s checkpoints were made: {manifest} lists other "
                f"shards (their sha256 and record counts: {'; '.join(changed)}). If the shards are the same, the "
                f"manifest was edited: restore it and check the shards with `runner verify "
                f"{posixpath.dirname(spec.data.train)}`. To train on the new data, start over with "
                f"`runner run --fresh` (the run folder is moved aside, not deleted) or choose a new job name "
                f"(`--set name={spec.name}-2`)"
            )
        if changed:
            self._refuse(
                f"{self.path} holds checkpoints of job {spec.name!r} (newest: {posixpath.basename(latest)}) made "
                f"with another spec ({'; '.join(changed)}): the checkpoints mean something else. Run it with the "
                f"earlier settings, choose a new job name (`--set name={spec.name}-2`), or start this job over with "
                "`runner run --fresh` (the folder is moved aside, not deleted)"
            )

    def check_backend(self) -> None:  # precedence 5: checkpoints another backend (or tf-keras) wrote
        previous = self.read_json("spec.json")
        if previous is None or not tf.io.gfile.isdir(self.checkpoints) or not tf.io.gfile.listdir(self.checkpoints):
            return
        if problem := backend_problem(self.path, previous):
            self._refuse(problem)

    def _check_software(self, spec: JobSpec, before: dict[str, Any], now: dict[str, Any]) -> None:
        """Keras 3 (not tf-keras) and the backend must be what wrote the checkpoints; TensorFlow the same or newer."""
        self.check_backend()
        if problem := software_problem(self.path, before, now):
            self._refuse(problem)

    def _refuse(self, message: str) -> None:
        self._refused = True
        raise SpecError(message)

    def _before_save(self) -> None:
        if self._lease is not None and self._lease.lost:
            raise StorageError(
                f"{self._lease.where} was taken over by another run: this run stopped without saving, so as "
                "not to overwrite that run's checkpoints"
            )
        if self._pin_written or self._reader:
            return
        if self._pin is None and self._spec is not None:  # check_checkpoints not called: the data is not known
            self._pin = {**self._spec.to_dict(), "pinned": pinned(self._spec, None)}
        if self._pin is not None:
            self.write_json("spec.json", self._pin)
        self._pin_written = True


    def next_attempt(self) -> int:
        folder = self.file("attempts")
        if not tf.io.gfile.isdir(folder):
            return 1
        numbers = [int(n.split(".")[0]) for n in tf.io.gfile.listdir(folder) if n.split(".")[0].isdigit()]
        return max(numbers, default=0) + 1

    def epochs_before(self, attempt: int) -> list[dict[str, Any]]:
        """The epoch records of the attempts before `attempt`, from the newest attempts/<n>.json written
        (each holds every earlier one's), each marked with its attempt; [] for a first attempt."""
        folder = self.file("attempts")
        if attempt <= 1 or not tf.io.gfile.isdir(folder):
            return []
        numbers = sorted(
            (int(n.split(".")[0]) for n in tf.io.gfile.listdir(folder)
             if n.split(".")[0].isdigit() and n.endswith(".json")),
            reverse=True,
        )
        for number in (n for n in numbers if n < attempt):
            earlier = self.read_json(f"attempts/{number:03d}.json") or {}
            records = [dict(r) for r in earlier.get("epochs") or []]
            for record in records:
                record.setdefault("attempt", number)  # summaries written before records carried it
                if record["attempt"] is None:
                    record["attempt"] = number
            if records or earlier.get("epochs") is not None:
                return records
        return []

    def write_summary(self, summary: dict[str, Any], attempt: int, keep_succeeded: bool = True) -> None:
        """attempts/<n>.json, then summary.json; with `keep_succeeded`, an attempt that did not succeed never
        replaces a finished job's summary (a benchmark, measured afresh each time, passes False). A refused
        attempt writes nothing, and neither does a run whose lease another run took over."""
        if self._refused or (self._lease is not None and self._lease.lost):
            return
        self.write_json(f"attempts/{attempt:03d}.json", summary)
        previous = self.read_json("summary.json") if keep_succeeded else None
        if (Recorded.of(previous) or Recorded()).succeeded and not (Recorded.of(summary) or Recorded()).succeeded:
            return
        self.write_json("summary.json", summary)

    def checkpoint_manager(self, checkpoint: tf.train.Checkpoint, keep: int) -> tf.train.CheckpointManager:
        """TensorFlow's checkpoints of the job (one process: several run under JAX, with Orbax's)."""
        return _Checkpoints(self, checkpoint, self.checkpoints, max_to_keep=keep, checkpoint_name="ckpt")

    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint (every process of a job restores the same), of this process's backend."""
        if engine.active().checkpoint_format == "orbax":
            return orbax_store.latest_in(self.checkpoints) if tf.io.gfile.isdir(self.checkpoints) else None
        return tf.train.latest_checkpoint(self.checkpoints)

    def orbax_store(self, model: Any, keep: int) -> orbax_store.OrbaxStore:  # spec.json with its first save
        return orbax_store.OrbaxStore(self.checkpoints, model, keep, before_save=self._before_save)

    def save_model(self, model: Any, worker_index: int = 0, examples_to_inputs: Callable | None = None,
                   saved_model: bool = True) -> str | None:
        """Writes model.keras whole-or-nothing, then (with `saved_model`) saved_model/ (runner/rundir/serving.py:
        `examples_to_inputs` gives it the `serve_examples` endpoint); by process 0 alone, the others taking part
        in the reads."""
        if worker_index:
            # Process 0 writes it. Reading a variable replicated over several processes' devices is a collective
            # under JAX: every process reads them as process 0 does, into a scratch file, or process 0 waits forever.
            scratch = posixpath.join(tempfile.mkdtemp(prefix=f"runner-process{worker_index}-"), "model.keras")
            model.save(scratch)
            tf.io.gfile.rmtree(posixpath.dirname(scratch))
            return None
        if self._lease is not None and self._lease.lost:
            raise StorageError(f"{self._lease.where} was taken over by another run: model.keras not written")
        path = self.file("model.keras")
        partial = self.file("model.partial.keras")
        model.save(partial)
        tf.io.gfile.rename(partial, path, overwrite=True)
        # A SavedModel too, for TF Serving and TensorFlow without Keras (written after model.keras, so an
        # interrupted export never leaves a run without its .keras file).
        exported = self.file("saved_model")
        if saved_model:
            serving.export(model, exported, examples_to_inputs)
        elif tf.io.gfile.exists(exported):  # an earlier attempt's: the weights of model.keras no longer
            tf.io.gfile.rmtree(exported)
            log.warning("output.saved_model is false: removed %s, an earlier attempt's export of other weights "
                        "than model.keras now holds", exported)
        return path

class _Checkpoints(tf.train.CheckpointManager):
    """The chief's CheckpointManager: spec.json is written with the attempt's first save (precedence 5),
    and a run whose lease was taken over saves nothing more."""

    def __init__(self, folder: RunFolder, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._folder = folder

    def save(self, checkpoint_number=None, check_interval=True, options=None):  # TensorFlow's signature
        self._folder._before_save()
        return super().save(checkpoint_number=checkpoint_number, check_interval=check_interval, options=options)
