"""Following a run: a progress line every N seconds in a log, a Rich bar on a terminal that log lines do not
break, a closing line for a person before the JSON summary, and no TensorFlow start-up noise by default."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, run_cli
from tests.support.terminal import run_in_terminal, screen_lines

# What TensorFlow's C++ start-up prints unless told not to (absl before InitializeLog, CPU feature and oneDNN
# notices), and what an INFO line of TensorFlow's own logging starts with.
NOISE = ("InitializeLog", "oneDNN", "cpu_feature_guard", "TF_ENABLE_ONEDNN_OPTS", "I0000 ")
LOG_LINE = re.compile(r"\d\d:\d\d:\d\d [DIWE] runner\.")
PROGRESS = re.compile(
    r"I runner\.train\.progress: epoch (\d+)/(\d+), step ([\d,]+)/([\d,]+) \(\d+%\), ([\d,]+) examples/s, "
    r"ETA [^,]+, loss \d"
)


def quiet_env(**extra: str) -> dict[str, str]:
    """The environment a user has: TensorFlow's log level is not set (cli_env sets it for the other tests)."""
    env = cli_env(**extra)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return env


# --- the closing line and the durations, from summaries with known fields -------------------------


def test_the_closing_line_says_status_epochs_result_time_and_where() -> None:
    from runner.train.progress import closing_line, duration

    assert [duration(s) for s in (0.4, 59.4, 61, 3599, 3661)] == ["0 s", "59 s", "1m 01s", "59m 59s", "1h 01m"]
    summary = {
        "status": "succeeded", "train_epochs": 12, "epochs": [{"epoch": 11}, {"epoch": 12}], "run_dir": "runs/m",
        "model": "runs/m/model.keras", "metrics": {"accuracy": 0.98681, "loss": 0.04, "examples": 9216},
        "timing": {"total_s": 292.4},
    }
    assert closing_line(summary) == "succeeded: 12 of 12 epochs, accuracy 0.9868 in 4m 52s; model: runs/m/model.keras"
    assert closing_line(summary, already_complete=True) == (
        "already complete: 12 epochs, accuracy 0.9868, trained earlier; model: runs/m/model.keras"
    )
    regression = {**summary, "metrics": {"loss": 0.8, "mae": 0.93}}
    assert ", mae 0.9300 in" in closing_line(regression), "without accuracy, the first other metric"
    # Stopped inside its third epoch, resumed once before: the step says how far it got.
    preempted = {**summary, "status": "preempted", "epochs": [{"epoch": 2, "steps": 58}, {"epoch": 3, "steps": 40}],
                 "metrics": {}, "steps_per_epoch": 58, "resumed_from_step": 58}
    assert closing_line(preempted) == (
        "preempted at step 156 of 696 (epoch 3 of 12) in 4m 52s: checkpoint saved in runs/m/checkpoints; "
        "run the same command again to continue"
    )
    assert closing_line({**preempted, "status": "interrupted"}).startswith("interrupted at step 156 of 696 (epoch 3")
    # Stopped before training began: nothing was saved, and the closing line does not say otherwise.
    early = {**preempted, "epochs": [], "checkpoint_saves": None, "resumed_from_step": 0}
    assert "no new checkpoint was saved" in closing_line(early) and "checkpoint saved" not in closing_line(early)
    # Another process of the job stopped while this one's save counted nothing: the run folder's newest whole
    # checkpoint is named (the line once said "no checkpoint was saved" beside a ckpt_400).
    lost = {**summary, "status": "failed", "resumed_from_step": 0, "checkpoint_saves": None,
            "newest_checkpoint": "runs/m/checkpoints/ckpt_400"}
    assert closing_line(lost).endswith(
        "; checkpoints kept in runs/m/checkpoints, the newest whole one ckpt_400: once the error is dealt with, the "
        "same command continues from it (the error follows)")
    assert "(the newest whole one: ckpt_400)" in closing_line({**lost, "status": "preempted"})
    limited = {**preempted, "status": "time_limit", "checkpoint_saves": {"saves": 3}}
    assert closing_line(limited).startswith("time limit at step 156 of 696 (epoch 3 of 12) in 4m 52s: checkpoint saved")
    chosen = {**summary, "accelerator": {"precision": {"policy": "bfloat16", "reason": "cpu flag avx512_bf16"}}}
    assert closing_line(chosen) == (
        "succeeded: 12 of 12 epochs, accuracy 0.9868 in 4m 52s, bfloat16 (cpu flag avx512_bf16); "
        "model: runs/m/model.keras"
    )
    failed = {**summary, "status": "failed", "epochs": [], "metrics": {}, "timing": {"total_s": 9.0}}
    assert closing_line(failed) == "failed before training began, in 9 s; run folder: runs/m (the error follows)"
    midway = {**failed, "final_step": 40}  # failed inside the first epoch, after 40 steps
    assert closing_line(midway) == "failed after 0 of 12 epochs in 9 s; run folder: runs/m (the error follows)"
    # A refusal (exit 2) of an attempt that trained nothing: the epochs listed are an earlier attempt's.
    resumed = {**failed, "attempt": 2, "epochs": [{"epoch": 1, "attempt": 1}, {"epoch": 2, "attempt": 1}]}
    assert closing_line(resumed, refused=True) == (
        "refused before training, in 9 s; run folder: runs/m (2 of 12 epochs were trained earlier) "
        "(the error says what to change)")
    assert closing_line(resumed).startswith("failed after 2 of 12 epochs"), "a failure is not a refusal"
    stopped = {**summary, "epochs": [{"epoch": 1}, {"epoch": 2}], "stopped_early_after_epoch": 2}
    assert closing_line(stopped) == (
        "succeeded: early stopping ended it after 2 of 12 epochs (val_loss stopped improving; the best epoch's "
        "weights were kept), accuracy 0.9868 in 4m 52s; model: runs/m/model.keras")
    bench = {"status": "succeeded", "kind": "matmul_bench", "run_dir": "runs/b",
             "tflops": {"cold": 0.01, "warm": 0.0712}, "timing": {"total_s": 3.0}, "epochs": []}
    assert closing_line(bench) == "succeeded: matmul benchmark, 0.0712 TFLOPS warm in 3 s; summary: runs/b/summary.json"


