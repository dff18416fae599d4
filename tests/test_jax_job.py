"""One job under JAX, run as a user runs it: stopped in every way a job stops (Ctrl-C, kill -9, train.max_duration,
the stall guard, a preemption notice), run again after each stop until it finishes, then evaluated, predicted
and exported.

XLA on these CPUs compiles slowly (benchmarks/RESULTS.md, "Backends"), so the job is trained once, in the module's
fixture, and every test reads what it left. The six attempts share the suite's XLA cache (JAX_COMPILATION_CACHE_DIR,
tests/conftest.py): only the first compiles the job's programs. The model and the callback are a user's own (in the
spec's code folder); the job also sets class weights, a learning-rate schedule and validation every second epoch, so
the same run shows each of them working under JAX across every resume.

The user's callback is also how the tests know where a run is: at the end of step HOLD_AT_STEP it holds the
run (as a step that does not return) until the test removes the file HOLD_FILE. A signal sent while a step is
held lands at a known step, with no guess of how fast this machine trains.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support.runs import finish, signal_taken, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("jax_job"), pytest.mark.timeout(1800)]

SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())
STEPS, EPOCHS, EVERY, BATCH = 6, 5, 2, 64
TOTAL = STEPS * EPOCHS
# The learning rate is 0.01 * 0.5 ** (step / 10): written out by hand in `rate_at` below.
SCHEDULE = {"class_name": "ExponentialDecay",
            "config": {"initial_learning_rate": 0.01, "decay_steps": 10, "decay_rate": 0.5}}
# Class 0 weighs (almost) nothing: a model trained with these weights almost never answers 0.
CLASS_WEIGHT = {c: (1e-6 if c == 0 else 1.0) for c in range(10)}
# The steps at which the attempts are held: Ctrl-C in epoch 2; kill -9 in epoch 3; the stall and SIGTERM in epoch 4.
INTERRUPT_AT, KILL_AT, STALL_AT, TERM_AT = 8, 14, 20, 22

MODEL = """
import keras


def build(params, features, inputs):
    x = keras.Input((28, 28, 1))
    y = keras.layers.Conv2D(4, 3, activation="relu")(keras.layers.Rescaling(1 / 255)(x))
    y = keras.layers.Dropout(0.1)(keras.layers.Flatten()(keras.layers.MaxPooling2D(2)(y)))
    return keras.Model(x, keras.layers.Dense(10, activation="softmax")(y))
"""

CALLBACK = '''
import json
import os
import time

import keras


class Marks(keras.callbacks.Callback):
    """Writes to the file MARKS the step each fit begins at and, at each epoch's end, the step and the learning
    rate. At the end of step HOLD_AT_STEP it creates the file HOLD_FILE and waits (at most 120 s) until it is gone."""

    def _step(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def _mark(self, **mark):
        with open(os.environ["MARKS"], "a") as marks:
            marks.write(json.dumps(mark) + "\\n")

    def on_train_begin(self, logs=None):
        self._mark(began=self._step())

    def on_epoch_end(self, epoch, logs=None):
        rate = keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
        self._mark(epoch=epoch + 1, step=self._step(), lr=float(rate))

    def on_train_batch_end(self, batch, logs=None):
        if str(self._step()) == os.environ.get("HOLD_AT_STEP"):
            held = os.environ["HOLD_FILE"]
            open(held, "w").close()
            deadline = time.monotonic() + 120
            while os.path.exists(held) and time.monotonic() < deadline:
                time.sleep(0.02)
'''


def rate_at(step: int) -> float:
    return 0.01 * 0.5 ** (step / 10)


def orbax_steps(run_dir: Path) -> list[int]:
    """The whole Orbax checkpoints in the run folder (a save in progress is a `.orbax-checkpoint-tmp` folder)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in folder.iterdir() if p.name.split("_")[-1].isdigit())


