"""Using a trained job anywhere: evaluate or predict from its newest checkpoint on whatever device is present.

A model trained on 8 TPU cores predicts on 1 CPU: the weights are restored into a freshly built model
under this machine's strategy (tf.train.Checkpoint is independent of the replica count), and inputs are
padded to whole batches and the padding dropped from the outputs (predict) or weighted 0 in every metric
and the loss (evaluate: every record counts once), so any number of rows works on any number of replicas.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import tensorflow as tf

from runner import DataError, SpecError
from runner.data import pipeline
from runner.device.strategy import Accelerator, resolve_accelerator
from runner.rundir.outputs import RunFolder
from runner.spec import usercode
from runner.spec.types import JobSpec
from runner.train import build

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Trained:
    model: tf.keras.Model
    accelerator: Accelerator
    checkpoint: str
    step: int
    features: dict


def load_trained(spec: JobSpec) -> Trained:
    """Builds the spec's model on the present device and restores the run's newest checkpoint into it."""
    run = RunFolder(spec.run_dir)
    latest = run.latest_checkpoint()
    if latest is None:
        raise SpecError(f"{run.checkpoints} holds no checkpoint of job {spec.name!r}: run `runner run` first")
    accelerator = resolve_accelerator(spec.accelerator)
    shards = pipeline.find_shards(spec.data.train)
    model, checkpoint = build.build_compiled(spec, shards.features, accelerator)
    step = build.restore(checkpoint, latest)
    log.info("restored %s (step %d) on %s x%d", latest, step, accelerator.kind, accelerator.replicas)
    return Trained(model, accelerator, latest, step, shards.features)


def evaluate(spec: JobSpec) -> dict:
    trained = load_trained(spec)
    if not spec.data.eval:
        raise SpecError(
            "data.eval is not set: name the shards to evaluate on (e.g. --set data.eval=DIR/test-*.tfrecord)"
        )
    shards = pipeline.find_shards(spec.data.eval)
    batch = _batch_for(spec, trained.accelerator)
    # Every record once: the last batch padded, its padding weighing 0 in the metrics and the loss.
    steps = pipeline.eval_steps(shards, batch, "data.eval")
    dataset = pipeline.make_dataset(
        shards, batch, spec.data.inputs, spec.data.label, training=False, preprocess=_preprocess(spec),
        autotune=spec.data.autotune, weighted=True,
    )
    try:
        results = trained.model.evaluate(dataset, steps=steps, return_dict=True, verbose=0)
    except tf.errors.OpError as exc:
        raise pipeline.input_error(exc, spec.data.eval, "data.eval") or exc from None
    metrics = {k: float(v) for k, v in results.items()}
    return {
        "job": spec.name, "checkpoint": trained.checkpoint, "step": trained.step,
        "accelerator": trained.accelerator.to_dict(), "examples": shards.records, "metrics": metrics,
    }


def _preprocess(spec: JobSpec):
    """data.preprocess, applied to TFRecord inputs exactly as in training."""
    if not spec.data.preprocess:
        return None
    return usercode.load_callable(spec.data.preprocess, "data.preprocess", ("features",), spec.code_roots)


def _batch_for(spec: JobSpec, accelerator: Accelerator) -> int:
    """The spec's global batch, rounded up to a multiple of this machine's replicas."""
    replicas = accelerator.replicas
    return -(-spec.data.global_batch_size // replicas) * replicas


def read_inputs(path: str, spec: JobSpec, features: dict) -> dict[str, np.ndarray]:
    """Rows to predict on: .npy (one input), .npz (arrays named by input feature) or TFRecord shards (a glob).

    TFRecords are decoded and preprocessed (data.preprocess) as in training; .npy/.npz rows are the model's
    inputs as they are.
    """
    inputs = spec.data.inputs
    suffix = Path(path).suffix
    if suffix == ".npy":
        if len(inputs) != 1:
            raise DataError(f"{path}: a .npy file holds one array, but the model takes {len(inputs)} inputs; use .npz")
        arrays = {inputs[0]: np.load(path, allow_pickle=False)}
    elif suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            missing = [n for n in inputs if n not in archive]
            if missing:
                raise DataError(f"{path} lacks arrays {missing}; it has {sorted(archive.files)}")
            arrays = {n: archive[n] for n in inputs}
    elif suffix == ".tfrecord" or "*" in path:
        shards = pipeline.find_shards(path)
        batches = pipeline.make_dataset(
            shards, 1, inputs, spec.data.label, training=False, preprocess=_preprocess(spec), autotune=spec.data.autotune
        )
        rows = [x for x, _ in batches.unbatch().batch(4096)]
        stacked = [x if isinstance(x, dict) else {inputs[0]: x} for x in rows]
        arrays = {n: np.concatenate([b[n].numpy() for b in stacked]) for n in inputs}
    else:
        raise DataError(f"{path}: predict reads .npy, .npz or TFRecord shards (*.tfrecord), not {suffix or 'this file'}")
    for name, array in arrays.items():
        expected = tuple(features[name].shape)
        if array.shape[1:] != expected:
            raise DataError(f"{path}: input {name!r} has rows of shape {array.shape[1:]}, the model expects {expected}")
    return arrays


def predict(spec: JobSpec, input_path: str) -> tuple[np.ndarray, Trained]:
    trained = load_trained(spec)
    arrays = read_inputs(input_path, spec, trained.features)
    rows = len(next(iter(arrays.values())))
    batch = _batch_for(spec, trained.accelerator)
    # Pad to whole batches: every replica gets an equal, static-shaped share (TPUs need both).
    padded = -(-rows // batch) * batch
    x = {n: np.concatenate([a.astype(np.float32), np.zeros((padded - rows, *a.shape[1:]), np.float32)]) for n, a in arrays.items()}
    dataset = tf.data.Dataset.from_tensor_slices(x[spec.data.inputs[0]] if len(x) == 1 else x).batch(batch, drop_remainder=True)
    outputs = trained.model.predict(dataset, verbose=0)
    return np.asarray(outputs)[:rows], trained
