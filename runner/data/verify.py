"""Shards checked against their manifest: the manifest's structure (check_manifest) and each shard's bytes
(check_bytes: its size, and with sha256 every byte read once and hashed, in parallel).

`runner run` uses both before training (runner/data/integrity.py, data.verify), `runner verify` for a whole
folder, and the input pipeline to name the shard a read failed on (data.corrupt_shards). Format:
docs/data.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from runner import DataError
from runner.data import storage

VERIFY_MODES = ("size", "sha256", "off")
# Bytes per read when hashing a local shard: one reusable buffer per shard, each read hashed in place (no
# copy per chunk). Larger buffers measured no faster and fall out of the CPU cache between read and hash.
_READ_BLOCK = 1 << 20
# gs:// shards stat'ed or hashed at once: those threads wait on requests, not on the CPU.
_REMOTE_THREADS = 16


# --- the bytes -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Listed:
    """One shard as its manifest lists it; `where` names the entry ("<manifest>: splits.train.shards[2]")."""

    path: str
    where: str
    records: int
    bytes: int | None  # None in manifests written before sizes were recorded
    sha256: str | None


@dataclasses.dataclass
class Checked:
    """What check_bytes found (one problem line per shard that differs, naming it) and what it cost."""

    mode: str
    shards: int
    bytes: int  # the sizes found
    bytes_read: int  # the bytes hashed (sha256)
    seconds: float
    threads: int
    problems: list[str]
    found: dict[str, int] = dataclasses.field(default_factory=dict)  # path -> size found

    @property
    def mb_per_s(self) -> float | None:
        return round(self.bytes_read / 1e6 / self.seconds, 1) if self.bytes_read and self.seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "shards": self.shards, "bytes": self.bytes, "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 4), "mb_per_s": self.mb_per_s, "threads": self.threads,
        }


def check_bytes(
    listed: Sequence[Listed], mode: str, timeout_s: float = storage.DEFAULT_TIMEOUT_S, threads: int | None = None
) -> Checked:
    """Checks shards against their manifest entries: `size` stats each one (present, the listed size);
    `sha256` also reads every byte once and hashes it. Shards are checked on parallel threads: file reads,
    gs:// requests and hashlib (for more than 2 KB at a time) release the GIL, so local shards hash on every
    core and gs:// requests overlap. `off` checks nothing. A bucket that does not answer (retried for
    `timeout_s`, storage.timeout_s) raises StorageError. `threads`: shards checked at once (default: one per
    core for local shards, more for gs://)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r} is not one of {', '.join(VERIFY_MODES)}")
    if mode == "off" or not listed:
        return Checked(mode, len(listed), 0, 0, 0.0, 0, [])
    remote = any(_is_remote(shard.path) for shard in listed)
    threads = min(len(listed), threads or (_REMOTE_THREADS if remote else len(os.sched_getaffinity(0))))
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="verify") as pool:
        results = list(pool.map(lambda shard: _check_one(shard, mode == "sha256", timeout_s), listed))
    seconds = time.monotonic() - began
    found = {shard.path: size for shard, (size, _, _) in zip(listed, results, strict=True) if size is not None}
    return Checked(
        mode, len(listed), sum(found.values()), sum(read for _, read, _ in results), seconds, threads,
        [problem for _, _, problem in results if problem], found,
    )


def _check_one(shard: Listed, hashing: bool, timeout_s: float) -> tuple[int | None, int, str | None]:
    """(size found or None when missing, bytes hashed, the problem or None)."""
    try:
        size, digest = _read_sha256(shard.path) if hashing else (_size_of(shard.path), None)
    except (FileNotFoundError, tf.errors.NotFoundError):
        listing = f"{shard.records:,} records" + ("" if shard.bytes is None else f", {shard.bytes:,} bytes")
        return None, 0, f"{shard.path}: missing; {shard.where} lists it ({listing})"
    except OSError as exc:  # a local file that cannot be read
        return None, 0, f"{shard.path}: cannot be read ({exc.strerror or exc}); {shard.where} lists it"
    except tf.errors.OpError as exc:
        raise storage.storage_error(exc, [shard.path], timeout_s) or DataError(
            f"{shard.path}: cannot be read ({exc.message.splitlines()[0]}); {shard.where} lists it"
        ) from None
    differences = []
    if digest is not None:
        if shard.sha256 is None:
            differences.append(f"no sha256 to compare: {shard.where} lists none")
        elif digest != shard.sha256:
            differences.append(f"sha256 {digest[:12]}... does not match the manifest's {shard.sha256[:12]}...")
    if shard.bytes is not None and size != shard.bytes:
        what = "empty (0 bytes)" if size == 0 else f"{size:,} bytes"
        differences.append(f"{what}, the manifest lists {shard.bytes:,} bytes ({shard.where})")
    return size, size if hashing else 0, f"{shard.path}: {'; '.join(differences)}" if differences else None


