"""Limits that end a job which would otherwise bill on: a wall-clock limit (`train.max_duration`) and a stall
guard (`train.stall_timeout`). `runner submit` sets both for a job on a Cloud TPU VM (docs/cloud.md), where a job
that never ends keeps its slice billing.

At the limit the job stops as after a preemption notice: it saves at the next step, writes its summary (status
`time_limit`) and exits 124 (EXIT_TIME_LIMIT, the code of coreutils' `timeout`), which nothing relaunches. A
stalled job cannot save (its step never returns): the guard ends the process with 124 after saying so (and marking
the run folder: runner/rundir/stalled.py); the newest complete checkpoint is kept and the next run resumes from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import keras

from runner import EXIT_TIME_LIMIT, PROCESS_START
from runner.train.preemption import PreemptionNotice, exit_now

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
    """Ends the process (exit 124) when the job makes no progress for `timeout` seconds.

    From `start` (run_job calls it as the job begins) to `stop`, progress is each phase of the job beginning or
    ending (reading the data, the accelerator, building, restoring, evaluating, exporting: the job's Phases
    call `beat`) and, as a Keras callback in training and evaluation, each step. Watched from a thread: a
    stalled step never returns to Python, so no callback could act on it. The first step's compilation counts
    as a step in progress: set the timeout above the longest compile (or data check) you expect."""

    def __init__(self, timeout: float, on_stall: Callable[[str], object] | None = None):
        super().__init__()
        self.timeout = timeout
        self._on_stall = on_stall  # told the message before the exit (run_job: the run folder's stall mark)
        self._last = time.monotonic()
        self._what = "the job's start"
        self._epoch_began_at = self._step = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.beat("the job's start")
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="stall-guard")
            self._thread.start()

    def beat(self, what: str) -> None:
        """Progress: `what` happened (named in the message if nothing follows it)."""
        self._last, self._what = time.monotonic(), what

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.start()
        self.beat("training began (the first step compiles)")
        # Read once per fit, then counted (as runner/train/fit.py `StepCount`): under JAX a read of the optimizer
        # in a callback copies the train state back from the devices (benchmarks/RESULTS.md, step_reads).
        self._step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_began_at = self._step

    def on_test_begin(self, logs: dict | None = None) -> None:
        self.beat("evaluation began")

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # The job's step, as checkpoints and progress lines count it: a stall mid-training names where it stopped
        # (`batch` is the epoch's last step index of the call, steps_per_execution steps per call).
        self._step = self._epoch_began_at + batch + 1
        self.beat(f"step {self._step} ended")

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
                said = (f"stalled: nothing progressed for {idle:.0f} s since {self._what} (train.stall_timeout "
                        f"{self.timeout:g} s); exiting {EXIT_TIME_LIMIT}. The newest complete checkpoint is kept: run "
                        "the same job again to continue from it")
                if self._on_stall is not None:
                    self._on_stall(said)
                exit_now(said, EXIT_TIME_LIMIT)
