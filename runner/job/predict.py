"""Using a trained job anywhere: evaluate or predict with the weights its run folder reports (model.keras of a
finished job, else its newest checkpoint: runner/rundir/reported.py) on whatever device is present.

A model trained on 8 TPU cores predicts on 1 CPU: the weights are restored into a freshly built model
under this machine's strategy (tf.train.Checkpoint is independent of the replica count), and inputs are
padded to whole batches and the padding dropped from the outputs (predict) or weighted 0 in every metric
and the loss (evaluate: every record counts once), so any number of rows works on any number of replicas.

Rows given as .npy/.npz/.csv are compared with what the model was trained on (the manifest's `value_ranges`
beside data.train) before anything is predicted: a model fed 0..1 pixels after training on 0..255 answers
confidently and wrongly, without an error, so a range, dtype kind or shape that does not match stops. A CSV's
words, an .npz's words and image files are read as `runner prepare` read the training data
(runner/data/rows.py); the answers speak the data's terms (runner/job/answers.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import posixpath
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from runner import DataError, SpecError
from runner.data import faults, pipeline, rows, splits
from runner.device.strategy import Accelerator, resolve_accelerator
from runner.job import answers
from runner.job.inputs import evaluation_batches
from runner.rundir import reported
from runner.rundir.outputs import RunFolder
from runner.spec import usercode
from runner.spec.types import JobSpec
from runner.train import build, store

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Trained:
    model: keras.Model
    accelerator: Accelerator
    checkpoint: str
    step: int
    features: dict
    manifest: dict  # the training shards' manifest: value_ranges tell what the model was fed
    manifest_path: str
    notes: list[str] = dataclasses.field(default_factory=list)  # for stderr: a newer checkpoint left unused


def load_trained(spec: JobSpec, checkpoint: str | None = None) -> Trained:
    """Builds the spec's model on the present device and restores into it the weights the run folder reports
    (runner/rundir/reported.py: model.keras of a finished job, else the newest checkpoint), or `checkpoint`."""
    run = RunFolder(spec.run_dir)
    weights = reported.chosen_weights(run, spec.name, checkpoint)
    accelerator = resolve_accelerator(spec.accelerator)
    shards = pipeline.find_shards(spec.data.train)
    model = build.build_compiled(spec, shards.features, accelerator, manifest=shards.manifest)
    if weights.keras_file:
        with accelerator.scope():
            build.load_keras_file(model, weights.path)
        step = weights.step
    else:
        step = store.restore_once(run, model, weights.path)
    log.info("restored %s (step %s) on %s x%d", weights.path, step, accelerator.kind, accelerator.replicas)
    manifest_path = posixpath.join(posixpath.dirname(spec.data.train), pipeline.MANIFEST)
    notes = [note] if checkpoint is None and (note := reported.abandoned_note(run)) else []
    return Trained(model, accelerator, weights.path, step, shards.features, shards.manifest, manifest_path, notes)


def evaluate(
    spec: JobSpec, input_path: str | None = None, options: InputOptions | None = None, checkpoint: str | None = None
) -> Evaluated:
    """Metrics of the reported weights (or `checkpoint`) on data.eval, or on the rows of `input_path` (an .npz
    holding every input and the label; a TFRecord glob is read like data.eval)."""
    trained = load_trained(spec, checkpoint)
    options = options or InputOptions()
    if input_path is not None and Path(input_path).suffix.lower() in (".npy", ".npz", ".csv"):
        return _evaluate_rows(spec, trained, input_path, options)
    if options.scale is not None:
        raise SpecError("--scale is for rows in .npy/.npz/.csv: TFRecords are decoded and preprocessed as in training")
    pattern = input_path or splits.eval_pattern(spec, trained.manifest)
    if not pattern:
        raise SpecError(f"data.eval is not set: {_eval_hint(spec.data.train, trained.manifest)}")
    key = "--input" if input_path else "data.eval"
    shards = pipeline.find_shards(pattern)
    batch = _batch_for(spec, trained.accelerator)
    # Every record once: the last batch padded, its padding weighing 0 in the metrics and the loss.
    steps = pipeline.eval_steps(shards, batch, key)
    dataset = evaluation_batches(spec, shards, batch, _preprocess(spec), trained.model, key)
    try:
        results = trained.model.evaluate(dataset, steps=steps, return_dict=True, verbose=0)
    except tf.errors.OpError as exc:
        raise faults.input_error(exc, pattern, key) or exc from None
    return Evaluated(_report(spec, trained, shards.records, results), trained.notes)


def _eval_hint(train: str, manifest: dict) -> str:
    """Where to evaluate: a split of data.train's manifest that data.train does not read, named as a glob."""
    folder, read = posixpath.split(train)
    for name, split in manifest.get("splits", {}).items():
        files = [entry.get("file", "") for entry in split.get("shards", [])]
        if files and all(f.startswith(f"{name}-") and not fnmatch.fnmatch(f, read) for f in files):
            return (f"evaluate on the held-out split {name!r} of {folder}/{pipeline.MANIFEST} with "
                    f"`--set data.eval={posixpath.join(folder, name)}-*.tfrecord`, or give rows with --input FILE.npz")
    return (f"{folder}/{pipeline.MANIFEST} lists no split besides the one data.train reads: set data.eval to a glob "
            "of held-out shards written like data.train's, or give rows with --input FILE.npz holding every input "
            "and the label")


