"""One job as several processes (runner/device/processes.py): real `runner run` processes on 127.0.0.1 joined
by JAX's distributed runtime (gloo collectives), each with one CPU device, as hosts of a slice would be.

Each process is started with Keras's own variables (KERAS_DISTRIBUTION_JOB_ADDRESSES, _NUM_PROCESSES,
_PROCESS_ID). The model is one dense layer: these tests are about the processes, not the model, and XLA on
these CPUs compiles a CNN for tens of seconds.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runner import EXIT_INFRA, EXIT_PREEMPTED
from runner.device import backend, processes
from runner.spec.types import AcceleratorSpec
from tests.conftest import REPO, cli_env, last_json
from tests.support import zygote

BATCH, STEPS = 64, 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_model(folder: Path) -> str:
    (folder / "tinynet.py").write_text(
        "import keras\n\n\n"
        "def build(params, features, inputs):\n"
        "    x = keras.Input((28, 28, 1))\n"
        "    flat = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))\n"
        "    return keras.Model(x, keras.layers.Dense(10, activation='softmax')(flat))\n"
    )
    return "tinynet:build"


def job(mnist_job, tmp_path: Path, name: str, train: str | None = None, **train_settings) -> Path:
    # Streamed (held in memory, one process would read in another order than the processes share out).
    data = {"global_batch_size": BATCH, "shuffle_buffer": 256, "in_memory": False}
    if train:
        data["train"] = train
    return mnist_job(
        name,
        accelerator={"kind": "cpu", "backend": "jax", "join_timeout_s": 60, "heartbeat_s": 5},
        data=data,
        model={"name": tiny_model(tmp_path)},
        train={"epochs": 2, "steps_per_epoch": STEPS, "allow_chance": True, **train_settings},
        output={"tensorboard": False},
    )


def start(spec: Path, count: int, *args: str, port: int | None = None, only: list[int] | None = None) -> list:
    """`runner run SPEC` as `count` processes of one job (or only those in `only`), stderr in files."""
    port = port or free_port()
    started = []
    for index in only if only is not None else range(count):
        env = cli_env(KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                      KERAS_DISTRIBUTION_NUM_PROCESSES=str(count), KERAS_DISTRIBUTION_PROCESS_ID=str(index))
        log = spec.parent / f"{spec.stem}-process{index}.log"
        with open(log, "w") as stderr:  # forked from a process that has loaded Keras on JAX (tests/support/zygote.py)
            proc = zygote.popen(["run", str(spec), *args], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
        proc.log = log
        started.append(proc)
    return started


def finish(started: list, timeout: float = 240) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process; every process is ended by the deadline, whichever hangs."""
    deadline, ended = time.monotonic() + timeout, []
    try:
        for proc in started:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            ended.append((proc.returncode, out, proc.log.read_text()))
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return ended


