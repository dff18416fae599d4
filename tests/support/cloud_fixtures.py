"""The fixtures of the Cloud TPU tests (test_submit, test_startup, test_recovery). A test module loads them with
`pytest_plugins = ["tests.support.cloud_fixtures"]` (one registration per session: the fakes' processes are
started once per pytest process, whichever modules use them):

    tpu_fake       the Cloud TPU API fake (tests/support/tpu_fake.py), reset for each test: no requests,
                   resources, VMs or configuration left from an earlier test
    metadata_fake  the GCE metadata server fake (tests/support/metadata_fake.py), answering again for each
                   test, as worker 0 of a single-host slice
    cloud_spec     a job spec in tmp_path whose data and run folder are on gs://runner-test
    bucket         gs://runner-test on the GCS emulator, with a training shard under cloud_spec's data.train
    engine_api     the engines' API fake (tests/support/engine_fake.py: Kubernetes, Vertex AI), recording every
                   request; a test reads the requests it made after len(engine_api.requests()) before it
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import write_spec
from tests.support.engine_fake import start_engine_fake
from tests.support.metadata_fake import MetadataFake, start_metadata_fake
from tests.support.tpu_fake import TpuFake, start_tpu_fake

# A session's fake lives as long as the session may (CI's bound on the whole suite), not a module's 10-15 min:
# started by an early module, it must still answer a module that runs 20 minutes later on a loaded machine.
# It is stopped by its PID when the session ends, and stops itself after this even if the session is killed.
SESSION_TTL_S = 90 * 60


def _started_once(name: str, start, folder: str):
    """A session fixture NAME: the fake `start(FOLDER)` runs, started at its first use, stopped at the end."""

    def fixture(tmp_path_factory) -> Iterator:
        with start(tmp_path_factory.mktemp(folder), ttl_s=SESSION_TTL_S) as fake:
            yield fake

    return pytest.fixture(scope="session", name=name)(fixture)


_tpu_api = _started_once("_tpu_api", start_tpu_fake, "tpu_api")
_metadata_server = _started_once("_metadata_server", start_metadata_fake, "metadata")
engine_api = _started_once("engine_api", start_engine_fake, "engines")


@pytest.fixture
def tpu_fake(_tpu_api: TpuFake) -> TpuFake:
    _tpu_api.reset()
    return _tpu_api


@pytest.fixture
def metadata_fake(_metadata_server: MetadataFake) -> MetadataFake:
    _metadata_server.recover()
    _metadata_server.set(agent_worker_number=0, worker_network_endpoints="unknown:unknown:10.0.0.2")
    return _metadata_server


@pytest.fixture
def cloud_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path, {
        "name": "mnist_cnn",
        "data": {"train": "gs://runner-test/data/mnist/train-*.tfrecord", "eval": "gs://runner-test/data/mnist/test-*.tfrecord"},
        "train": {"epochs": 2},
        "output": {"dir": "gs://runner-test/runs"},
    })


# The run folders' bucket of the submit tests, on the GCS emulator (job.json, cancel marks, summaries).
RUNS_BUCKET = "runner-test"


@pytest.fixture(scope="module")
def bucket(gcs) -> str:
    """RUNS_BUCKET, made once on the emulator, holding a shard where cloud_spec's data.train points (what
    `runner submit`'s preflight lists before it submits)."""
    from google.api_core import exceptions

    try:
        gcs.bucket(RUNS_BUCKET)
    except exceptions.Conflict:
        pass
    gcs.write(RUNS_BUCKET, TRAIN_SHARD, b"records")
    return RUNS_BUCKET


TRAIN_SHARD = "data/mnist/train-00000-of-00001.tfrecord"  # under cloud_spec's data.train
