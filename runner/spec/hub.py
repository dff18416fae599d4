"""`model.hub`: a KerasHub causal language model fine-tuned from its preset, checked when the spec loads (no
TensorFlow, no Keras). runner/train/hub.py builds it; `runner prepare text` writes its records
(docs/language-models.md).

A preset is what `keras_hub.models.CausalLM.from_preset` takes: a KerasHub preset name (`gemma3_1b`), a
`kaggle://OWNER/MODEL/keras/VARIATION[/VERSION]` or `hf://OWNER/NAME` handle, or a preset folder (on disk,
relative to the spec file, or gs://) as `save_to_preset` writes it: config.json and metadata.json among its
files. A folder on disk is read here; a name, a handle or a gs:// folder only when the job loads it.

A hub job's records hold what `CausalLMPreprocessor` makes of a text, written by `runner prepare text`:
the model's two inputs (`token_ids`, `padding_mask`), the label (`target_ids`: the next token at every position)
and the sample weight (`target_mask`: 1 where a token is learned from, 0 on padding and, for prompt/response
pairs, on the prompt). The data, loss and metric keys a hub job leaves unset are filled with these here.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from runner.spec.paths import resolve_path

TOKEN_IDS, PADDING_MASK, TARGET_IDS, TARGET_MASK = "token_ids", "padding_mask", "target_ids", "target_mask"
INPUTS = (TOKEN_IDS, PADDING_MASK)
# What save_to_preset writes and from_preset reads first (keras_hub/src/utils/preset_utils.py CONFIG_FILE,
# METADATA_FILE).
PRESET_FILES = ("config.json", "metadata.json")
MAX_LORA_RANK = 4096
# KerasHub CausalLM's own loss (its compile's default), the mean taken over the weighted tokens; a hub job's
# metrics are the language-model ones runner/train/hub.py adds (token_accuracy, perplexity), none of the spec's.
LOSS = {"class_name": "SparseCategoricalCrossentropy",
        "config": {"from_logits": True, "reduction": "mean_with_sample_weight"}}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_PART = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_HANDLES = {
    "kaggle": (re.compile(rf"{_PART}/{_PART}/{_PART}/{_PART}(/[0-9]+)?"),
               "kaggle://OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION], e.g. kaggle://keras/gemma3/keras/gemma3_1b"),
    "hf": (re.compile(rf"{_PART}/{_PART}"), "hf://OWNER/NAME, e.g. hf://google/gemma-3-1b-it"),
}


def check_preset(value: Any, context: dict | None) -> str:
    """The preset as the job will hand it to KerasHub: a name or handle as written, a local folder made absolute
    (relative to the spec file) and checked to be a preset folder."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} is not a preset: write a KerasHub preset name (e.g. gemma3_1b), a kaggle:// or "
                         "hf:// handle, or a preset folder")
    scheme, sep, rest = value.partition("://")
    if sep and scheme in _HANDLES:
        pattern, form = _HANDLES[scheme]
        if not pattern.fullmatch(rest):
            raise ValueError(f"{value!r} is not a {scheme}:// handle: write {form}")
        return value
    if sep and scheme != "gs":
        raise ValueError(f"{value!r}: {scheme}:// is not a preset source; use a preset name, kaggle://, hf://, "
                         "gs:// or a folder")
    if not sep and "/" not in value and not value.startswith((".", "~")):
        if not _NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a KerasHub preset name (letters, digits, '_', '.', '-'), e.g. "
                             "gemma3_1b; a folder is written with a '/' (./my_preset)")
        return value
    path = resolve_path(value, ("model", "hub"), context)
    if path.startswith("gs://") or not os.path.isabs(path):
        return path
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a folder: a preset folder holds {' and '.join(PRESET_FILES)} "
                         "(keras_hub save_to_preset writes it), or write a KerasHub preset name")
    missing = [name for name in PRESET_FILES if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise ValueError(f"{path} holds no {' and no '.join(missing)}: it is not a KerasHub preset folder "
                         "(save_to_preset writes them)")
    return path


def check_lora_rank(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LORA_RANK:
        raise ValueError(f"{value!r}: the LoRA rank is a whole number from 1 to {MAX_LORA_RANK} (4 to 16 is usual)")
    return value


def fill_defaults(doc: Any) -> Any:
    """A raw spec document with the keys a hub job leaves unset filled: its data's inputs, label and sample weight
    (the records `runner prepare text` writes), the loss it trains on and no metrics of the spec's (so the resolved
    spec says what runs), no SavedModel export (a generating model is served by `runner predict`), and JAX (the
    engine its models run on: `auto` would choose TensorFlow on a CPU, refused only as the model builds). Called
    before the spec is validated; anything the spec sets stays as it is (and is refused by job_problem if it
    cannot be)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict) or doc["model"].get("hub") is None:
        return doc
    doc = dict(doc)
    filled = {"data": {"inputs": list(INPUTS), "label": TARGET_IDS},
              "train": {"sample_weight": TARGET_MASK, "loss": LOSS, "metrics": []},
              "output": {"saved_model": False}, "accelerator": {"backend": "jax"}}
    for section, defaults in filled.items():
        given = doc.get(section, {})
        if isinstance(given, dict):
            doc[section] = {**defaults, **given}
    return doc


def job_problem(spec: Any) -> str | None:
    """What a hub job sets that it cannot run with, or None (read after the whole spec validated)."""
    model, train, data = spec.model, spec.train, spec.data
    if model.hub is None:
        return "model.lora_rank is LoRA on a KerasHub backbone: set model.hub" if model.lora_rank else None
    if "name" in model.model_fields_set or model.params:
        return (f"model.hub ({model.hub}) builds the model: remove model.name and model.params (a hub job's model is "
                "its preset's CausalLM)")
    loss = train.loss if isinstance(train.loss, str) else {"class_name": train.loss.class_name,
                                                           "config": dict(train.loss.config)}
    if loss != LOSS or train.metrics:
        return ("a model.hub job trains on its CausalLM's own loss (sparse categorical cross-entropy of the logits, "
                "padding and prompts weighed 0) and reports perplexity and token accuracy: remove train.loss and "
                "train.metrics")
    if tuple(data.inputs) != INPUTS or data.label != TARGET_IDS or train.sample_weight != TARGET_MASK:
        return (f"a model.hub job reads the records `runner prepare text` writes: data.inputs {list(INPUTS)}, "
                f"data.label {TARGET_IDS}, train.sample_weight {TARGET_MASK} (leave them unset)")
    if spec.accelerator.backend == "tensorflow":
        return ("a model.hub job runs Keras on JAX (KerasHub's language models on TPU are JAX's): "
                "set accelerator.backend: jax")
    return None


def records_problem(model: Any, manifest: dict[str, Any], manifest_path: str) -> str | None:
    """Records written with another tokenizer than a preset folder's backbone takes (their vocabularies differ),
    read without TensorFlow for `runner validate`; a name, a handle or a gs:// preset is compared when the job
    loads it (runner/train/hub.py `check_records`)."""
    size = ((manifest.get("preprocessing") or {}) if isinstance(manifest, dict) else {}).get("vocabulary_size")
    if model.hub is None or size is None or not os.path.isabs(model.hub):
        return None
    try:
        with open(os.path.join(model.hub, PRESET_FILES[0]), "rb") as handle:
            vocabulary = json.loads(handle.read(1 << 20)).get("config", {}).get("vocabulary_size")
    except (OSError, ValueError, AttributeError):
        return None  # the job's own load says what is wrong with the preset
    if vocabulary is None or int(vocabulary) == int(size):
        return None
    return (f"{manifest_path} holds token ids of a vocabulary of {size} and model.hub {model.hub}'s backbone has "
            f"{vocabulary}: prepare the records with its tokenizer, `runner prepare text ... --preset {model.hub}`")
