"""runner: a containerised batch job runner for TensorFlow/Keras on Cloud TPU.

The package root holds what every module shares: the process clock, the environment TensorFlow reads when it
loads, and the errors a user can act on, each with the exit code the CLI maps it to:
0 ok; 1 training failed (a non-finite loss included); 2 spec or usage; 3 infrastructure (accelerator, storage);
4 trained but learned nothing (at chance); 75 preempted (retry); 124 time limit or stall; 130 interrupted by
Ctrl-C (SIGINT; saved, run again to continue).

The layers (docs/architecture.md; tests/test_architecture.py enforces them):

    cli/                          the commands
    prepare/ doctor/ cloud/ compare/   the periphery: use the core, never the CLI
    job/                          the story of a job (train, evaluate/predict, matmul)
    train/ data/ device/ rundir/  the core's parts, each handed the part of the spec it needs
    models.py                     the built-in models: one table
    spec/                         the job spec; no TensorFlow
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# The start of the clock every summary's `startup_s` is measured from (the interpreter's own start-up,
# tens of milliseconds, comes before it and is not counted).
PROCESS_START = time.monotonic()

__version__ = "0.1.0"

# What TensorFlow reads once, when it loads (after this package), set for every command unless the environment
# says otherwise (runner/job/startup.py lists them in each command's start-up plan):
# - TF_CPP_MIN_LOG_LEVEL: TensorFlow's C++ start-up notices (absl's InitializeLog warning, CPU feature and oneDNN
#   lines) are noise to a user, hidden unless the environment asks for them; `--debug` sets 0 first
#   (runner/cli/common.py).
# - TF_ENABLE_ONEDNN_OPTS: oneDNN's CPU kernels. TensorFlow turns them on by default only on CPUs with AVX-512
#   (VNNI, BF16) or AMX. On an AVX2-only CPU its Eigen kernels trained the MNIST CNN with twice the CPU time (page
#   faults of freshly mapped buffers, 37% of it in the kernel): benchmarks/RESULTS.md, docs/performance.md.
#   `TF_ENABLE_ONEDNN_OPTS=0` keeps TensorFlow's own choice.
PROCESS_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "1"}
for _name, _value in PROCESS_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

EXIT_OK = 0
EXIT_TRAINING = 1
EXIT_USAGE = 2
EXIT_INFRA = 3
# EX_TEMPFAIL from sysexits.h: the job was preempted and saved; running it again continues it.
EXIT_PREEMPTED = 75
# 128 + SIGINT, what a shell reports for a command ended by Ctrl-C: interrupted, saved; running it again continues it.
EXIT_INTERRUPTED = 130
# A finished run whose result is meaningless (its metric at chance, or its loss never below the first epoch's):
# trained and saved, but not a success (train.allow_chance: true accepts it).
EXIT_LEARNED_NOTHING = 4
# The code of coreutils' `timeout`: train.max_duration reached (saved) or train.stall_timeout (no step for that
# long). Nothing relaunches it: the limit was the user's.
EXIT_TIME_LIMIT = 124


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

    def at(self, file: str | Path) -> SpecError:
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


class TimeLimitReached(RunnerError):
    """train.max_duration passed; a checkpoint was saved and running the job again continues it."""

    exit_code = EXIT_TIME_LIMIT


class LearnedNothing(RunnerError):
    """Training finished, but its metrics say the model learned nothing (train.allow_chance accepts that)."""

    exit_code = EXIT_LEARNED_NOTHING


class Interrupted(RunnerError):
    """Ctrl-C (SIGINT): a checkpoint was saved as on a preemption notice, and the job can be run again."""

    exit_code = EXIT_INTERRUPTED


class Diverged(RunnerError):
    """The loss (or the weights) became NaN or infinite: training stopped before saving any of it."""

    exit_code = EXIT_TRAINING
