"""The parts of the run summary (runner/rundir/summary.py `Summary`): timing, epochs, the accelerator, throughput,
the checks of the data, checkpoints, profile, processes and sharding, and the matmul benchmark's results. Each
forbids a key it does not declare; the descriptions are the schema's (runner/rundir/summary.schema.json)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

# A key the writers leave out rather than set to null: None in Python, absent from the JSON and its schema.
Absent = SkipJsonSchema[None]
# Bounds the schema declares (readers and the suite's jsonschema checks hold runs to them) but a run never fails
# on: a figure out of bounds is the runner's defect, and the summary that shows it is still written.
AT_LEAST_0, AT_LEAST_1, SHARE = {"minimum": 0}, {"minimum": 1}, {"minimum": 0, "maximum": 1}
Phase = Annotated[float, Field(json_schema_extra=AT_LEAST_0)]
Seconds = Annotated[float, Field(json_schema_extra=AT_LEAST_0)]
SecondsOrNull = Annotated[float, Field(json_schema_extra=AT_LEAST_0)] | None
Count = Annotated[int, Field(json_schema_extra=AT_LEAST_0)]
Positive = Annotated[int, Field(json_schema_extra=AT_LEAST_1)]


class Strict(BaseModel):
    """A part of the summary: every key declared (extra="forbid"), every assignment checked."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Backend(Strict):
    name: Literal["tensorflow", "jax"]
    reason: str


class Precision(Strict):
    policy: Literal["float32", "bfloat16", "float16"]
    reason: str


class TpuFacts(Strict):
    device_kind: str
    generation: str | None
    accelerator_type: str | None
    runtime_version: str | None


class Accelerator(Strict):
    kind: Literal["tpu", "gpu", "cpu"]
    backend: Backend | Absent = Field(None, description=(
        "The engine Keras computed with (`accelerator.backend`, runner/device/backend.py) and why: for `auto`, JAX "
        "on a TPU and TensorFlow elsewhere, with the rule that decided."))
    replicas: int = Field(json_schema_extra=AT_LEAST_1,
                          description="Devices training in sync (TPU cores, GPUs, logical CPUs).")
    workers: int = Field(json_schema_extra=AT_LEAST_1, description="Hosts (processes) taking part.")
    detail: str = Field(description="The strategy and devices in words.")
    tensorflow: str | Absent = Field(None, description="TensorFlow version the run used.")
    keras: str | Absent = Field(None, description="Keras and its version the run used (\"keras 3.15.1\").")
    jax: str | Absent = Field(None, description="JAX version, when the run computed with it.")
    allocator: Literal["tcmalloc", "jemalloc", "glibc"] | Absent = Field(None, description=(
        "The malloc the process ran on (the runner image preloads tcmalloc; the input pipeline ran up to 1.38x "
        "faster on it)."))
    tpu: TpuFacts | Absent = Field(None, description=(
        "On a TPU only (runner/device/tpus.py `device_facts`): the device kind JAX reports, its generation (as "
        "JAX's tpu_info reads it; null for a kind the TPU table does not know), which MFU's peak reads, the "
        "accelerator type submitted (RUNNER_TPU_TYPE, else TPU_ACCELERATOR_TYPE) and the TPU VM's software version "
        "(RUNNER_TPU_RUNTIME_VERSION); null where not known."))
    precision: Precision | Absent = Field(None, description=(
        "What the job computed in (`train.mixed_precision`; variables and the output layer stay float32) and why: "
        "for `auto`, the device or CPU flag that decided it (\"TPU\", \"cpu flag avx512_bf16\", \"GPU ... compute "
        "capability 8.0\", \"no bf16 flag in /proc/cpuinfo: float32\", or \"RUNNER_CPU_BF16=1: as on a CPU with "
        "avx512_bf16\" where that variable decides), or the model kept in float32; otherwise "
        "\"train.mixed_precision: <value>\" (runner/device/precision.py)."))
    onednn: bool | None | Absent = Field(None, description=(
        "Whether TensorFlow ran its oneDNN CPU kernels (on by default in the runner, TF_ENABLE_ONEDNN_OPTS=0 turns "
        "them off; null when TensorFlow cannot tell): runs compared side by side should agree on it."))


_STEADY = "kept out of step time and throughput"


