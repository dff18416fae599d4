"""Errors a user can act on, each with the exit code the CLI maps it to.

0 ok; 1 training failed (a non-finite loss included); 2 spec or usage; 3 infrastructure (accelerator, storage);
75 preempted (retry); 130 interrupted by Ctrl-C (SIGINT; saved, run again to continue).
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_TRAINING = 1
EXIT_USAGE = 2
EXIT_INFRA = 3
# EX_TEMPFAIL from sysexits.h: the job was preempted and saved; running it again continues it.
EXIT_PREEMPTED = 75
# 128 + SIGINT, what a shell reports for a command ended by Ctrl-C: interrupted, saved; running it again continues it.
EXIT_INTERRUPTED = 130


class RunnerError(Exception):
    """Base of the errors the CLI prints without a traceback."""

    exit_code = EXIT_TRAINING


class SpecError(RunnerError):
    """A job spec, override or flag that cannot be used; the message names file, line and key."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, file: str | Path | None = None, line: int | None = None):
        self.message, self.file, self.line = message, file, line
        super().__init__(self._render())

    def _render(self) -> str:
        if self.file is None:
            return self.message
        where = f"{self.file}:{self.line}" if self.line else str(self.file)
        return f"{where}: {self.message}"

    def at(self, file: str | Path) -> "SpecError":
        return SpecError(self.message, file=file, line=self.line)


class DataError(RunnerError):
    """Training data that is missing, does not match its manifest, or is corrupt."""

    exit_code = EXIT_USAGE


class AcceleratorError(RunnerError):
    """The requested accelerator could not be reached or initialised in time."""

    exit_code = EXIT_INFRA


class StorageError(RunnerError):
    """A bucket or folder that could not be read or written within the allowed time."""

    exit_code = EXIT_INFRA


class Preempted(RunnerError):
    """A preemption notice arrived; a checkpoint was saved and the job can be run again."""

    exit_code = EXIT_PREEMPTED


class Interrupted(RunnerError):
    """Ctrl-C (SIGINT): a checkpoint was saved as on a preemption notice, and the job can be run again."""

    exit_code = EXIT_INTERRUPTED


class Diverged(RunnerError):
    """The loss (or the weights) became NaN or infinite: training stopped before saving any of it."""

    exit_code = EXIT_TRAINING
