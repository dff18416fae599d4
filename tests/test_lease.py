"""One run per run folder (runner/rundir/lease.py), with real concurrent processes, on a local folder and on the
GCS emulator (whose uploads and deletes honour `ifGenerationMatch` as GCS does: tests/support/gcs_servers.py).

The first tests race small processes that only take the lease (no TensorFlow: they start in a fraction of
a second, so many start together); the last ones race and block real `runner run` processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli
from tests.support.runs import finish, start_run

# A process that takes the lease of FOLDER, prints TOOK or HELD, then holds it for HOLD_S seconds (or until its
# lease is lost) and releases it. Gated, it first prints READY once imported and takes the lease only when a
# line comes on stdin (so that several take it together); a HOLD_S below 0 holds it until stdin closes.
TAKER = """
import json, logging, select, sys, time
from runner.rundir.lease import Lease, LeaseHeld
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
folder, hold_s, heartbeat_s, expiry_s = sys.argv[1], *map(float, sys.argv[2:5])
if sys.argv[5] == "gated":
    print("READY", flush=True)
    sys.stdin.readline()
try:
    lease = Lease.take(folder, "race", timeout_s=20, heartbeat_s=heartbeat_s, expiry_s=expiry_s)
except LeaseHeld as exc:
    print("HELD", exc, flush=True)
    sys.exit(2)
print("TOOK", json.dumps(lease.doc), flush=True)
deadline = time.monotonic() + hold_s
while (hold_s < 0 or time.monotonic() < deadline) and not lease.lost:
    if hold_s < 0 and select.select([sys.stdin], [], [], 0.05)[0]:
        break
    time.sleep(0 if hold_s < 0 else 0.05)
print("LOST" if lease.lost else "DONE", flush=True)
lease.release()
"""


def taker(folder: str, env: dict[str, str], hold_s: float = 0.0, heartbeat_s: float = 30.0, expiry_s: float = 120.0,
          gated: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", TAKER, folder, str(hold_s), str(heartbeat_s), str(expiry_s), "gated" if gated else "-"],
        stdin=subprocess.PIPE if gated else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, cwd=REPO,
    )


def ready(*takers: subprocess.Popen) -> None:
    """Waits until every gated taker is imported and waiting, then lets them all take the lease at once."""
    for process in takers:
        assert first_line(process) == "READY"
    for process in takers:
        process.stdin.write("go\n")
        process.stdin.flush()


def first_line(process: subprocess.Popen, timeout: float = 60) -> str:
    """The taker's verdict (TOOK ... or HELD ...), read as soon as it is printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line:
            return line.strip()
        if process.poll() is not None:
            raise AssertionError(f"taker exited ({process.returncode}) silently: {process.stderr.read()[-2000:]}")
    process.kill()
    raise AssertionError("taker said nothing in time")


@pytest.fixture(params=["local", "gcs"])
def place(request, tmp_path: Path):
    """(run folder, environment, read the lease or None, write a lease) on a local disk or in a bucket."""
    if request.param == "local":
        folder = tmp_path / "runs" / "race"
        folder.mkdir(parents=True)
        lease = folder / "lease.json"

        def read() -> dict | None:
            return json.loads(lease.read_text()) if lease.exists() else None

        def write(doc: dict) -> None:
            lease.write_text(json.dumps(doc))

        return str(folder), cli_env(), read, write
    gcs = request.getfixturevalue("gcs")
    bucket = gcs.bucket()

    def read_gcs() -> dict | None:
        names = gcs.objects(bucket, "runs/race/")
        return json.loads(gcs.read(bucket, "runs/race/lease.json")) if "runs/race/lease.json" in names else None

    def write_gcs(doc: dict) -> None:
        gcs.write(bucket, "runs/race/lease.json", json.dumps(doc).encode())

    return f"gs://{bucket}/runs/race", cli_env(**gcs.env), read_gcs, write_gcs


