"""The run summary, typed: every key `runner run` writes (summary.json, attempts/<n>.json, stdout's last line).

`Summary` and its parts are the one declaration of the summary: the writers (runner/rundir/timing.py
`build_summary`, runner/job/run.py, runner/job/matmul.py) build it through them, so a key not declared here
cannot be written (extra="forbid" at every level); runner/rundir/summary.schema.json is generated from them:

    python -m runner.rundir.summary --write-schema

The parts that hold many different records (the sharding report, the processes' shares) live in
runner/rundir/summary_parts.py; its readers read it leniently through runner/rundir/recorded.py `Recorded`
(re-exported here). No TensorFlow: `runner report` and `runner sweep` read summaries with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from runner.rundir.recorded import Recorded
from runner.rundir.summary_parts import (
    Absent,
    Accelerator,
    CheckpointSaves,
    Count,
    DataVerify,
    Epoch,
    Matmul,
    Metrics,
    Notice,
    Positive,
    Processes,
    Profile,
    Sharding,
    Splits,
    Strict,
    Tflops,
    Throughput,
    TimeLimit,
    Timing,
    TrainInput,
)

# 2: adds import_s, run_folder_s, unaccounted_s, input wait, per-epoch checkpoint_s and input_wait_s;
# epoch `seconds` no longer include checkpoint saves. runner/compare/report.py reads 1 and 2.
SCHEMA_VERSION = 2

# How an attempt ended: succeeded (exit 0); failed (1, 2 or 3: `error` says why); preempted (SIGTERM: saved,
# exit 75); interrupted (Ctrl-C, SIGINT: saved, exit 130). The last two continue when the job is run again.
STATUSES = ("succeeded", "failed", "preempted", "interrupted", "time_limit", "learned_nothing")
Status = Literal["succeeded", "failed", "preempted", "interrupted", "time_limit", "learned_nothing"]

__all__ = ["SCHEMA_FILE", "SCHEMA_VERSION", "STATUSES", "Recorded", "Status", "Summary", "main", "schema",
           "schema_text"]

SCHEMA_FILE = Path(__file__).with_name("summary.schema.json")
_DESCRIPTION = (
    "The last stdout line of `runner run` and <run folder>/summary.json (attempts/<n>.json keeps each attempt's "
    "own). Written even when a run fails or is preempted. Times are seconds on a monotonic clock from the start of "
    "the process; phases are measured one by one and add up to total_s with unaccounted_s. Generated from "
    "runner/rundir/summary.py (`python -m runner.rundir.summary --write-schema`): do not edit by hand."
)


class Summary(Strict):
    schema_version: Literal[2] = Field(
        description="2 since the input wait and per-epoch checkpoint time; `runner report` also reads 1.")
    status: Status = Field(description=(
        "failed: `error` says why (exit 1, 2 or 3; a loss that turned NaN or infinite is exit 1, nothing of it "
        "saved); preempted: a checkpoint was saved on SIGTERM (exit 75); interrupted: a checkpoint was saved on "
        "Ctrl-C, SIGINT (exit 130); time_limit: train.max_duration passed, a checkpoint was saved (exit 124); "
        "learned_nothing: training finished but `warnings` says its result is at chance (exit 4; "
        "train.allow_chance: true makes it succeeded). Run the same job again to continue a preempted, interrupted "
        "or time-limited one."))
    job: str = Field(description="The spec's `name`; it names the run folder.")
    accelerator: Accelerator | None = Field(
        description="What the job ran on; null when it failed before a device was chosen.")
    global_batch_size: int | None = Field(
        description="Examples per step over all replicas; null for a matmul_bench job.")
    timing: Timing
    epochs: list[Epoch] = Field(description=(
        "One record per epoch trained, across every attempt of the job, each marked with its attempt (a resumed "
        "partial epoch is a record of the attempt that finished it). The timing block describes this attempt's "
        "epochs only."))
    metrics: Metrics = Field(description=(
        "Evaluation on every record of data.eval after training (loss and metrics; the last batch is padded to the "
        "static batch shape and its padding weighs 0); {} when there is no eval data or the run did not finish."))
    error: str | Absent = Field(None, description="What ended a failed or preempted run and what to change.")
    kind: Literal["matmul_bench"] | Absent = Field(
        None, description="matmul_bench for the matmul benchmark (`tflops` and `matmul` hold its results); absent "
                          "for a training job.")
    attempt: Positive | Absent = Field(None, description="This attempt's number in the run folder (attempts/<n>.json).")
    run_dir: str | Absent = Field(None, description="The run folder, local or gs://.")
    train_epochs: Positive | Absent = Field(None, description=(
        "train.epochs this attempt was asked to reach. A succeeded summary's is what the resume rules compare "
        "(runner/rundir/outputs.py, precedence 3): equal, the job is complete; lower, a job never shrinks; "
        "higher, it continues."))
    data_verify: DataVerify | Absent = Field(None, description=(
        "The check of the job's shards against their manifests (data.verify, docs/data.md), made before the run "
        "folder was touched; a failed check ends the run with exit 2 and this key absent."))
    train_input: TrainInput | Absent = Field(None, description=(
        "How data.train fed training (data.in_memory, runner/data/in_memory.py): held in memory, decoded, or "
        "streamed from its shards, and why."))
    splits: Splits | Absent = Field(None, description=(
        "Which split did what (runner/data/splits.py): trained_on data.train; validated_on the split of the "
        "epochs' val_ metrics (null: none); selected_on the split early stopping, learning-rate cuts or a callback "
        "monitoring a val_ metric chose by (never data.eval; null: nothing chose), selected_by the keys that "
        "chose; measured_on the split of `metrics` (null: nothing measured). Each a shard glob."))
    steps_per_epoch: Positive | Absent = None
    steps_per_execution: Positive | Absent = Field(None, description=(
        "Training steps Keras runs per call to the device (runner/train/build.py `steps_per_execution`)."))
    resumed_from_step: Count | Absent = Field(
        None, description="The step restored from a checkpoint; 0 for a fresh start.")
    final_step: Count | Absent = None
    stopped_early_after_epoch: Positive | Absent = Field(None, description=(
        "The epoch after which train.early_stopping ended training; absent when it did not."))
    final_learning_rate: float | Absent = Field(None, description=(
        "With train.reduce_lr_patience: the optimizer's learning rate when training ended, after its cuts."))
    checkpoint_saves: CheckpointSaves | Absent = Field(None, description=(
        "How this attempt's checkpoints were saved (runner/train/saver.py): async (written in the background; "
        "training waited only for the copy of the weights and for the previous write) or sync (multi-worker runs, "
        "or a background save that could not start: why_sync says which); saves made, blocked_s the training loop "
        "waited on them (the timing's checkpoint_s), write_s the writes took from start to files written."))
    profile: Profile | Absent = Field(
        None, description="Set when the spec has `profile:`; the trace is under dir/plugins/profile/.")
    interruption: Notice | Absent = Field(
        None, description="Set when Ctrl-C (SIGINT) stopped the run during training (status interrupted).")
    preemption: Notice | Absent = Field(
        None, description="Set when a SIGTERM stopped the run (status preempted).")
    time_limit: TimeLimit | Absent = Field(
        None, description="Set when train.max_duration stopped the run (status time_limit).")
    warnings: list[str] | Absent = Field(None, description=(
        "Why the result looks like nothing was learned (runner/train/verdict.py): an accuracy at chance, a loss "
        "that never fell. Kept in a succeeded summary when train.allow_chance is true."))
    model: str | Absent = Field(None, description="Where the trained model was saved.")
    tensorboard: str | Absent = Field(None, description="Folder of the TensorBoard scalars (train/, eval/).")
    processes: Processes | Absent = Field(None, description=(
        "A job of several processes (runner/device/processes.py, docs/multihost.md): count, this process's index, "
        "found_by (keras: Keras's KERAS_DISTRIBUTION_* variables; tpu: JAX found the TPU slice), the coordinator, "
        "how each split was divided (data: by files or by records, and shards per process), and per_process: each "
        "process's examples/s and input wait, with the slowest named. Only process 0 writes the run folder."))
    compile_cache: str | Absent = Field(None, description=(
        "JAX's persistent compilation cache in the run folder (jax backend): a resumed or relaunched run loads the "
        "programs an earlier attempt compiled, which its timing.first_step_s shows."))
    sharding: Sharding | Absent = Field(None, description=(
        "accelerator.mesh and model.sharding under JAX (runner/device/sharding.py, docs/sharding.md): the mesh's "
        "axes and sizes (the first carries the batch), the layout, how many variables each rule laid out, and the "
        "bytes of parameters and optimizer state on the device holding most (measured from the arrays' shards) "
        "beside one whole copy's."))
    tflops: Tflops | Absent = Field(None, description="A matmul_bench job: the TFLOPS it measured.")
    matmul: Matmul | Absent = Field(None, description="A matmul_bench job: what it multiplied and how long it took.")
    throughput: Throughput | None = Field(None, description=(
        "How close training came to the hardware (runner/train/flops.py `throughput_block`, docs/performance.md): "
        "the model's FLOPs per example (forward + backward, a multiply-add = 2 FLOPs, backward = 2x forward), the "
        "TFLOP/s each device achieved over the steady epochs, the device's peak in the job's precision and MFU = "
        "achieved / peak. Absent from runs before it existed; a field that cannot be computed is null and why_null "
        "says why."))
    newest_checkpoint: str | None = Field(None, description=(
        "A job that did not succeed: the newest whole checkpoint in the run folder when it ended (the one the "
        "same command continues from), read from the folder; null when there is none."))

    def to_json(self) -> dict[str, Any]:
        """The summary as written: the keys set, in declaration order (a key never set is absent, not null)."""
        return self.model_dump(mode="json", exclude_unset=True)

    @classmethod
    def checked(cls, summary: dict[str, Any]) -> dict[str, Any]:
        """`summary` through the model: pydantic.ValidationError names a key not declared or a value of the wrong
        type; the written form otherwise."""
        return cls.model_validate(summary).to_json()


def schema() -> dict[str, Any]:
    """The JSON schema of `Summary`, each part inlined where it is used (no $ref), without pydantic's titles."""
    generated = Summary.model_json_schema()
    defs = generated.pop("$defs", {})
    body = _clean(generated, defs)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "runner/rundir/summary.schema.json",
        "title": f"runner run summary, schema_version {SCHEMA_VERSION}",
        "description": _DESCRIPTION,
        **{k: v for k, v in body.items() if k not in ("title", "description")},
    }


def _clean(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_clean(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    out = {}
    for key, value in node.items():
        if key in ("title", "default"):  # a key left out is absent, not the default pydantic fills in
            continue
        if key == "properties":
            out[key] = {name: _clean(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _clean(value, defs)
    return out


def schema_text() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["--write-schema"]:
        SCHEMA_FILE.write_text(schema_text())
        print(f"wrote {SCHEMA_FILE}")
        return 0
    if argv == ["--check-schema"]:
        same = SCHEMA_FILE.read_text() == schema_text()
        print(f"{SCHEMA_FILE} {'matches' if same else 'differs from'} runner/rundir/summary.py")
        return 0 if same else 1
    print("usage: python -m runner.rundir.summary --write-schema | --check-schema", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