class Timing(Strict):
    startup_s: Phase = Field(description="Phase: process start to the spec loaded and checked.")
    import_s: Phase = Field(description=(
        "Phase: loading TensorFlow (done after the spec check, so a bad spec fails fast)."))
    run_folder_s: Phase = Field(description=(
        "Phase: checking the run folder (resume or refuse), recording spec.json, numbering the attempt."))
    strategy_s: Phase = Field(description=(
        "Phase: accelerator init: finding the TPU, GPU or CPU and building the tf.distribute strategy."))
    data_init_s: Phase = Field(description=(
        "Phase: checking the data against its manifests before the run folder is touched (data_verify.seconds, "
        "data.verify), then finding the shards, reading the manifest, building the tf.data pipelines (no batch is "
        "read yet)."))
    build_s: Phase = Field(description="Phase: building and compiling the Keras model inside the strategy's scope.")
    restore_s: Phase = Field(description="Phase: restoring the newest checkpoint when resuming; 0 for a fresh start.")
    train_s: Phase = Field(description=(
        "Phase: training (model.fit), the first epoch with its compile included, checkpoint saves and per-epoch "
        "validation excluded."))
    checkpoint_s: Phase = Field(description=(
        "Phase: every checkpoint save (epoch ends, every_steps, the save on a preemption notice)."))
    eval_s: Phase = Field(description=(
        "Phase: evaluation on data.eval after training, plus per-epoch validation if enabled."))
    export_s: Phase = Field(description="Phase: saving the trained model into the run folder.")
    peak_s: Phase = Field(description=(
        "Phase: measuring this CPU's matmul peak for MFU (once per host and dtype, then read from its cache: "
        "runner/device/peak.py); 0 elsewhere."))
    unaccounted_s: float = Field(description=(
        "total_s minus the sum of the phases above: time between phases (logging, summary assembly). Small; "
        "reported, never folded into a phase."))
    total_s: Seconds = Field(description=(
        "Process start to the summary being built (the summary write itself comes after)."))
    first_epoch_s: SecondsOrNull = Field(description=(
        f"The first epoch this process trained, including tracing and compilation; {_STEADY}."))
    steady_epoch_s: SecondsOrNull = Field(description=(
        "Median wall time of the later full epochs; null with a single epoch."))
    step_time_ms: SecondsOrNull = Field(description=(
        "Median of (epoch seconds / steps) over the steady epochs; with one epoch, its steps after the first "
        "device execution."))
    examples_per_sec: SecondsOrNull = Field(description=(
        "global_batch_size / step time: training throughput with the compile step left out."))
    steady_train_s: SecondsOrNull = Field(description=(
        "train_s less first_epoch_s: steady training, the later epochs plus fit_overhead_s."))
    fit_overhead_s: SecondsOrNull = Field(description=(
        "train_s less the sum of the epoch times: what model.fit spent outside every epoch (creating and tearing "
        "down the input iterator, starting a resumed run's second leg)."))
    first_step_s: SecondsOrNull = Field(description=(
        "The first device execution (trace + compile + one step), part of first_epoch_s."))
    input_wait_s: SecondsOrNull = Field(description=(
        "Seconds the training loop was blocked waiting for a batch from the input pipeline, summed over all epochs "
        "of this attempt; null when not measured (input_wait_method says why)."))
    input_wait_fraction: SecondsOrNull = Field(description="input_wait_s / train_s.")
    input_wait_method: str = Field(description=(
        "getnext_blocked: measured by a timing stage at the end of the tf.data pipeline (the time each GetNext call "
        "blocked); exact when the training step itself pulls the batch (one replica, steps_per_execution 1), an "
        "upper bound when the runtime prefetches the next batch while the device computes (several replicas, TPU, "
        "steps_per_execution > 1). Otherwise 'not measured: <reason>'."))
    productive_s: Seconds = Field(description=(
        "Time spent running training steps: the sum of the epoch times (saves and validation already out) less the "
        "first device execution's excess over a steady step (tracing and compilation). Input waits inside the "
        "epochs stay in it; they are reported apart as input_wait_s."))
    goodput: Annotated[float, Field(json_schema_extra=SHARE)] | None = Field(description=(
        "productive_s / total_s: the share of the wall time spent training; null when no epoch was trained."))