# --- a real run without a terminal: lines every N seconds, rising steps, the closing line, no noise -----


EVERY_S, LINES = 1, 8  # `--progress-every 1`: a long run's log, with as many lines as 45 s at 5 s gave, in ~10 s


@pytest.mark.slow
def test_a_run_without_a_terminal_logs_progress_every_n_seconds(small_mnist: Path, mnist_job, tmp_path: Path) -> None:
    """A run longer than LINES progress intervals, whatever this machine's speed: far more epochs than that
    can train, Ctrl-C once LINES progress lines are in the log."""
    spec = mnist_job("lines", train={"epochs": 500})
    run = subprocess.Popen(
        [sys.executable, "-m", "runner", "run", str(spec), "--progress-every", str(EVERY_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=quiet_env(), cwd=REPO,
    )
    lines: list[str] = []  # stderr, read as it comes by a thread of its own
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in run.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while sum(bool(PROGRESS.search(line)) for line in list(lines)) < LINES and time.monotonic() < deadline:
            assert run.poll() is None, "the job ended before its progress lines: it cannot show what a long run shows"
            time.sleep(0.1)
        run.send_signal(signal.SIGINT)
        run.wait(timeout=120)
        reader.join(timeout=30)
        stdout = run.stdout.read()
    finally:
        run.kill()
    stderr = "\n".join(lines)
    assert run.returncode == 130, stderr[-3000:]
    summary = json.loads(stdout.splitlines()[-1])
    assert summary["status"] == "interrupted"

    progress = [PROGRESS.search(line) for line in lines]
    steps = [int(m.group(3).replace(",", "")) for m in progress if m]
    assert all(int(m.group(4).replace(",", "")) == 8000 and m.group(2) == "500" for m in progress if m), [
        m.group(0) for m in progress if m
    ]
    # Lines come from the end of the first step (it traces and compiles, and says so on a line of its own) on.
    timing = summary["timing"]
    stepping_s = timing["train_s"] - timing["first_step_s"]
    # A line comes at the first step boundary EVERY_S after the last one (later when a checkpoint save is on).
    assert len(steps) >= LINES and len(steps) >= int(stepping_s // (1.6 * EVERY_S)), (
        f"{len(steps)} progress lines in {stepping_s:.1f} s of training after the first step"
    )
    assert steps == sorted(steps) and len(set(steps)) == len(steps), f"steps must rise: {steps}"
    assert 0 < steps[0] < steps[-1]

    # A closing line for a person on stderr, before the summary (the last stdout line) and the error.
    closing = [line for line in lines if line.startswith("interrupted at step ")]
    assert closing and "run the same command again to continue" in closing[0], lines[-5:]
    # TensorFlow's start-up notices stay out.
    noisy = [line for line in lines if any(n in line for n in NOISE)]
    assert not noisy, noisy


@pytest.mark.slow
def test_a_finished_run_closes_with_a_line_and_counts_its_examples_as_counts(small_mnist: Path, mnist_job) -> None:
    spec = mnist_job("closing", train={"epochs": 1})
    result = subprocess.run(
        [sys.executable, "-m", "runner", "run", str(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=quiet_env(), cwd=REPO,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads(lines[-1])
    assert lines[-2].startswith("succeeded: 1 of 1 epoch, accuracy 0."), lines[-2]
    assert lines[-2].endswith(f"model: {summary['model']}")
    assert any(re.search(r"eval: .*examples 512(,|$)", line) for line in lines), [l for l in lines if "eval:" in l]


def test_tensorflow_notices_are_shown_with_debug_only(tiny_mnist: Path) -> None:
    quiet = run_cli("verify", tiny_mnist, env=quiet_env())
    assert quiet.returncode == 0, quiet.stderr
    assert not [n for n in NOISE if n in quiet.stderr], quiet.stderr
    loud = run_cli("verify", tiny_mnist, "--debug", env=quiet_env())
    assert loud.returncode == 0, loud.stderr
    assert "cpu_feature_guard" in loud.stderr, "--debug shows TensorFlow's own log lines"


# --- a real run on a terminal: a bar, and log lines that start lines of their own --------------------


@pytest.mark.slow
def test_on_a_terminal_a_bar_shows_progress_and_log_lines_stay_whole(mnist_job) -> None:
    spec = mnist_job("bar", train={"epochs": 4})
    code, raw = run_in_terminal(["run", str(spec)], env=quiet_env(), cwd=REPO, timeout=240)
    assert code == 0, raw
    segments = screen_lines(raw)
    assert any(re.search(r"epoch \d/4 .*step \d+/64 .*examples/s .*ETA", s) for s in segments), raw
    assert any("examples/s" in s and re.search(r"loss \d+\.\d{4}", s) for s in segments), raw
    glued = [s for s in segments if LOG_LINE.search(s) and not LOG_LINE.match(s.strip())]
    assert not glued, f"a log line shares its line with other output: {glued}"
    assert sum(bool(re.match(r"\d\d:\d\d:\d\d I runner\.[\w.]+: epoch \d/4: ", s.strip())) for s in segments) == 4
    printed = [s.strip() for s in segments if s.strip()]
    assert json.loads(printed[-1])["status"] == "succeeded", "the summary is still the last line"
    assert printed[-2].startswith("succeeded: 4 of 4 epochs"), printed[-3:]
    assert "Epoch 1/4" not in raw, "Keras's own progress bar is off"


@pytest.mark.slow
def test_the_closing_line_says_early_stopping_ended_the_run(mnist_job, small_mnist: Path) -> None:
    """A learning rate far below float32 resolution freezes the weights: val_loss repeats exactly, and patience 1
    stops the run after its second of four epochs."""
    spec = mnist_job("stops", data={"validation": f"{small_mnist}/test-*.tfrecord", "eval": None},
                     train={"epochs": 4, "steps_per_epoch": 2, "learning_rate": 1e-12,
                            "early_stopping_patience": 1, "allow_chance": True},
                     output={"tensorboard": False})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    closing = [line for line in result.stderr.splitlines() if line.startswith("succeeded: ")]
    assert closing and closing[0].startswith(
        "succeeded: early stopping ended it after 2 of 4 epochs (val_loss stopped improving; the best epoch's "
        "weights were kept)"), result.stderr[-3000:]


def test_a_small_mfu_is_shown_with_its_digits_not_as_zero() -> None:
    """A tabular model's MFU is thousandths of a percent: the closing line shows 0.0042%, not 0.0%."""
    from runner.train.progress import percent

    assert percent(0.0742) == "7.4%"
    assert percent(0.000042) == "0.0042%"
    assert percent(0.0) == "0.0%"
