"""A `model.hub` job's model: the preset's KerasHub CausalLM, with LoRA adapters when `model.lora_rank` is set,
compiled on its own loss and the language-model metrics (docs/language-models.md).

- Built by `keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, dtype=...)`: the task class the
  preset names (GemmaCausalLM, Gemma3CausalLM, LlamaCausalLM...), its weights, no preprocessor: the records hold
  token ids already (`runner prepare text`, runner/prepare/lm.py). Loaded in the job's precision (bfloat16:
  the `mixed_bfloat16` policy, float32 variables and bfloat16 arithmetic), not the dtype the preset was saved in.
- `backbone.enable_lora(rank)`: every query and value projection gains two trainable low-rank matrices; the
  backbone's own weights are frozen (KerasHub `Backbone.enable_lora`).
- The loss is the one KerasHub's `CausalLM.compile` sets, sparse categorical cross-entropy of the logits, with
  the records' `target_mask` as sample weights (padding and prompts weigh 0), reduced as the mean over the
  weighted tokens (`mean_with_sample_weight`) so that a batch's loss is its mean token loss.
- Metrics: `token_accuracy` (the next token predicted right, over the weighted tokens) and `perplexity`
  (KerasHub's `Perplexity`: exp of the mean token cross-entropy, accumulated over every token of the split, so
  exact over an evaluation whatever its batches), both weighted: Keras hands sample weights only to
  weighted metrics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import keras

from runner import SpecError
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)
LM_METRICS = ("token_accuracy", "perplexity")


def _keras_hub() -> Any:
    try:
        import keras_hub
    except ImportError as exc:
        raise SpecError(f"model.hub needs keras-hub: pip install --no-deps -r requirements-hub-nodeps.txt ({exc})"
                        ) from None
    return keras_hub


@contextlib.contextmanager
def fresh_preset(preset: str) -> Iterator[None]:
    """A gs:// preset read afresh: KerasHub copies a gs:// preset's files into KERAS_HOME's cache and never reads
    the bucket again while a copy is there (keras_hub/src/utils/preset_utils.py `tf_copy_gfile_to_cache`), so a
    preset written anew under the same path would be the old one without a word. Here the cache is a temporary
    folder for the one load. Names and handles keep KerasHub's and kagglehub's own caches (versioned)."""
    if not preset.startswith("gs://"):
        yield
        return
    before = os.environ.get("KERAS_HOME")
    with tempfile.TemporaryDirectory(prefix="runner-preset-") as home:
        os.environ["KERAS_HOME"] = home
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("KERAS_HOME", None)
            else:
                os.environ["KERAS_HOME"] = before


def build_causal_lm(spec: JobSpec, accelerator: Any, policy: str | None = None) -> Any:
    """The preset's CausalLM without its preprocessor, LoRA enabled at model.lora_rank, for `accelerator`
    (runner/device/accelerator.py), whose engine must run KerasHub's language models; call inside its scope (a
    sharded job's layout applies to the variables made here)."""
    keras_hub = _keras_hub()
    if not accelerator.engine.runs_hub_models:  # `auto` on a CPU chose TensorFlow
        raise SpecError(f"model.hub ({spec.model.hub}) runs Keras on JAX, not {accelerator.engine.name} "
                        f"({accelerator.engine.reason}): set accelerator.backend: jax")
    # The preset's config.json names its own dtype policy, which would win over Keras's global one.
    dtype = "float32" if policy in (None, "float32") else f"mixed_{policy}"
    try:
        with fresh_preset(spec.model.hub):
            model = keras_hub.models.CausalLM.from_preset(spec.model.hub, preprocessor=None, dtype=dtype)
    except (FileNotFoundError, ValueError, OSError, KeyError) as exc:
        raise SpecError(f"model.hub: KerasHub cannot build a CausalLM from the preset {spec.model.hub!r}: {exc}"
                        ) from None
    if spec.model.lora_rank:
        model.backbone.enable_lora(spec.model.lora_rank)
    trainable = sum(_size(v) for v in model.trainable_weights)
    log.info("model.hub %s: %s (%s), %s parameters, %s trainable%s", spec.model.hub, type(model).__name__,
             type(model.backbone).__name__, f"{model.count_params():,}", f"{trainable:,}",
             f" (LoRA rank {spec.model.lora_rank})" if spec.model.lora_rank else "")
    return model


def check_records(model: Any, manifest: dict[str, Any] | None, preset: str) -> None:
    """The records were made for this model: their tokenizer's vocabulary is the backbone's (token ids of another
    tokenizer train without an error and mean nothing; on a TPU an id past the vocabulary is not even refused).
    SpecError (exit 2) naming both; another preset of the same vocabulary (a copy in a bucket) is only logged."""
    said = (manifest or {}).get("preprocessing") or {}
    size, theirs = said.get("vocabulary_size"), said.get("preset")
    vocabulary = getattr(model.backbone, "vocabulary_size", None)
    if size is not None and vocabulary is not None and int(size) != int(vocabulary):
        raise SpecError(f"data.train's records hold token ids of {theirs}'s tokenizer, a vocabulary of {size}, and "
                        f"model.hub {preset}'s backbone has {vocabulary}: prepare them again with "
                        f"`runner prepare text ... --preset {preset}`")
    if theirs is not None and theirs != preset:
        log.info("data.train was prepared with the preset %s, model.hub is %s: the same vocabulary of %s", theirs,
                 preset, vocabulary)