def _is_remote(path: str) -> bool:
    return "://" in path


def _size_of(path: str) -> int:
    return tf.io.gfile.stat(path).length if _is_remote(path) else os.stat(path).st_size


def _read_sha256(path: str) -> tuple[int, str]:
    """(size, sha256) of a file, read once. A local file is read into one buffer that hashlib hashes in
    place; gs:// goes through tf.io.gfile in the runner's read block size."""
    digest, size = hashlib.sha256(), 0
    if _is_remote(path):
        with tf.io.gfile.GFile(path, "rb") as handle:
            while chunk := handle.read(storage.READ_BLOCK_MB << 20):
                digest.update(chunk)
                size += len(chunk)
        return size, digest.hexdigest()
    buffer = memoryview(bytearray(_READ_BLOCK))
    with open(path, "rb", buffering=0) as handle:
        if hasattr(os, "posix_fadvise"):  # a larger read-ahead from disk
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while count := handle.readinto(buffer):
            digest.update(buffer[:count])
            size += count
    return size, digest.hexdigest()


def sha256_of(path: str) -> str:
    return _read_sha256(path)[1]


# --- the manifest's structure ------------------------------------------------------------------------


WRITE_AGAIN = (
    "write the manifest again with `runner prepare` (built-in datasets) or `runner manifest SPEC --force` (your own "
    "records; SPEC: the job's spec file, data.features declared)"
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_manifest(manifest: dict[str, Any], path: str) -> None:
    """Every split lists its shards (file, records, and bytes, sha256, label_range where recorded) and its
    `records` is the sum of theirs: steps per epoch and evaluation counts come from these numbers."""
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not splits:
        state = "missing" if splits is None else f"{json.dumps(splits)[:60]}, not a mapping of splits"
        raise DataError(
            f"{path}: field `splits` is {state}; a manifest lists every split with its shards and record counts "
            f"(splits: {{train: {{records: N, shards: [{{file, records, bytes, sha256}}]}}}}): {WRITE_AGAIN}"
        )
    owner: dict[str, str] = {}
    for split, info in splits.items():
        field = f"splits.{split}"
        shards = info.get("shards") if isinstance(info, dict) else None
        if not isinstance(shards, list):
            raise DataError(f"{path}: field `{field}.shards` is missing or not a list of shards; {WRITE_AGAIN}")
        for index, entry in enumerate(shards):
            _check_entry(entry, f"{field}.shards[{index}]", path)
            if entry["file"] in owner:
                twice = f"{entry['file']} is listed twice ({owner[entry['file']]} and {field})"
                raise DataError(f"{path}: {twice}; {WRITE_AGAIN}")
            owner[entry["file"]] = field
        total = sum(entry["records"] for entry in shards)
        if info.get("records") != total:
            raise DataError(
                f"{path}: field `{field}.records` is {info.get('records')!r}, but the records of its {len(shards)} "
                f"shard(s) ({field}.shards[*].records) add up to {total:,}; one of them is wrong: {WRITE_AGAIN}"
            )


def _check_entry(entry: Any, field: str, path: str) -> None:
    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def count(value: Any) -> bool:
        return integer(value) and value >= 0

    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not entry["file"]:
        raise DataError(f"{path}: field `{field}.file` is missing: every shard entry names its file; {WRITE_AGAIN}")
    problems = []
    if not count(entry.get("records")):
        problems.append(f"`{field}.records` ({entry.get('records')!r}) is not a record count")
    if entry.get("bytes") is not None and not count(entry["bytes"]):
        problems.append(f"`{field}.bytes` ({entry['bytes']!r}) is not a size in bytes")
    sha256 = entry.get("sha256")
    if sha256 is not None and not (isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
        problems.append(f"`{field}.sha256` ({sha256!r}) is not 64 lowercase hex digits")
    labels = entry.get("label_range")
    if labels is not None and not (
        isinstance(labels, list) and len(labels) == 2 and all(map(integer, labels)) and labels[0] <= labels[1]
    ):
        problems.append(f"`{field}.label_range` ({labels!r}) is not [lowest label, highest label]")
    counts = entry.get("label_counts")
    if counts is not None and not (isinstance(counts, list) and all(map(count, counts))):
        problems.append(f"`{field}.label_counts` ({str(counts)[:60]}) is not a list of record counts per class id")
    if problems:
        raise DataError(f"{path}: field {'; field '.join(problems)}; {WRITE_AGAIN}")
