"""gs:// for real: TensorFlow's own client and google-cloud-storage against an emulator on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import cli_env
from tests.support.gcs import gcs  # noqa: F401  (fixture)


def run_python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=cli_env(**env)
    )


def test_tensorflow_gs_client_round_trips_through_the_rig(gcs):
    bucket = gcs.bucket()
    code = f"""
        import os, tensorflow as tf
        root = "gs://{bucket}/round"
        tf.io.gfile.makedirs(root + "/empty")
        assert tf.io.gfile.isdir(root + "/empty")
        records = [os.urandom(n) for n in range(1, 3000, 7)]
        with tf.io.TFRecordWriter(root + "/a.tfrecord") as writer:
            for record in records:
                writer.write(record)
        read = [r.numpy() for r in tf.data.TFRecordDataset(tf.io.gfile.glob(root + "/*.tfrecord"))]
        assert read == records, "records differ"
        tf.io.gfile.rename(root + "/a.tfrecord", root + "/b.tfrecord", overwrite=True)
        variable = tf.Variable([1.0, 2.0])
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=variable), root + "/ckpt", max_to_keep=2)
        for step in (1, 2, 3):
            variable.assign_add([1.0, 1.0])
            manager.save(checkpoint_number=step)
        variable.assign([0.0, 0.0])
        tf.train.Checkpoint(v=variable).restore(tf.train.latest_checkpoint(root + "/ckpt")).assert_consumed()
        print(manager.latest_checkpoint, variable.numpy().tolist(), sorted(tf.io.gfile.listdir(root)))
    """
    result = run_python(code, gcs.env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == f"gs://{bucket}/round/ckpt/ckpt-3"
    assert "[4.0, 5.0]" in result.stdout
    names = gcs.objects(bucket, "round/")
    assert "round/b.tfrecord" in names and "round/a.tfrecord" not in names
    assert {"round/ckpt/ckpt-3.index", "round/ckpt/ckpt-2.index"} <= set(names)
    assert "round/ckpt/ckpt-1.index" not in names  # max_to_keep deleted it through the proxy
    # The bytes TensorFlow wrote are what the emulator holds: the first record is 1 byte long.
    blob = gcs.read(bucket, "round/b.tfrecord")
    assert int.from_bytes(blob[:8], "little") == 1