@dataclasses.dataclass(frozen=True)
class Evaluated:
    report: dict
    notes: list[str]  # one line each, for stderr: what was not checked and why


def _report(spec: JobSpec, trained: Trained, examples: int, results: dict) -> dict:
    return {
        "job": spec.name, "checkpoint": trained.checkpoint, "step": trained.step,
        "accelerator": trained.accelerator.to_dict(), "examples": examples,
        "metrics": {k: float(v) for k, v in results.items()},
    }


def _evaluate_rows(spec: JobSpec, trained: Trained, path: str, options: InputOptions) -> Evaluated:
    """Evaluation on in-memory rows, padded as data.eval is (runner/data/pipeline.py `_weighted_records`):
    real rows weigh padded / rows and the padding 0, so metrics and loss are exact means over the rows."""
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":  # the label column, text labels through the manifest's class_names
        labels = rows.csv_labels(Path(path), spec.data.label, trained.features[spec.data.label].dtype,
                                 trained.manifest.get("class_names") or None, trained.manifest_path)
    elif suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            if spec.data.label not in archive:
                raise DataError(f"{path} lacks the label array {spec.data.label!r}; it has {sorted(archive.files)}")
            labels = archive[spec.data.label]
    else:
        raise DataError(
            f"{path}: evaluate needs the labels too: an .npz holding {', '.join(map(repr, spec.data.inputs))} "
            f"and the label {spec.data.label!r}, or a .csv with those columns"
        )
    given = given_inputs(path, spec, trained, options)
    arrays, notes, count = given.arrays, given.notes, len(labels)
    if any(len(a) != count for a in arrays.values()):
        counts = {n: len(a) for n, a in {**arrays, spec.data.label: labels}.items()}
        raise DataError(f"{path}: the arrays hold different numbers of rows: {counts}")
    batch = _batch_for(spec, trained.accelerator)
    padded = -(-count // batch) * batch
    weights = np.concatenate([np.full(count, padded / count, np.float32), np.zeros(padded - count, np.float32)])
    y = np.concatenate([labels, np.repeat(labels[:1], padded - count, axis=0)])
    x = _padded(spec, trained.features, arrays, padded)
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(batch, drop_remainder=True)
    results = trained.model.evaluate(dataset, return_dict=True, verbose=0)
    return Evaluated(_report(spec, trained, count, results), trained.notes + notes)


def _preprocess(spec: JobSpec):
    """data.preprocess, applied to TFRecord inputs exactly as in training."""
    if not spec.data.preprocess:
        return None
    return usercode.load_callable(spec.data.preprocess, "data.preprocess", ("features",), spec.code_roots)


def _batch_for(spec: JobSpec, accelerator: Accelerator) -> int:
    """The spec's global batch, rounded up to a multiple of this machine's replicas."""
    replicas = accelerator.replicas
    return -(-spec.data.global_batch_size // replicas) * replicas


def read_inputs(path: str, spec: JobSpec, trained: Trained) -> tuple[dict[str, np.ndarray], list[dict], list[str]]:
    """Rows to predict on, each row's origin (`{"line": N}` of a CSV, `{"file": NAME}` of an image; none for
    arrays and records) and notes: .npy (one input), .npz (arrays named by input feature), .csv (a column per
    input), an image file or a folder of them, or TFRecord shards (a glob).

    TFRecords are decoded and preprocessed (data.preprocess) as in training; a CSV's words and gaps and an
    image's pixels are read as `runner prepare` read the training data (runner/data/rows.py); .npy/.npz rows are
    the model's inputs as they are, but for words, mapped through the manifest's vocabularies.
    """
    inputs, features, origins, notes = spec.data.inputs, trained.features, [], []
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        if len(inputs) != 1:
            raise DataError(
                f"{path}: a .npy file holds one array, but the model takes {len(inputs)} inputs: give an .npz "
                f"holding one array per input, named {', '.join(map(repr, inputs))} (numpy.savez(FILE, name=array))"
            )
        arrays = {inputs[0]: np.load(path, allow_pickle=False)}
    elif suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            missing = [n for n in inputs if n not in archive]
            if missing:
                raise DataError(f"{path} lacks arrays {missing}; it has {sorted(archive.files)}")
            arrays = {n: archive[n] for n in inputs}
    elif suffix == ".csv":
        arrays, lines = rows.csv_inputs(Path(path), inputs, features, trained.manifest, trained.manifest_path)
        origins = [{"line": line} for line in lines]
    elif suffix in rows.IMAGE_EXTENSIONS or Path(path).is_dir():
        if len(inputs) != 1:
            raise DataError(f"{path}: images are one input, but the model takes {len(inputs)}: {', '.join(inputs)}")
        images, names, notes = rows.image_inputs(Path(path), tuple(features[inputs[0]].shape))
        arrays, origins = {inputs[0]: images}, [{"file": name} for name in names]
    elif suffix == ".tfrecord" or "*" in path:
        shards = pipeline.find_shards(path)
        batches = pipeline.make_dataset(
            shards, 1, inputs, spec.data.label, training=False, preprocess=_preprocess(spec),
            autotune=spec.data.autotune,
        )
        batched = [x for x, _ in batches.unbatch().batch(4096)]
        stacked = [x if isinstance(x, dict) else {inputs[0]: x} for x in batched]
        arrays = {n: np.concatenate([b[n].numpy() for b in stacked]) for n in inputs}
    else:
        raise DataError(
            f"{path}: predict reads .npy, .npz, .csv, an image ({', '.join(rows.IMAGE_EXTENSIONS)}) or a folder of "
            f"images, or TFRecord shards (*.tfrecord), not {suffix or 'this file'}"
        )
    for name, array in arrays.items():
        if array.dtype.kind in "US":  # words: a CSV's categories saved as they read
            vocabulary = rows.vocabulary_of(trained.manifest, name)
            if vocabulary is None:
                raise DataError(f"{path}: input {name!r} holds words ({array.dtype}), but the model was trained on "
                                f"numbers there ({trained.manifest_path} has no vocabulary for it): give numbers")
            ids = rows.word_ids(array.astype(str).ravel().tolist(), vocabulary,
                                f"{trained.manifest_path} (preprocessing.vocabularies)",
                                lambda i, name=name: f"{path}: input {name!r} (row {i})")
            arrays[name] = ids.reshape(array.shape)
        expected = tuple(features[name].shape)
        if arrays[name].shape[1:] != expected:
            raise DataError(
                f"{path}: input {name!r} has rows of shape {array.shape[1:]}, the model expects {expected} "
                f"(data.features.{name}.shape): give arrays of shape (rows, {', '.join(map(str, expected))})"
            )
    return arrays, origins, notes


@dataclasses.dataclass(frozen=True)
class InputOptions:
    scale: float | None = None  # --scale: every input multiplied by it before the check and the model
    check: bool = True  # --no-check: the value-range and dtype checks are skipped (the shape is always checked)


@dataclasses.dataclass(frozen=True)
class Given:
    arrays: dict[str, np.ndarray]  # input name -> rows, as the model will get them
    origins: list[dict]  # per row, where it came from (a CSV's line, an image's file); empty for arrays
    notes: list[str]  # one line each, for stderr: what was not checked, or done to the rows


def given_inputs(path: str, spec: JobSpec, trained: Trained, options: InputOptions) -> Given:
    """The rows of `path` as the model will get them (scaled by --scale), checked against the training data's
    value_ranges; and notes on what was not checked."""
    arrays, origins, notes = read_inputs(path, spec, trained)
    if options.scale is not None:
        arrays = {n: a.astype(np.float64) * options.scale for n, a in arrays.items()}
    if Path(path).suffix.lower() not in (".npy", ".npz", ".csv"):
        return Given(arrays, origins, notes)  # records and images are decoded as in training: the same values
    if not options.check:
        return Given(arrays, origins, [*notes, "--no-check: the inputs' values were not compared with the training "
                                               "data"])
    ranges = trained.manifest.get("value_ranges")
    if ranges is None:
        return Given(arrays, origins, [*notes,
            f"{trained.manifest_path} has no value_ranges (written before they were recorded): the inputs' "
            "values are not checked; `runner prepare` (or `runner manifest`) again records them"
        ])
    if spec.data.preprocess:
        return Given(arrays, origins, [*notes,
            f"data.preprocess changes the values after the manifest's value_ranges were taken: the rows of {path} "
            "(the model's inputs after it) are not checked against them"
        ])
    scaled = f" (after --scale {options.scale:g})" if options.scale is not None else ""
    for name, array in arrays.items():
        # A category's ids were looked up in its vocabulary: every word is known, though not every one need be
        # in the training split's range.
        if name in ranges and rows.vocabulary_of(trained.manifest, name) is None:
            check_values(array, ranges[name], f"{path}: input {name!r}{scaled}", trained.manifest_path, options)
    return Given(arrays, origins, notes)


def check_values(array: np.ndarray, trained_on: dict, what: str, manifest_path: str, options: InputOptions) -> None:
    """Refuses values the model never saw in training: ranges that do not overlap, an integer id outside the
    training range, a range far from the training one (0..1 given, 0..255 trained), or another dtype kind
    (not numbers; fractional values where training held whole ones). Integers given for a float feature are
    numbers of the same kind (the model computes in floats either way): their range decides.
    Silently wrong answers are the cost of letting these through; the message names both ranges and the fix."""
    dtype = np.dtype(trained_on["dtype"])
    low, high = trained_on["min"], trained_on["max"]
    where = f"{manifest_path} value_ranges: {trained_on['dtype']} {low:g}..{high:g}"
    skip = "`--no-check` predicts anyway"
    if array.size == 0:
        return
    if array.dtype.kind not in "biuf":  # no --no-check offered: the model cannot take them either way
        raise DataError(f"{what} holds {array.dtype} values; the model was trained on numbers ({where}): give numbers")
    given_low, given_high = float(np.min(array)), float(np.max(array))
    given = f"{given_low:g}..{given_high:g} ({array.dtype})"
    integer = dtype.kind in "iu"
    # Fractional values for whole-number training data (0.3..255.3 for uint8 pixels) first: no --scale mends
    # them, and a factor offered for their range would only lead to this refusal after it.
    whole = 0 < max(abs(given_low), abs(given_high)) and abs(given_high) > 1.0  # 0..1 is a scale, checked below
    if integer and whole and array.dtype.kind == "f" and not np.allclose(array, np.rint(array), rtol=0, atol=1e-3):
        raise DataError(
            f"{what} holds fractional values {given}; the model was trained on whole {dtype} values "
            f"{low:g}..{high:g} ({where}): round them (numpy.rint) or give {dtype} values as the training data "
            f"holds them; {skip}"
        )
    span = max(high - low, 1e-12)
    outside = given_high < low or given_low > high  # no overlap at all
    outside |= given_high > high + span or given_low < low - span  # far beyond the training range
    if integer:
        # Token ids and categories: one never seen in training is wrong (an id past the vocabulary reads as
        # zeros on a TPU). uint8 pixels only need the type's own range: a split need not hold both 0 and 255.
        bounds = (np.iinfo(dtype).min, np.iinfo(dtype).max) if dtype == np.uint8 else (low, high)
        slack = 1e-6 * max(1.0, abs(bounds[1]))  # a factor's last digit, not a value out of range
        outside |= given_low < bounds[0] - slack or given_high > bounds[1] + slack
    # Far inside: 0..1 given to a model trained on 0..255 (the values overlap, yet mean something else).
    magnitude, trained_magnitude = max(abs(given_low), abs(given_high)), max(abs(low), abs(high))
    shrunk = 0 < magnitude <= 1.0 and trained_magnitude > 2.0
    if outside or shrunk:
        fix = "give values as the training data holds them"
        if given_low >= 0 and low >= 0 and given_high > 0 and high > 0:
            factor = float(round(high)) if shrunk else high / given_high  # 0..1 pixels come from 0..255 ones
            factor = float(f"{factor:.6g}")  # as printed: the factor a user types is the one checked
            if given_high * factor <= high * (1 + 1e-6) and given_low * factor >= low - span:
                fix = f"`--scale {factor:g}` multiplies these to {given_low * factor:g}..{given_high * factor:g}"
        raise DataError(
            f"{what} holds values {given}, but the model was trained on {low:g}..{high:g} ({where}): it would "
            f"answer without an error, and wrongly. {fix[0].upper() + fix[1:]} (scaling belongs inside the "
            "model, e.g. a keras.layers.Rescaling layer, so that it sees the same raw values in training and "
            f"prediction); {skip}"
        )
    # A float copy of whole numbers (pixels as float32) is the same values; 127.5 never was a pixel.
    if integer and array.dtype.kind == "f" and not np.allclose(array, np.rint(array), rtol=0, atol=1e-3):
        raise DataError(
            f"{what} holds fractional values {given}; the model was trained on whole {dtype} values "
            f"{low:g}..{high:g} ({where}): give {dtype} values as the training data holds them; {skip}"
        )


def _padded(spec: JobSpec, features: dict, arrays: dict[str, np.ndarray], padded: int):
    """Every input padded with zero rows to `padded` rows, in the dtype the model gets (int64 stays int64:
    category ids index an embedding; the rest float32); a single input as its array."""
    x = {}
    for n, a in arrays.items():
        dtype = np.int64 if features[n].dtype == "int64" else np.float32
        x[n] = np.concatenate([a.astype(dtype), np.zeros((padded - len(a), *a.shape[1:]), dtype)])
    return x[spec.data.inputs[0]] if len(x) == 1 else x


@dataclasses.dataclass(frozen=True)
class Predicted:
    outputs: np.ndarray  # per row: probabilities for a classifier (of logits, softmax applied), else the outputs
    lines: list[dict]  # per row, what predict prints: index, origin, class and class name, probabilities or output
    trained: Trained
    notes: list[str]


def predict(
    spec: JobSpec, input_path: str, options: InputOptions | None = None, checkpoint: str | None = None
) -> Predicted:
    """The model's answers for every row of `input_path`, in the data's own terms (class names, probabilities)."""
    trained = load_trained(spec, checkpoint)
    given = given_inputs(input_path, spec, trained, options or InputOptions())
    count = len(next(iter(given.arrays.values())))
    batch = _batch_for(spec, trained.accelerator)
    # Pad to whole batches: every replica gets an equal, static-shaped share (TPUs need both).
    padded = -(-count // batch) * batch
    x = _padded(spec, trained.features, given.arrays, padded)
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(batch, drop_remainder=True)
    outputs = np.asarray(trained.model.predict(dataset, verbose=0))[:count]
    outputs, kind, said = answers.probabilities(outputs, build.output_kind(trained.model))
    lines = answers.lines(outputs, kind, trained.manifest.get("class_names") or (), given.origins)
    return Predicted(outputs, lines, trained, [*trained.notes, *given.notes, *said])
