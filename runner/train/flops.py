"""How much arithmetic a model's training step does, and how close a run came to the device's peak (MFU).

The convention (the one MFU is defined with, PaLM paper appendix B, and docs/performance.md):
  * a multiply-add is 2 FLOPs;
  * one training example costs its forward pass plus a backward pass of twice the forward's FLOPs (the
    gradients with respect to the activations and to the weights, each about one forward), so 3x forward.
These are the model's FLOPs, not the kernels': a step that skips the input gradient of the first layer (as
TensorFlow does) or recomputes activations does not change them, so MFU compares runs across devices and
frameworks. Elementwise work (activations, pooling, dropout) is counted where TensorFlow's cost analysis counts
it and left out of the per-layer arithmetic; it is a few percent for the built-in models.

`count` asks the job's engine first (runner/device/engine.py `count_forward`): under JAX, XLA's cost analysis of
the lowered forward pass; under TensorFlow, its profiler's `float_ops` over the graph of the traced forward pass
(the cost functions TensorFlow registers per op: MatMul, Conv2D, BiasAdd, ...). That analysis does not look inside loop
bodies (`While`: Keras 3's LSTM and GRU on a CPU), so a graph holding control flow is counted per layer instead
(Dense, convolutions, LSTM/GRU/SimpleRNN, Embedding as a lookup of 0 FLOPs); a model with a weighted layer the
arithmetic does not know gets no count rather than a wrong one. TensorFlow 2.21 offers XLA's HLO text
(`experimental_get_compiler_ir(...)(stage="hlo")`) but no Python access to XLA's cost analysis.

No TensorFlow is imported until a model is counted: `throughput_block` is plain arithmetic.
"""

from __future__ import annotations

import math
from typing import Any

from runner.device import engine
from runner.device.engine import CONTROL_FLOW_OPS, Engine

BACKWARD_FACTOR = 2  # backward = 2x forward, by convention
_LIMIT = "the arithmetic knows Dense, Conv, DepthwiseConv, LSTM, GRU, SimpleRNN, Embedding, Bidirectional"


def count(model: Any, batch_size: int | None = None, computes: Engine | None = None) -> tuple[float | None, str]:
    """(FLOPs of one training example, forward + backward, by the convention above; how they were counted).

    `batch_size`: the batch the graph is traced at (the FLOPs are divided by it; a few ops such as the loss's
    mean do not scale with it). The count is None when neither method can count the model; the method then
    says why. `computes`: the job's engine (`accelerator.engine`; this process's by default), whose own cost
    analysis counts the forward pass (runner/device/engine.py `count_forward`).
    """
    batch = max(1, int(batch_size or 1))
    computes = computes or engine.active()
    try:
        specs = _input_specs(model, batch)
    except Exception as exc:  # a model without symbolic inputs (subclassed, never built): the per-layer count
        forward, why_not_traced = None, f"the forward pass could not be traced ({type(exc).__name__}: {exc})"
    else:
        forward, why_not_traced = computes.count_forward(model, specs, batch)
    if forward:
        return forward * (1 + BACKWARD_FACTOR), computes.flops_method
    forward, unknown = _layer_forward(model)
    if unknown:
        return None, f"not counted: {why_not_traced}; per layer: {unknown} ({_LIMIT})"
    return forward * (1 + BACKWARD_FACTOR), f"layers: per-layer arithmetic of the forward pass, x3 ({why_not_traced})"


def _input_specs(model: Any, batch: int) -> Any:
    """TensorSpecs of the model's inputs at `batch`, in the structure the model is called with."""
    import tensorflow as tf

    try:
        structure = model.input  # a functional model: its inputs as declared (one, a list or a dict)
    except (AttributeError, ValueError):
        structure = model.inputs  # a Sequential model built from keras.Input: a list of one
        structure = structure[0] if len(structure) == 1 else structure
    return tf.nest.map_structure(lambda t: tf.TensorSpec((batch, *t.shape[1:]), t.dtype), structure)


def _layer_forward(model: Any) -> tuple[float, str]:
    """(Forward FLOPs per example summed over the model's layers, the layers the arithmetic cannot count)."""
    total, unknown = 0.0, []
    for layer in _leaf_layers(model):
        flops = layer_forward_flops(layer)
        if flops is None:
            unknown.append(f"{layer.name} ({type(layer).__name__})")
        else:
            total += flops
    return total, ", ".join(unknown)


def _leaf_layers(model: Any) -> list[Any]:
    found = []
    for layer in model.layers:
        found.extend(_leaf_layers(layer) if hasattr(layer, "layers") and layer.layers else [layer])
    return found


