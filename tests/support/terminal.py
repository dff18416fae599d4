"""The CLI on a pseudo-terminal, as a person at a terminal runs it: stdin, stdout and stderr on one pty of a
given size, read until the child ends, bounded in time; the child is killed by its process group if not."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

# Escape sequences a terminal program writes: colours, cursor moves, line erases, window titles.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def run_in_terminal(
    args: list[str], *, env: dict[str, str], cwd: Path, timeout: float, columns: int = 120, rows: int = 40
) -> tuple[int, str]:
    """Runs `python -m runner ARGS` on a pseudo-terminal of `columns` x `rows`; returns its exit code and
    everything it wrote (escape sequences included)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "runner", *args], stdin=terminal, stdout=terminal, stderr=terminal,
        env={**env, "TERM": "xterm-256color"}, cwd=cwd, start_new_session=True,
    )
    os.close(terminal)
    output, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the child closed the terminal (EIO)
                    break
                if not chunk:
                    break
                output += chunk
            elif process.poll() is not None:
                break
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        os.close(controller)
    return code, output.decode(errors="replace")


def screen_lines(raw: str) -> list[str]:
    """What was written, split where the terminal starts a line (newline or carriage return), escapes removed."""
    return [ANSI.sub("", part) for part in re.split(r"[\r\n]", raw)]

