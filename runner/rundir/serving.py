"""The run's SavedModel (`saved_model/`), for TF Serving and TensorFlow without Keras or the runner.

Two endpoints:
    serve            the model's own inputs (what `model.export` writes; also `serving_default`)
    serve_examples   a batch of serialized tf.train.Example, as the shards hold them: parsed and decoded by
                     the runner's own parser (runner/data/schema.py) and passed through `data.preprocess`, so a
                     client sends records and gets the model's outputs with the exact input handling of
                     training

    loaded = tf.saved_model.load("runs/mnist_cnn/saved_model")
    loaded.serve_examples(tf.constant([record_bytes, ...]))     # -> the model's outputs

`serve_examples` parses the input features only (no label needed). A `data.preprocess` that needs the label
(or anything else a record without it lacks) cannot be traced that way: the SavedModel then has `serve`
alone and a warning says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from runner.device import engine

log = logging.getLogger(__name__)

SERVE, SERVE_EXAMPLES = "serve", "serve_examples"


_RECORDS = tf.TensorSpec([None], tf.string, name="examples")


def export(model: Any, path: str, examples_to_inputs: Callable[[tf.Tensor], Any] | None) -> list[str]:
    """Writes the SavedModel at `path`; returns the endpoints written (serve first: the serving default).

    `examples_to_inputs` maps a [batch] string tensor of serialized Examples to the model's inputs
    (data.example_inputs); None exports `serve` alone, as `model.export` does.
    """
    parse = None
    if examples_to_inputs is not None:
        try:
            parse = tf.function(examples_to_inputs, input_signature=[_RECORDS]).get_concrete_function()
        except Exception as exc:  # a preprocess that needs what a record without its label lacks
            cause = _first_cause(exc)
            log.warning("saved_model: no %s endpoint: data.preprocess could not be traced on the input features "
                        "alone (%s: %s)", SERVE_EXAMPLES, type(cause).__name__, (str(cause).splitlines() or [""])[0])
    if parse is None:
        model.export(path, verbose=False)  # Keras prints every exported variable unless told not to
        return [SERVE]
    archive = keras.export.ExportArchive()
    archive.track(model)
    # The model's inputs are what the parser produces, with the batch dimension left open.
    inputs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), parse.structured_outputs)
    # What differs per engine (a JAX model's call converted through jax2tf): runner/device/engine.py.
    engine.active().serving_endpoints(archive, model, inputs, examples_to_inputs, _RECORDS, (SERVE, SERVE_EXAMPLES))
    archive.write_out(path, verbose=False)
    return [SERVE, SERVE_EXAMPLES]


def _first_cause(exc: BaseException) -> BaseException:
    """The exception that started a chain: autograph's error handling can itself fail (an IndexError was seen)
    while handling the preprocess's own error (a KeyError for the label), and the first is the one to name."""
    for _ in range(16):
        earlier = exc.__cause__ or exc.__context__
        if earlier is None:
            break
        exc = earlier
    return exc
