"""The input pipeline's reading order: shard readers hand over blocks of records (runner/data/pipeline.py)."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path


def test_block_size_keeps_every_open_shard_in_each_batch() -> None:
    from runner.data.pipeline import MAX_READ_BLOCK, block_for

    assert block_for(1024, 6) == MAX_READ_BLOCK == 64
    assert block_for(256, 4) == 64
    assert block_for(32, 16) == 2
    assert block_for(8, 16) == 1, "a batch smaller than the shards open: records one by one"


def test_blocks_read_every_record_once_and_mix_all_shards_in_each_batch(tiny_mnist: Path) -> None:
    """4 shards of 512 records, batch 256: blocks of 64, so each batch holds 64 records of every shard."""
    import numpy as np

    from runner.data import pipeline

    def digest(image: np.ndarray) -> str:
        return hashlib.sha1(image.tobytes()).hexdigest()

    shards = pipeline.find_shards(f"{tiny_mnist}/train-*.tfrecord")
    assert len(shards.files) == 4 and pipeline.block_for(256, 4) == 64
    shard_of = {}
    for index, path in enumerate(shards.files):
        one = pipeline.Shards(path, (path,), 0, shards.features, shards.manifest)
        for images, _ in pipeline.make_dataset(one, 64, ("image",), "label", training=False, block=1):
            shard_of.update((digest(image), index) for image in images.numpy())
    assert len(shard_of) == shards.records == 2048

    def epoch(block: int | None) -> list[list[str]]:
        batches = pipeline.make_dataset(shards, 256, ("image",), "label", training=False, block=block)
        return [[digest(image) for image in images.numpy()] for images, _ in batches]

    in_blocks, one_by_one = epoch(None), epoch(1)
    assert sorted(sum(in_blocks, [])) == sorted(sum(one_by_one, [])) == sorted(shard_of), "each record once"
    for batch in in_blocks:
        assert Counter(shard_of[d] for d in batch) == {0: 64, 1: 64, 2: 64, 3: 64}
    assert in_blocks != one_by_one, "the order differs: blocks of 64, not single records, per shard"


def test_a_preprocess_that_branches_on_tensors_still_works_streamed_and_in_memory(tiny_mnist: Path) -> None:
    """The runner's own input functions are traced without AutoGraph (runner/data/schema.py `plain`); the user's
    data.preprocess still gets it, so Python control flow on a tensor works in both input paths."""
    import numpy as np
    import tensorflow as tf

    from runner.data import in_memory, pipeline

    def scale_if_bright(features: dict) -> dict:
        image = features["image"]
        if tf.reduce_max(image) > 1.0:  # a tensor in a Python `if`: AutoGraph makes it a tf.cond
            image = image / 255.0
        return {**features, "image": image}

    shards = pipeline.find_shards(f"{tiny_mnist}/test-*.tfrecord")
    streamed = pipeline.make_dataset(shards, 128, ("image",), "label", training=False, preprocess=scale_if_bright)
    held = in_memory.load(shards, ("image", "label"), "data.eval")
    memory = in_memory.make_dataset(held, shards.features, 128, ("image",), "label", shuffle=False, seed=0,
                                    preprocess=scale_if_bright)
    for images, _ in [*streamed.take(2), *memory.take(2)]:
        values = images.numpy()
        assert 0.0 <= values.min() and 0.5 < values.max() <= 1.0 and np.isfinite(values).all()
