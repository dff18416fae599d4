"""A call in a daemon thread, waited for at most a given time: the bound for steps that have none of their own
(TPU start-up, DNS lookups that ignore socket timeouts). On a timeout the thread is abandoned (a thread
cannot be killed); being a daemon, it does not keep the process from exiting. TensorFlow-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Bounded:
    """Starts `fn()` at once in a daemon thread; `result(seconds)` waits for it."""

    def __init__(self, name: str, fn: Callable[[], Any]):
        self._fn, self._outcome = fn, {}
        self._thread = threading.Thread(target=self._call, name=f"bounded-{name}", daemon=True)
        self._thread.start()

    def _call(self) -> None:
        try:
            self._outcome["value"] = self._fn()
        except BaseException as exc:  # handed to the waiting thread in result()
            self._outcome["error"] = exc

    def result(self, seconds: float) -> Any:
        """fn's value, or its exception re-raised; TimeoutError when it is still running after `seconds`."""
        self._thread.join(seconds)
        if self._thread.is_alive():
            raise TimeoutError(f"still running after {seconds:g} s")
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome.get("value")
