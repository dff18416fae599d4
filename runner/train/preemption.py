"""Preemption notices and Ctrl-C: SIGTERM (how Cloud TPU VMs and Kubernetes announce preemption) and SIGINT
(Ctrl-C) as a flag the training loop reads between steps, with a grace period that ends the process if a save
hangs. A second Ctrl-C ends the process at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from runner import EXIT_INTERRUPTED, EXIT_PREEMPTED

# The signals that stop a job after a save: SIGTERM (preempted, exit 75) and SIGINT (interrupted, exit 130).
SIGNALS = (signal.SIGTERM, signal.SIGINT)


# The process's stderr as it was when the runner started: a last message before os._exit reaches it even while
# fd 2 is redirected (runner/cli/common.py holds TensorFlow's start-up notices back that way).
_STDERR_FD = os.dup(2)


def exit_now(message: str, code: int) -> None:
    sys.stderr.flush()
    os.write(_STDERR_FD, f"error: {message}\n".encode())
    os._exit(code)


def _interrupted_again() -> None:
    exit_now(
        f"interrupted again: exiting now ({EXIT_INTERRUPTED}) without saving; the newest complete checkpoint is "
        "kept: run the same job again to continue from it",
        EXIT_INTERRUPTED,
    )


class _Watcher:
    """Sees SIGTERM and SIGINT the moment they arrive and hands each to `on_signal(signum)` in a thread.

    Python runs signal handlers in the main thread between bytecodes, so a main thread stuck in a long C
    call (TensorFlow's import, a save to storage that does not answer) would not see a signal for seconds
    or ever. The wakeup fd is written by the C-level handler at once, one byte per signal; a watcher thread
    reads it and is the only one to act (so each signal counts once). The Python-level handlers only keep
    the default actions (KeyboardInterrupt, termination) away. Install and remove in the main thread.
    """

    def __init__(self, on_signal: Callable[[int], None], signals: tuple[int, ...] = SIGNALS):
        self._on_signal, self._signals = on_signal, signals
        self._previous: dict[int, Any] = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None

    def install(self) -> None:
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)
        self._previous = {signum: signal.signal(signum, lambda *_: None) for signum in self._signals}
        self._previous_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self._pipe[0],), daemon=True, name="signals").start()

    def remove(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self._pipe[1])  # ends the watcher
        self._pipe = None

    def _watch(self, read_fd: int) -> None:
        try:
            while chunk := os.read(read_fd, 64):
                for signum in chunk:
                    if signum in SIGNALS:
                        self._on_signal(signum)
        finally:
            os.close(read_fd)


class PreemptionNotice:
    """Turns SIGTERM and SIGINT into a flag read between steps; `interrupted` tells a Ctrl-C from a preemption.

    The job installs it for its whole run (training uses it as a context manager inside). The notice opens
    the grace period (`checkpoint.grace_s`): the job saves at the next step boundary, writes its summary
    and exits 75 (SIGTERM: preempted) or 130 (SIGINT: interrupted); a notice during evaluation or export
    lets the job finish if it can within the period. A step or save stuck past the deadline (storage that
    does not answer) ends the process with the same code at the deadline, before the platform's SIGKILL
    would: the cut-short save is never chosen as the latest, so the next attempt resumes from the newest
    complete checkpoint. A second SIGINT ends the process at once with 130.

    `shared` (a job of several processes, runner/device/processes.py): every process must stop at the same step,
    or the others would wait on it forever. SIGTERM then belongs to JAX's preemption service, which
    jax.distributed.initialize installs: a SIGTERM to any process makes every process reach one sync point
    (`reached_sync_point`, asked each step). A notice that starts here (Ctrl-C, the time limit) is passed to that
    service as a SIGTERM to this process, so it stops all processes at one step too.
    """

    def __init__(self, grace_s: float = 30.0, shared: bool = False):
        self.grace_s, self.shared = grace_s, shared
        self.received = threading.Event()
        self.received_at: float | None = None
        self.signal: int | None = None  # the signal the notice came by
        self._interrupts = 0
        self._lock = threading.Lock()
        self._watcher = _Watcher(lambda signum: self.notify(signum=signum),
                                 (signal.SIGINT,) if shared else SIGNALS)
        self._depth = 0

    @property
    def interrupted(self) -> bool:
        """The notice was a Ctrl-C (SIGINT), not a preemption."""
        return self.signal == signal.SIGINT

    def install(self) -> None:
        """From here on SIGTERM and SIGINT are notices, not the end of the process. Nested installs count."""
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            self._watcher.install()

    def remove(self) -> None:
        """Gives SIGTERM and SIGINT back their previous handlers. The deadline, once started, stays."""
        self._depth -= 1
        if self._depth == 0:
            self._watcher.remove()

    def __enter__(self) -> PreemptionNotice:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def notify(self, at: float | None = None, signum: int = signal.SIGTERM, relay: bool = True) -> None:
        """The notice, received now or at `at` (time.monotonic()): the grace period runs from then.
        A second SIGINT ends the process at once. Shared, it is passed on to every process (`relay`)."""
        at = time.monotonic() if at is None else at
        with self._lock:
            if signum == signal.SIGINT:
                self._interrupts += 1
                if self._interrupts > 1:
                    _interrupted_again()
            if self.received.is_set():
                return
            self.received_at, self.signal = at, signum
            self.received.set()
        if self.shared and relay:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption service, which tells every process
        deadline = threading.Timer(max(0.0, self.grace_s - (time.monotonic() - at)), self._expire)
        deadline.daemon = True
        deadline.start()

    def reached_sync_point(self, step: int) -> bool:
        """Shared: whether every process stops at `step` (JAX's preemption sync point: all processes agree on it
        once any was noticed). Ask at every step, with the same steps on every process."""
        from runner.device import processes

        if not processes.reached_preemption_sync_point(step):
            return False
        if not self.received.is_set():
            self.notify(signum=signal.SIGTERM, relay=False)
        return True

    def _expire(self) -> None:
        if self.interrupted:
            what, status, code = "Ctrl-C", "interrupted", EXIT_INTERRUPTED
        else:
            what, status, code = "the preemption notice", "preempted", EXIT_PREEMPTED
        exit_now(
            f"{status}: the job did not save and stop within checkpoint.grace_s ({self.grace_s:g} s) of {what}; "
            f"exiting {code} now: the next attempt resumes from the newest complete checkpoint",
            code,
        )

    def seconds_since(self) -> float | None:
        return None if self.received_at is None else time.monotonic() - self.received_at


class EarlyNotice:
    """Holds a SIGTERM or SIGINT that arrives before the job installs its PreemptionNotice, mostly while
    TensorFlow imports, so the run then ends as `preempted` (exit 75) or `interrupted` (exit 130) with its
    summary, not killed (143) or with a traceback. A second SIGINT exits at once (130), even mid-import."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.signal: int | None = None
        self._interrupts = 0
        self._lock = threading.Lock()
        self._watcher = _Watcher(self._note)
        self._watcher.install()

    def _note(self, signum: int) -> None:
        with self._lock:
            if signum == signal.SIGINT:
                self._interrupts += 1
                if self._interrupts > 1:
                    _interrupted_again()
            if self.at is None:
                self.at, self.signal = time.monotonic(), signum

    def pass_to(self, notice: PreemptionNotice) -> None:
        """Hands a signal held here to the job's notice (its grace period runs from when it came)."""
        with self._lock:
            if self.at is not None:
                notice.notify(self.at, self.signal)
            if self._interrupts and self.signal != signal.SIGINT:  # a Ctrl-C after a SIGTERM: the next is the second
                notice.notify(self.at, signal.SIGINT)

    def restore(self) -> None:
        self._watcher.remove()
