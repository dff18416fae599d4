"""The spec's building blocks: strict integers and finite numbers, the bounds TensorFlow can hold, and the
base of every section (unknown keys refused, frozen, finite). No TensorFlow."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

# Counts TensorFlow holds in int32 (shapes, steps per execution, TPU loop counters).
INT32_MAX = 2**31 - 1
# Seconds a timer, a join or a retry loop can wait: Python's timers overflow near 2**31 ms and the gs:// retry
# schedule (runner/data/storage.py) near 32,800 s; an hour is more than any of them needs.
MAX_WAIT_S = 3600.0


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a number, not true/false")
    return value


def _integer(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not true/false")
    return value


# An int, never a bool or a float such as 3.0 (pydantic strict), with a message that says why.
Integer = Annotated[StrictInt, BeforeValidator(_integer)]
# A finite float that is never a bool (pydantic's lax float reads `true` as 1.0; allow_inf_nan is off below).
Number = Annotated[float, BeforeValidator(_not_a_bool)]
Name = Annotated[str, Field(min_length=1, max_length=256)]


class Strict(BaseModel):
    """A spec section: unknown keys are errors, values are frozen, numbers finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
