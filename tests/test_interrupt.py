"""Ctrl-C (SIGINT) on real `runner run` processes: handled like a preemption notice (SIGTERM, also here while
TensorFlow loads), but said as an interruption.

The first Ctrl-C saves at the next step boundary, writes the summary with status `interrupted` and exits
130; running the job again continues it. A second Ctrl-C exits at once, saving nothing more.
"""

from __future__ import annotations

import json
import re
import signal
import time

import jsonschema
import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli
from tests.support.runs import (
    EPOCHS,
    STEPS,
    finish,
    indexed_step,
    local_index,
    signal_in_second_epoch,
    signal_taken,
    start_run,
    tensorflow_loading,
    wait_for,
)
from tests.support.runs import interruptible_job as job

SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())


@pytest.mark.slow
def test_ctrl_c_saves_writes_an_interrupted_summary_exits_130_and_the_rerun_continues(mnist_job, tmp_path):
    spec = job(mnist_job, "interrupted", grace_s=20)  # epoch-end saves only: the interruption's save is its own
    run_dir = tmp_path / "runs" / "interrupted"
    process = start_run(spec, progress=True)
    signal_in_second_epoch(process, run_dir, signal.SIGINT)
    code, out, err = finish(process)
    assert code == 130, err[-3000:]
    saved = indexed_step(local_index(run_dir))
    assert STEPS < saved < EPOCHS * STEPS and saved % STEPS, f"the interruption's save is mid-epoch, got step {saved}"
    assert f"interrupted: saved step {saved}; run the same job again to continue" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    summary = last_json(out)
    jsonschema.validate(summary, SCHEMA)
    assert summary["status"] == "interrupted"
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = last_json(result.stdout)
    assert resumed["status"] == "succeeded"
    assert resumed["resumed_from_step"] == saved
    assert resumed["final_step"] == EPOCHS * STEPS
    mine = [e for e in resumed["epochs"] if e["attempt"] == resumed["attempt"]]
    assert sum(e["steps"] for e in mine) == EPOCHS * STEPS - saved
    # The interrupted attempt's epochs come first; its cut-short epoch is marked partial.
    earlier = [e for e in resumed["epochs"] if e["attempt"] < resumed["attempt"]]
    assert [e["partial"] for e in earlier] == [False, True] and sum(e["steps"] for e in earlier) == saved
    attempts = sorted((run_dir / "attempts").iterdir())
    assert [json.loads(a.read_text())["status"] for a in attempts] == ["interrupted", "succeeded"]


@pytest.mark.parametrize(("sent", "code", "status", "says"), [
    (signal.SIGINT, 130, "interrupted", "interrupted while the job was starting"),
    (signal.SIGTERM, 75, "preempted", "preemption notice received while the job was starting"),
])
def test_a_signal_while_tensorflow_imports_ends_the_run_having_saved_nothing(
    mnist_job, tmp_path, sent, code, status, says
):
    """Ctrl-C is an interruption (130), SIGTERM a preemption (75): either, before a step has run, is reported
    as such in the summary, locally and in the run folder, and leaves no checkpoint."""
    spec = job(mnist_job, "early")
    run_dir = tmp_path / "runs" / "early"
    process = start_run(spec, fresh=True)
    wait_for(lambda: tensorflow_loading(process.pid), process, timeout=60, every=0.01)
    process.send_signal(sent)
    exit_code, out, err = finish(process)
    assert exit_code == code, err[-3000:]
    assert says in err and "run the same job again" in err
    assert "Traceback" not in err
    summary = last_json(out)
    jsonschema.validate(summary, SCHEMA)
    assert summary["status"] == status
    assert json.loads((run_dir / "summary.json").read_text())["status"] == status
    assert local_index(run_dir) is None, "nothing was trained, so nothing is saved"


def test_a_sigterm_while_the_command_line_imports_is_a_preemption_too(mnist_job, tmp_path):
    """Before `run` begins, Python imports the CLI (Typer, Rich, every command's module: 0.3-0.5 s). A notice
    then is held as well: exit 75 with its summary, never 143. Python reports each import as it completes
    (PYTHONPROFILEIMPORTTIME): the signal goes the moment Typer's is reported."""
    spec = job(mnist_job, "imports")
    process = start_run(spec, fresh=True, env=cli_env(PYTHONPROFILEIMPORTTIME="1"))
    seen = []
    for line in process.stderr:
        seen.append(line)
        if re.search(r"\|\s+typer$", line.rstrip()):
            break
    else:
        raise AssertionError("the CLI exited before Typer was imported: " + "".join(seen[-20:]))
    process.send_signal(signal.SIGTERM)
    code, out, err = finish(process)
    assert code == 75, err[-3000:]
    assert "preemption notice received while the job was starting" in err
    summary = last_json(out)
    assert summary["status"] == "preempted"
    assert json.loads((tmp_path / "runs" / "imports" / "summary.json").read_text())["status"] == "preempted"


