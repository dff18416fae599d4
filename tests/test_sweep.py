"""`runner sweep`: one spec, several settings, each a separate resumable run; then the comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner import SpecError
from runner.compare.sweep import finished_summary, plan_variants, split_values
from tests.conftest import REPO, cli_env, run_cli
from tests.support.cli import invoke


def test_values_split_at_top_level_commas_only() -> None:
    assert split_values("256,512, 1024") == ["256", "512", "1024"]
    assert split_values("[a,b],[c]") == ["[a,b]", "[c]"]
    assert split_values("'x,y',z") == ["'x,y'", "z"]


def test_every_combination_becomes_a_named_variant(mnist_job) -> None:
    spec = mnist_job("base")
    variants = plan_variants(
        spec, ["data.global_batch_size=128,256", "accelerator.cpu_devices=1,2", "train.epochs=1"]
    )
    # The swept values, then each single value that changes the spec (the spec file trains 2 epochs).
    assert [v.name for v in variants] == [
        "base-global_batch_size-128-cpu_devices-1-epochs-1",
        "base-global_batch_size-128-cpu_devices-2-epochs-1",
        "base-global_batch_size-256-cpu_devices-1-epochs-1",
        "base-global_batch_size-256-cpu_devices-2-epochs-1",
    ]
    assert [(v.spec.data.global_batch_size, v.spec.accelerator.cpu_devices) for v in variants] == [
        (128, 1), (128, 2), (256, 1), (256, 2)
    ]
    assert all(v.spec.train.epochs == 1 for v in variants), "a single value applies to every variant"
    assert variants[0].spec.run_dir.endswith("/runs/base-global_batch_size-128-cpu_devices-1-epochs-1")


def test_a_set_that_changes_the_spec_names_new_run_folders(mnist_job) -> None:
    spec = mnist_job("base")
    swept = "data.global_batch_size=128,256"
    plain = [v.name for v in plan_variants(spec, [swept])]
    assert plain == ["base-global_batch_size-128", "base-global_batch_size-256"]
    # What the spec file already says, the name and where runs go change no setting: the same folders.
    assert [v.name for v in plan_variants(spec, [swept, "train.epochs=2"])] == plain
    assert [v.name for v in plan_variants(spec, [swept, "name=other"])] == [
        "other-global_batch_size-128", "other-global_batch_size-256"]
    # Another learning rate: other folders, never the ones trained at 0.001.
    assert [v.name for v in plan_variants(spec, [swept, "train.learning_rate=0.01"])] == [
        "base-global_batch_size-128-learning_rate-0.01", "base-global_batch_size-256-learning_rate-0.01"]
    long = plan_variants(spec, [swept, "name=" + "n" * 120])
    assert all(len(v.name) == 128 for v in long) and len({v.name for v in long}) == 2, "cut, and told apart"


def test_a_bad_variant_is_refused_before_anything_runs(mnist_job) -> None:
    spec = mnist_job("base")
    with pytest.raises(SpecError, match=r"variant base-global_batch_size-0: .*data.global_batch_size"):
        plan_variants(spec, ["data.global_batch_size=128,0"])
    with pytest.raises(SpecError, match="needs a --set with several values"):
        plan_variants(spec, ["data.global_batch_size=128"])
    result = invoke("sweep", spec, "--set", "data.global_batch_sise=128,256", env=cli_env())  # refused before it runs
    assert result.returncode == 2
    assert "did you mean 'global_batch_size'?" in result.stderr
    assert not (spec.parent / "runs").exists()


@pytest.mark.slow
def test_a_sweep_runs_each_variant_once_and_compares_them(mnist_job, tmp_path: Path) -> None:
    # Two epochs (the plot needs a steady one) of 3 steps: the sweep's bookkeeping is checked, not training.
    spec = mnist_job("sw", train={"steps_per_epoch": 3})
    args = ("sweep", spec, "--set", "data.global_batch_size=128,256", "--markdown", "--plot", tmp_path / "sweep.png")
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    runs = {n: tmp_path / "runs" / f"sw-global_batch_size-{n}" for n in (128, 256)}
    summaries = {n: json.loads((d / "summary.json").read_text()) for n, d in runs.items()}
    assert {n: s["global_batch_size"] for n, s in summaries.items()} == {128: 128, 256: 256}
    assert all(s["status"] == "succeeded" and s["attempt"] == 1 for s in summaries.values())
    rows = [line for line in result.stdout.splitlines() if line.startswith("| sw-")]
    assert [r.split("|")[1].strip() for r in rows] == ["sw-global_batch_size-128", "sw-global_batch_size-256"]
    speedup = round(summaries[256]["timing"]["examples_per_sec"] / summaries[128]["timing"]["examples_per_sec"], 2)
    assert rows[1].rstrip(" |").endswith(f"{speedup:.2f}x")
    header = [c.strip() for c in result.stdout.splitlines()[0].strip("|").split("|")]
    cells = dict(zip(header, (c.strip() for c in rows[1].strip("|").split("|")), strict=True))
    mfu = (summaries[256].get("throughput") or {}).get("mfu")
    assert (cells["epochs"], cells["learning rate"]) == ("2", "0.001")
    assert cells["MFU"] == ("-" if mfu is None else f"{mfu:.1%}")
    assert cells["precision"] == summaries[256]["accelerator"]["precision"]["policy"]
    assert cells["total s"] == f"{summaries[256]['timing']['total_s']:.1f}"
    assert "sorted by data.global_batch_size" in result.stdout and "\\*" not in result.stdout, "nothing flagged"
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    # `runner report` on the folders, in the shell's order, shows the same rows and baseline.
    reported = invoke("report", runs[256], runs[128], "--markdown", env=cli_env())
    assert [r for r in reported.stdout.splitlines() if r.startswith("| sw-")] == rows

    began = time.monotonic()
    again = run_cli(*args)
    elapsed = time.monotonic() - began
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already complete") == 2 and again.stderr.count("skipped") == 2, again.stderr
    assert "accelerator:" not in again.stderr, "no variant process started (each would load TensorFlow)"
    assert elapsed < 20, f"re-running a finished sweep took {elapsed:.1f} s"
    assert [json.loads((d / "summary.json").read_text()) for d in runs.values()] == list(summaries.values())
    assert [r for r in again.stdout.splitlines() if r.startswith("| sw-")] == rows

    # Finished means finished for this very spec.
    same = plan_variants(spec, ["data.global_batch_size=128,256"])
    assert [finished_summary(v) for v in same] == list(summaries.values())
    changed = plan_variants(spec, ["data.global_batch_size=128,256", "train.learning_rate=0.01"])
    assert [finished_summary(v) for v in changed] == [None, None]
    assert not any(Path(v.spec.run_dir).exists() for v in changed), "another learning rate: new run folders"


@pytest.mark.slow
def test_runs_made_with_other_settings_are_marked_and_the_suggested_name_works(mnist_job, tmp_path: Path) -> None:
    """The spec file edited after a finished sweep: same names, other settings. The sweep never passes those
    runs off as the asked ones, and the one suggestion it prints works when followed."""
    spec = mnist_job("ed", train={"epochs": 1, "steps_per_epoch": 3})
    sweep = ("sweep", spec, "--set", "data.global_batch_size=128,256", "--markdown")
    first = run_cli(*sweep)
    assert first.returncode == 0, first.stderr
    spec.write_text(spec.read_text().replace("steps_per_epoch: 3", "steps_per_epoch: 4"))

    again = run_cli(*sweep)
    assert again.returncode == 2, again.stderr
    rows = [line for line in again.stdout.splitlines() if line.startswith("| ed-")]
    assert [r.split("|")[1].strip() for r in rows] == ["ed-global_batch_size-128!", "ed-global_batch_size-256!"]
    assert "train.steps_per_epoch 3 (asked 4)" in again.stdout
    advice = "add `--set name=ed-2` to the command"
    assert advice in again.stderr, again.stderr
    assert "run the same sweep again" not in again.stderr, "running it again would fail the same way"

    followed = run_cli(*sweep, "--set", "name=ed-2")
    assert followed.returncode == 0, followed.stderr
    rows = [line for line in followed.stdout.splitlines() if line.startswith("| ed-2-")]
    assert [r.split("|")[1].strip() for r in rows] == ["ed-2-global_batch_size-128", "ed-2-global_batch_size-256"]
    summary = json.loads((tmp_path / "runs" / "ed-2-global_batch_size-128" / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps_per_epoch"] == 4
    assert "--set name=" not in followed.stderr


@pytest.mark.slow
def test_a_failed_variant_is_named_and_fixing_it_reuses_the_finished_ones(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("fx", train={"epochs": 1})
    failed = run_cli("sweep", spec, "--set", "data.global_batch_size=128,4096")  # 2,048 records: no 4,096 batch
    assert failed.returncode == 2, failed.stderr
    assert "make no full batch of data.global_batch_size (4096)" in failed.stderr
    assert ("sweep: 1 of 2 variants succeeded; fx-global_batch_size-4096 exited 2: fix what its error above says "
            "(in the spec, the data or the values swept), then run the sweep again") in failed.stderr
    assert "cannot read" not in failed.stderr, "a variant that wrote nothing is left out of the table"
    assert [line.split()[0] for line in failed.stdout.splitlines()[2:]][:1] == ["fx-global_batch_size-128"]

    fixed = run_cli("sweep", spec, "--set", "data.global_batch_size=128,256")
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stderr.count("already complete") == 1, "the finished variant is not trained again"
    assert json.loads((tmp_path / "runs" / "fx-global_batch_size-256" / "summary.json").read_text())["status"] == (
        "succeeded")


@pytest.mark.slow
def test_a_preemption_notice_reaches_the_running_variant_and_stops_the_sweep(mnist_job, tmp_path: Path) -> None:
    # Short epochs at small batches, so that continuing is quick (a step costs in proportion to its batch).
    spec = mnist_job("pre", train={"epochs": 40, "steps_per_epoch": 2})
    sweep = subprocess.Popen(
        [sys.executable, "-m", "runner", "sweep", str(spec), "--set", "data.global_batch_size=16,32"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO,
        start_new_session=True,  # its own process group: a failed test stops the sweep and its variant together
    )
    try:
        deadline = time.monotonic() + 120
        for line in sweep.stderr:
            if "epoch 1/40" in line or time.monotonic() > deadline:
                break
        sweep.send_signal(signal.SIGTERM)
        _, stderr = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    assert sweep.returncode == 75, stderr
    first = json.loads((tmp_path / "runs" / "pre-global_batch_size-16" / "summary.json").read_text())
    assert first["status"] == "preempted" and "run the same job again" in first["error"]
    assert list((tmp_path / "runs" / "pre-global_batch_size-16" / "checkpoints").glob("ckpt-*.index"))
    assert not (tmp_path / "runs" / "pre-global_batch_size-32").exists(), "no variant starts after the notice"
    assert "stopped by a preemption notice: run the same sweep again to continue" in stderr

    # Following it: the stopped variant resumes, the other runs; the table says whose timing is one attempt's.
    again = run_cli("sweep", spec, "--set", "data.global_batch_size=16,32")
    assert again.returncode == 0, again.stderr
    resumed = json.loads((tmp_path / "runs" / "pre-global_batch_size-16" / "summary.json").read_text())
    assert (resumed["status"], resumed["attempt"], resumed["epochs"][-1]["epoch"]) == ("succeeded", 2, 40)
    assert "resumed runs: their timing columns cover the last attempt only: pre-global_batch_size-16" in again.stdout
    assert "run the same sweep again" not in again.stderr and "--set name=" not in again.stderr, "nothing to do"


def test_finished_variants_in_a_bucket_are_skipped_without_tensorflow(mnist_job, gcs, tmp_path: Path) -> None:
    """The completeness check reads gs:// summaries with google-cloud-storage: the sweep starts no run."""
    bucket = gcs.bucket()
    spec = mnist_job("gsw", output={"dir": f"gs://{bucket}/runs"}, train={"epochs": 1})
    sets = ["data.global_batch_size=128,256"]
    base = json.loads((REPO / "tests" / "data" / "summary_v1.json").read_text())
    for variant in plan_variants(spec, sets):
        prefix = f"runs/{variant.name}"
        gcs.write(bucket, f"{prefix}/spec.json", json.dumps(variant.spec.to_dict()).encode())
        summary = {**base, "job": variant.name, "status": "succeeded", "train_epochs": 1,
                   "global_batch_size": variant.spec.data.global_batch_size}
        gcs.write(bucket, f"{prefix}/summary.json", json.dumps(summary).encode())
    began = time.monotonic()
    result = run_cli("sweep", spec, "--set", sets[0], env=cli_env(**gcs.env))
    elapsed = time.monotonic() - began
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("already complete") == 2 and "accelerator:" not in result.stderr, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[2:4]] == ["128", "256"], result.stdout
    assert elapsed < 20, f"{elapsed:.1f} s"


