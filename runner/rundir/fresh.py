"""`runner run --fresh`: a job started over at step 0, its earlier run folder moved aside whole, never deleted."""

from __future__ import annotations

import logging
import posixpath
import time

import tensorflow as tf

from runner.data import storage
from runner.rundir.lease import Lease
from runner.rundir.outputs import RunFolder

log = logging.getLogger(__name__)


def move_aside(run: RunFolder, job: str, timeout_s: float = storage.DEFAULT_TIMEOUT_S) -> str | None:
    """`runner run --fresh`: moves the whole run folder to `<folder>.old-<UTC time>` (never deletes) so
    the job starts at step 0; returns where it went, None when there was nothing to move. Refused
    (LeaseHeld, exit 2) while another run holds the folder."""
    try:
        run.check_bucket()
        if not tf.io.gfile.exists(run.path) or not tf.io.gfile.listdir(run.path):
            return None
    except tf.errors.OpError as exc:
        raise run.storage_fault(exc) from None
    lease = Lease.take(run.path, job, timeout_s)  # no run may write here while its files move
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = f"{run.path}.old-{stamp}"
    suffix = 1
    while tf.io.gfile.exists(target):
        suffix += 1
        target = f"{run.path}.old-{stamp}-{suffix}"
    lease_name = posixpath.basename(lease.where)
    try:
        for folder, _, files in tf.io.gfile.walk(run.path):
            relative = posixpath.relpath(folder, run.path) if folder != run.path else ""
            for name in files:
                if not relative and name == lease_name:
                    continue  # ours, released below
                source, moved = posixpath.join(folder, name), posixpath.join(target, relative, name)
                tf.io.gfile.makedirs(posixpath.dirname(moved))
                tf.io.gfile.rename(source, moved)
        if not storage.is_gcs(run.path):  # empty local folders left behind; a bucket has none
            for folder, _, _ in sorted(tf.io.gfile.walk(run.path), key=lambda w: -len(w[0])):
                if folder != run.path and not tf.io.gfile.listdir(folder):
                    tf.io.gfile.rmtree(folder)  # empty: its files were moved
    except tf.errors.OpError as exc:
        raise run.storage_fault(exc) from None
    finally:
        lease.release()
    log.info("--fresh: moved %s aside to %s (nothing deleted); %r starts at step 0", run.path, target, job)
    return target
