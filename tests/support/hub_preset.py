"""A tiny KerasHub preset made offline: a GemmaBackbone of 2 layers (hidden 128, 8 query and 4 key-value heads of
32, vocabulary 512) with random weights, a SentencePiece tokenizer trained here on a few hundred lines, saved
with `save_to_preset` into a folder, as a real preset is (config.json, metadata.json, tokenizer assets, weights).
Real presets download from Kaggle or Hugging Face; this machine has no internet.

Also the prompt/response JSONL the language-model tests fine-tune on: a question about an animal, answered with
its colour, which is the same for every question about that animal, so a few steps of LoRA visibly learn it.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

VOCABULARY = 512
SEQUENCE_LENGTH = 24
ANIMALS = {"cat": "red", "dog": "blue", "bird": "green", "fish": "yellow"}
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]


def prompt(animal: str) -> str:
    return f"what color is the {animal}?"


def response(animal: str) -> str:
    return f"the {animal} is {ANIMALS[animal]}."


def _corpus(lines: int = 600) -> list[str]:
    """Made-up words of 1-3 syllables (enough distinct pieces for 512) and the test's own sentences."""
    rng = random.Random(0)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(1500)]
    text = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(lines)]
    return text + [f"{prompt(a)} {response(a)}" for a in ANIMALS] * 100


def make_preset(folder: Path) -> Path:
    """Writes the tiny preset into `folder` (made); returns it. Imports Keras and KerasHub: call it in a child
    process or a session fixture."""
    import keras
    import keras_hub
    import sentencepiece

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=proto, vocab_size=VOCABULARY, model_type="unigram",
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>",
        unk_piece="<unk>", minloglevel=2, num_threads=1,
    )
    keras.utils.set_random_seed(0)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=proto.getvalue())
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_query_heads=8, num_key_value_heads=4,
        hidden_dim=128, intermediate_dim=256, head_dim=32,
    )
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=SEQUENCE_LENGTH)
    keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor).save_to_preset(str(folder))
    return folder


def write_chats(path: Path, count: int = 96) -> Path:
    """`count` prompt/response lines as JSONL, the animals in a fixed random order."""
    rng = random.Random(1)
    animals = [rng.choice(list(ANIMALS)) for _ in range(count)]
    path.write_text("".join(json.dumps({"prompt": prompt(a), "response": response(a)}) + "\n" for a in animals))
    return path


if __name__ == "__main__":  # python -m tests.support.hub_preset FOLDER: the preset, for a look at it by hand
    import sys

    print(make_preset(Path(sys.argv[1])))