@dataclasses.dataclass
class Attempt:
    """What one `runner run` of the job left: its exit, its output, the newest whole checkpoint after it, the
    user callback's marks, the attempt files of the run folder and its stall mark (runner/rundir/stalled.py)."""

    code: int
    out: str
    err: str
    newest: int | None
    marks: list[dict]
    attempts: list[str]
    stall_mark: dict | None = None

    @property
    def summary(self) -> dict:
        return last_json(self.out)

    @property
    def began(self) -> int:
        """The step the attempt's training began at: the step it resumed from."""
        return next(m["began"] for m in self.marks if "began" in m)


@dataclasses.dataclass
class Job:
    spec: Path
    run_dir: Path
    folder: Path
    data: Path
    tries: dict[str, Attempt] = dataclasses.field(default_factory=dict)

    def attempt(self, name: str, *args: str, hold: int | None = None, act=None) -> Attempt:
        """Runs the job again with `args`; with `hold`, calls act(process, held file) once step `hold` is held."""
        marks, held = self.folder / f"marks-{name}.jsonl", self.folder / f"held-{name}"
        env = cli_env(MARKS=str(marks), HOLD_FILE=str(held), **({"HOLD_AT_STEP": str(hold)} if hold else {}))
        process = start_run(self.spec, *args, env=env)
        if act is not None:
            wait_for(lambda: held.exists() or None, process, timeout=600)
            act(process, held)
        code, out, err = finish(process, timeout=600)
        read = [json.loads(line) for line in marks.read_text().splitlines()] if marks.exists() else []
        attempts = self.run_dir / "attempts"
        listed = sorted(p.name for p in attempts.iterdir()) if attempts.is_dir() else []
        mark = self.run_dir / "stalled.json"
        self.tries[name] = Attempt(code, out, err, (orbax_steps(self.run_dir) or [None])[-1], read, listed,
                                   json.loads(mark.read_text()) if mark.exists() else None)
        return self.tries[name]


def held_for(seconds: float):
    def act(process, held: Path) -> None:
        time.sleep(seconds)
        held.unlink()
    return act


def signalled(sent: int):
    def act(process, held: Path) -> None:
        process.send_signal(sent)
        wait_for(lambda: signal_taken(process.pid, sent), process, timeout=60, every=0.01)
        held.unlink()  # the held step returns: the next one sees the notice
    return act


def killed_once_saved(run_dir: Path, step: int):
    def act(process, held: Path) -> None:
        wait_for(lambda: step in orbax_steps(run_dir) or None, process, timeout=120)
        os.kill(process.pid, signal.SIGKILL)
    return act


@pytest.fixture(scope="module")
def job(tiny_mnist: Path, tmp_path_factory) -> Job:
    folder = tmp_path_factory.mktemp("jax-job")
    code = folder / "code"
    code.mkdir()
    (code / "tinynet.py").write_text(MODEL)
    (code / "marks.py").write_text(CALLBACK)
    spec = write_spec(folder, {
        "name": "jax-job",
        "accelerator": {"kind": "cpu", "backend": "jax"},
        "code": {"folder": str(code)},
        "model": {"name": "tinynet:build"},
        "data": {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": f"{tiny_mnist}/test-*.tfrecord",
                 "global_batch_size": BATCH, "shuffle_buffer": 512},
        # float32: the learning rates and the answers below are compared with figures computed here
        "train": {"epochs": EPOCHS, "steps_per_epoch": STEPS, "validation_every": 2, "mixed_precision": "float32",
                  "schedule": SCHEDULE, "class_weight": CLASS_WEIGHT, "callbacks": ["marks:Marks"]},
        "checkpoint": {"every_steps": EVERY, "keep": 3},
        "output": {"dir": str(folder / "runs"), "tensorboard": False},
    })
    job = Job(spec, folder / "runs" / "jax-job", folder, tiny_mnist)
    # Steps 1-30, epochs of 6. Each attempt resumes from where the one before it left its newest checkpoint.
    job.attempt("interrupted", hold=INTERRUPT_AT, act=signalled(signal.SIGINT))  # saves at the next step
    job.attempt("killed", hold=KILL_AT, act=killed_once_saved(job.run_dir, KILL_AT))  # once that step is saved
    # What a save cut short by a kill leaves: Orbax's temporary folder of a step never made whole.
    leftover = job.run_dir / "checkpoints" / f"ckpt_{KILL_AT + 2}.orbax-checkpoint-tmp-1795770000000000"
    leftover.mkdir()
    (leftover / "junk").write_bytes(os.urandom(999))
    # Its first step held 1.5 s: the 1 s limit is past by the next step however fast the process started (a warm
    # compile cache once ended a whole epoch inside the second): saves and stops within epoch 3.
    job.attempt("time_limit", "--set", "train.max_duration=1", hold=KILL_AT + 1, act=held_for(1.5))
    job.attempt("stalled", "--set", "train.stall_timeout=10", hold=STALL_AT)  # never released: the guard ends it
    job.attempt("preempted", hold=TERM_AT, act=signalled(signal.SIGTERM))
    job.attempt("succeeded")
    return job


