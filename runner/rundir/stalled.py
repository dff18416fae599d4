"""A stall's mark in the run folder, `stalled.json`: how a stall is told from a time limit after the job is gone.

Both end the job with exit 124 (runner/train/limits.py), but a stalled job cannot write its summary (its step never
returns to Python): the stall guard writes this mark, bounded in time, before it exits. The TPU VM's startup script
(runner/cloud/tpu_startup.sh) and the relaunch watcher (runner/cloud/recovery.py) read it after an exit 124;
process 0 removes a mark an earlier attempt left when the next attempt opens the run folder. TensorFlow
(its file system) loads only to write or remove one: `runner runs` and the cloud read NAME without it.
"""

from __future__ import annotations

import json
import logging
import posixpath
import threading
import time

NAME = "stalled.json"
WRITE_BOUND_S = 30.0  # a stall in storage must not keep the guard from exiting

log = logging.getLogger(__name__)


def mark(run_dir: str, message: str, attempt: int, bound_s: float = WRITE_BOUND_S) -> bool:
    """Writes the mark (whole or not at all) within `bound_s`; False when it could not (the guard exits anyway)."""
    doc = {"attempt": attempt or None, "message": message, "unix_time": round(time.time(), 3)}
    written = threading.Event()

    def write() -> None:
        import tensorflow as tf

        path = posixpath.join(run_dir, NAME)
        try:
            with tf.io.gfile.GFile(path + ".partial", "w") as handle:
                handle.write(json.dumps(doc) + "\n")
            tf.io.gfile.rename(path + ".partial", path, overwrite=True)
            written.set()
        except Exception as exc:  # noqa: BLE001 - the exit that follows matters more than the mark
            log.warning("could not mark the stall in %s: %s", run_dir, exc)

    threading.Thread(target=write, daemon=True, name="stall-mark").start()
    return written.wait(bound_s)


def clear(run_dir: str) -> None:
    """Removes an earlier attempt's mark: an exit 124 of this attempt must not read as that stall."""
    import tensorflow as tf

    path = posixpath.join(run_dir, NAME)
    if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)
        log.info("removed %s: the stall it marked was an earlier attempt's", path)