def wait_for_epoch(proc, epoch: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while f"epoch {epoch}/" not in proc.log.read_text():
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no epoch {epoch} within {timeout} s"
        time.sleep(0.1)


def one_shard_mnist(tiny_mnist: Path, out: Path) -> str:
    """The tiny MNIST's training records as one shard: fewer shards than processes, so records are shared out."""
    from runner.prepare import shards
    from runner.prepare.datasets import Dataset, load_dataset

    full = load_dataset("mnist")
    small = Dataset(full.name, {"train": {k: v[:1024] for k, v in full.splits["train"].items()}}, full.features,
                    full.inputs, full.label, full.source, full.license)
    out.mkdir()
    entries = {"train": shards.write_split(small, "train", str(out), 1)}
    shards.write_manifest(str(out), shards.manifest_for(small, entries))
    return f"{out}/train-*.tfrecord"


def weights(path: Path) -> list[np.ndarray]:
    import zipfile

    import h5py

    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as handle, h5py.File(handle) as h5:
        found = []
        h5.visititems(lambda name, item: found.append(np.array(item)) if isinstance(item, h5py.Dataset) else None)
    return found


# --- which processes form the job: no JAX needed ----------------------------------------------------------


def test_keras_variables_make_a_job_of_several_processes_and_bad_ones_are_named() -> None:
    env = {processes.ADDRESSES: "10.0.0.2:8476,10.0.0.3:8476", processes.COUNT: "2", processes.INDEX: "1"}
    asked = processes.asked(env)
    assert (asked.how, asked.count, asked.index, asked.coordinator) == ("keras", 2, 1, "10.0.0.2:8476")
    assert processes.asked({}) == processes.SINGLE
    with pytest.raises(processes.SpecError, match=processes.INDEX):
        processes.asked({processes.ADDRESSES: "10.0.0.2:8476", processes.COUNT: "2"})
    with pytest.raises(processes.SpecError, match="from 0 to"):
        processes.asked({**env, processes.INDEX: "2"})
    with pytest.raises(processes.SpecError, match="lists 2 processes but"):
        processes.asked({**env, processes.COUNT: "3"})


def test_a_gke_tpu_slice_is_left_to_jax_to_find() -> None:
    """GKE's TPU webhook sets TPU_WORKER_HOSTNAMES and TPU_WORKER_ID; JAX's GkeTpuCluster reads them itself, so
    the join passes no address (not run here: no TPU)."""
    asked = processes.asked({"TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc,w-2.svc,w-3.svc", "TPU_WORKER_ID": "2"})
    assert (asked.how, asked.count, asked.index, asked.coordinator) == ("tpu", 4, 2, None)
    assert processes.asked({"TPU_WORKER_HOSTNAMES": "w-0.svc", "TPU_WORKER_ID": "0"}) == processes.SINGLE


def test_each_bad_variable_is_named_as_itself() -> None:
    env = {processes.ADDRESSES: "127.0.0.1:8476", processes.COUNT: "0", processes.INDEX: "0"}
    with pytest.raises(processes.SpecError, match=f"^{processes.COUNT}=0 must be 1 or more"):
        processes.asked(env)
    for port in ("99999", "0", "http"):
        with pytest.raises(processes.SpecError, match=f"the port of '127.0.0.1:{port}' must be from 1 to 65535"):
            processes.asked({**env, processes.COUNT: "2", processes.ADDRESSES: f"127.0.0.1:{port}"})


def test_one_tpu_host_joins_nothing_and_a_slice_is_counted_from_the_tpu_vm_metadata(tmp_path: Path) -> None:
    """As JAX counts a slice (jax/_src/clusters/cloud_tpu_cluster.py): the TPU VM's worker-network-endpoints,
    asked of the metadata server JAX asks (GCE_METADATA_IP); GKE's hostnames. One host, or no metadata server
    (a Vertex AI job, a GKE pod), is one process: jax.distributed.initialize is never called."""
    from tests.support.metadata_fake import start_metadata_fake

    with start_metadata_fake(tmp_path, ttl_s=60) as metadata:
        env = {"GCE_METADATA_IP": metadata.host}
        assert processes.asked(env, on_tpu=True) == processes.SINGLE  # a v5litepod-8: one worker
        metadata.set(worker_network_endpoints="w-0:0:10.0.0.2,w-1:1:10.0.0.3,w-2:2:10.0.0.4,w-3:3:10.0.0.5",
                     agent_worker_number="3")
        asked = processes.asked(env, on_tpu=True)
        assert (asked.how, asked.count, asked.index, asked.coordinator) == ("tpu", 4, 3, None)
        assert processes.asked(env, on_tpu=False) == processes.SINGLE  # a CPU job on that VM
        assert processes.asked({**env, "TPU_SKIP_MDS_QUERY": "1"}, on_tpu=True) == processes.SINGLE
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{closed.getsockname()[1]}"
    assert processes.asked({"GCE_METADATA_IP": nobody}, on_tpu=True) == processes.SINGLE
    assert processes.asked({"TPU_WORKER_HOSTNAMES": "pod-0.svc", "TPU_WORKER_ID": "0"}, on_tpu=True) == (
        processes.SINGLE)
    two_slices = processes.asked({"TPU_WORKER_HOSTNAMES": "pod-0.svc,pod-1.svc", "MEGASCALE_NUM_SLICES": "2",
                                  "MEGASCALE_SLICE_ID": "1", "TPU_WORKER_ID": "1"}, on_tpu=True)
    assert (two_slices.how, two_slices.count, two_slices.index) == ("tpu", 4, 3)  # as JAX numbers it


def test_a_tpu_slice_waits_at_least_jaxs_own_join_bound_and_processes_started_by_hand_as_given() -> None:
    """JAX's initialization_timeout defaults to 300 s (jax/_src/distributed.py): a slice's workers reach the join
    minutes apart, so a shorter accelerator.join_timeout_s is raised there; Keras's variables take any bound."""
    slice_of_4 = processes.Processes("tpu", 4, 1)
    assert processes.join_bound(slice_of_4, 60) == 300 and processes.join_bound(slice_of_4, 1200) == 1200
    assert processes.join_bound(processes.Processes("keras", 2, 0, "127.0.0.1:1234"), 8) == 8
    assert AcceleratorSpec().join_timeout_s >= 300 and AcceleratorSpec().timeout_s == 60


def test_the_join_markers_name_who_began_and_leave_no_run_folder_behind(tmp_path: Path) -> None:
    from runner.rundir.joining import Roll

    run = tmp_path / "runs" / "job"
    first, second = Roll(str(run), 0, bound_s=5), Roll(str(run), 1, bound_s=5)
    first.mark()
    assert sorted(second.present()) == [0]
    # An earlier launch's marker, older than the bound (and the clocks' skew), counts for nothing.
    (run / "joining" / "process-1.json").write_text(json.dumps({"process": 1, "at": time.time() - 1000}))
    assert sorted(second.present()) == [0]
    second.mark()
    assert sorted(first.present()) == [0, 1]
    second.clear()
    assert sorted(first.present()) == [0]
    first.clear()  # the join failed: its own marker, and the run folder it made, are removed
    assert not run.exists()
    # A process that could not join leaves its marker, with why, for the others to read.
    first.mark(failed="the coordinator's port 1 is in use")
    first.clear()
    assert second.present()[0]["failed"] == "the coordinator's port 1 is in use"
    first.clear(everyone=True)  # every process joined
    assert not run.exists()


def test_tf_config_for_several_workers_is_refused_with_the_variables_that_replace_it() -> None:
    tf_config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}
    with pytest.raises(processes.SpecError, match="KERAS_DISTRIBUTION_JOB_ADDRESSES.*docs/multihost.md"):
        processes.asked({"TF_CONFIG": json.dumps(tf_config)})