# --- each way an attempt stops, and the attempt after it ---------------------------------------------------


def test_ctrl_c_under_jax_saves_the_next_step_exits_130_and_the_rerun_continues_from_it(job):
    stopped = job.tries["interrupted"]
    assert stopped.code == 130, stopped.err[-3000:]
    saved = stopped.newest
    assert INTERRUPT_AT < saved < 2 * STEPS, f"a save after the notice, mid-epoch 2: {saved}"
    assert f"interrupted: saved step {saved}; run the same job again to continue" in stopped.err
    assert "Traceback" not in stopped.err and "KeyboardInterrupt" not in stopped.err
    summary = stopped.summary
    jsonschema.validate(summary, SCHEMA)
    assert summary["status"] == "interrupted"
    assert [(e["epoch"], e["partial"]) for e in summary["epochs"]] == [(1, False), (2, True)]
    assert stopped.attempts == ["001.json"]
    assert job.tries["killed"].began == saved
    assert f"(step {saved} of {TOTAL})" in job.tries["killed"].err


def test_kill_9_under_jax_resumes_from_the_newest_whole_checkpoint_and_removes_a_cut_save(job):
    killed, after = job.tries["killed"], job.tries["time_limit"]
    assert killed.code == -signal.SIGKILL
    assert killed.newest == KILL_AT
    assert killed.attempts == job.tries["interrupted"].attempts, "a killed process writes nothing more"
    # The next attempt resumes from that step, not from the leftover of a later save cut short.
    assert after.summary["resumed_from_step"] == KILL_AT
    assert not [p.name for p in (job.run_dir / "checkpoints").iterdir() if "tmp" in p.name]
    # Named in the log, as TensorFlow's leftovers are (docs/resume.md, precedence 4).
    assert (f"removed 1 leftover(s) of a checkpoint save that was cut short from {job.run_dir / 'checkpoints'}: "
            f"ckpt_{KILL_AT + 2}.orbax-checkpoint-tmp-1795770000000000") in after.err, after.err[-3000:]


def test_max_duration_under_jax_saves_exits_124_and_the_rerun_continues(job):
    stopped = job.tries["time_limit"]
    assert stopped.code == 124, stopped.err[-3000:]
    summary = stopped.summary
    jsonschema.validate(summary, SCHEMA)
    assert summary["status"] == "time_limit" and summary["time_limit"]["max_duration_s"] == 1
    assert "interrupted after" in stopped.err and "time limit at step" in stopped.err
    saved = stopped.newest
    mine = [e for e in summary["epochs"] if e["attempt"] == summary["attempt"]]
    assert [e["partial"] for e in mine] == [True] and mine[0]["steps"] == saved - KILL_AT, mine
    assert job.tries["stalled"].began == saved