def test_of_six_processes_started_together_exactly_one_takes_the_lease(place) -> None:
    folder, env, read, _ = place
    racers = [taker(folder, env, hold_s=-1, gated=True) for _ in range(6)]  # the winner holds until told
    ready(*racers)
    verdicts = [first_line(racer) for racer in racers]
    winners = [v for v in verdicts if v.startswith("TOOK")]
    assert len(winners) == 1, verdicts
    owner = json.loads(winners[0].split(" ", 1)[1])
    assert read()["run_id"] == owner["run_id"]
    for verdict in verdicts:
        if verdict.startswith("HELD"):
            assert f"pid {owner['pid']}" in verdict and f"run id {owner['run_id']}" in verdict
            assert f"running since {owner['started_at']}" in verdict
            assert "Wait for that run to end, or, if it is dead, delete" in verdict and "lease.json" in verdict
    assert read()["run_id"] == owner["run_id"], "the winner holds its lease while the others are refused"
    codes = [finish(racer, timeout=30)[0] for racer in racers]  # closes stdin: the winner releases
    assert sorted(codes) == [0] + [2] * 5
    assert read() is None, "the winner released its lease"


def test_the_lease_of_a_killed_run_is_taken_over_and_logged(place) -> None:
    folder, env, read, _ = place
    holder = taker(folder, env, hold_s=600)
    assert first_line(holder).startswith("TOOK")
    held = read()
    holder.send_signal(signal.SIGKILL)
    finish(holder)
    assert read() == held, "a killed run leaves its lease behind"

    code, out, err = finish(taker(folder, env, hold_s=0))
    assert code == 0 and out.startswith("TOOK"), err
    assert f"taking over a stale lease (its process (pid {held['pid']} on this host) is gone)" in err
    assert f"run id {held['run_id']}" in err


def test_a_live_run_keeps_its_lease_however_long_it_was_silent(tmp_path: Path) -> None:
    """On the same host the holder's process decides: alive, its lease holds even past its expiry."""
    folder = str(tmp_path)
    holder = taker(folder, cli_env(), hold_s=600, heartbeat_s=600, expiry_s=0.5)
    try:
        assert first_line(holder).startswith("TOOK")
        time.sleep(1.5)
        code, out, _ = finish(taker(folder, cli_env()))
        assert code == 2 and out.startswith("HELD") and f"pid {holder.pid}" in out
    finally:
        holder.kill()
        finish(holder)


def test_a_lease_from_another_host_holds_until_its_expiry_then_is_taken_over(place) -> None:
    folder, env, _, write = place
    began = time.time() - 3600
    other = {
        "run_id": "f" * 32, "job": "race", "host": "tpu-vm-7", "boot_id": "elsewhere", "pid_namespace": None,
        "pid": 4242, "pid_start": "1", "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)),
        "started_unix": began, "heartbeat_s": 0.5, "expiry_s": 60,
    }
    first, second = taker(folder, env, gated=True), taker(folder, env, gated=True)
    assert first_line(first) == first_line(second) == "READY"  # both imported: each takes it as soon as told
    # Fresh for a minute (however busy the machine, the first taker asks well within it): refused at once,
    # not after waiting out its timeout_s (20 s).
    write(other)
    written = time.monotonic()
    first.stdin.write("go\n")
    first.stdin.flush()
    code, out, _ = finish(first)
    assert code == 2 and time.monotonic() - written < 15, out
    assert f"host tpu-vm-7, pid 4242, running since {other['started_at']} (60 min ago)" in out
    assert "lapses 60 s after its last renewal" in out
    # Written again with an expiry of 0.5 s, and not renewed: stale once that has passed (more may: never less).
    write({**other, "expiry_s": 0.5})
    time.sleep(1.0)
    second.stdin.write("go\n")
    second.stdin.flush()
    code, out, err = finish(second)
    assert code == 0 and out.split()[0] == "TOOK", err
    assert "taking over a stale lease (it was last renewed" in err and "past its expiry of 0.5 s" in err
    assert "host tpu-vm-7, pid 4242" in err


def test_the_holder_renews_its_lease_and_finds_out_when_another_run_took_it(place) -> None:
    folder, env, read, write = place
    holder = taker(folder, env, hold_s=30, heartbeat_s=0.3)
    assert first_line(holder).startswith("TOOK")
    mine = read()
    time.sleep(1.0)
    assert read()["run_id"] == mine["run_id"], "renewing keeps the lease the holder's"
    intruder = {**mine, "run_id": "e" * 32, "host": "another-vm", "pid": 1}
    write(intruder)  # as if the holder had been silent past its expiry and another run took over
    code, out, err = finish(holder, timeout=30)
    assert code == 0 and out.split()[-1] == "LOST", err
    assert "was taken over by another run" in err
    assert read() == intruder, "a run that lost its lease does not delete the new holder's"