class Epoch(Strict):
    epoch: int = Field(json_schema_extra=AT_LEAST_1, description="1-based, counted across resumed attempts.")
    seconds: Seconds = Field(description=(
        "Wall time of the epoch, checkpoint saves and validation made inside it excluded."))
    steps: Count
    examples_per_sec: Seconds = Field(description=(
        "steps x global_batch_size / seconds (the first epoch's includes compile)."))
    loss: float | None = Field(description="Mean training loss over the epoch.")
    metrics: dict[str, float] = Field(description=(
        "Training metrics over the epoch (val_* when validation runs every epoch)."))
    first_step_s: SecondsOrNull = Field(description=(
        "Set on the epoch holding this process's first device execution."))
    checkpoint_s: Seconds = Field(description="Checkpoint saves made inside the epoch (every_steps, preemption).")
    input_wait_s: SecondsOrNull = Field(description="The epoch's share of timing.input_wait_s.")
    partial: bool | Absent = Field(None, description=(
        "The epoch stopped before its last step (a notice, a time limit): fewer steps than steps_per_epoch, kept "
        "out of the steady figures. A resumed attempt's first record finishes that epoch."))
    attempt: Annotated[int, Field(json_schema_extra=AT_LEAST_1)] | None | Absent = Field(
        None, description="The attempt that trained this epoch (attempts/<n>.json).")


