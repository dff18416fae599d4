"""gs:// for real: TensorFlow's own client and google-cloud-storage against an emulator on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import cli_env, last_json, run_cli


def run_python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        env=cli_env(**env),
    )


def test_tensorstore_reads_each_objects_generation_and_writes_on_the_condition_it_holds(gcs):
    """Orbax writes a JAX run's arrays through TensorStore, whose OCDBT database re-reads its manifest and writes
    it back on the generation it read when two commits meet (more often on a busy machine). The rig answers a
    read with `x-goog-generation` as GCS does, and refuses a write whose generation no longer holds (412)."""
    bucket = gcs.bucket()
    code = f"""
        import tensorstore as ts
        store = ts.KvStore.open({{"driver": "gcs", "bucket": "{bucket}"}}).result()
        written = store.write("db/manifest", b"one").result().generation
        read = store.read("db/manifest").result()
        print(read.stamp.generation == written)
        store.write("db/manifest", b"two", if_equal=read.stamp.generation).result()
        stale = store.write("db/manifest", b"three", if_equal=read.stamp.generation).result()
        print(stale.generation == b"", bytes(store.read("db/manifest").result().value).decode())  # b"": not written
    """
    result = run_python(code, gcs.env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True", "two"]


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


SECRET = "ya29.never-print-this-token"  # stands in for an access token: it must not leak anywhere


def count_records(tfrecord: bytes) -> int:
    """Counts TFRecord framing (length, crc, data, crc) without TensorFlow."""
    count, offset = 0, 0
    while offset < len(tfrecord):
        offset += 8 + 4 + int.from_bytes(tfrecord[offset : offset + 8], "little") + 4
        count += 1
    assert offset == len(tfrecord), "trailing bytes after the last record"
    return count


@pytest.mark.slow
def test_prepare_writes_shards_and_sha256_to_a_bucket_and_verify_checks_them(gcs):
    bucket = gcs.bucket()
    out = f"gs://{bucket}/mnist"
    env = cli_env(**gcs.env)
    result = run_cli("prepare", "mnist", "--out", out, "--limit", "1500", "--shards", "3", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"{out}/manifest.json"
    assert "uploaded 7 files" in result.stderr and "(0 retries)" in result.stderr
    manifest = json.loads(gcs.read(bucket, "mnist/manifest.json"))
    for _split, info in manifest["splits"].items():
        assert len(info["shards"]) == 3
        for shard in info["shards"]:
            content = gcs.read(bucket, f"mnist/{shard['file']}")
            assert hashlib.sha256(content).hexdigest() == shard["sha256"]
            assert count_records(content) == shard["records"]
        assert info["records"] == 1500

    result = run_cli("verify", out, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every shard matches" in result.stdout

    # One shard with a flipped byte, one cut short: both named, exit 2.
    flipped = bytearray(gcs.read(bucket, "mnist/train-00001-of-00003.tfrecord"))
    flipped[len(flipped) // 2] ^= 0xFF
    gcs.write(bucket, "mnist/train-00001-of-00003.tfrecord", bytes(flipped))
    whole = gcs.read(bucket, "mnist/test-00002-of-00003.tfrecord")
    gcs.write(bucket, "mnist/test-00002-of-00003.tfrecord", whole[: len(whole) // 3])
    result = run_cli("verify", out, env=env)
    assert result.returncode == 2
    assert f"{out}/train-00001-of-00003.tfrecord: sha256" in result.stderr
    assert f"{out}/test-00002-of-00003.tfrecord: sha256" in result.stderr
    assert "train-00000" not in result.stderr


def test_prepare_to_a_missing_bucket_fails_fast_naming_it(gcs):
    result = run_cli("prepare", "mnist", "--out", "gs://no-such-bucket-here/mnist", "--limit", "10",
                     env=cli_env(**gcs.env))
    assert result.returncode == 3
    assert "gs://no-such-bucket-here does not exist" in result.stderr


@pytest.mark.slow
def test_run_reads_and_writes_gs_the_same_spec_runs_on_local_paths_and_a_corrupt_shard_stops_the_resume(
    gcs, small_mnist, mnist_job, tmp_path
):
    """One job trained on gs:// serves three checks: what it wrote to the bucket, the same spec on local paths,
    and (its checkpoints the set-up) a byte flipped in a bucket shard stopping one more epoch, naming the shard."""
    bucket = gcs.bucket()
    data_url = gcs.upload_folder(small_mnist, bucket, "mnist")
    on_gs = {
        "data": {"train": f"{data_url}/train-*.tfrecord", "eval": f"{data_url}/test-*.tfrecord"},
        "output": {"dir": f"gs://{bucket}/runs"},
        "checkpoint": {"every_steps": 8},
    }
    remote = mnist_job("remote", **on_gs)
    env = cli_env(**{**gcs.env, "GOOGLE_AUTH_TOKEN_FOR_TESTING": SECRET})
    result = run_cli("run", remote, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded"
    assert summary["final_step"] == 2 * 16
    assert summary["metrics"]["examples"] == 512
    assert json.loads(gcs.read(bucket, "runs/remote/summary.json")) == summary
    names = gcs.objects(bucket, "runs/remote/")
    assert {"runs/remote/spec.json", "runs/remote/model.keras", "runs/remote/checkpoints/ckpt-32.index"} <= set(names)
    assert 'model_checkpoint_path: "ckpt-32"' in gcs.read(bucket, "runs/remote/checkpoints/checkpoint").decode()
    # Credentials: the token TensorFlow sent with every request is in no output and no object written.
    assert SECRET not in result.stdout + result.stderr
    assert not [n for n in names if SECRET.encode() in gcs.read(bucket, n)]

    local = mnist_job("remote", checkpoint={"every_steps": 8})  # the same spec, local data and run folder
    result = run_cli("run", local)
    assert result.returncode == 0, result.stderr[-3000:]
    local_summary = last_json(result.stdout)
    assert local_summary["final_step"] == summary["final_step"]
    assert [e["steps"] for e in local_summary["epochs"]] == [e["steps"] for e in summary["epochs"]]
    assert (tmp_path / "runs" / "remote" / "checkpoints" / "ckpt-32.index").exists()

    # A shard of the bucket corrupted after the job trained: one more epoch stops, naming it, and saves nothing.
    checkpoints = {n: gcs.read(bucket, n) for n in gcs.objects(bucket, "runs/remote/checkpoints/")}
    shard = "mnist/train-00002-of-00004.tfrecord"
    flipped = bytearray(gcs.read(bucket, shard))
    # Its size unchanged (a shard cut short stops before training: test_integrity). The byte lies in the shard's
    # first block of records, which the resumed run reads while it fills its shuffle buffer, before its first step.
    flipped[len(flipped) // 32] ^= 0x01
    gcs.write(bucket, shard, bytes(flipped))
    remote = mnist_job("remote", **on_gs)  # the local run wrote its spec over the same file name
    result = run_cli("run", remote, "--set", "train.epochs=3", env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"corrupt training data in gs://{bucket}/{shard}" in result.stderr
    summary = last_json(result.stdout)
    assert summary["status"] == "failed" and shard in summary["error"]
    # Found while loading the split into memory, before the first step: a refusal at start writes nothing.
    assert "runs/remote/attempts/002.json" not in set(gcs.objects(bucket, "runs/remote/"))
    assert json.loads(gcs.read(bucket, "runs/remote/summary.json"))["status"] == "succeeded"
    after = {n: gcs.read(bucket, n) for n in gcs.objects(bucket, "runs/remote/checkpoints/")}
    assert after == checkpoints  # the failing run saved nothing over them
    assert SECRET not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_flipped_byte_in_a_local_shard_stops_training_naming_it(small_mnist, mnist_job, tmp_path):
    folder = tmp_path / "mnist"
    shutil.copytree(small_mnist, folder)
    shard = folder / "train-00001-of-00004.tfrecord"
    content = bytearray(shard.read_bytes())
    content[len(content) // 2] ^= 0x01  # inside a record: its CRC no longer matches
    shard.write_bytes(bytes(content))
    spec = mnist_job("flipped", data={"train": f"{folder}/train-*.tfrecord", "eval": None}, train={"epochs": 1})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"corrupt training data in {shard}: sha256" in result.stderr
    assert "corrupted record" in result.stderr or "checksum" in result.stderr.lower()
    assert not list((tmp_path / "runs" / "flipped").glob("checkpoints/ckpt-*"))  # it failed before any save


@pytest.mark.slow
@pytest.mark.parametrize(
    ("in_memory", "said"),
    [(False, "data.train: a batch could not be decoded"),  # streamed: met by the training step's batch
     (True, "data.train: a record could not be decoded while loading it into memory")],  # held: met loading it
)
def test_a_replaced_shard_whose_record_does_not_fit_stops_training_naming_it(
    small_mnist, mnist_job, tmp_path, in_memory, said
):
    """A readable shard swapped in after `runner prepare`, one image 10 bytes short: exit 2, not a traceback."""
    import tensorflow as tf

    folder = tmp_path / "mnist"
    shutil.copytree(small_mnist, folder)
    shard = folder / "train-00003-of-00004.tfrecord"
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(shard))]
    short = tf.train.Example.FromString(records[100])
    image = short.features.feature["image"].bytes_list.value
    image[0] = image[0][:-10]
    records[100] = short.SerializeToString()
    with tf.io.TFRecordWriter(str(shard)) as writer:
        for record in records:
            writer.write(record)
    # data.verify off: its size changed, which the default check would refuse before training (test_integrity).
    spec = mnist_job("misfit", data={"train": f"{folder}/train-*.tfrecord", "eval": None, "verify": "off",
                                     "in_memory": in_memory},
                     train={"epochs": 1})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert said in result.stderr
    assert f"shards that differ from their manifest: {shard}: sha256" in result.stderr
    assert "Traceback" not in result.stderr
    assert last_json(result.stdout)["status"] == "failed"
    assert not list((tmp_path / "runs" / "misfit").glob("checkpoints/ckpt-*"))


def test_run_into_a_missing_output_bucket_fails_fast_naming_it(gcs, mnist_job):
    spec = mnist_job(
        "nobucket", output={"dir": "gs://no-such-output-bucket/runs"},
        train={"epochs": 1, "steps_per_epoch": 2}, data={"eval": None},
    )
    result = run_cli("run", spec, env=cli_env(**gcs.env), timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "bucket gs://no-such-output-bucket (output.dir) does not exist" in result.stderr
    assert last_json(result.stdout)["status"] == "failed"


@pytest.mark.parametrize(("preset", "block_mb"), [(None, 8), ("64", 64)])
def test_gs_shards_are_read_in_the_runners_block_size_unless_the_environment_names_one(gcs_faults, preset, block_mb):
    """TensorFlow reads a gs:// file in blocks of GCS_READ_CACHE_BLOCK_SIZE_MB (runner/data/storage.py): with the
    runner's 8 MB, a 20 MB shard takes three ranged GETs; a size already in the environment is kept."""
    bucket = gcs_faults.bucket()
    env = {**gcs_faults.env, **({"GCS_READ_CACHE_BLOCK_SIZE_MB": preset} if preset else {})}
    code = f"""
        import os, tempfile
        from runner.data import storage
        storage.configure_tensorflow(300)
        print(os.environ["GCS_READ_CACHE_BLOCK_SIZE_MB"])
        import tensorflow as tf
        local = os.path.join(tempfile.mkdtemp(), "big.tfrecord")
        with tf.io.TFRecordWriter(local) as writer:
            for _ in range(20):
                writer.write(os.urandom(2**20))
        tf.io.gfile.copy(local, "gs://{bucket}/big.tfrecord")
        print(sum(1 for _ in tf.data.TFRecordDataset("gs://{bucket}/big.tfrecord")))
    """
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(block_mb), "20"]
    media_gets = [line for line in gcs_faults.faults.stats()["recent"] if line == f"pass GET /{bucket}/big.tfrecord"]
    assert len(media_gets) == -(-20 * (2**20 + 16) // (block_mb * 2**20))