def test_the_stall_guard_under_jax_exits_124_and_the_rerun_resumes_from_the_newest_checkpoint(job):
    stalled = job.tries["stalled"]
    assert stalled.code == 124, stalled.err[-3000:]
    said = re.search(rf"stalled: nothing progressed for (\d+) s since step {STALL_AT} ended "
                     r"\(train\.stall_timeout 10 s\)", stalled.err)
    assert said, stalled.err[-2000:]
    assert int(said.group(1)) < 40, f"the guard waited {said.group(1)} s for a 10 s stall timeout"
    assert stalled.newest == STALL_AT, "the save of the held step had 10 s to complete"
    assert stalled.attempts == job.tries["time_limit"].attempts, "the guard exits at once, writing no summary"
    # but the mark that tells the TPU VM's script and the watcher a stall from a time limit (both exit 124)
    assert stalled.stall_mark and stalled.stall_mark["message"] in stalled.err, stalled.stall_mark
    assert job.tries["time_limit"].stall_mark is None and job.tries["preempted"].stall_mark is None, "removed"
    assert job.tries["preempted"].summary["resumed_from_step"] == STALL_AT


def test_sigterm_under_jax_saves_exits_75_and_the_last_attempt_trains_exactly_the_missing_steps(job):
    stopped, last = job.tries["preempted"], job.tries["succeeded"]
    assert stopped.code == 75, stopped.err[-3000:]
    assert stopped.summary["status"] == "preempted"
    assert stopped.summary["preemption"]["saved_after_notice_s"] is not None
    assert "run the same job again to continue" in stopped.err
    saved = stopped.newest
    assert TERM_AT < saved < 4 * STEPS, f"a save after the notice, mid-epoch 4: {saved}"

    assert last.code == 0, last.err[-3000:]
    summary = last.summary
    jsonschema.validate(summary, SCHEMA)
    assert summary["status"] == "succeeded" and summary["resumed_from_step"] == saved
    assert summary["final_step"] == TOTAL
    mine = [e for e in summary["epochs"] if e["attempt"] == summary["attempt"]]
    assert sum(e["steps"] for e in mine) == TOTAL - saved  # none twice, none skipped
    assert [e["epoch"] for e in mine] == [4, 5] and mine[0]["steps"] == 4 * STEPS - saved
    statuses = [json.loads((job.run_dir / "attempts" / a).read_text())["status"] for a in last.attempts]
    assert statuses == ["interrupted", "time_limit", "preempted", "succeeded"]


# --- what the job asked of Keras, under JAX, across every resume --------------------------------------------


def test_the_user_callback_ran_in_every_attempt_and_the_schedule_continued_from_each_restored_step(job):
    names = ["interrupted", "killed", "time_limit", "stalled", "preempted", "succeeded"]
    began = [job.tries[n].began for n in names]
    assert began == [0] + [job.tries[n].newest for n in names[:-1]], began
    ends = [m for n in names for m in job.tries[n].marks if "lr" in m]
    assert {m["step"] for m in ends} >= {6, 12, 18, 24, TOTAL}, ends  # every epoch's end, in one attempt or another
    for mark in ends:
        assert mark["lr"] == pytest.approx(rate_at(mark["step"]), rel=1e-5), mark


def test_validation_every_2_validates_epochs_2_and_4_in_whichever_attempt_ran_them(job):
    """Keras counts the cadence from the job's first epoch, so a resumed job validates on the same epochs as one
    that ran through; an epoch cut short by a stop is validated too when it is one of them."""
    epochs = job.tries["succeeded"].summary["epochs"]
    assert {e["epoch"] for e in epochs} == set(range(1, EPOCHS + 1)), epochs
    for epoch in epochs:
        validated = "val_accuracy" in epoch["metrics"]
        assert validated == (epoch["epoch"] % 2 == 0), epoch
        assert not validated or np.isfinite(epoch["metrics"]["val_loss"]), epoch


