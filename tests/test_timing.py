"""The timing summary: phases that add up, the compiling first epoch apart, a measured input wait,
TensorBoard scalars and a profiler trace, and a summary even from a run that failed or was preempted."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from runner.rundir.timing import PHASES, EpochRecord, Phases, build_summary
from tests.conftest import REPO, cli_env, last_json, run_cli

SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())


def phase_sum(timing: dict) -> float:
    return sum(timing[f"{name}_s"] for name in PHASES)


def assert_phases_add_up(summary: dict) -> None:
    timing = summary["timing"]
    # By construction the phases plus what falls between them are the total ...
    assert phase_sum(timing) + timing["unaccounted_s"] == pytest.approx(timing["total_s"], abs=0.01)
    # ... and what falls between them is small: every second of the run belongs to a named phase.
    assert 0 <= timing["unaccounted_s"] <= max(0.5, 0.03 * timing["total_s"]), timing


def test_every_timing_field_is_documented() -> None:
    page = (REPO / "docs" / "summary.md").read_text()
    missing = [name for name in SCHEMA["properties"]["timing"]["properties"] if f"`{name}`" not in page]
    assert not missing, f"docs/summary.md does not describe: {missing}"
    assert set(SCHEMA["properties"]["timing"]["required"]) == set(SCHEMA["properties"]["timing"]["properties"])


# --- the arithmetic, on records with known numbers ------------------------------------------------


def record(
    epoch: int, seconds: float, steps: int = 10, first_step_s: float | None = None, wait: float = 0.0
) -> EpochRecord:
    return EpochRecord(epoch, seconds, steps, steps * 32 / seconds, 1.0, {}, first_step_s, 0.0, wait)


def test_the_compiling_first_epoch_stays_out_of_step_time_and_goodput() -> None:
    phases = Phases(start=time.monotonic() - 20.0)
    phases.add("train", 9.5)  # the epochs (9.2 s) and 0.3 s of fit outside them
    epochs = [record(1, 5.0, first_step_s=4.0, wait=0.5), record(2, 2.0, wait=0.2), record(3, 2.2, wait=0.3)]
    summary = build_summary(
        status="succeeded", job="j", accelerator=None, phases=phases, epochs=epochs, global_batch=32, metrics={},
        input_wait_method="getnext_blocked",
    ).to_json()
    timing = summary["timing"]
    assert timing["first_epoch_s"] == 5.0 and timing["first_step_s"] == 4.0
    assert timing["steady_epoch_s"] == 2.1  # median of the later epochs only
    assert timing["step_time_ms"] == 210.0
    assert timing["examples_per_sec"] == pytest.approx(32 / 0.21, rel=1e-3)
    # Productive: the epochs less the compile's excess over one steady step.
    assert timing["productive_s"] == pytest.approx(5.0 + 2.0 + 2.2 - (4.0 - 0.21))
    assert timing["goodput"] == pytest.approx(timing["productive_s"] / timing["total_s"], abs=1e-3)
    assert timing["input_wait_s"] == 1.0 and timing["input_wait_fraction"] == pytest.approx(1.0 / 9.5, abs=1e-4)
    assert timing["unaccounted_s"] == pytest.approx(timing["total_s"] - 9.5, abs=1e-3)
    assert timing["steady_train_s"] == pytest.approx(9.5 - 5.0) and timing["fit_overhead_s"] == pytest.approx(0.3)
    jsonschema.validate(summary, SCHEMA)


def test_one_epoch_takes_its_step_time_from_the_steps_after_the_first() -> None:
    summary = build_summary(
        status="succeeded", job="j", accelerator=None, phases=Phases(start=time.monotonic() - 10.0),
        epochs=[record(1, 6.0, 11, first_step_s=4.0)],
        global_batch=32, metrics={},
    )
    assert summary.timing.steady_epoch_s is None
    assert summary.timing.step_time_ms == 200.0
    assert summary.timing.input_wait_method == "not measured"


def test_a_wait_missing_from_one_epoch_is_not_summed_as_if_complete() -> None:
    epochs = [record(1, 5.0, first_step_s=1.0), dataclasses.replace(record(2, 2.0), input_wait_s=None)]
    summary = build_summary(status="failed", job="j", accelerator=None, phases=Phases(start=time.monotonic() - 10.0),
                            epochs=epochs, global_batch=32,
                            metrics={})
    assert summary.timing.input_wait_s is None


# --- input wait, measured on real tf.data pipelines ----------------------------------------------


def test_input_wait_is_the_time_the_consumer_blocked_on_the_pipeline() -> None:
    import tensorflow as tf

    from runner.device.strategy import Accelerator
    from runner.train.observe import InputClock

    def consume(producer_s: float, consumer_s: float, batches: int = 25) -> tuple[float, float]:
        clock = InputClock(Accelerator(tf.distribute.get_strategy(), "cpu", 1))
        dataset = tf.data.Dataset.range(10**6)
        if producer_s:
            dataset = dataset.map(lambda x: tf.py_function(lambda v: (time.sleep(producer_s), v)[1], [x], tf.int64))
        iterator = iter(clock.wrap(dataset.prefetch(2)))
        next(iterator)  # warm-up: the first element starts the pipeline's threads
        waited_before, blocked = clock.seconds(), 0.0
        for _ in range(batches):
            began = time.monotonic()
            next(iterator)
            blocked += time.monotonic() - began  # what the loop itself saw, however busy the machine
            time.sleep(consumer_s)  # the "training step"
        return clock.seconds() - waited_before, blocked

    # The clock counts the time the loop was blocked on the pipeline: the test times the same calls around it
    # (a busy machine stretches the sleeps, not the agreement), less the iterator's own overhead per call
    # (which the clock, inside the pipeline, does not see), and nothing of the loop's own work.
    slow_wait, slow_blocked = consume(producer_s=0.06, consumer_s=0.01)
    assert slow_blocked - 25 * 0.01 <= slow_wait <= slow_blocked
    assert slow_wait > 25 * 0.02, "input-bound: most of each batch's 0.06 s is waited for"
    fast_wait, fast_blocked = consume(producer_s=0.0, consumer_s=0.02)
    assert fast_wait <= fast_blocked
    assert fast_wait < slow_wait / 4, "a pipeline that keeps up costs (almost) no wait"


def test_the_input_pipeline_runs_without_the_tf_data_autotuner_unless_the_spec_asks(tiny_mnist: Path) -> None:
    """With the autotuner on, fit and evaluate return only when its sleeping thread wakes, up to a minute
    late (runner/data/pipeline.py; benchmarks/autotune_teardown.py): off by default, on with data.autotune."""
    import tensorflow as tf

    from runner.data import pipeline
    from runner.device.strategy import Accelerator
    from runner.spec.types import JobSpec
    from runner.train.observe import InputClock

    shards = pipeline.find_shards(f"{tiny_mnist}/test-*.tfrecord")
    default = pipeline.make_dataset(shards, 32, ("image",), "label", training=False)
    clocked = InputClock(Accelerator(tf.distribute.get_strategy(), "cpu", 1)).wrap(default)
    asked = pipeline.make_dataset(shards, 32, ("image",), "label", training=False, autotune=True)
    assert [d.options().autotune.enabled for d in (default, clocked, asked)] == [False, False, True]
    assert JobSpec().data.autotune is False
    assert sum(int(labels.shape[0]) for _, labels in default) == shards.records // 32 * 32


# --- a real short run through the CLI ------------------------------------------------------------


@pytest.fixture(scope="module")
def timed_run(tiny_mnist: Path, tmp_path_factory) -> tuple[dict, Path]:
    folder = tmp_path_factory.mktemp("timed")
    spec = folder / "timed.yaml"
    spec.write_text(
        f"name: timed\naccelerator: {{kind: cpu}}\n"
        f"data: {{train: '{tiny_mnist}/train-*.tfrecord', eval: '{tiny_mnist}/test-*.tfrecord', "
        f"global_batch_size: 128, shuffle_buffer: 512}}\n"
        f"train: {{epochs: 3}}\ncheckpoint: {{every_steps: 8}}\nprofile: {{start_step: 20, steps: 3}}\n"
        f"output: {{dir: '{folder / 'runs'}'}}\n"
    )
    result = run_cli("run", spec, fresh=True)  # a start of its own: loading TensorFlow is one of its phases
    assert result.returncode == 0, result.stderr
    return last_json(result.stdout), folder / "runs" / "timed"


@pytest.mark.slow
@pytest.mark.xdist_group("timed_run")  # the tests of the one timed run share a worker, so it trains once
def test_a_real_run_accounts_for_every_second(timed_run) -> None:
    summary, run_dir = timed_run
    jsonschema.validate(summary, SCHEMA)
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert_phases_add_up(summary)
    timing = summary["timing"]
    assert timing["import_s"] > 0.5, "loading TensorFlow is its own phase"
    assert timing["checkpoint_s"] > 0 and timing["eval_s"] > 0 and timing["export_s"] > 0
    # Saves inside an epoch (every 8 steps) are counted once, in checkpoint_s, not in the epoch times.
    # Each figure is rounded to 0.1 ms, so the epochs' sum may pass the total by half of that per epoch.
    epochs = summary["epochs"]
    assert sum(e["checkpoint_s"] for e in epochs) <= timing["checkpoint_s"] + 0.5e-4 * (len(epochs) + 1)
    assert all(e["checkpoint_s"] > 0 for e in epochs)
    epochs_s = sum(e["seconds"] for e in epochs)
    assert timing["fit_overhead_s"] == pytest.approx(timing["train_s"] - epochs_s, abs=1e-3)
    assert timing["steady_train_s"] == pytest.approx(timing["train_s"] - timing["first_epoch_s"], abs=1e-3)


@pytest.mark.slow
@pytest.mark.xdist_group("timed_run")
def test_the_first_epoch_is_reported_apart_from_the_steady_ones(timed_run) -> None:
    summary, _ = timed_run
    timing, epochs = summary["timing"], summary["epochs"]
    assert timing["first_epoch_s"] == epochs[0]["seconds"]
    assert epochs[0]["first_step_s"] == timing["first_step_s"] < timing["first_epoch_s"]
    assert timing["first_epoch_s"] > timing["steady_epoch_s"], "the first epoch carries the compile"
    steady = epochs[1:]
    assert timing["steady_epoch_s"] == pytest.approx(statistics.median(e["seconds"] for e in steady), abs=1e-3)
    assert timing["step_time_ms"] == pytest.approx(
        statistics.median(e["seconds"] / e["steps"] for e in steady) * 1e3, abs=0.01)
    assert timing["examples_per_sec"] == pytest.approx(128 / (timing["step_time_ms"] / 1e3), rel=1e-3)
    compile_excess = timing["first_step_s"] - timing["step_time_ms"] / 1e3
    assert timing["productive_s"] == pytest.approx(sum(e["seconds"] for e in epochs) - compile_excess, abs=1e-3)
    assert timing["productive_s"] < timing["train_s"]
    assert timing["goodput"] == pytest.approx(timing["productive_s"] / timing["total_s"], abs=1e-3)
    assert timing["input_wait_method"] == "getnext_blocked"
    assert timing["input_wait_s"] == pytest.approx(sum(e["input_wait_s"] for e in epochs), abs=1e-3)
    assert 0 <= timing["input_wait_s"] < timing["train_s"]


@pytest.mark.slow
@pytest.mark.xdist_group("timed_run")
def test_tensorboard_scalars_and_the_profiler_trace_are_in_the_run_folder(timed_run) -> None:
    import tensorflow as tf

    summary, run_dir = timed_run
    scalars: dict[str, dict[int, float]] = {}
    for events in (run_dir / "tensorboard" / "train").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                scalars.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
    by_epoch = {e["epoch"]: e for e in summary["epochs"]}
    assert scalars["loss"] == pytest.approx({n: e["loss"] for n, e in by_epoch.items()}, rel=1e-5)
    assert scalars["accuracy"] == pytest.approx({n: e["metrics"]["accuracy"] for n, e in by_epoch.items()}, rel=1e-5)
    assert scalars["examples_per_sec"] == pytest.approx(
        {n: e["examples_per_sec"] for n, e in by_epoch.items()}, rel=1e-5)
    assert set(scalars["input_wait_s"]) == {1, 2, 3}
    assert list((run_dir / "tensorboard" / "eval").glob("events.out.tfevents.*")), "eval metrics are logged too"

    profile = summary["profile"]
    assert profile["traced_steps"] == [20, 22] and profile["error"] is None
    traces = list((run_dir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 10_000


@pytest.mark.slow
def test_a_preempted_run_still_writes_its_summary(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("preempted", train={"epochs": 40})
    child = subprocess.Popen(
        [sys.executable, "-m", "runner", "run", str(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(), cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 120
        for line in child.stderr:
            if "epoch 1/40" in line or time.monotonic() > deadline:
                break
        child.send_signal(signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 75, stderr
    summary = last_json(stdout)
    assert summary == json.loads((tmp_path / "runs" / "preempted" / "summary.json").read_text())
    assert summary["status"] == "preempted" and "run the same job again" in summary["error"]
    jsonschema.validate(summary, SCHEMA)
    assert_phases_add_up(summary)
    assert summary["timing"]["first_epoch_s"] == summary["epochs"][0]["seconds"]
    assert summary["timing"]["checkpoint_s"] > 0
    assert summary["timing"]["eval_s"] == 0 and summary["metrics"] == {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("in_memory", "failed_in"),
    [(False, "train_s"),  # streamed: the first batch to read the damaged record fails the training step
     (True, "data_init_s")],  # held in memory: loading the split fails, before training
)
def test_a_run_failing_on_corrupt_data_still_writes_its_summary(
    small_mnist: Path, mnist_job, tmp_path: Path, in_memory: bool, failed_in: str
) -> None:
    data = tmp_path / "data"
    shutil.copytree(small_mnist, data)
    shard = data / "train-00001-of-00004.tfrecord"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)  # the record checksums no longer match
    shard.write_bytes(bytes(raw))
    spec = mnist_job("corrupt", data={"train": f"{data}/train-*.tfrecord", "eval": None, "in_memory": in_memory})
    result = run_cli("run", spec)
    assert result.returncode == 2, result.stderr
    summary = last_json(result.stdout)
    assert summary["status"] == "failed" and "train-00001-of-00004.tfrecord" in summary["error"]
    run_dir = tmp_path / "runs" / "corrupt"
    if failed_in == "data_init_s":  # refused before the first step: the summary is on stdout, no folder is left
        assert not run_dir.exists()
    else:
        assert json.loads((run_dir / "summary.json").read_text()) == summary
    jsonschema.validate(summary, SCHEMA)
    assert_phases_add_up(summary)
    assert summary["timing"][failed_in] > 0, "the time spent before the failure is still accounted"
    assert (summary["train_input"]["mode"] == "in_memory") is in_memory
