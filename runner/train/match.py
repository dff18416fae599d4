"""What a TensorFlow checkpoint or a model.keras holds, against the model as built now, by the store's own naming
(the match itself, and why it is made this way: runner/rundir/matching.py).

A TensorFlow checkpoint keys each variable by its shortest path through the object graph saved with it
(`optimizer/_trainable_variables/2/.ATTRIBUTES/VARIABLE_VALUE`, `model/_operations/3/moving_mean/...`). The
model's list is made by the same traversal TensorFlow's save makes (`ObjectGraphView.breadth_first_traversal`,
`object_path_to_string`), once every variable exists: the model built and the optimizer's slots made. What a
restore would otherwise make later is exactly what TensorFlow restores out of sight: a variable created after
`restore()` receives its value, or a shape clash, when it is created, and `expect_partial()` silences every
value nothing claims.

model.keras keys each variable by Keras's walk of the model's layers (`layers/dense_1/vars/0`); the model's list
is the same walk, written to memory. Its optimizer state is left out: evaluation and prediction do not use it.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

import keras
import tensorflow as tf

from runner import SpecError
from runner.rundir import matching
from runner.rundir.matching import Held

_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
# Variables that hold a spec setting, not something learned (runner/rundir/matching.py): left out of the match.
_SETTINGS = ("/_learning_rate" + _VALUE,)


def _setting(key: str) -> bool:
    return key.startswith("optimizer/") and key.endswith(_SETTINGS)


def make_every_variable(model: Any, element_spec: Any = None) -> None:
    """Creates the model's variables (from `element_spec`, a batch's shapes, when the model is not built yet)
    and its optimizer's slots, so that a match sees all of them and a restore leaves none for later."""
    with model.distribute_strategy.scope() if hasattr(model, "distribute_strategy") else _nothing():
        if not model.built:
            try:
                if element_spec is None:
                    raise ValueError("no batch to build it from")
                model._symbolic_build(data_batch=element_spec)
            except Exception as exc:  # noqa: BLE001 - Keras's reason is in the message
                raise SpecError(
                    f"model {model.name!r} has no variables before its first call ({type(exc).__name__}: {exc}), "
                    "so its checkpoint cannot be matched to it: build it in the build function (start it with "
                    "keras.Input(shape), or call model.build(input_shape) before returning it)"
                ) from None
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def restore_tensorflow(checkpoint: tf.train.Checkpoint, path: str, element_spec: Any = None, *, read: bool = True,
                       complete: bool = False) -> None:
    """Every variable made, matched (SpecError naming each difference) and only then restored; with `read` False
    only matched (`complete`: the job is finished, and a refusal says so).

    A checkpoint whose optimizer kept its learning rate in a variable (a constant rate) resumed under a schedule,
    or the reverse, numbers the optimizer's other variables (its slots) one apart: they are matched and restored
    through a twin of the optimizer in the checkpoint's form, then copied."""
    model, optimizer = checkpoint.model, checkpoint.optimizer
    make_every_variable(model, element_spec)
    saved = tensorflow_saved(path)
    twin = _optimizer_in_form_of(optimizer, model, _keeps_rate(path))
    if twin is None:
        matching.check(path, saved, tensorflow_live(checkpoint), complete=complete)
        if read:  # every value has its variable now: expect_partial only quiets those left out of the match
            checkpoint.restore(path).expect_partial()
        return
    model.optimizer = twin  # the model tracks its optimizer too: the twin stands where the checkpoint's stood
    try:
        target = tf.train.Checkpoint(model=model, optimizer=twin)
        matching.check(path, saved, tensorflow_live(target), complete=complete)
        if read:
            target.restore(path).expect_partial()
    finally:
        model.optimizer = optimizer
    if read:
        for mine, theirs in zip(_learned(optimizer), _learned(twin), strict=True):
            mine.assign(theirs)


def _keeps_rate(path: str) -> bool:
    return any(_setting(key) for key in tf.train.load_checkpoint(path).get_variable_to_shape_map())


