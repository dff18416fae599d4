"""Forming one job of several processes and ending it (runner/device/processes.py): a late process, processes
given different jobs, a coordinator port in use, a preemption of every process. Real `runner run` processes on
127.0.0.1 joined by JAX's distributed runtime, as in tests/test_multihost.py, whose tiny job they run.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from runner import EXIT_INFRA, EXIT_PREEMPTED, EXIT_USAGE
from tests.conftest import REPO, cli_env, last_json
from tests.support import zygote
from tests.test_multihost import STEPS, finish, free_port, job

pytestmark = pytest.mark.slow


def start_each(spec: Path, args: dict[int, list[str]], port: int, only: list[int] | None = None,
               count: int = 2, stdout: dict[int, int] | None = None) -> list:
    """`runner run SPEC ARGS[i]` as process i of `count` with coordinator port `port` (or only those in `only`);
    stdout a pipe, or the file descriptor `stdout[i]`."""
    started = []
    for index in only if only is not None else range(count):
        env = cli_env(KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                      KERAS_DISTRIBUTION_NUM_PROCESSES=str(count), KERAS_DISTRIBUTION_PROCESS_ID=str(index))
        log = spec.parent / f"{spec.stem}-process{index}.log"
        with open(log, "w") as stderr:
            proc = zygote.popen(["run", str(spec), *args.get(index, [])], env=env, cwd=REPO, stderr=stderr,
                                stdout=(stdout or {}).get(index, subprocess.PIPE), text=True)
        proc.log = log
        started.append(proc)
    return started


def wait_in_log(proc, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log.read_text():
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
        time.sleep(0.1)


def test_a_process_that_starts_late_still_joins_past_the_device_bound(mnist_job, tmp_path: Path) -> None:
    """The join waits accelerator.join_timeout_s, not accelerator.timeout_s (the device listing's): process 1
    begins after process 0 has waited longer than the device bound, as a worker still pulling the image would."""
    spec = job(mnist_job, tmp_path, "late", epochs=1)
    bounds = ["--set", "accelerator.timeout_s=5", "--set", "accelerator.join_timeout_s=60"]
    port = free_port()
    first = start_each(spec, {0: bounds}, port, only=[0])
    # Its first waiting line comes a tenth of the join's bound (6 s) into the join: past accelerator.timeout_s.
    wait_in_log(first[0], "joining: waiting for process 1 to begin joining (1 of 2 ready) after ")
    ended = finish(first + start_each(spec, {1: bounds}, port, only=[1]))
    for code, _, err in ended:
        assert code == 0, err[-3000:]
    assert last_json(ended[0][1])["final_step"] == STEPS


def test_processes_given_different_jobs_all_end_with_exit_2_naming_the_difference(mnist_job, tmp_path) -> None:
    """Process 1 given another global batch: before, process 0 trained and printed an accuracy of 1.4 while
    process 1 hung in a collective of another shape. Now every process refuses, before any step."""
    spec = job(mnist_job, tmp_path, "unalike")
    ended = finish(start_each(spec, {1: ["--set", "data.global_batch_size=128"]}, free_port()), timeout=180)
    assert [code for code, _, _ in ended] == [EXIT_USAGE, EXIT_USAGE], ended[0][2][-3000:]
    for _, out, err in ended:
        assert "not given the same job: process 1 has data.global_batch_size 128 where process 0 has 64." in err, (
            err[-3000:])
        assert "epoch 1/" not in err and last_json(out)["status"] == "failed"
    assert not (tmp_path / "runs" / "unalike").exists(), "a refused job wrote a run folder"


def test_a_coordinator_port_in_use_ends_every_process_with_exit_3_naming_it(mnist_job, tmp_path) -> None:
    """JAX's gRPC server died of SIGSEGV on a port in use, with no word of why, and process 1 waited out its
    join. Now process 0 names the port at once, and process 1 reads why from its marker in the run folder."""
    spec = job(mnist_job, tmp_path, "port-taken")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        began = time.monotonic()
        ended = finish(start_each(spec, {}, port), timeout=120)
    assert [code for code, _, _ in ended] == [EXIT_INFRA, EXIT_INFRA], ended[0][2][-3000:]
    for _, _, err in ended:
        assert f"the coordinator's port {port} is in use on this host" in err, err[-3000:]
    assert "process 0 could not join the job" in ended[1][2]
    assert time.monotonic() - began < 60  # the join's bound (60 s) not waited out


def held_pipe(room: int = 256) -> tuple[int, int]:
    """A pipe with `room` bytes free: a process given its write end as stdout prints Gloo's line ("[Gloo] Rank 1
    is connected to 1 peer ranks") and then blocks at its summary until the read end is drained. Linux keeps a
    pipe in page-sized buffers and adds a small write to the newest one while it has room: fill every page, free
    one, fill that one but for `room`."""
    read_end, write_end = os.pipe()
    page = os.sysconf("SC_PAGE_SIZE")
    os.set_blocking(write_end, False)
    try:
        while True:
            os.write(write_end, b"#" * page)
    except BlockingIOError:
        pass
    os.read(read_end, page)
    os.write(write_end, b"#" * (page - room))
    os.set_blocking(write_end, True)  # the child shares this flag: its print must wait, not fail
    return read_end, write_end


def test_sigterm_to_every_process_gives_75_on_every_process_every_time(mnist_job, tmp_path: Path) -> None:
    """A preemption signals every host. Process 1 is held while it prints its summary (its stdout a full pipe),
    as a slow disk or a loaded host holds it: process 0 used to leave as soon as it had written its own, taking
    the coordination service with it, and JAX aborted process 1 (exit -6, no summary; 1 run of 17 under load).
    Process 0 now leaves last. Twice, the second attempt resuming the first's save."""
    spec = job(mnist_job, tmp_path, "preempted-twice", epochs=400)
    steps = []
    for _ in range(2):
        read_end, write_end = held_pipe()
        try:
            started = start_each(spec, {}, free_port(), stdout={1: write_end})
        finally:
            os.close(write_end)
        for proc in started:
            wait_in_log(proc, "/400: ")  # an epoch of this attempt trained (each attempt's log starts empty)
        for proc in started:
            proc.send_signal(signal.SIGTERM)
        wait_in_log(started[0], "preempted at step")  # process 0's closing line: its summary is written
        time.sleep(3)  # process 1 still held: before, process 0 was gone by now and process 1 aborted
        with os.fdopen(read_end, "r") as held:
            out1 = held.read()  # drains the pipe: process 1 prints its summary and leaves
        code0, out0, err0 = finish(started[:1], timeout=60)[0]
        code1 = started[1].wait(60)
        err1 = started[1].log.read_text()
        assert (code0, code1) == (EXIT_PREEMPTED, EXIT_PREEMPTED), f"{err0[-2000:]}\n{err1[-2000:]}"
        summaries = [last_json(out0), last_json(out1)]
        assert [s["status"] for s in summaries] == ["preempted", "preempted"]
        step = {int(re.search(r"saved step (\d+)", s["error"]).group(1)) for s in summaries}
        assert len(step) == 1, f"the processes stopped at different steps: {step}"
        steps.append(step.pop())
    assert steps[0] < steps[1]
