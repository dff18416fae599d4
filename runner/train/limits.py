"""Limits that end a job which would otherwise bill on: a wall-clock limit (`train.max_duration`) and a stall
guard (`train.stall_timeout`). `runner submit` sets both for a job on a Cloud TPU VM (docs/cloud.md), where a job
that never ends keeps its slice billing.

At the limit the job stops as after a preemption notice: it saves at the next step, writes its summary (status
`time_limit`) and exits 124 (EXIT_TIME_LIMIT, the code of coreutils' `timeout`), which nothing relaunches. A
stalled job cannot save (its step never returns): the guard ends the process with 124 after saying so; the newest
complete checkpoint is kept and the next run resumes from it.
"""

from __future__ import annotations

import logging
import threading
import time

import tensorflow as tf

from runner import EXIT_TIME_LIMIT, PROCESS_START
from runner.train.preemption import PreemptionNotice, exit_now

keras = tf.keras
log = logging.getLogger(__name__)


class TimeLimit(keras.callbacks.Callback):
    """Hands the job a notice once `max_duration` seconds have passed since the process started."""

    def __init__(self, max_duration: float, notice: PreemptionNotice, started: float = PROCESS_START):
        super().__init__()
        self.max_duration, self._notice, self._started = max_duration, notice, started
        self.reached = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self.reached and time.monotonic() - self._started >= self.max_duration:
            self.reached = True
            log.warning("train.max_duration (%g s) reached: saving and stopping", self.max_duration)
            self._notice.notify()


class StallGuard(keras.callbacks.Callback):
    """Ends the process (exit 124) when no training or validation step has finished for `timeout` seconds.

    Watched from a thread: a stalled step never returns to Python, so no callback could act on it. The first
    step's compilation counts as a step in progress: set the timeout above the longest compile you expect."""

    def __init__(self, timeout: float):
        super().__init__()
        self.timeout = timeout
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._last = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="stall-guard")
            self._thread.start()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._last = time.monotonic()

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._last = time.monotonic()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(self.timeout / 4, 30.0)):
            idle = time.monotonic() - self._last
            if idle >= self.timeout:
                exit_now(
                    f"stalled: no training step finished for {idle:.0f} s (train.stall_timeout {self.timeout:g} s); "
                    f"exiting {EXIT_TIME_LIMIT}. The newest complete checkpoint is kept: run the same job again to "
                    "continue from it",
                    EXIT_TIME_LIMIT,
                )