def test_several_processes_choose_jax_and_refuse_tensorflow() -> None:
    env = {processes.ADDRESSES: "127.0.0.1:9", processes.COUNT: "2", processes.INDEX: "0"}
    assert backend.choose(AcceleratorSpec(kind="cpu"), dict(env)).name == "jax"
    with pytest.raises(processes.AcceleratorError, match="backend: jax"):
        backend.choose(AcceleratorSpec(kind="cpu", backend="tensorflow"), dict(env))


# --- real processes -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_and_four_processes_train_the_weights_one_process_trains(mnist_job, tiny_mnist, tmp_path: Path) -> None:
    train = one_shard_mnist(tiny_mnist, tmp_path / "one-shard")
    alone = job(mnist_job, tmp_path, "alone", train=train)
    one = subprocess.run([sys.executable, "-m", "runner", "run", str(alone), "--set", "accelerator.cpu_devices=2"],
                         capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    for count in (2, 4):
        together = job(mnist_job, tmp_path, f"together{count}", train=train)
        ended = finish(start(together, count), timeout=420)
        for code, _, err in ended:
            assert code == 0, err[-3000:]
        summaries = [last_json(out) for _, out, _ in ended]
        chief = summaries[0]
        assert chief["processes"]["count"] == count and chief["accelerator"]["workers"] == count
        assert chief["accelerator"]["replicas"] == count and chief["final_step"] == 2 * STEPS
        # One shard for several processes: each reads it in one order and keeps its every n-th record.
        assert chief["processes"]["data"]["data.train"]["by"] == "records"
        assert chief["metrics"]["examples"] == 512  # every eval record once, shared out between the processes
        assert all(s["metrics"] == chief["metrics"] for s in summaries)
        # Process 0's summary has every process's own figures; the others say where the job's model is.
        per = chief["processes"]["per_process"]
        assert [p["process"] for p in per] == list(range(count))
        assert all(p["examples_per_sec"] > 0 and p["input_wait_s"] is not None for p in per)
        assert chief["processes"]["slowest_input"] in range(count)
        assert f"process 1 of {count}: process 0 writes" in ended[1][2]
        run = tmp_path / "runs" / f"together{count}"
        assert sorted(p.name for p in (run / "attempts").iterdir()) == ["001.json"]  # written once, by process 0
        alone_weights = weights(tmp_path / "runs" / "alone" / "model.keras")
        for mine, theirs in zip(weights(run / "model.keras"), alone_weights, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-6)
        assert chief["metrics"]["loss"] == pytest.approx(last_json(one.stdout)["metrics"]["loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["one", "all"])
def test_sigterm_to_one_process_or_all_stops_both_at_one_step_and_the_rerun_ends_at_the_planned_step(
    mnist_job, tmp_path: Path, signalled: str
) -> None:
    spec = job(mnist_job, tmp_path, "preempted", epochs=400, steps_per_epoch=STEPS)
    started = start(spec, 2)
    wait_for_epoch(started[0], 2)
    for proc in started[1:] if signalled == "one" else started:  # a TPU preemption signals every host
        proc.send_signal(signal.SIGTERM)
    ended = finish(started)
    codes = [code for code, _, _ in ended]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], f"{codes}\n{ended[0][2][-2000:]}\n{ended[1][2][-2000:]}"
    saved = {int(re.search(r"saved step (\d+)", last_json(out)["error"]).group(1)) for _, out, _ in ended}
    assert len(saved) == 1, f"the processes stopped at different steps: {saved}"
    step = saved.pop()
    assert (tmp_path / "runs" / "preempted" / "checkpoints" / f"ckpt_{step}").is_dir()
    # Four shards for two processes: each reads its own two.
    assert last_json(ended[0][1])["processes"]["data"]["data.train"] == {
        "by": "files", "shards": 4, "shards_per_process": [2, 2]}

    if signalled == "all":
        return  # the rerun is the same as after one
    planned = (step // STEPS + 2) * STEPS
    again = finish(start(spec, 2, "--set", f"train.epochs={planned // STEPS}"))
    for code, out, err in again:
        assert code == 0, err[-3000:]
        summary = last_json(out)
        assert (summary["resumed_from_step"], summary["final_step"]) == (step, planned)


@pytest.mark.slow
def test_kill_9_of_one_process_ends_the_other_within_the_heartbeat_and_the_rerun_resumes(
    mnist_job, tmp_path: Path
) -> None:
    spec = job(mnist_job, tmp_path, "lost", epochs=400, steps_per_epoch=STEPS)
    started = start(spec, 2)
    wait_for_epoch(started[0], 3)
    killed_at = time.monotonic()
    started[1].kill()
    code, _, err = finish(started[:1], timeout=120)[0]
    took = time.monotonic() - killed_at
    # accelerator.heartbeat_s is 5: a collective that meets the gone process fails at once (exit 3, with the
    # summary); one blocked in a barrier is ended by JAX when the heartbeat runs out (SIGABRT, JAX's message).
    assert took < 5 + 30, f"the survivor took {took:.0f} s to stop"
    assert code in (EXIT_INFRA, -signal.SIGABRT, 128 + signal.SIGABRT), err[-3000:]
    assert "another process of the job stopped" in err or "another task died" in err, err[-3000:]
    checkpoints = tmp_path / "runs" / "lost" / "checkpoints"
    whole = sorted(int(p.name.split("_")[1]) for p in checkpoints.iterdir() if p.name.split("_")[1].isdigit())
    assert whole, "no whole checkpoint before the kill"
    if code == EXIT_INFRA:  # its closing line names what the rerun continues from (it said none was saved)
        assert f"kept in {checkpoints}, the newest whole one ckpt_{whole[-1]}: once" in err, err[-3000:]
        assert "no checkpoint was saved" not in err

    again = finish(start(spec, 2, "--set", f"train.epochs={whole[-1] // STEPS + 1}"))
    for code, out, err in again:
        assert code == 0, err[-3000:]
        summary = last_json(out)
        assert summary["resumed_from_step"] == whole[-1]
        assert summary["final_step"] == (whole[-1] // STEPS + 1) * STEPS


@pytest.mark.slow
def test_a_lease_held_by_another_run_ends_every_process_with_exit_2(mnist_job, tmp_path: Path) -> None:
    from runner.rundir.lease import Lease

    spec = job(mnist_job, tmp_path, "leased")
    run_dir = tmp_path / "runs" / "leased"
    run_dir.mkdir(parents=True)
    held = Lease.take(str(run_dir), "leased", timeout_s=20)
    try:
        ended = finish(start(spec, 2), timeout=180)
    finally:
        held.release()
    assert [code for code, _, _ in ended] == [2, 2], ended[1][2][-3000:]
    assert "lease.json" in ended[0][2] and "process 0 could not open the run folder" in ended[1][2]
    assert sorted(p.name for p in run_dir.iterdir()) == [], "a refused job wrote into the run folder"


@pytest.mark.slow
def test_two_processes_share_a_gs_run_folder(gcs, mnist_job, tmp_path: Path) -> None:
    bucket = gcs.bucket()
    spec = mnist_job(
        "shared-gcs",
        accelerator={"kind": "cpu", "backend": "jax", "timeout_s": 60, "heartbeat_s": 10},
        data={"global_batch_size": BATCH, "in_memory": False, "eval": None},
        model={"name": tiny_model(tmp_path)},
        train={"epochs": 1, "steps_per_epoch": STEPS, "allow_chance": True},
        output={"dir": f"gs://{bucket}/runs", "tensorboard": False},
    )
    port, started = free_port(), []
    for index in range(2):
        env = cli_env(**gcs.env, KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                      KERAS_DISTRIBUTION_NUM_PROCESSES="2", KERAS_DISTRIBUTION_PROCESS_ID=str(index))
        log = tmp_path / f"gcs-process{index}.log"
        with open(log, "w") as stderr:
            proc = zygote.popen(["run", str(spec)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
        proc.log = log
        started.append(proc)
    ended = finish(started)
    for code, _, err in ended:
        assert code == 0, err[-3000:]
    names = gcs.objects(bucket, "runs/shared-gcs/")
    assert f"runs/shared-gcs/checkpoints/ckpt_{STEPS}/commit_success.txt" in names  # whole: every process wrote
    assert "runs/shared-gcs/summary.json" in names and "runs/shared-gcs/model.keras" in names
    attempts = [n for n in names if n.startswith("runs/shared-gcs/attempts/") and n.endswith(".json")]
    assert attempts == ["runs/shared-gcs/attempts/001.json"]  # one summary, by process 0
    assert not [n for n in names if "/joining/" in n], "the join's markers were left in the bucket"


@pytest.mark.slow
def test_a_process_that_never_starts_ends_the_others_with_exit_3_within_the_timeout(mnist_job, tmp_path) -> None:
    """While it waits, process 0 names the process that has not begun to join (every tenth of a bound this
    short, every 30 s under the default), from the markers the processes write in the run folder; a bounded wait
    for a late host is no stall (train.stall_timeout, shorter here, does not end it)."""
    spec = job(mnist_job, tmp_path, "alone-of-two")
    began = time.monotonic()
    bounds = ["--set", "accelerator.join_timeout_s=14", "--set", "train.stall_timeout=10"]
    code, out, err = finish(start(spec, 2, *bounds, only=[0]), timeout=120)[0]
    assert code == EXIT_INFRA, err[-3000:]
    assert "not every process joined within accelerator.join_timeout_s (14 s)" in err
    assert "missing: process 1 never began to join" in err
    assert "process 0 of 2" in err and "KERAS_DISTRIBUTION_JOB_ADDRESSES" in err
    waiting = re.findall(r"joining: waiting for process 1 to begin joining \(1 of 2 ready\)", err)
    assert len(waiting) >= 3, err[-3000:]
    assert time.monotonic() - began < 14 + 60  # the timeout, plus the start-up of TensorFlow and JAX
    assert last_json(out)["status"] == "failed"
    assert not (tmp_path / "runs" / "alone-of-two").exists(), "a job that never formed wrote a run folder"