def test_the_sweep_and_its_completeness_check_load_no_tensorflow(mnist_job) -> None:
    spec = mnist_job("notf")
    code = (
        "import sys\n"
        "from runner.compare.sweep import finished_summary, plan_variants\n"
        f"variants = plan_variants({str(spec)!r}, ['data.global_batch_size=128,256'])\n"
        "assert [finished_summary(v) for v in variants] == [None, None]\n"
        "print('tensorflow loaded' if 'tensorflow' in sys.modules else 'no tensorflow')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env(),
                            cwd=REPO)
    assert result.stdout.strip().splitlines()[-1:] == ["no tensorflow"], result.stdout + result.stderr


def test_a_run_made_with_a_named_optimizer_is_not_passed_off_as_a_configured_one(mnist_job) -> None:
    """A run folder finished with `adam`, a sweep asking for AdamW's config and class weights: every difference
    is named whole (the two specs hold no sub-key of train.optimizer in common)."""
    from runner.compare.sweep import not_as_asked

    spec = mnist_job("opt")
    adam, adamw = plan_variants(spec, ["train.optimizer=adam,{class_name: AdamW, config: {weight_decay: 0.004}}",
                                       "train.class_weight={0: 1.0, 1: 3.0}"])
    folder = Path(adamw.spec.run_dir)
    folder.mkdir(parents=True)
    made = {**adamw.spec.to_dict(), "train": {**adamw.spec.to_dict()["train"], "optimizer": "adam",
                                              "class_weight": None}}
    (folder / "spec.json").write_text(json.dumps(made))
    assert not_as_asked(adamw) == ["train.optimizer adam (asked AdamW(weight_decay=0.004))",
                                   "train.class_weight unset (asked {0: 1.0, 1: 3.0})"]
    assert adam.name.endswith("-optimizer-adam-class_weight-0_1.0_1_3.0")
