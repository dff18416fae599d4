"""`runner predict` on a `model.hub` job: text generated from prompts by the trained CausalLM
(`CausalLM.generate`), with its preset's own preprocessor and tokenizer (docs/language-models.md).

Prompts come from a .txt file (one a line) or a .jsonl file (`{"prompt": ...}` or `{"text": ...}` a line). The
sampler is greedy by default (the most likely next token every time: the same answer for the same prompt);
`max_length` counts the prompt's tokens and the generated ones together, the records' sequence length unless
given. Each answer is a JSON line: the prompt, the whole text generated (prompt included, as KerasHub returns
it) and the response (what follows the prompt).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from runner import DataError, SpecError
from runner.data import rows
from runner.job.predict import Trained, load_trained
from runner.spec.types import JobSpec
from runner.train import hub

SAMPLERS = ("greedy", "top_k", "top_p", "beam", "random", "contrastive")
MAX_LENGTH = 1 << 17


@dataclasses.dataclass(frozen=True)
class Generated:
    lines: list[dict]
    trained: Trained
    notes: list[str]


def read_prompts(path: str) -> list[str]:
    source = Path(path)
    if not source.is_file():
        raise SpecError(f"--input {path}: not a file; a model.hub job takes prompts as a .txt (one a line) or a "
                        ".jsonl ({\"prompt\": TEXT} a line)")
    lines = source.read_text(encoding="utf-8").splitlines()
    if source.suffix.lower() not in (".jsonl", ".json"):
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for number, line, row in rows.json_lines(path, lines):
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: {line.strip()[:80]!r} holds no \"prompt\" (or \"text\") string")
            prompts.append(text)
    if not prompts:
        raise DataError(f"{path} holds no prompt")
    return prompts


def generate(spec: JobSpec, input_path: str, max_length: int | None = None, sampler: str = "greedy",
             checkpoint: str | None = None) -> Generated:
    """Text the job's trained CausalLM generates for every prompt of `input_path`."""
    import keras_hub

    if sampler not in SAMPLERS:
        raise SpecError(f"--sampler {sampler!r}: one of {', '.join(SAMPLERS)} (KerasHub's samplers)")
    if max_length is not None and not 2 <= max_length <= MAX_LENGTH:
        raise SpecError(f"--max-length {max_length}: tokens of prompt and answer together, 2 to {MAX_LENGTH}")
    prompts = read_prompts(input_path)
    trained = load_trained(spec, checkpoint)
    length = max_length or int(trained.features["token_ids"].shape[-1])
    model = trained.model
    with hub.fresh_preset(spec.model.hub):
        model.preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(spec.model.hub, sequence_length=length)
    model.compile(sampler=sampler)  # generation only: the loss and optimizer it resets are not used
    with trained.accelerator.scope():
        texts = model.generate(prompts, max_length=length)
    texts = [texts] if isinstance(texts, str) else list(texts)
    lines = [{"prompt": p, "generated": t, "response": t[len(p):].strip() if t.startswith(p) else None}
             for p, t in zip(prompts, texts, strict=True)]
    return Generated(lines, trained, [*trained.notes, f"generated with the {sampler} sampler, at most {length} "
                                      "tokens a prompt with its answer (--max-length)"])