# --- the finished job: summary, evaluate, predict, export -------------------------------------------------


def test_the_finished_jax_job_reports_its_backend_flops_and_orbax_checkpoints(job):
    last = job.tries["succeeded"]
    summary = last.summary
    assert summary["accelerator"]["backend"] == {
        "name": "jax", "reason": "accelerator.backend: jax, as the spec asks (on a CPU, TensorFlow was measured "
                                 "faster: benchmarks/RESULTS.md, backends)"}
    assert "jax" in summary["accelerator"]
    assert "on jax (accelerator.backend: jax, as the spec asks" in last.err  # the accelerator line says it too
    assert summary["metrics"]["examples"] == 512  # every test record, once
    assert summary["checkpoint_saves"]["store"] == "orbax" and summary["checkpoint_saves"]["mode"] == "async"
    assert summary["throughput"]["flops_method"].startswith("xla:")
    assert summary["throughput"]["mfu"] > 0
    assert orbax_steps(job.run_dir)[-1] == TOTAL and len(orbax_steps(job.run_dir)) == 3  # checkpoint.keep
    # JAX_COMPILATION_CACHE_DIR (the suite's, tests/conftest.py) is used instead of the run folder's jax_cache/
    assert summary["compile_cache"] == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert not (job.run_dir / "jax_cache").exists()
    assert list(Path(summary["compile_cache"]).glob("jit_train_step*"))
    assert (job.run_dir / "model.keras").is_file()


@pytest.mark.fresh  # a JAX command started as a user's is, at every `make test` (docs/architecture.md)
def test_evaluate_under_jax_measures_what_the_run_reported(job):
    evaluated = run_cli("evaluate", job.spec, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert report["examples"] == 512
    assert report["metrics"]["accuracy"] == pytest.approx(job.tries["succeeded"].summary["metrics"]["accuracy"],
                                                          abs=1e-6)


@pytest.fixture(scope="module")
def predicted(job) -> tuple[np.ndarray, list[dict]]:
    """(labels, predict's answers) for the 512 test digits, as `runner predict` gives them."""
    from runner.prepare.datasets import load_dataset

    test = load_dataset("mnist").splits["test"]
    digits = job.folder / "digits.npy"
    np.save(digits, test["image"][:512])
    result = run_cli("predict", job.spec, "--input", digits, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return test["label"][:512], [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_predict_under_jax_answers_every_row_as_the_run_measured_with_the_class_weights_applied(job, predicted):
    labels, answers = predicted
    assert [a["index"] for a in answers] == list(range(512))
    classes = np.array([a["class"] for a in answers])
    # The same model as the run's evaluation: the same accuracy (a near tie may fall the other way in a row).
    accuracy = job.tries["succeeded"].summary["metrics"]["accuracy"]
    assert np.mean(classes == labels) == pytest.approx(accuracy, abs=2 / 512)
    # Class 0 weighed nothing in training: the model learned the other nine and almost never answers 0.
    zeros = labels == 0
    assert np.mean(classes[zeros] == 0) < 0.1, np.mean(classes[zeros] == 0)
    assert np.mean(classes[~zeros] == labels[~zeros]) > 0.5


def test_the_saved_model_serves_records_as_predict_answers_them(job, predicted):
    """The SavedModel, converted from JAX, parses records with the runner's own parser."""
    import tensorflow as tf

    loaded = tf.saved_model.load(str(job.run_dir / "saved_model"))
    shards = sorted(str(p) for p in job.data.glob("test-*.tfrecord"))
    records = [r.numpy() for r in tf.data.TFRecordDataset(shards).take(3)]
    outputs = loaded.serve_examples(tf.constant(records)).numpy()
    assert outputs.shape == (3, 10)
    _, answers = predicted
    np.testing.assert_allclose(outputs, [a["probabilities"] for a in answers[:3]], atol=1e-4)