def _learned(optimizer: Any) -> list:
    return [v for v in optimizer.variables if str(v.path).rsplit("/", 1)[-1] != "learning_rate"]


def _optimizer_in_form_of(optimizer: Any, model: Any, keeps_rate: bool) -> Any:
    """None when `optimizer` keeps its rate as the checkpoint did; else a built twin that does."""
    scheduled = isinstance(getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule)
    if scheduled != keeps_rate or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    rate = 1e-3 if keeps_rate else keras.optimizers.schedules.ExponentialDecay(1e-3, 1, 1.0)
    with model.distribute_strategy.scope() if hasattr(model, "distribute_strategy") else _nothing():
        twin = type(optimizer).from_config({**optimizer.get_config(), "learning_rate": rate})
        twin.build(model.trainable_variables)
    return twin


def tensorflow_saved(path: str) -> dict[str, Held]:
    """Every variable of the checkpoint at `path`: its key, shape and dtype, from the checkpoint's own index."""
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
    return {
        key: Held(key, tuple(int(d) for d in shapes[key]), dtypes[key].name)
        for key in sorted(shapes) if key.endswith(_VALUE) and not key.startswith("save_counter/") and not _setting(key)
    }


def tensorflow_live(checkpoint: tf.train.Checkpoint) -> dict[str, Held]:
    """Every variable the checkpoint object would save now, keyed as TensorFlow's save keys it."""
    from tensorflow.python.checkpoint import graph_view
    from tensorflow.python.trackable import trackable_utils

    objects, paths = graph_view.ObjectGraphView(checkpoint).breadth_first_traversal()
    found = {}
    for obj in objects:
        if not isinstance(obj, (tf.Variable, keras.Variable)):
            continue
        key = trackable_utils.object_path_to_string(paths[obj]) + _VALUE
        if key.startswith("save_counter/") or _setting(key):
            continue
        found[key] = Held(key, tuple(int(d) for d in obj.shape), tf.as_dtype(obj.dtype).name,
                          getattr(obj, "path", None) or getattr(obj, "name", None))
    return found


_WEIGHTS = "model.weights.h5"


# Keras's load casts a floating value to its variable's dtype: a floating width is no change of the model. (A LoRA
# layer saves its kernel merged with its adapters in its compute dtype: bfloat16 under mixed precision, which h5
# holds as opaque 2-byte values with a `dtype: bfloat16` attribute.)
_FLOATING = ("float16", "bfloat16", "float32", "float64")


def _h5_variables(h5: Any) -> dict[str, Held]:
    import h5py

    found: dict[str, Held] = {}

    def add(name: str, item: Any) -> None:
        if isinstance(item, h5py.Dataset) and not name.startswith("optimizer/"):
            dtype = str(item.attrs.get("dtype") or item.dtype)
            found[name] = Held(name, tuple(int(d) for d in item.shape), "floating" if dtype in _FLOATING else dtype)

    h5.visititems(add)
    return found


def keras_file_saved(path: str) -> dict[str, Held]:
    """The model's variables in a .keras file (not its optimizer's)."""
    import h5py

    with tf.io.gfile.GFile(path, "rb") as raw, zipfile.ZipFile(io.BytesIO(raw.read())) as archive:
        with h5py.File(io.BytesIO(archive.read(_WEIGHTS)), "r") as h5:
            return _h5_variables(h5)


def keras_file_live(model: Any) -> dict[str, Held]:
    """The model's variables as Keras's save would write them into a .keras file, with their Keras names."""
    import h5py
    from keras.src.saving import saving_lib

    buffer = io.BytesIO()
    store = saving_lib.H5IOStore(buffer, mode="w")
    saving_lib._save_state(model, weights_store=store, assets_store=None, inner_path="", visited_saveables=set())
    store.close()
    with h5py.File(io.BytesIO(buffer.getvalue()), "r") as h5:
        return _h5_variables(h5)