def _shape(tensor: Any) -> tuple[int | None, ...]:
    return tuple(tensor.shape[1:])


def _known(*dims: int | None) -> bool:
    return all(d is not None for d in dims)


def layer_forward_flops(layer: Any) -> float | None:
    """Forward FLOPs per example of one Keras layer (multiply-add = 2); 0 for a layer without weights
    (elementwise, reshaping) and for normalisation and embedding lookups; None when the layer has weights
    the arithmetic does not know, or a dimension is unknown (a sequence of unfixed length)."""
    kind = type(layer).__name__
    if kind == "Bidirectional":
        parts = [layer_forward_flops(layer.forward_layer), layer_forward_flops(layer.backward_layer)]
        return None if None in parts else sum(parts)
    if not layer.weights or kind in ("Embedding", "BatchNormalization", "LayerNormalization",
                                     "GroupNormalization", "Normalization"):
        return 0.0
    try:
        inputs, outputs = _shape(layer.input), _shape(layer.output)
    except (AttributeError, ValueError):  # a layer used more than once, or never called symbolically
        return None
    if kind in ("LSTM", "GRU", "SimpleRNN"):
        steps, features, units = inputs[0], inputs[-1], layer.units
        if not _known(steps, features):
            return None
        gates = {"LSTM": 4, "GRU": 3, "SimpleRNN": 1}[kind]
        return float(steps * gates * 2 * units * (features + units))
    if not _known(*outputs):
        return None
    if kind == "Dense" or (kind.startswith("Conv") and "Transpose" not in kind):
        # Dense kernel (in, units); Conv kernel (*window, in / groups, filters): every output value is a dot
        # product over all of the kernel's dimensions but the last.
        return float(2 * math.prod(outputs) * math.prod(layer.kernel.shape[:-1]))
    if kind.startswith("DepthwiseConv"):
        return float(2 * math.prod(outputs) * math.prod(layer.kernel.shape[:-2]))
    return None


def step_flops(model: Any, batch_size: int) -> float | None:
    """FLOPs TensorFlow's profiler counts in one traced training step (forward, loss and gradients, no optimizer
    update) per example: what the kernels execute, below the convention's 3x forward where a gradient is not
    needed (the first layer's input). For comparison only; None when the graph holds loops."""
    import tensorflow as tf
    from tensorflow.python.profiler import model_analyzer, option_builder

    specs = _input_specs(model, batch_size)
    label = tf.TensorSpec((batch_size,), tf.int64)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = tf.function(step, autograph=False).get_concrete_function(specs, label).graph  # as Keras's own step
    if any(op.type in CONTROL_FLOW_OPS for op in graph.get_operations()):
        return None
    options = option_builder.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    return model_analyzer.profile(graph, options=options).total_float_ops / batch_size


def throughput_block(
    flops_per_example: float | None,
    method: str,
    steady_examples_per_s: float | None,
    devices: int,
    peak: float | None,
    peak_source: str,
) -> dict[str, Any]:
    """The summary's `throughput` block (runner/rundir/summary.schema.json).

    `steady_examples_per_s`: the summary's timing.examples_per_sec (steady epochs only, the compiling first one
    left out), over all `devices` (the summary's accelerator.replicas); `peak`: TFLOP/s of one device and
    `peak_source` where it comes from (runner/device/peak.py). Achieved TFLOP/s per device = FLOPs per example x
    examples/s / devices; MFU = that / peak. A field that cannot be computed is null and `why_null` says why.
    """
    why = []
    if flops_per_example is None:
        why.append(f"model FLOPs: {method}")
    if steady_examples_per_s is None:
        why.append("no steady epoch (timing.examples_per_sec is null: one epoch, or none finished)")
    achieved = None
    if flops_per_example is not None and steady_examples_per_s is not None:
        achieved = flops_per_example * steady_examples_per_s / max(1, devices) / 1e12
    if peak is None:
        why.append(f"peak: {peak_source}")
    mfu = achieved / peak if achieved is not None and peak else None
    return {
        "model_flops_per_example": _significant(flops_per_example),
        "flops_method": method,
        "tflops_per_device": _significant(achieved),
        "peak_tflops_per_device": _significant(peak),
        "peak_source": peak_source,
        "mfu": _significant(mfu),
        "why_null": "; ".join(why) or None,
    }


def _significant(value: float | None, digits: int = 4) -> float | None:
    """Four significant figures: a CPU's 0.02 TFLOP/s and a TPU's 180 both keep theirs."""
    return None if value is None else float(f"{value:.{digits}g}")
