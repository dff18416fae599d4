"""Helpers for tests that interrupt real `runner run` processes: start one, watch its checkpoints, stop it."""

from __future__ import annotations

import functools
import inspect
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from runner.rundir import checkpoints
from tests.conftest import REPO, cli_env
from tests.support import zygote

T = TypeVar("T")

# An interruptible job: EPOCHS x STEPS steps of small MNIST at a batch of 128, long enough to be signalled
# mid-epoch. A signal is sent once a progress line shows a step of epoch 2 at least 10 steps before its end
# (`signal_in_second_epoch`): at batch 128 those 10 steps last about 1 s on a 2-core AMD EPYC in float32 and
# 0.2 s on an AMX Xeon in bfloat16.
STEPS, EPOCHS, BATCH = 24, 3, 128


def interruptible_job(mnist_job, name: str, **checkpoint) -> Path:
    """The job the interruption tests signal: no evaluation, no TensorBoard, `checkpoint` settings as given."""
    return mnist_job(
        name,
        data={"eval": None, "global_batch_size": BATCH},
        train={"epochs": EPOCHS, "steps_per_epoch": STEPS},
        checkpoint=checkpoint,
        output={"tensorboard": False},
    )


def start_run(spec: Path, *args: str, env: dict[str, str] | None = None, progress: bool = False,
              fresh: bool = False) -> subprocess.Popen:
    """`python -m runner run SPEC` as a child process the test can signal, forked from a process that has loaded
    TensorFlow (tests/support/zygote.py) unless `fresh` (a test of what happens while TensorFlow loads).
    `progress`: a progress line every 0.1 s, its stderr in a file read as it grows (signal_in_second_epoch waits
    for a step of epoch 2 in it)."""
    args = ("run", str(spec), *args, *(["--progress-every", "0.1"] if progress else []))
    start = functools.partial(zygote.popen, args, env=env or cli_env(), cwd=REPO, plan=None if fresh else "auto",
                              stdout=subprocess.PIPE, text=True)
    if not progress:
        return start(stderr=subprocess.PIPE)
    log = Path(tempfile.mkstemp(prefix="runner-stderr-", suffix=".log")[1])
    with open(log, "w") as stderr:
        process = start(stderr=stderr)
    process.stderr_log = log  # type: ignore[attr-defined]
    return process


def _ended(process: subprocess.Popen, timeout: float | None = None) -> tuple[str, str]:
    out, err = process.communicate(timeout=timeout)
    log = getattr(process, "stderr_log", None)
    if log is not None and log.exists():
        err = log.read_text()
        log.unlink()
    return out, err


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    """Waits for the child (killing it if it overstays); returns (exit code, stdout, stderr)."""
    try:
        out, err = _ended(process, timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = _ended(process)
        raise AssertionError(f"runner did not exit within {timeout} s; stderr: {err[-3000:]}") from None
    return process.returncode, out, err


def wait_for(probe: Callable[[], T | None], process: subprocess.Popen, timeout: float = 120, every: float = 0.05) -> T:
    """Polls `probe` until it returns a value; fails if the child exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        if process.poll() is not None:
            _, err = _ended(process)
            raise AssertionError(f"runner exited ({process.returncode}) before the awaited state; "
                                 f"stderr: {err[-3000:]}")
        time.sleep(every)
    process.kill()
    raise AssertionError(f"waited {timeout:g} s for {awaited(probe)}: it did not come")


def awaited(probe: Callable[..., Any]) -> str:
    """Which wait ran out, as a failure says it: the probe's source and where it is."""
    code = getattr(probe, "__code__", None)
    try:
        text = " ".join(inspect.getsource(probe).split())
    except (OSError, TypeError):
        text = getattr(probe, "__qualname__", repr(probe))
    where = f" ({Path(code.co_filename).name}:{code.co_firstlineno})" if code else ""
    return f"`{text[:200]}`{where}"


def signal_taken(pid: int, signum: int) -> bool | None:
    """True once `signum` sent to the process is no longer pending: its handler has it, so one sent now is a
    second signal, not merged with the first (standard signals do not queue). None while it is pending."""
    bit = 1 << (signum - 1)
    with open(f"/proc/{pid}/status") as status:
        pending = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return None if any(mask & bit for mask in pending) else True


def _early_step_of_epoch_2(stderr: str) -> bool | None:
    """A progress line of epoch 2 before its last few steps (so a signal sent now lands inside the epoch); its
    step is the run's, counted from the first epoch."""
    steps = [int(m.group(1).replace(",", "")) for m in re.finditer(rf"epoch 2/{EPOCHS}, step ([\d,]+)/", stderr)]
    return True if any(STEPS < step <= 2 * STEPS - 10 for step in steps) else None


def indexed_step(index_text: str | None) -> int | None:
    """The step of the checkpoint a CheckpointManager index (`checkpoints/checkpoint`) names as the latest: the
    runner's own reading (runner/rundir/checkpoints.py)."""
    return checkpoints.indexed_step(index_text)


def local_index(run_dir: Path) -> str | None:
    path = run_dir / "checkpoints" / "checkpoint"
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def tensorflow_loading(pid: int) -> bool | None:
    """True once TensorFlow's library is mapped into the process: its Python import runs on for seconds."""
    with open(f"/proc/{pid}/maps") as maps:
        return True if "libtensorflow" in maps.read() else None


def signal_in_second_epoch(process: subprocess.Popen, run_dir: Path, sent: int) -> float:
    """Sends `sent` a few steps into epoch 2 (a progress line says so: a run started with `progress`), once
    epoch 1's checkpoint is indexed; returns when (monotonic). Events, not a wall-clock guess of where the
    run is: a busy machine may not have begun epoch 2 a fixed time after epoch 1's save."""
    wait_for(lambda: (s := indexed_step(local_index(run_dir))) is not None and s >= STEPS or None, process,
             timeout=600)
    wait_for(lambda: _early_step_of_epoch_2(process.stderr_log.read_text()), process, timeout=600, every=0.01)
    sent_at = time.monotonic()
    process.send_signal(sent)
    return sent_at