def test_a_second_ctrl_c_while_tensorflow_imports_exits_at_once(mnist_job, tmp_path):
    spec = job(mnist_job, "twice")
    process = start_run(spec, fresh=True)
    wait_for(lambda: tensorflow_loading(process.pid), process, timeout=60, every=0.01)
    process.send_signal(signal.SIGINT)
    # Two signals sent before the first is taken reach the process as one: the second waits for that.
    wait_for(lambda: signal_taken(process.pid, signal.SIGINT), process, timeout=60, every=0.01)
    process.send_signal(signal.SIGINT)
    code, out, err = finish(process, timeout=120)
    assert code == 130, err[-3000:]
    assert "interrupted again: exiting now" in err
    assert out.strip() == "", "the second Ctrl-C exits before any summary"
    assert not (tmp_path / "runs" / "twice" / "checkpoints" / "checkpoint").exists()


def stalled_save_job(gcs_faults, mnist_job, name: str, grace_s: float):
    """A job writing to gs:// whose save of step 16 hangs on its .index upload (after its data file is in place);
    its data stays local."""
    bucket = gcs_faults.bucket()
    spec = mnist_job(
        name,
        data={"eval": None, "global_batch_size": 32},
        train={"epochs": 2, "steps_per_epoch": 24},
        checkpoint={"every_steps": 8, "grace_s": grace_s},
        output={"dir": f"gs://{bucket}/runs", "tensorboard": False},
    )
    hang = {"match": rf"^POST /upload/.*name=runs/{name}/checkpoints/ckpt-16\.index", "action": "stall", "delay_s": 60}
    gcs_faults.faults.set([hang])
    return spec, bucket


@pytest.mark.slow
def test_a_second_ctrl_c_during_a_hung_save_exits_at_once(gcs_faults, mnist_job):
    spec, bucket = stalled_save_job(gcs_faults, mnist_job, "hung", grace_s=60)
    process = start_run(spec, env=cli_env(**gcs_faults.env))
    wait_for(lambda: gcs_faults.faults.stats()["stall"] or None, process, every=0.2)  # this run's save, stalled
    process.send_signal(signal.SIGINT)  # the save of step 16 is stuck: the first Ctrl-C waits for it
    wait_for(lambda: signal_taken(process.pid, signal.SIGINT), process, timeout=60, every=0.01)
    time.sleep(1.0)
    assert process.poll() is None, "the first Ctrl-C waits for the save (grace_s 60)"
    second = time.monotonic()
    process.send_signal(signal.SIGINT)
    code, out, err = finish(process, timeout=120)
    assert code == 130, err[-3000:]
    # At once, not at the end of grace_s (60 s): the bound leaves room for a busy machine.
    assert time.monotonic() - second < 20
    assert "interrupted again: exiting now" in err
    assert out.strip() == "", "the second Ctrl-C exits before any summary"
    index = gcs_faults.read(bucket, "runs/hung/checkpoints/checkpoint").decode()
    assert indexed_step(index) == 8, "the save cut short is never the newest checkpoint"


@pytest.mark.slow
def test_ctrl_c_during_a_save_stuck_past_the_grace_period_exits_130(gcs_faults, mnist_job):
    spec, bucket = stalled_save_job(gcs_faults, mnist_job, "stuck", grace_s=3)
    process = start_run(spec, env=cli_env(**gcs_faults.env))
    wait_for(lambda: gcs_faults.faults.stats()["stall"] or None, process, every=0.2)  # this run's save, stalled
    noticed = time.monotonic()
    process.send_signal(signal.SIGINT)
    code, _, err = finish(process, timeout=60)
    assert code == 130, err[-3000:]
    assert 3 <= time.monotonic() - noticed < 3 + 30  # at grace_s (3 s), with room for a busy machine
    assert "did not save and stop within checkpoint.grace_s (3 s)" in err
    assert indexed_step(gcs_faults.read(bucket, "runs/stuck/checkpoints/checkpoint").decode()) == 8
    # What the rerun finds is what a SIGTERM leaves in the same place: the data file of ckpt-16 without its
    # index. test_resume.py's stuck save runs the job again from there (it resumes from step 8, to step 48).
    names = gcs_faults.objects(bucket, "runs/stuck/checkpoints/")
    assert "runs/stuck/checkpoints/ckpt-16.data-00000-of-00001" in names
    assert "runs/stuck/checkpoints/ckpt-16.index" not in names