class Metrics(BaseModel):
    """Evaluation metrics by name (numbers), and the records evaluated."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    __pydantic_extra__: dict[str, float]
    examples: Positive | Absent = Field(None, description=(
        "Records evaluated: the eval split's record count in its manifest."))


class DataVerify(Strict):
    mode: Literal["size", "sha256", "off"] = Field(description=(
        "data.verify: size stats each shard, sha256 also reads and hashes every byte, off checks neither."))
    shards: Count = Field(description=(
        "Shards checked: those of data.train, data.eval and (with validate_every_epoch) data.validation."))
    bytes: Count = Field(description="Their total size as found (0 with off).")
    bytes_read: Count = Field(description="Bytes read and hashed (sha256 only).")
    seconds: Seconds = Field(description="Wall time of the byte checks (part of timing.data_init_s).")
    mb_per_s: SecondsOrNull = Field(description="bytes_read / 1e6 / seconds; null when nothing was read.")
    threads: Count = Field(description="Shards checked at once.")


class TrainInput(Strict):
    mode: Literal["in_memory", "streamed"]
    why: str = Field(description=(
        "The setting and the rule that decided, e.g. 'auto: 47 MB decoded, within auto's limit of 1,074 MB, one "
        "worker on cpu'."))
    bytes: Count = Field(description=(
        "The decoded split's size as held in memory (uint8 features as uint8; text as the shards' size)."))
    load_s: SecondsOrNull = Field(description=(
        "Reading and decoding the split into memory (part of timing.data_init_s); null when streamed."))


class Splits(Strict):
    trained_on: str
    validated_on: str | None
    selected_on: str | None
    selected_by: list[str]
    measured_on: str | None


class CheckpointSaves(Strict):
    mode: Literal["async", "sync"]
    why_sync: str | Absent = None
    store: Literal["orbax"] | Absent = Field(None, description=(
        "Set when the checkpoints went through Orbax (jax backend); TensorFlow's CheckpointManager otherwise."))
    saves: Count
    blocked_s: Seconds
    write_s: Seconds


class Profile(Strict):
    start_step: int
    steps: int
    dir: str
    profiler: Literal["tensorflow", "jax"] | Absent = Field(None, description=(
        "Whose profiler traced: the engine that computed (JAX's records XLA's computations; TensorFlow's, under "
        "JAX, would record only tf.data)."))
    traced_steps: list[int] | None = Field(description=(
        "First and last step traced; null when training never reached start_step."))
    error: str | None = Field(description="Why the profiler did not start, if it did not.")


class Notice(Strict):
    grace_s: float = Field(description="checkpoint.grace_s: how long the save and stop could take.")
    saved_after_notice_s: SecondsOrNull = Field(description=(
        "Seconds from the signal to the saved checkpoint; null when training ended before the next step."))


class TimeLimit(Notice):
    max_duration_s: float = Field(description="train.max_duration: the limit that was reached.")


class Share(Strict):
    by: Literal["files", "records"] = Field(description=(
        "How the processes divided the split (runner/data/pipeline.py `host_share`): whole files each, or every "
        "process reading every file and keeping its own records."))
    shards: Count
    shards_per_process: list[int] | Absent = None


class ProcessFigures(Strict):
    process: int = Field(json_schema_extra=AT_LEAST_0)
    examples_per_sec: SecondsOrNull = None
    step_time_ms: SecondsOrNull = None
    input_wait_s: SecondsOrNull = None
    input_wait_fraction: SecondsOrNull = None
    total_s: SecondsOrNull = None
    missing: str | Absent = Field(None, description="Set when the process said nothing (see its log).")


class Processes(Strict):
    count: int = Field(json_schema_extra=AT_LEAST_1)
    index: int = Field(json_schema_extra=AT_LEAST_0)
    found_by: Literal["keras", "tpu", "single"]
    coordinator: str | None
    data: dict[str, Share] | Absent = Field(None, description="Each split's division, by its spec key.")
    per_process: list[ProcessFigures] | Absent = None
    slowest_input: Count | Absent = Field(None, description="The process that waited longest for input.")


class Bytes(Strict):
    parameters: Count
    optimizer: Count


class Estimate(Strict):
    parameters: Count
    trainable: Count
    bytes_per_device: dict[str, int]
    total_bytes_per_device: Count
    model_axis: int = Field(json_schema_extra=AT_LEAST_1)
    method: str


class Sharding(Strict):
    mesh: dict[str, int]
    batch_axis: str | None | Absent = None
    layout: str
    variables_per_rule: dict[str, int] | Absent = None
    bytes_per_device: Bytes
    bytes_replicated: Bytes
    fraction_of_replicated: float | Absent = None
    estimate: Estimate | Absent = Field(None, description=(
        "runner/device/memory.py's estimate of the same model, as `runner validate --tpu-type` makes it."))
    method: str | Absent = None


class Throughput(Strict):
    tokens_per_example: Positive | Absent = Field(None, description=(
        "A model.hub job: tokens of one record (its sequence length, runner/train/hub.py)."))
    tokens_per_sec: SecondsOrNull | Absent = Field(None, description=(
        "A model.hub job: timing.examples_per_sec x tokens_per_example (steady epochs, all devices); null without "
        "a steady epoch."))
    model_flops_per_token: SecondsOrNull | Absent = Field(None, description=(
        "A model.hub job: training FLOPs of one token, PaLM appendix B (6N + 12LHQT; 4N + 2 x trainable with frozen "
        "weights): flops_method names N, L, HQ and T."))
    model_flops_per_example: SecondsOrNull = Field(description=(
        "FLOPs of one training example: 3x the forward pass's. null when the model could not be counted "
        "(flops_method says why)."))
    flops_method: str = Field(description=(
        "How the FLOPs were counted: `tf_profiler: ...` (TensorFlow's profiler float_ops over the traced forward "
        "pass), `xla: ...` (XLA's cost analysis of the lowered forward pass, jax backend), `layers: ...` (per-layer "
        "arithmetic, for graphs with loops such as LSTM/GRU, with the reason), or `not counted: ...` with the layers "
        "it could not count."))
    tflops_per_device: SecondsOrNull = Field(description=(
        "Achieved: model_flops_per_example x timing.examples_per_sec / accelerator.replicas / 1e12 (steady epochs "
        "only); null without a steady epoch or a FLOP count."))
    peak_tflops_per_device: SecondsOrNull = Field(description=(
        "The device's peak in the job's precision: the vendor's published figure for a TPU or GPU, the host's own "
        "measured matmul peak for a CPU (runner/device/peak.py); null when there is none."))
    peak_source: str = Field(description=(
        "Where the peak comes from (the vendor page and its figure, or the CPU measurement: size, dtype, date, "
        "cache file), or why there is none."))
    mfu: SecondsOrNull = Field(description=(
        "Model FLOPs utilisation: tflops_per_device / peak_tflops_per_device. Against a CPU's measured matmul peak "
        "it can approach or pass 1 only if the training step outruns a plain matmul."))
    why_null: str | None = Field(description=(
        "Why tflops_per_device, peak_tflops_per_device or mfu is null; null when all are set."))


class Tflops(Strict):
    cold: float = Field(description="The first call: tracing, compilation and the run, as a one-off job pays them.")
    warm: float = Field(description="The median of the later calls: what the device sustains once compiled.")


class Matmul(Strict):
    size: int = Field(json_schema_extra=AT_LEAST_1)
    chain: int = Field(json_schema_extra=AT_LEAST_1)
    dtype: str
    replicas: int = Field(json_schema_extra=AT_LEAST_1)
    flops_per_call: float
    cold_s: Seconds
    warm_s: Seconds
    warm_calls_s: list[float]
    checksum: float
