"""`runner prepare text`: texts for a KerasHub causal LM (`model.hub`) -> records of token ids, made with the
preset's own tokenizer and packed as its `CausalLMPreprocessor` packs them (docs/language-models.md).

The input is a JSONL file of `{"prompt": ..., "response": ...}` objects (or `{"text": ...}`), or a text file of
one text per line. Every record is one text, never several packed together: the preset's start token, the
text's tokens (a prompt's, then its response's, each tokenized alone), the end token, truncated to
`sequence_length + 1` tokens and padded at the end with the tokenizer's padding id, then shifted as
`CausalLMPreprocessor` does (keras_hub/src/models/causal_lm_preprocessor.py): the inputs are the first
`sequence_length` tokens, the targets the next ones. `target_mask` is 1 where a target is learned from: a real
token (not padding) and, for a prompt/response pair, one of the response's (the end token included), so the model
learns to answer, not to ask. The manifest's `preprocessing` says all of it, with how many texts were truncated.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from runner import DataError, SpecError
from runner.data import rows
from runner.data.schema import Feature
from runner.prepare.datasets import Dataset
from runner.prepare.own import parse_split, split_rows
from runner.spec.hub import INPUTS, PADDING_MASK, TARGET_IDS, TARGET_MASK, TOKEN_IDS

log = logging.getLogger(__name__)
DEFAULT_SPLIT = "train=0.8,validation=0.1,test=0.1"
MAX_SEQUENCE_LENGTH = 1 << 17
_CHUNK = 512


def read_texts(path: str) -> tuple[list[str], list[str] | None]:
    """(texts, their responses or None): a JSONL file's prompt/response pairs or texts, or a text file's lines."""
    source = Path(path)
    if not source.is_file():
        raise DataError(f"{path} is not a file: runner prepare text reads a .jsonl of prompt/response (or text) "
                        "objects, or a text file of one text per line")
    lines = source.read_text(encoding="utf-8").splitlines()
    if source.suffix.lower() not in (".jsonl", ".json"):
        texts = [line for line in lines if line.strip()]
        if not texts:
            raise DataError(f"{path} holds no text (one text per line)")
        return texts, None
    prompts, responses, kinds = [], [], set()
    for number, line, row in rows.json_lines(path, lines):
        keys = set(row) if isinstance(row, dict) else set()
        kind = "pair" if keys == {"prompt", "response"} else "text" if keys == {"text"} else None
        if kind is None or not all(isinstance(v, str) for v in row.values()):
            raise DataError(f"{path}:{number}: {line.strip()[:80]!r} is not {{\"prompt\": TEXT, \"response\": TEXT}} "
                            "or {\"text\": TEXT}")
        kinds.add(kind)
        if len(kinds) > 1:
            raise DataError(f"{path}:{number}: a {kind} among the earlier lines' other kind: one file holds "
                            "prompt/response pairs or texts, not both")
        prompts.append(row.get("prompt", row.get("text")))
        responses.append(row.get("response"))
    if not prompts:
        raise DataError(f"{path} holds no JSON objects (one a line)")
    return prompts, (responses if kinds == {"pair"} else None)


def load_preprocessor(preset: str, sequence_length: int) -> Any:
    """The preset's `CausalLMPreprocessor` (its tokenizer and packer) at `sequence_length`."""
    import keras_hub

    from runner.train.hub import fresh_preset

    try:
        with fresh_preset(preset):
            return keras_hub.models.CausalLMPreprocessor.from_preset(preset, sequence_length=sequence_length)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise SpecError(f"--preset {preset!r}: KerasHub cannot load its CausalLM preprocessor: {exc}") from None


