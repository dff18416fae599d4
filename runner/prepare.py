"""`runner prepare`: a real dataset -> sharded TFRecords + manifest.json in a folder or bucket."""

from __future__ import annotations

import logging
import sys

import tensorflow as tf
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from runner import data
from runner.datasets import load_dataset

log = logging.getLogger(__name__)


def prepare(
    name: str, out: str, source: str = "offline", shards: int | None = None,
    limit: int | None = None, params: dict[str, str] | None = None,
) -> str:
    """Writes every split of dataset `name` under `out` (each cut to `limit` records if set); returns the manifest's path."""
    dataset = load_dataset(name, source, params)
    if limit is not None:
        dataset = dataset.head(limit)
    out = out.rstrip("/")
    tf.io.gfile.makedirs(out)
    total = sum(len(next(iter(arrays.values()))) for arrays in dataset.splits.values())
    entries = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        disable=not sys.stderr.isatty(), console=None,
    ) as progress:
        task = progress.add_task(f"writing {name} to {out}", total=total)
        for split in dataset.splits:
            count = shards or data.shard_count(dataset, split)
            entries[split] = data.write_split(dataset, split, out, count, lambda n: progress.advance(task, n))
            log.info("%s: %d records in %d shards", split, sum(e["records"] for e in entries[split]), count)
    return data.write_manifest(out, data.manifest_for(dataset, entries))
