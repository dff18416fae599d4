"""Which split a job trains on, which it validates and selects on, and which it is measured on.

The summary's `metrics` are measured on data.eval, the test split. Whatever chooses by the validation figures
(train.early_stopping_patience keeps the best epoch's weights, train.reduce_lr_patience cuts the rate, a callback
of train.callbacks that monitors a `val_` metric) must choose on another split: chosen on data.eval, the figure
reported is the one picked for being best. The rules, applied once the manifest beside data.train is read:

  1. data.eval unset: the split named `test` in that manifest (`test-*.tfrecord` beside data.train), else
     none (logged); never another dataset's.
  2. data.validation unset: the split named `validation` in that manifest, else data.eval, watched only.
  3. A job that selects on validation and has no split for it apart from data.eval is refused (exit 2)
     before its run folder is touched, naming the key and how to get one. No share of data.train is cut out
     silently: its records, steps per epoch and fingerprint are what the checkpoints mean.

The summary's `splits` says which split trained, validated, selected (and by which keys) and measured.
"""

from __future__ import annotations

import fnmatch
import logging
import posixpath

from runner import SpecError
from runner.data import pipeline
from runner.spec.paths import sibling_split
from runner.spec.types import JobSpec

log = logging.getLogger(__name__)


def beside_train(train: str, manifest: dict, split: str) -> str | None:
    """The glob of split `split` beside data.train when its manifest lists it and every shard of it is named
    as `runner prepare` names shards; else None."""
    pattern = sibling_split(train, split)
    files = [entry.get("file", "") for entry in manifest.get("splits", {}).get(split, {}).get("shards", [])]
    if pattern is None or not files or not all(fnmatch.fnmatch(f, posixpath.basename(pattern)) for f in files):
        return None
    return pattern


def eval_pattern(spec: JobSpec, train_manifest: dict) -> str | None:
    """data.eval, or (unset) the test split beside data.train, or None (rule 1)."""
    d = spec.data
    if not d.eval_is_derived:
        return d.eval
    found = beside_train(d.train, train_manifest, "test")
    where = posixpath.join(posixpath.dirname(d.train), pipeline.MANIFEST)
    if found:
        log.info("data.eval unset: the test split beside data.train, %s", found)
    else:
        log.info("data.eval unset and %s lists no test split: nothing is evaluated after training (set data.eval "
                 "to held-out shards to measure the model)", where)
    return found


def patterns(spec: JobSpec, train_manifest: dict) -> dict[str, str]:
    """The shard patterns the job reads, by spec key (rules 1-3); raises SpecError for rule 3."""
    d = spec.data
    found = {"data.train": d.train}
    if eval_ := eval_pattern(spec, train_manifest):
        found["data.eval"] = eval_
    if spec.train.validates():  # auto decides from the record counts, once every split is found
        validation = d.validation or beside_train(d.train, train_manifest, "validation")
        if validation and not d.validation:
            log.info("data.validation unset: the validation split beside data.train, %s", validation)
        if validation:
            found["data.validation"] = validation
    selecting = spec.train.selects_on_validation()
    if selecting and not apart(found):
        raise refusal(selecting[0], "val_loss", d.train, found.get("data.validation"))
    return found


def apart(patterns: dict[str, str]) -> bool:
    """Whether the job validates on a split apart from data.eval (patterns by spec key)."""
    validation = patterns.get("data.validation")
    return validation is not None and validation != patterns.get("data.eval")


def refusal(key: str, metric: str, train: str, validation: str | None = None) -> SpecError:
    """Rule 3's refusal: what selects, why not on data.eval, and how to get a validation split."""
    where = posixpath.join(posixpath.dirname(train), pipeline.MANIFEST)
    missing = (f"data.validation names the shards of data.eval ({validation})" if validation else
               f"data.validation is unset and {where} lists no split named validation")
    return SpecError(
        f"{key} selects by {metric}, and the job has no validation split: {missing}. Selecting on data.eval "
        "would make the figures the summary reports the ones chosen for being best. Set data.validation to "
        "held-out shards of their own (`runner prepare images|arrays|csv` writes validation-*.tfrecord beside "
        f"train-*.tfrecord by default; `--split train=0.8,validation=0.1,test=0.1` for a pool), or remove {key}"
    )


def record(spec: JobSpec, shards: dict[str, pipeline.Shards], validated: str | None, selectors: list[str]) -> dict:
    """The summary's `splits`: the patterns trained, validated (`validated`: the key, None for no validation),
    selected on (by `selectors`) and measured on."""
    def pattern(key: str | None) -> str | None:
        return shards[key].pattern if key in shards else None

    return {
        "trained_on": pattern("data.train"),
        "validated_on": pattern(validated),
        "selected_on": pattern(validated) if selectors else None,
        "selected_by": selectors,
        "measured_on": pattern("data.eval"),
    }