def tokenize(preprocessor: Any, prompts: list[str], responses: list[str] | None) -> dict[str, np.ndarray]:
    """The four features (see the module docstring) for every text, and `truncated`: the texts cut short."""
    length = preprocessor.sequence_length
    if not preprocessor.built:
        preprocessor.build(None)  # its packer is made here
    tokenizer, packer = preprocessor.tokenizer, preprocessor.packer
    starts = _values(packer.start_value) if preprocessor.add_start_token else []
    ends = _values(packer.end_value) if preprocessor.add_end_token else []
    end = len(ends)
    pad = int(packer.pad_value if packer.pad_value is not None else 0)
    out = {name: [] for name in (TOKEN_IDS, PADDING_MASK, TARGET_IDS, TARGET_MASK)}
    truncated = 0
    for first in range(0, len(prompts), _CHUNK):
        asked = _ids(tokenizer(prompts[first:first + _CHUNK]))
        answered = _ids(tokenizer(responses[first:first + _CHUNK])) if responses is not None else None
        for i, prompt in enumerate(asked):
            ids = starts + prompt
            learned_from = len(ids) if answered is not None else 1  # the first target a pair learns from
            ids += (answered[i] if answered is not None else []) + ends
            if len(ids) > length + 1:
                truncated += 1
                ids = ids[: length + 1 - end] + ids[len(ids) - end:]  # the end token stays, as the packer keeps it
            real = len(ids)
            ids = np.array(ids + [pad] * (length + 1 - real), np.int64)
            mask = np.arange(length + 1) < real
            out[TOKEN_IDS].append(ids[:-1])
            out[PADDING_MASK].append(mask[:-1].astype(np.int64))
            out[TARGET_IDS].append(ids[1:])
            weight = mask[1:].astype(np.float32)
            weight[: max(0, learned_from - 1)] = 0.0
            out[TARGET_MASK].append(weight)
    arrays = {name: np.stack(rows) for name, rows in out.items()}
    arrays["truncated"] = np.array(truncated)
    return arrays


def _values(value: Any) -> list[int]:
    """A packer's start or end value (one id, several, or none) as a list of ids."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) or hasattr(value, "__iter__") else [int(value)]


def _ids(tokens: Any) -> list[list[int]]:
    if hasattr(tokens, "to_list"):  # a tf.RaggedTensor (KerasHub's tf.data workflow)
        return [[int(t) for t in row] for row in tokens.to_list()]
    return [[int(t) for t in np.asarray(row).ravel()] for row in tokens]


def text_dataset(path: str, preset: str | None, sequence_length: int | None, split: str | None = None) -> Dataset:
    """`runner prepare text PATH --preset P --sequence-length N`: the records of every split, the preset and the
    layout in the manifest's `preprocessing`."""
    if not preset:
        raise SpecError("runner prepare text needs --preset: the KerasHub preset the job fine-tunes (model.hub), "
                        "whose tokenizer makes the token ids")
    if sequence_length is None or not 2 <= sequence_length <= MAX_SEQUENCE_LENGTH:
        raise SpecError(f"runner prepare text needs --sequence-length N (2 to {MAX_SEQUENCE_LENGTH}): the tokens of a "
                        f"record, e.g. 256 (given: {sequence_length})")
    prompts, responses = read_texts(path)
    fractions = parse_split(split or DEFAULT_SPLIT)
    rows = split_rows(len(prompts), fractions, path)
    preprocessor = load_preprocessor(preset, sequence_length)
    arrays = tokenize(preprocessor, prompts, responses)
    truncated = int(arrays.pop("truncated"))
    if truncated:
        log.warning("%d of %d texts are longer than %d tokens and were truncated (their end token kept)",
                    truncated, len(prompts), sequence_length + 1)
    features = {name: Feature("float32" if name == TARGET_MASK else "int64", (sequence_length,)) for name in arrays}
    splits = {name: {k: v[chosen] for k, v in arrays.items()} for name, chosen in rows.items()}
    stem = Path(path).name.split(".")[0] or "text"
    preprocessing = {
        "preset": preset,
        "preprocessor": type(preprocessor).__name__,
        "tokenizer": type(preprocessor.tokenizer).__name__,
        "vocabulary_size": int(preprocessor.tokenizer.vocabulary_size()),
        "sequence_length": sequence_length,
        "layout": "padded: one text a record, start and end tokens added, padded at the end (never packed)",
        "texts": "prompt/response pairs: the loss is on the response" if responses is not None
        else "texts: the loss is on every token",
        "truncated": truncated,
        "sample_weight": TARGET_MASK,
    }
    return Dataset(
        stem, splits, features, INPUTS, TARGET_IDS, source=f"{os.path.abspath(path)} (runner prepare text)",
        license="as the data's owner states", preprocessing=preprocessing,
    )
