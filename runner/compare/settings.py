"""The settings a run was made with, as dotted keys, and how two runs' settings differ.

A spec section flattens to one key per leaf (`train.optimizer.config.learning_rate`), so two AdamW runs differ in
the one number that differs. A setting that one run gives as a name or leaves unset and another as a Keras config
or a map (`adam` beside `{class_name: AdamW, ...}`, no class weights beside `{0: 1.0, 1: 3.0}`) has no sub-key in
common: it is compared whole, at the key both runs hold (`train.optimizer`), each side in its readable form
(`adam`, `AdamW(learning_rate=0.001, weight_decay=0.004)`, `unset`). So no difference is left out because the
runs wrote it in different shapes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from runner.rundir.recorded import Recorded

Settings = dict[str, Any]  # dotted key -> leaf value, in the spec's order

# Spec keys that say nothing about what a run measured: where it wrote, how it saved, what it may import.
_NOT_SETTINGS = ("name", "output.", "code.", "checkpoint.", "storage.", "profile", "pinned", "data.verify",
                 "accelerator.timeout_s", "train.max_duration", "train.stall_timeout")


def settings_of(said: Recorded, spec: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """The settings a run was made with, as (dotted key, value): the spec.json's comparable keys, and the
    global batch and epochs the summary records (all a summary without its spec.json tells)."""
    flat = dict(flatten(spec)) if spec else {}
    if spec and spec.get("kind") != "matmul_bench":
        flat = {k: v for k, v in flat.items() if not k.startswith("matmul.")}
    flat = {k: v for k, v in flat.items() if not any(k == n or k.startswith(n) for n in _NOT_SETTINGS)}
    if said.global_batch_size is not None:
        flat["data.global_batch_size"] = said.global_batch_size
    if said.train_epochs is not None:
        flat["train.epochs"] = said.train_epochs
    return tuple(flat.items())


def flatten(doc: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in doc.items():
        if isinstance(value, dict) and value and key != "params":
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def differing(runs: list[Settings]) -> list[str]:
    """The settings not all runs hold alike, in the order the runs list them. A key some run lacks is compared at
    the nearest enclosing key another run holds as a value (`train.optimizer` for `train.optimizer.class_name`
    beside `adam` or unset), so a name, a config and unset are one setting with different values."""
    keys: list[str] = []
    for key in dict.fromkeys(k for run in runs for k in run):
        if not all(key in run for run in runs):
            key = _enclosing(key, runs)
        if key not in keys and len({json.dumps(value_at(run, key), sort_keys=True) for run in runs}) > 1:
            keys.append(key)
    return keys


def _enclosing(key: str, runs: list[Settings]) -> str:
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if any(prefix in run for run in runs):
            return prefix
    return key


def value_at(run: Settings, key: str) -> Any:
    """A run's value of a setting: its leaf, or the mapping of the leaves under it, or None (unset)."""
    if key in run:
        return run[key]
    tree: dict[str, Any] = {}
    for name, value in run.items():
        if name.startswith(f"{key}."):
            *path, leaf = name[len(key) + 1:].split(".")
            node = tree
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = value
    return tree or None


def readable(value: Any) -> str:
    """`unset`, a name as it is, a Keras config as `AdamW(learning_rate=0.001)`, a map as `{0: 1.0, 1: 3.0}`."""
    if value is None:
        return "unset"
    if isinstance(value, dict) and set(value) <= {"class_name", "config"} and "class_name" in value:
        config = value.get("config") or {}
        config = json.loads(config) if isinstance(config, str) else config  # an empty config flattens to "{}"
        return f"{value['class_name']}({', '.join(f'{k}={_item(v)}' for k, v in config.items())})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_item(v)}" for k, v in value.items()) + "}"
    return str(value)


def _item(value: Any) -> str:
    return readable(value) if isinstance(value, dict) else str(value)