def test_renewal_moves_a_gs_lease_to_a_new_generation(gcs) -> None:
    bucket = gcs.bucket()
    holder = taker(f"gs://{bucket}/runs/beat", cli_env(**gcs.env), hold_s=30, heartbeat_s=0.3)
    try:
        assert first_line(holder).startswith("TOOK")
        blob = gcs.client().bucket(bucket).get_blob("runs/beat/lease.json")
        renewed = blob
        deadline = time.monotonic() + 60  # a renewal every 0.3 s: a busy machine may delay it, never skip it
        while renewed.generation == blob.generation:
            assert time.monotonic() < deadline, "waiting for the lease's renewal: no new generation within 60 s"
            time.sleep(0.1)
            renewed = gcs.client().bucket(bucket).get_blob("runs/beat/lease.json")
        assert renewed.generation > blob.generation
        assert json.loads(renewed.download_as_bytes())["renewed_at"].endswith("Z")
    finally:
        holder.kill()
        finish(holder)


# --- real runs -------------------------------------------------------------------------------------


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a local run folder, byte for byte, but the lease."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "lease.json"
    }


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gcs"])
def test_two_runs_started_together_one_trains_and_the_other_exits_2_having_written_nothing(
    where, mnist_job, tmp_path: Path, request
) -> None:
    env, output = cli_env(), str(tmp_path / "runs")
    if where == "gcs":
        gcs = request.getfixturevalue("gcs")
        bucket = gcs.bucket()
        env, output = cli_env(**gcs.env), f"gs://{bucket}/runs"
    spec = mnist_job(
        "together", data={"eval": None, "global_batch_size": 32}, train={"epochs": 2, "steps_per_epoch": 16},
        output={"dir": output, "tensorboard": False},
    )
    runs = [start_run(spec, env=env), start_run(spec, env=env)]
    results = [finish(run, timeout=240) for run in runs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    (_, won, _), (_, lost, lost_err) = sorted(results, key=lambda r: r[0])
    winner = runs[[code for code, _, _ in results].index(0)]
    assert "is in use by another run of job 'together': host " in lost_err
    assert f"pid {winner.pid}, running since" in lost_err
    refused = last_json(lost)
    assert refused["status"] == "failed" and "in use by another run" in refused["error"]
    summary = last_json(won)
    assert summary["status"] == "succeeded" and summary["attempt"] == 1 and summary["final_step"] == 32

    if where == "local":
        run_dir = tmp_path / "runs" / "together"
        names = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
        stored = json.loads((run_dir / "summary.json").read_text())
    else:
        prefix = "runs/together/"
        names = [n[len(prefix):] for n in gcs.objects(bucket, prefix) if not n.endswith("/")]
        stored = json.loads(gcs.read(bucket, prefix + "summary.json"))
    assert stored == summary, "summary.json is the winner's"
    assert [n for n in names if n.startswith("attempts/")] == ["attempts/001.json"], (
        "the refused run recorded no attempt")
    assert "lease.json" not in names, "the winner released its lease"
    assert {n for n in names if n.startswith("checkpoints/ckpt-")} == {
        f"checkpoints/ckpt-{step}.{kind}" for step in (16, 32) for kind in ("index", "data-00000-of-00001")
    }


@pytest.mark.slow
def test_a_run_refused_by_a_live_lease_leaves_the_earlier_run_byte_for_byte_then_takes_over_once_it_dies(
    mnist_job, tmp_path: Path
) -> None:
    spec = mnist_job(
        "held", data={"eval": None, "global_batch_size": 32}, train={"epochs": 1, "steps_per_epoch": 16},
        output={"tensorboard": False},
    )
    run_dir = tmp_path / "runs" / "held"
    first = run_cli("run", spec)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(run_dir)
    assert {"model.keras", "summary.json", "checkpoints/ckpt-16.index"} <= set(before)

    holder = taker(str(run_dir), cli_env(), hold_s=600)
    try:
        assert first_line(holder).startswith("TOOK")
        refused = run_cli("run", spec, "--set", "train.epochs=2")
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"pid {holder.pid}, running since" in refused.stderr
        assert f"delete {run_dir}/lease.json and run again" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert snapshot(run_dir) == before, "a refused run writes nothing"
    finally:
        holder.send_signal(signal.SIGKILL)
        finish(holder)

    resumed = run_cli("run", spec, "--set", "train.epochs=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"taking over a stale lease (its process (pid {holder.pid} on this host) is gone)" in resumed.stderr
    summary = last_json(resumed.stdout)
    assert summary["resumed_from_step"] == 16 and summary["final_step"] == 32
    assert not (run_dir / "lease.json").exists()
