"""A checkpoint's variables against the model's, both ways, before anything is restored (docs/resume.md).

A restore is all or nothing: every variable the store holds must meet a variable of the same shape and dtype at
the same path in the model or its optimizer, and every variable of theirs one in the store; anything missing,
extra or reshaped stops the job (exit 2) naming each, and nothing is restored. Both lists come from the store's
own naming, applied to the saved state and to the model as built now: TensorFlow's object graph
(runner/train/match.py), the layout Orbax's saves record (orbax_store.py), the weights file inside model.keras.
So the match does not depend on what a process happened to build before the restore: Keras's automatic layer
names (`dense_1`) differ from process to process, and TensorFlow restores a variable created after the restore
call when it is created, out of sight of any check made at that call.

A variable that holds a setting the spec decides, not something learned (the optimizer's learning rate: a
constant rate is a variable, a schedule none, and the spec's rate is applied on resume either way), is left out
of the match on both sides.
"""

from __future__ import annotations

import dataclasses
import re

from runner import SpecError

# At most this many variables are named; a count says how many more differ.
_NAMED = 40
# The end of every variable's key in a TensorFlow checkpoint, left out where a key is shown.
_TENSORFLOW_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


@dataclasses.dataclass(frozen=True)
class Held:
    """One variable: its path in the store, shape, dtype (None where the store does not say) and, for the
    model's own variables, Keras's name for it."""

    key: str
    shape: tuple[int, ...]
    dtype: str | None = None
    name: str | None = None

    def shown(self) -> str:
        key = self.key.removesuffix(_TENSORFLOW_VALUE)
        return f"{self.name} ({key})" if self.name and self.name != key else key

    def form(self, dtype: bool = False) -> str:
        return f"{self.shape}{f' {self.dtype}' if dtype and self.dtype else ''}"


def _order(key: str) -> tuple:
    """The model's own variables first, then the optimizer's; positions in numeric order."""
    mine = key.startswith("model/") or "/_trainable_variables/" in key
    return (not mine, [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)])


def differences(saved: dict[str, Held], live: dict[str, Held], store: str = "checkpoint") -> list[str]:
    """One line per variable that is missing on a side or has another shape or dtype there; [] when they match."""
    lines = []
    for key in sorted(saved.keys() | live.keys(), key=_order):
        old, new = saved.get(key), live.get(key)
        if new is None:
            lines.append(f"the {store} has {old.shown()} {old.form()}, which the model lacks")
            continue
        if old is None:
            lines.append(f"the model has {new.shown()} {new.form()}, which the {store} lacks")
            continue
        retyped = bool(old.dtype and new.dtype and old.dtype != new.dtype)
        if old.shape != new.shape or retyped:
            lines.append(f"{new.shown()} is {new.form(retyped)} in the model and {old.form(retyped)} in the {store}")
    return lines


def refusal(path: str, lines: list[str], store: str = "checkpoint", complete: bool = False) -> SpecError:
    """The SpecError (exit 2) of a model that no longer matches the weights at `path`, naming each difference."""
    named = lines[:_NAMED] + ([f"... and {len(lines) - _NAMED} more"] if len(lines) > _NAMED else [])
    done = "the job is complete, but " if complete else ""
    return SpecError(
        f"{done}the model changed since {path} was saved: {len(lines)} variable"
        f"{'s differ' if len(lines) != 1 else ' differs'} (matched by path and shape, both ways):\n  "
        + "\n  ".join(named)
        + "\nNothing was restored: a model restored in part would train or answer on weights it never learned. "
        "Start the job over with `runner run --fresh` (the run folder is moved aside, not deleted), or give the "
        "changed model a new job name (`--set name=...`)"
    )


def check(path: str, saved: dict[str, Held], live: dict[str, Held], store: str = "checkpoint",
          complete: bool = False) -> None:
    """Raises `refusal` when the two lists differ."""
    lines = differences(saved, live, store)
    if lines:
        raise refusal(path, lines, store, complete)
