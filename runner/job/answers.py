"""What predict answers for each row, in the data's own terms: probabilities for a classifier (softmax or
sigmoid applied when the model ends in logits, and said), the class and its name from the manifest's
`class_names`, and where the row came from (a CSV's line, an image's file). Other models' outputs as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PROBABILITIES = "probabilities"


def probabilities(outputs: np.ndarray, kind: str | None) -> tuple[np.ndarray, str | None, list[str]]:
    """(the outputs, "probabilities" when they are a classifier's, notes): logits become probabilities, by
    softmax over one output per class, by sigmoid for a single output."""
    if kind is None or outputs.ndim != 2:
        return outputs, None, []
    if kind == "probabilities":
        return outputs, PROBABILITIES, []
    logits = outputs.astype(np.float64)
    if logits.shape[1] == 1:
        applied, made = "sigmoid", 1 / (1 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))  # no overflow for large logits
        applied, made = "softmax", shifted / shifted.sum(axis=1, keepdims=True)
    note = (f"the model ends in logits (its train.loss has from_logits: true): {applied} applied, the "
            f"`probabilities` printed (and any --output) are probabilities")
    return made.astype(np.float32), PROBABILITIES, [note]


def lines(outputs: np.ndarray, kind: str | None, class_names: Sequence[str], origins: list[dict]) -> list[dict]:
    """One JSON object per row: `index`, its origin, and `class`, `class_name` and `probabilities` for a
    classifier (a single output: class 1 at 0.5 or more), else `output`."""
    answered = []
    for index, row in enumerate(outputs):
        line = {"index": index, **(origins[index] if origins else {})}
        values = [round(float(v), 6) for v in np.atleast_1d(row)]
        if kind == PROBABILITIES:
            chosen = int(np.argmax(row)) if len(values) > 1 else int(values[0] >= 0.5)
            line["class"] = chosen
            if chosen < len(class_names):
                line["class_name"] = class_names[chosen]
            line["probabilities"] = values
        else:
            line["output"] = values
        answered.append(line)
    return answered
