"""data.in_memory: the training split held in memory, decoded, and gathered batch by batch (runner/data/in_memory.py).

The datasets are real TFRecords (tiny MNIST; records of every feature kind from test_schema); the runs are
`runner run` in a child process, as a user runs it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from runner import DataError, SpecError
from runner.data import in_memory, pipeline
from runner.device import host
from tests.conftest import last_json, run_cli
from tests.test_schema import FEATURES, RGB, ROWS, job, mixed_records  # noqa: F401 (a fixture)

GIB = 1 << 30


def digest(image: np.ndarray) -> str:
    return hashlib.sha1(image.tobytes()).hexdigest()


@pytest.fixture(scope="module")
def mnist_shards(tiny_mnist: Path) -> pipeline.Shards:
    return pipeline.find_shards(f"{tiny_mnist}/train-*.tfrecord")


@pytest.fixture(scope="module")
def held(mnist_shards: pipeline.Shards) -> in_memory.Held:
    return in_memory.load(mnist_shards, ("image", "label"), "data.train")


def batches(dataset: tf.data.Dataset, count: int) -> list[list[str]]:
    return [[digest(image) for image in images.numpy()] for images, _ in dataset.take(count)]


# --- choosing -----------------------------------------------------------------------------------


def test_held_bytes_count_uint8_as_one_byte_and_text_as_the_shards_size(mnist_shards, mixed_records):  # noqa: F811
    assert in_memory.held_bytes(mnist_shards, ("image", "label")) == 2048 * (28 * 28 * 1 + 8)
    from runner.prepare import manifest as index

    spec = job(mixed_records, FEATURES, inputs=[n for n in FEATURES if n != "label"])
    index.write_user_manifests(spec, "schema.yaml", force=True)
    shards = pipeline.find_shards(spec.data.train)
    shard_bytes = (mixed_records / "train-0.tfrecord").stat().st_size
    assert in_memory.held_bytes(shards, ("raw", "label")) == ROWS * (2 * 3 + 8)
    assert in_memory.held_bytes(shards, ("words", "label")) == ROWS * 8 + shard_bytes


@pytest.mark.parametrize(
    "setting, kind, workers, memory, held, why",
    [
        ("auto", "cpu", 1, 24 * GIB, True, "auto: 1.5 MiB decoded, within auto's limit of 1.0 GiB, one worker on cpu"),
        ("auto", "gpu", 1, 24 * GIB, True, "auto: 1.5 MiB decoded, within auto's limit of 1.0 GiB, one worker on gpu"),
        ("auto", "cpu", 1, 8 * (1 << 20), False,
         "auto: streamed, the split takes 1.5 MiB decoded, over auto's limit of 1.0 MiB"),
        ("auto", "cpu", 1, None, True, "auto: 1.5 MiB decoded, within auto's limit of 1.0 GiB, one worker on cpu"),
        ("auto", "tpu", 1, 24 * GIB, False,
         "auto: streamed, the job runs on a TPU, where holding the split in memory is not measured by this runner"),
        ("auto", "cpu", 2, 24 * GIB, False, "auto: streamed, 2 workers each read their share of the shards"),
        (True, "cpu", 1, 4 * (1 << 20), True, "data.in_memory: true"),
        (False, "cpu", 1, 24 * GIB, False, "data.in_memory: false"),
    ],
)
def test_auto_holds_a_split_that_fits_on_a_cpu_or_gpu_with_one_worker(
    mnist_shards, setting, kind, workers, memory, held, why
):
    choice = in_memory.choose(setting, mnist_shards, ("image", "label"), kind, workers, memory, 128)
    assert (choice.held, choice.why) == (held, why)
    assert choice.bytes == 2048 * 792
    assert choice.to_dict() == {"mode": "in_memory" if held else "streamed", "why": why, "bytes": 2048 * 792,
                                "load_s": None}


@pytest.mark.parametrize(
    "kind, workers, memory, reason",
    [
        ("tpu", 1, 24 * GIB, "the job runs on a TPU"),
        ("cpu", 3, 24 * GIB, "3 workers each read their share of the shards"),
        ("cpu", 1, 2 * (1 << 20),
         "the split takes 1.5 MiB decoded, more than half of the 2.0 MiB this process may use"),
    ],
)
def test_true_that_cannot_be_honoured_is_refused_with_what_to_set(mnist_shards, kind, workers, memory, reason):
    with pytest.raises(SpecError) as caught:
        in_memory.choose(True, mnist_shards, ("image", "label"), kind, workers, memory, 128)
    assert str(caught.value).startswith("data.in_memory: true cannot be honoured: " + reason)
    assert str(caught.value).endswith("; set data.in_memory: auto or false")


def test_a_split_smaller_than_one_batch_streams_where_batches_run_across_passes(mnist_shards):
    # With train.steps_per_epoch set a job may train on fewer records than a batch: streamed, a batch then
    # holds records of two passes; a held pass is whole batches only.
    choice = in_memory.choose("auto", mnist_shards, ("image", "label"), "cpu", 1, 24 * GIB, 4096)
    assert (choice.held, choice.why) == (
        False, "auto: streamed, its 2048 records make no full batch of data.global_batch_size (4096)")
    with pytest.raises(SpecError, match=r"true cannot be honoured: its 2048 records make no full batch"):
        in_memory.choose(True, mnist_shards, ("image", "label"), "cpu", 1, 24 * GIB, 4096)


def test_the_memory_a_process_may_use_is_its_containers_limit_when_lower(tmp_path: Path) -> None:
    machine = host.memory_bytes(limits=())
    assert machine and machine > 1 << 28
    (tmp_path / "v2").write_text("536870912\n")
    (tmp_path / "none").write_text("max\n")
    assert host.memory_bytes(limits=(str(tmp_path / "v2"),)) == 512 << 20
    assert host.memory_bytes(limits=(str(tmp_path / "none"), str(tmp_path / "absent"))) == machine


# --- what the held split yields -----------------------------------------------------------------


def test_each_pass_is_a_permutation_holding_every_record_once(mnist_shards, held):
    assert held.records == 2048 and held.columns["image"].dtype == tf.uint8, "uint8 is held as uint8"
    from runner.data import schema

    in_shard_order = tf.data.TFRecordDataset(list(mnist_shards.files)).batch(256).map(
        lambda block: (schema.parse_batch(block, mnist_shards.features)["image"], 0))
    streamed = sum(batches(in_shard_order, 8), [])

    dataset = in_memory.make_dataset(held, mnist_shards.features, 256, ("image",), "label", shuffle=True, seed=3)
    assert dataset.element_spec[0].shape == (256, 28, 28, 1) and dataset.element_spec[0].dtype == tf.float32
    two_passes = batches(dataset, 16)
    first, second = sum(two_passes[:8], []), sum(two_passes[8:], [])
    assert sorted(first) == sorted(second) == sorted(streamed), "every record once per pass"
    assert first != second, "a fresh permutation each pass"
    assert first != streamed, "shuffled, not in shard order"
    again = batches(in_memory.make_dataset(held, mnist_shards.features, 256, ("image",), "label", shuffle=True,
                                           seed=3), 16)
    other = batches(in_memory.make_dataset(held, mnist_shards.features, 256, ("image",), "label", shuffle=True,
                                           seed=4), 8)
    assert again == two_passes, "the same seed gives the same order"
    assert sum(other, []) != first

    in_order = batches(in_memory.make_dataset(held, mnist_shards.features, 256, ("image",), "label", shuffle=False,
                                              seed=3), 9)
    assert sum(in_order[:8], []) == streamed and in_order[8] == streamed[:256], (
        "no shuffle: shard order, pass after pass")


def test_records_left_over_by_the_batch_change_from_pass_to_pass(mnist_shards, held):
    # 2048 records in batches of 500: 4 batches a pass, 48 left out, a different 48 each time.
    dataset = in_memory.make_dataset(held, mnist_shards.features, 500, ("image",), "label", shuffle=True, seed=0)
    passes = [set(sum(p, [])) for p in (batches(dataset, 12)[i : i + 4] for i in (0, 4, 8))]
    assert all(len(p) == 2000 for p in passes), "each pass: 2000 distinct records"
    assert len(passes[0] | passes[1] | passes[2]) > 2000


def test_a_batch_is_what_streaming_decodes_for_the_same_records(mnist_shards, held):
    def preprocess(features):
        return {**features, "image": features["image"] / 255.0}

    dataset = in_memory.make_dataset(held, mnist_shards.features, 128, ("image",), "label", shuffle=True, seed=1,
                                     preprocess=preprocess)
    streamed = pipeline.make_dataset(mnist_shards, 2048, ("image",), "label", training=False, preprocess=preprocess)
    images, labels = next(iter(streamed))
    label_of = {digest(i): (i, int(l)) for i, l in zip(images.numpy(), labels.numpy(), strict=True)}
    for got, label in dataset.take(3):
        for image, value in zip(got.numpy(), label.numpy(), strict=True):
            want, want_label = label_of[digest(image)]
            np.testing.assert_array_equal(image, want)
            assert int(value) == want_label
        assert float(tf.reduce_max(got)) <= 1.0, "data.preprocess ran on the batch"


def test_several_features_are_gathered_for_the_same_records(mixed_records):  # noqa: F811
    from runner.prepare import manifest as index

    spec = job(mixed_records, FEATURES, inputs=["rgb", "tokens", "words", "score"])
    index.write_user_manifests(spec, "schema.yaml", force=True)
    shards = pipeline.find_shards(spec.data.train)
    loaded = in_memory.load(shards, ("rgb", "tokens", "words", "score", "label"), "data.train")
    dataset = in_memory.make_dataset(loaded, shards.features, 3, ("rgb", "tokens", "words", "score"), "label",
                                     shuffle=True, seed=5)
    for inputs, labels in dataset.take(4):
        for row, label in enumerate(labels.numpy()):
            assert inputs["rgb"].dtype == tf.float32
            np.testing.assert_array_equal(inputs["rgb"][row].numpy(), RGB[label].astype(np.float32))
            assert inputs["tokens"][row].numpy().tolist() == (list(range(1, 1 + label)) + [0, 0, 0])[:3]


# --- loading ------------------------------------------------------------------------------------


def test_a_damaged_record_stops_the_load_naming_its_shard(tiny_mnist: Path, tmp_path: Path):
    copy = tmp_path / "mnist"
    copy.mkdir()
    for path in tiny_mnist.glob("*"):
        (copy / path.name).write_bytes(path.read_bytes())
    victim = sorted(copy.glob("train-*"))[2]
    raw = bytearray(victim.read_bytes())
    raw[5000:5010] = b"\xff" * 10
    victim.write_bytes(bytes(raw))
    shards = pipeline.find_shards(f"{copy}/train-*.tfrecord")
    with pytest.raises(DataError) as caught:
        in_memory.load(shards, ("image", "label"), "data.train")
    assert str(caught.value).startswith(f"corrupt training data in {victim}: sha256 ")


def test_shards_holding_other_than_the_manifests_count_are_refused(mnist_shards):
    claims_more = dataclasses.replace(mnist_shards, records=2049)
    with pytest.raises(DataError) as caught:
        in_memory.load(claims_more, ("image", "label"), "data.train")
    manifest = f"{posixpath.dirname(mnist_shards.pattern)}/manifest.json"
    assert f"hold 2048 records, their manifest lists 2049 (in {manifest}: its `records` counts" in str(caught.value)


# --- runs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_records_how_its_training_was_fed(mnist_job, tmp_path: Path):
    held_run = run_cli("run", mnist_job("held"), timeout=300)
    assert held_run.returncode == 0, held_run.stderr[-3000:]
    summary = last_json(held_run.stdout)
    assert summary["train_input"]["mode"] == "in_memory"
    assert summary["train_input"]["why"].startswith("auto: 0.4 MiB decoded, within auto's limit of")
    assert summary["train_input"]["bytes"] == 512 * 792 and summary["train_input"]["load_s"] > 0
    assert "data.train held in memory: 512 records" in held_run.stderr
    assert summary["metrics"]["accuracy"] > 0.5, "it learned from the held split"

    streamed = run_cli("run", mnist_job("streamed", data={"in_memory": False}, accelerator={"cpu_devices": 2}),
                       timeout=300)
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert last_json(streamed.stdout)["train_input"] == {"mode": "streamed", "why": "data.in_memory: false",
                                                         "bytes": 512 * 792, "load_s": None}
    on_disk = json.loads((tmp_path / "runs" / "held" / "summary.json").read_text())
    assert on_disk["train_input"] == summary["train_input"]


@pytest.mark.slow
def test_two_replicas_train_from_the_held_split(mnist_job):
    result = run_cli("run", mnist_job("mirrored", data={"in_memory": True}, accelerator={"cpu_devices": 2}),
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["accelerator"]["replicas"] == 2
    assert summary["train_input"]["mode"] == "in_memory" and summary["train_input"]["why"] == "data.in_memory: true"
    assert summary["metrics"]["accuracy"] > 0.5
    assert Counter(e["steps"] for e in summary["epochs"]) == {16: 2}
