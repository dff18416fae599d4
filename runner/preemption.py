"""Preemption notices: SIGTERM (how Cloud TPU VMs and Kubernetes announce preemption) as a flag the
training loop reads between steps, with a grace period that ends the process if a save hangs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from runner.errors import EXIT_PREEMPTED


class PreemptionNotice:
    """Turns SIGTERM (how Cloud TPU VMs and Kubernetes announce preemption) into a flag read between steps.

    The job installs it for its whole run (training uses it as a context manager inside). The notice opens
    the grace period (`checkpoint.grace_s`): the job saves at the next step boundary, writes its summary
    and exits 75; a notice during evaluation or export lets the job finish if it can within the period.
    A step or save stuck past the deadline (storage that does not answer) ends the process with 75 at the
    deadline, before the platform's SIGKILL would: the cut-short save is never chosen as the latest, so
    the next attempt resumes from the newest complete checkpoint.
    """

    def __init__(self, grace_s: float = 30.0):
        self.grace_s = grace_s
        self.received = threading.Event()
        self.received_at: float | None = None
        self._lock = threading.Lock()
        self._previous: Any = None
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._depth = 0

    def install(self) -> None:
        """From here on SIGTERM is a notice, not the end of the process. Nested installs count."""
        self._depth += 1
        if self._depth > 1 or threading.current_thread() is not threading.main_thread():
            return
        # Python runs signal handlers in the main thread between bytecodes, so a main thread stuck in
        # a TensorFlow call (a save to storage that does not answer) would never see the notice. The
        # wakeup fd is written by the C-level handler at once; a watcher thread reads it.
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)
        self._previous = signal.signal(signal.SIGTERM, lambda *_: self.notify())
        self._previous_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self._pipe[0],), daemon=True, name="preemption").start()

    def remove(self) -> None:
        """Gives SIGTERM back its previous handler. The deadline, once started, stays."""
        self._depth -= 1
        if self._depth == 0 and self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            signal.signal(signal.SIGTERM, self._previous)
            os.close(self._pipe[1])  # ends the watcher
            self._pipe = None

    def __enter__(self) -> "PreemptionNotice":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _watch(self, read_fd: int) -> None:
        try:
            while chunk := os.read(read_fd, 64):
                if signal.SIGTERM in chunk:
                    self.notify()
        finally:
            os.close(read_fd)

    def notify(self, at: float | None = None) -> None:
        """The notice, received now or at `at` (time.monotonic()): the grace period runs from then."""
        at = time.monotonic() if at is None else at
        with self._lock:
            if self.received.is_set():
                return
            self.received_at = at
            self.received.set()
        deadline = threading.Timer(max(0.0, self.grace_s - (time.monotonic() - at)), self._expire)
        deadline.daemon = True
        deadline.start()

    def _expire(self) -> None:
        sys.stderr.write(
            f"error: preempted: the job did not save and stop within checkpoint.grace_s ({self.grace_s:g} s) of "
            f"the preemption notice; exiting {EXIT_PREEMPTED} now: the next attempt resumes from the newest "
            "complete checkpoint\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)

    def seconds_since(self) -> float | None:
        return None if self.received_at is None else time.monotonic() - self.received_at


class EarlyNotice:
    """Holds a SIGTERM that arrives before the job installs its preemption handler (runner/train.py), mostly
    while TensorFlow imports, so a preemption then ends the run as `preempted` (exit 75), not killed (143)."""

    def __init__(self) -> None:
        self.at: float | None = None
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, *_: object) -> None:
        if self.at is None:
            self.at = time.monotonic()

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