def compile_causal_lm(model: Any, optimizer: Any, steps_per_execution: int) -> None:
    keras_hub = _keras_hub()
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
        weighted_metrics=[
            keras.metrics.SparseCategoricalAccuracy(name="token_accuracy"),
            keras_hub.metrics.Perplexity(from_logits=True, name="perplexity"),
        ],
        steps_per_execution=steps_per_execution,
    )


def count(model: Any, features: dict[str, Any]) -> tuple[float | None, str]:
    """(training FLOPs of one record, the method): runner/train/flops.py `lm_flops_per_token` x its tokens."""
    tokens = tokens_per_record(features)
    backbone = model.backbone
    embedding = getattr(backbone, "token_embedding", None)
    tied = getattr(embedding, "tie_weights", True)
    vocabulary, hidden = getattr(backbone, "vocabulary_size", 0), getattr(backbone, "hidden_dim", 0)
    if not tokens or not vocabulary or not hidden:
        return None, f"not counted: {type(backbone).__name__} does not say its vocabulary, width or the tokens"
    per_token, method = lm_flops_per_token(
        parameters=backbone.count_params(),
        lookup=0 if tied else int(vocabulary) * int(hidden),
        trainable=sum(_size(v) for v in model.trainable_weights),
        layers=int(getattr(backbone, "num_layers", 0) or 0),
        attention_width=_attention_width(backbone),
        tokens=tokens,
    )
    return per_token * tokens, method


def lm_flops_per_token(parameters: int, lookup: int, trainable: int, layers: int, attention_width: int,
                       tokens: int) -> tuple[float, str]:
    """(training FLOPs per token of a decoder-only language model, the method), PaLM's way (Chowdhery et al. 2022,
    "PaLM: Scaling Language Modeling with Pathways", appendix B: 6N + 12LHQT).

    N = `parameters` less `lookup` (an input embedding table that is not also the output projection: a lookup,
    no arithmetic; a tied table is counted, as the logits' matmul). Each of the N weights costs 2 FLOPs a token
    forward, 2 for the gradient with respect to the activations and 2 for its own gradient: 6N when all train.
    Frozen weights (LoRA) have no gradient of their own: 4N + 2 x `trainable`. Attention's two products of T
    positions over H heads of size Q (H x Q = `attention_width`) add 12 x L x H x Q x T (forward 4LHQT, backward
    twice that), counted over the whole T x T score matrix as PaLM does; MaxText's
    calculate_tflops_training_per_device halves it for the causal mask, so its MFU reads lower for the same run."""
    weights = max(0, parameters - lookup)
    dense = 6 * weights if trainable >= weights else 4 * weights + 2 * trainable
    attention = 12 * layers * attention_width * tokens
    frozen = "" if trainable >= weights else f"; frozen weights without their gradient (4N + 2 x {trainable:,})"
    method = (f"palm: 6N + 12LHQT per token (PaLM appendix B) with N {weights:,}, L {layers}, HQ {attention_width}, "
              f"T {tokens}{frozen}")
    return float(dense + attention), method


def add_token_throughput(summary: dict[str, Any], features: dict[str, Any]) -> None:
    """The summary's throughput block (runner/train/flops.py `throughput_block`) with a language model's figures:
    tokens per record, tokens per second (timing.examples_per_sec x tokens: steady epochs, all devices) and
    training FLOPs per token."""
    block, tokens = summary.get("throughput"), tokens_per_record(features)
    if not block or not tokens:
        return
    per_example, per_s = block.get("model_flops_per_example"), summary["timing"].get("examples_per_sec")
    block["tokens_per_example"] = tokens
    block["tokens_per_sec"] = None if per_s is None else float(f"{per_s * tokens:.4g}")
    block["model_flops_per_token"] = None if per_example is None else float(f"{per_example / tokens:.4g}")


def tokens_per_record(features: dict[str, Any]) -> int | None:
    """Tokens of one record: the length of its token_ids feature."""
    shape = getattr(features.get("token_ids"), "shape", None)
    return int(shape[-1]) if shape else None


def _size(variable: Any) -> int:
    size = 1
    for dim in variable.shape:
        size *= int(dim)
    return size


def _attention_width(backbone: Any) -> int:
    """Query heads x head size: the width of attention's score and value products (PaLM's H x Q)."""
    heads = getattr(backbone, "num_query_heads", None) or getattr(backbone, "num_heads", None)
    head_dim = getattr(backbone, "head_dim", None)
    if heads and head_dim:
        return int(heads) * int(head_dim)
    return int(getattr(backbone, "hidden_dim", 0) or 0)
