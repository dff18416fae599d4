"""SIGTERM and SIGINT held from the first line of the command line, for `runner run`.

The CLI's own imports (Typer, Rich, every command's module) take 0.3-0.5 s before the `run` command begins; a
preemption notice in that window would kill the job with 143 and no summary, where docs/storage.md promises 75
and the relaunch logic counts on it. So runner/cli/__init__.py imports this module before anything else, and
the notice it holds is the one the run hands to its job (runner/train/preemption.py EarlyNotice). Only `run`
holds signals: in any other command Ctrl-C keeps its ordinary meaning.
"""

from __future__ import annotations

import sys

from runner.train.preemption import EarlyNotice

_held: EarlyNotice | None = EarlyNotice() if sys.argv[1:2] == ["run"] else None


def early_notice() -> EarlyNotice:
    """The notice held since the process started (once), else one installed now (a run invoked in-process)."""
    global _held
    notice, _held = _held or EarlyNotice(), None
    return notice
