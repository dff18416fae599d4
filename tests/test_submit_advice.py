"""`runner submit` advises the batch per chip and data.train's shards per host for the chosen TPU type
(runner/cloud/advice.py), in the dry run too: a user's batch of 16 is 2 per chip on v6e-8 and 1 on v6e-16, and
one shard per split feeds the 4 hosts of a v6e-16. A batch the slice's chips do not divide, and shards that
leave a host without a record, are refused before anything is sent. The manifest is read from the GCS
emulator where submit reads remote files (a dry run only with --preflight), the preflight against the local
fakes (tests/support/cloud_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import write_spec
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke

pytest_plugins = ["tests.support.cloud_fixtures"]

BUCKET = "runner-test"


@pytest.fixture
def api(tpu_fake, gcs, bucket, tmp_path: Path) -> dict[str, str]:
    for name in gcs.objects(bucket, "runs/"):
        gcs.client().bucket(bucket).blob(name).delete()
    return cloud_env(tpu_fake.endpoint, tmp_path, **gcs.env)


def job(tmp_path: Path, batch: int, folder: str = "mnist") -> Path:
    return write_spec(tmp_path, {
        "name": "advice",
        "data": {"train": f"gs://{BUCKET}/data/{folder}/train-*.tfrecord", "eval": None, "global_batch_size": batch},
        "output": {"dir": f"gs://{BUCKET}/runs"},
    })


def submit(spec: Path, env: dict[str, str], tpu_type: str, *extra: str):
    return invoke("submit", spec, "--tpu-type", tpu_type, "--zone", ZONE, "--project", PROJECT, "--image", IMAGE,
                  *extra, env=env)


def shards_in_bucket(gcs, folder: str, records: list[int]) -> None:
    """A prepared split as `runner prepare` writes it: the shards and a manifest listing each with its records."""
    count = len(records)
    files = [f"train-{i:05d}-of-{count:05d}.tfrecord" for i in range(count)]
    for name in files:
        gcs.write(BUCKET, f"data/{folder}/{name}", b"records")
    listed = [{"file": name, "records": n, "bytes": 7, "sha256": "0" * 64}
              for name, n in zip(files, records, strict=True)]
    manifest = {"manifest_version": 1, "features": {}, "splits": {"train": {"shards": listed}}}
    gcs.write(BUCKET, f"data/{folder}/manifest.json", json.dumps(manifest).encode())


def test_a_batch_of_16_is_said_per_chip_on_v6e_8_and_v6e_16_with_the_docs_rule(api, tpu_fake, tmp_path):
    spec = job(tmp_path, 16)
    eight = submit(spec, api, "v6e-8", "--dry-run")
    assert eight.returncode == 0, eight.stderr
    assert ("warning: batch: data.global_batch_size 16 on v6e-8 is 2 per chip: the TPU cores pad a batch per chip "
            'that is not a multiple of 8, and 128 is best (docs/accelerators.md, "Batch size"); e.g. '
            "--set data.global_batch_size=1024 (128 x 8)") in eight.stderr, eight.stderr
    sixteen = submit(spec, api, "v6e-16", "--dry-run")
    assert sixteen.returncode == 0, sixteen.stderr
    assert ("warning: batch: data.global_batch_size 16 on v6e-16 is 1 per chip, 4 per host on each of its 4 hosts"
            in sixteen.stderr), sixteen.stderr
    # A dry run reads no bucket: the shards are not counted, and it says where --preflight would read them.
    assert (f"shards: not counted (a dry run reads nothing remote; with --preflight it reads gs://{BUCKET}/data/mnist/"
            "manifest.json to count data.train's shards for the 4 hosts") in sixteen.stderr
    good = submit(job(tmp_path, 1024), api, "v6e-8", "--dry-run")
    assert "batch: data.global_batch_size 1024 on v6e-8 is 128 per chip (docs/accelerators.md" in good.stderr
    assert "warning: batch" not in good.stderr and "shards:" not in good.stderr  # one host: nothing to divide
    assert tpu_fake.requests() == []


def test_a_batch_the_chips_do_not_divide_is_refused_before_anything_is_sent(api, tpu_fake, tmp_path):
    refused = submit(job(tmp_path, 12), api, "v6e-8", "--dry-run")
    assert refused.returncode == 2, refused.stderr
    assert ("data.global_batch_size (12) must be divisible by the 8 devices of v6e-8 (one batch per chip): the job "
            "refuses it on the TPU VM, after the slice has booted; set it to 8 or 16") in refused.stderr
    assert tpu_fake.requests() == []


def test_one_shard_for_the_4_hosts_of_a_v6e_16_is_a_warning_with_the_rule(api, tpu_fake, gcs, tmp_path):
    shards_in_bucket(gcs, "one", [60_000])
    said = submit(job(tmp_path, 1024, "one"), api, "v6e-16", "--dry-run", "--preflight")
    assert said.returncode == 0, said.stderr
    assert ("warning: shards: data.train has 1 shard for the 4 hosts of v6e-16: every host reads all of them and "
            "keeps one record in 4, reading 4x what it trains on; at least one shard per host, a multiple of 4 best "
            '(docs/multihost.md, "Data"; docs/tpu.md, "Shards per slice"): `runner prepare DATASET --shards 4` '
            "writes 4") in said.stderr, said.stderr


def test_shards_that_do_not_divide_among_the_hosts_are_said_and_even_ones_counted(api, tpu_fake, gcs, tmp_path):
    shards_in_bucket(gcs, "six", [100] * 6)
    uneven = submit(job(tmp_path, 1024, "six"), api, "v6e-16", "--dry-run", "--preflight")
    assert uneven.returncode == 0, uneven.stderr
    assert ("warning: shards: data.train's 6 shards give the 4 hosts of v6e-16 1 or 2 each (100-200 records a host); "
            "a multiple of 4 gives each the same") in uneven.stderr, uneven.stderr
    assert "--shards 8` writes 8" in uneven.stderr
    shards_in_bucket(gcs, "eight", [100] * 8)
    even = submit(job(tmp_path, 1024, "eight"), api, "v6e-16", "--dry-run", "--preflight")
    assert "shards: data.train's 8 shards give each of the 4 hosts of v6e-16 2 (200-200 records a host" in even.stderr


def test_shards_that_leave_a_host_without_a_record_are_refused(api, tpu_fake, gcs, tmp_path):
    shards_in_bucket(gcs, "empty", [500, 0, 0, 0, 500, 0, 0, 0])
    refused = submit(job(tmp_path, 1024, "empty"), api, "v6e-16", "--no-preflight")
    assert refused.returncode == 2, refused.stderr
    assert (f"data.train's 8 shards in gs://{BUCKET}/data/empty/manifest.json leave hosts 1, 2, 3 of v6e-16 no "
            "record (host i reads shards i, i+4, ...: runner/data/pipeline.py)") in refused.stderr, refused.stderr
    assert not [r for r in tpu_fake.requests() if r["method"] == "POST"], "nothing is created"
