"""Whether a finished training learned anything: a run that ends at chance is not a success.

Two signs, each a warning with its numbers (the summary's `warnings`):
  - an accuracy within 2 points of chance (1 / classes; the classes read from the model's output: its last
    dimension, or 2 for a single sigmoid output), or under half of chance: far worse than guessing is not
    learning either (a loss option out of range does that; a few steps' noise around chance does not);
  - a training loss that never fell below its first epoch's by 0.1% (at least two epochs trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runner.rundir.timing import EpochRecord

# How close to chance an accuracy may be and still count as "at chance", in points of accuracy.
CHANCE_MARGIN = 0.02
# A loss that fell by less than this share of its first epoch's did not fall (float noise is not learning).
LOSS_FELL = 1e-3
# A loss that rose by more than this share rose (a rate too large); less is the noise of a loss that stayed.
LOSS_ROSE = 0.05


def classes_of_output(output_shape: Any) -> int | None:
    """The number of classes a classifier's output shape implies: its last dimension, 2 for one sigmoid unit."""
    try:
        last = output_shape[-1]
    except (TypeError, IndexError):
        return None
    if not isinstance(last, int):
        return None
    return 2 if last == 1 else last


def _accuracy(metrics: dict[str, Any]) -> tuple[str, float] | None:
    for key, value in metrics.items():
        if isinstance(value, float) and not key.startswith("val_") and (key == "acc" or key.endswith("accuracy")):
            return key, value
    return None


def warnings_of(epochs: Sequence[EpochRecord], metrics: dict[str, Any], classes: int | None) -> list[str]:
    """What says the model learned nothing; [] when nothing does. `epochs`: the job's, across its attempts.
    `metrics`: the final evaluation's, else the last epoch's training metrics are read."""
    found = []
    scored = _accuracy(metrics) or (_accuracy(epochs[-1].metrics) if epochs else None)
    if scored and classes and classes > 1:
        key, value = scored
        chance = 1 / classes
        if chance - CHANCE_MARGIN <= value <= chance + CHANCE_MARGIN or value < chance / 2:
            where = "at chance" if value >= chance - CHANCE_MARGIN else "far below chance"
            found.append(
                f"{key} {value:.4f} is {where} for {classes} classes ({chance:.4f} +- {CHANCE_MARGIN:.2f}): the "
                "model learned nothing. Check that the loss fits the model's output (from_logits) and its options "
                "(label_smoothing between 0 and 1), the labels and the learning rate"
            )
    # Whole epochs only: a cut-short epoch, or the rest of one finished by a resumed attempt, averages its
    # loss over another part of the data and the training.
    whole = max((e.steps for e in epochs), default=0)
    losses = [e.loss for e in epochs if e.loss is not None and not e.partial and e.steps == whole]
    if len(losses) >= 2 and min(losses[1:]) > losses[0] * (1 - LOSS_FELL):
        found.append(
            f"the training loss never fell below its first epoch's ({losses[0]:.4g}; last {losses[-1]:.4g}): the "
            f"model learned nothing. {_loss_advice(losses)}"
        )
    return found


def _loss_advice(losses: list[float]) -> str:
    """A loss that rose overshoots: the rate is the likely cause. One that stayed flat is as likely a model whose
    output ignores its weights, labels that do not fit the loss, or too low a rate: lowering it would not help."""
    if max(losses[1:]) > losses[0] * (1 + LOSS_ROSE):
        return "It rose: lower train.learning_rate (a step too large overshoots), or check the data and the loss"
    return ("It stayed flat: check that the model's output depends on weights that train, that the labels fit the "
            "loss, and that train.learning_rate is not too small to move it")
