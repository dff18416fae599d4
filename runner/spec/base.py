"""The spec's building blocks: strict integers and finite numbers held to a range, names without invisible
characters, the bounds TensorFlow can hold, and the base of every section (unknown keys refused, frozen,
finite). No TensorFlow."""

from __future__ import annotations

import math
import unicodedata
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

# Counts TensorFlow holds in int32 (shapes, steps per execution, TPU loop counters).
INT32_MAX = 2**31 - 1
# Seconds a timer, a join or a retry loop can wait: Python's timers overflow near 2**31 ms and the gs:// retry
# schedule (runner/data/storage.py) near 32,800 s; an hour is more than any of them needs.
MAX_WAIT_S = 3600.0
# The shortest wait worth a setting: below 10 ms nothing (a TPU probe, a save, a gs:// call) can finish, and a
# denormal such as 1e-320 is a typo, not a timeout.
MIN_WAIT_S = 0.01
# Keras holds the learning rate in a float32 variable and multiplies gradients by it: past these ends the update
# overflows or vanishes in float32 (1e30 * a gradient of 1e9 is inf; 1e-320 is 0 in float32).
LEARNING_RATE_RANGE = (1e-12, 1e12)


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a number, not true/false")
    return value


def _integer(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not true/false")
    return value


def bounded(low: float, high: float, unit: str = "") -> Any:
    """A finite number from `low` to `high`; the message gives the range (`1e+30 is outside 1e-12 to 1e+12`)."""

    def check(value: float) -> float:
        if not low <= value <= high:
            shown = f"{value:g}" if value == 0 or abs(value) >= 1e-300 else repr(value)  # a denormal as written
            raise ValueError(f"{shown}{unit} is outside the range {low:g}{unit} to {high:g}{unit}")
        return value

    return Annotated[Number, AfterValidator(check)]


# Characters a name may not hold: control characters (Cc: NUL, newlines, C1 codes), format characters (Cf: the
# bidirectional overrides U+202A-202E and isolates U+2066-2069 that make text display in another order, zero-width
# characters, the BOM) and the line and paragraph separators. A feature or label named with one reads the same
# as another name on screen and never matches it.
_INVISIBLE = {"Cc", "Cf", "Zl", "Zp"}


def invisible_character(text: str) -> str | None:
    """The first control, format (bidirectional, zero-width) or separator character in `text`, described."""
    for index, char in enumerate(text):
        if unicodedata.category(char) in _INVISIBLE:
            name = unicodedata.name(char, "a control character")
            return f"U+{ord(char):04X} ({name}) at character {index + 1}"
    return None


def _visible(value: str) -> str:
    if bad := invisible_character(value):
        raise ValueError(f"{value!r} holds {bad}: names are plain visible text")
    return value


# An int, never a bool or a float such as 3.0 (pydantic strict), with a message that says why.
Integer = Annotated[StrictInt, BeforeValidator(_integer)]
# A finite float that is never a bool (pydantic's lax float reads `true` as 1.0; allow_inf_nan is off below).
Number = Annotated[float, BeforeValidator(_not_a_bool)]
Name = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_visible)]


class Strict(BaseModel):
    """A spec section: unknown keys are errors, values are frozen, numbers finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def check_json(value: Any, where: str) -> None:
    """Text keys, finite numbers, text, booleans, null, lists and mappings of them (what JSON can record)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: the key {key!r} is not text")
            check_json(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json(item, f"{where}[{index}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: use a finite number")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(
            f"{where} is a {type(value).__name__} ({value!r:.40}): use text, a number, true/false, a list or a mapping"
        )
