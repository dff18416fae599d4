"""`runner report`: real summaries (this schema and the older one) as a table, Markdown and a PNG plot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.compare import plot, report
from tests.conftest import REPO, cli_env, last_json, run_cli
from tests.support.cli import invoke

V1 = REPO / "tests" / "data" / "summary_v1.json"  # written by the runner at schema_version 1


@pytest.fixture(scope="module")
def real_run(tiny_mnist: Path, tmp_path_factory) -> tuple[dict, Path]:
    folder = tmp_path_factory.mktemp("report")
    spec = folder / "b256.yaml"
    spec.write_text(
        f"name: b256\naccelerator: {{kind: cpu}}\n"
        f"data: {{train: '{tiny_mnist}/train-*.tfrecord', eval: '{tiny_mnist}/test-*.tfrecord', "
        f"global_batch_size: 256, shuffle_buffer: 512}}\ntrain: {{epochs: 2, steps_per_epoch: 3}}\n"
        f"output: {{dir: '{folder / 'runs'}'}}\n"
    )
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr
    (folder / "b256.stdout").write_text(result.stdout)
    return last_json(result.stdout), folder


def test_a_schema_1_summary_is_read_and_what_it_lacks_stays_empty() -> None:
    doc = report.read_summary(str(V1))
    assert doc["schema_version"] == 2 and doc["read_from_schema_version"] == 1
    original = json.loads(V1.read_text())
    assert doc["timing"]["steady_epoch_s"] == original["timing"]["steady_epoch_s"]
    assert doc["timing"]["input_wait_s"] is None and "schema_version 1" in doc["timing"]["input_wait_method"]
    assert doc["timing"]["import_s"] is None, "a phase version 1 did not measure is not invented"
    row = report.to_row(str(V1), doc)
    assert (row.device, row.replicas, row.batch, row.schema_version) == ("cpu", 1, 128, 1)
    assert row.accuracy == original["metrics"]["accuracy"]


def test_runner_report_reads_a_schema_1_summary_and_a_misshapen_value_reads_as_unknown(tmp_path: Path) -> None:
    """A summary of schema_version 1 (which the writers' strict model refuses) tabulates as it always did; a value
    of another type (an accelerator as text, a rate as a string, an epoch record that is no object) shows as -."""
    odd = {**json.loads(V1.read_text()), "job": "odd", "accelerator": "cpu"}
    odd["timing"] = {**odd["timing"], "examples_per_sec": "fast"}
    odd["epochs"] = ["lost", *odd["epochs"]]
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    result = invoke("report", V1, tmp_path / "odd.json", "--markdown", env=cli_env())
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[2] == ("| mnist_v1 | cpu | 1 | 128 | 3 | - | - | 3.22 | 1.21 | 75.57 | 1,694 | - | 33% | 0.8262 | "
                        "0.7155 | 0.7155 | - | - | - | 11.0 | 1.00x |")
    assert lines[3] == ("| odd | - | - | 128 | 3 | - | - | 3.22 | 1.21 | 75.57 | - | - | 33% | 0.8262 | 0.7155 | "
                        "0.7155 | - | - | - | 11.0 | - |")
    assert "_read from schema_version 1 (no input wait recorded): mnist_v1, odd_" in lines


def test_unreadable_inputs_are_named_with_the_reason(tmp_path: Path) -> None:
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**json.loads(V1.read_text()), "schema_version": 9}))
    other = tmp_path / "other.json"
    other.write_text('{"loss": 1}')
    result = invoke("report", V1, newer, other, tmp_path / "missing", env=cli_env())
    assert result.returncode == 2
    assert f"{newer}: schema_version 9 cannot be read: this runner reads 1, 2; upgrade runner" in result.stderr
    assert f"{other}: not a runner summary" in result.stderr
    assert f"{tmp_path / 'missing'}: no such file" in result.stderr
    assert "mnist_v1" in result.stdout, "what can be read is still shown"


@pytest.mark.slow
@pytest.mark.xdist_group("report_real_run")  # the tests of the one real run share a worker, so it trains once
def test_report_tabulates_runs_with_speed_up_over_the_baseline(real_run, tmp_path: Path) -> None:
    summary, folder = real_run
    run_dir = folder / "runs" / "b256"
    result = invoke("report", V1, run_dir, folder / "b256.stdout", "--baseline", "mnist_v1", "--markdown",
                    env=cli_env())
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("| run | device | replicas | batch | epochs | learning rate | precision | "
                               "first epoch s | steady epoch s | step ms | examples/s | MFU |")
    v1_rate = json.loads(V1.read_text())["timing"]["examples_per_sec"]
    rate = summary["timing"]["examples_per_sec"]
    # Unlike runs, not a sweep: every difference from the baseline is marked and named.
    row = next(line for line in lines if line.startswith("| b256\\* "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:7] == ["cpu", "1", "256", "2", "0.001", summary["accelerator"]["precision"]["policy"]]
    # Seconds print with 2 decimals, 3 below one second.
    assert float(cells[8]) == pytest.approx(summary["timing"]["steady_epoch_s"], abs=0.005)
    assert len(cells[8].split(".")[1]) == (2 if summary["timing"]["steady_epoch_s"] >= 1 else 3)
    assert cells[10] == f"{rate:,.0f}"
    assert cells[12] == f"{summary['timing']['goodput']:.0%}"
    # What it learned: the last epoch's loss and the lowest (no validation split: val_loss -).
    losses = [e["loss"] for e in summary["epochs"]]
    assert cells[13:18] == [f"{summary['metrics']['accuracy']:.4f}", f"{losses[-1]:.4f}", f"{min(losses):.4f}",
                            "-", "-"]
    assert cells[19] == f"{summary['timing']['total_s']:.1f}"
    assert cells[20] == f"{round(rate / v1_rate, 2):.2f}x"
    assert "| mnist_v1 | cpu | 1 | 128 | 3 | - | - |" in result.stdout and "1.00x" in result.stdout
    assert "read from schema_version 1 (no input wait recorded): mnist_v1" in result.stdout
    assert "b256: data.global_batch_size 256 (baseline 128), train.epochs 2 (baseline 3)" in result.stdout
    # The saved stdout of `runner run` reads as the same run, its spec.json found in the run folder it names.
    assert sum(line.startswith("| b256\\* | cpu | 1 | 256 | 2 | 0.001 |") for line in lines) == 2

    plain = invoke("report", run_dir, V1, "--plot", tmp_path / "compare.png", env=cli_env())
    assert plain.returncode == 0, plain.stderr
    # The default baseline: the first row in the shared order (the smaller batch), whatever order was given.
    assert "mnist_v1" in plain.stdout.splitlines()[2] and "1.00x" in plain.stdout.splitlines()[2]
    png = (tmp_path / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    wrong = invoke("report", run_dir, "--baseline", "nope", env=cli_env())
    assert wrong.returncode == 2 and "--baseline 'nope' names no run; use a job name (b256)" in wrong.stderr


def test_runs_on_different_software_are_flagged_beside_the_speed_up() -> None:
    doc = report.read_summary(str(V1))

    def run(job: str, allocator: str) -> report.Row:
        accelerator = {**doc["accelerator"], "tensorflow": "2.21.0", "keras": "keras 3.15.1", "allocator": allocator}
        return report.to_row(job, {**doc, "job": job, "accelerator": accelerator})

    same = [run("a", "tcmalloc"), run("b", "tcmalloc"), report.to_row("v1", doc)]
    assert same[0].software == (("TensorFlow", "2.21.0"), ("Keras", "keras 3.15.1"), ("malloc", "tcmalloc"))
    assert same[2].software == (("TensorFlow", "2.21.0"), ("Keras", "keras 3.15.1")), "version 1 recorded no malloc"
    assert not any("differ in software" in line for line in report.notes(same, same[0])), "unknown is not different"
    mixed = [run("image", "tcmalloc"), run("laptop", "glibc")]
    assert report.notes(mixed, mixed[0])[-1] == (
        "the runs differ in software, which the speed-up includes: image: TensorFlow 2.21.0, keras 3.15.1, "
        "malloc tcmalloc; laptop: TensorFlow 2.21.0, keras 3.15.1, malloc glibc"
    )


def test_a_plot_needs_steady_timing(tmp_path: Path) -> None:
    row = report.to_row(
        "x", {**report.read_summary(str(V1)), "timing": {"steady_epoch_s": None, "examples_per_sec": None}})
    with pytest.raises(report.SummaryError, match="train 2 or more epochs"):
        plot.plot([row], str(tmp_path / "x.png"))


@pytest.mark.slow
@pytest.mark.xdist_group("report_real_run")
def test_report_reads_a_run_folder_in_a_bucket(real_run, gcs) -> None:
    summary, folder = real_run
    bucket = gcs.bucket()
    blob = gcs.client().bucket(bucket).blob("runs/b256/summary.json")
    blob.upload_from_string((folder / "runs" / "b256" / "summary.json").read_text())
    shutil.copy(V1, folder / "v1.json")
    result = invoke("report", f"gs://{bucket}/runs/b256", folder / "v1.json", env=cli_env(**gcs.env))
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("b256"))
    assert f"{summary['timing']['examples_per_sec']:,.0f}" in row
    missing = invoke("report", f"gs://{bucket}/runs/none", env=cli_env(**gcs.env))
    assert missing.returncode == 2 and f"gs://{bucket}/runs/none: no such file" in missing.stderr


# --- fitting the terminal, the plot's labels, and what reading needs -------------------------------------


def sweep_of(tmp_path: Path, batches=(256, 512, 1024)) -> list[Path]:
    """Summaries as a batch-size sweep writes them (one run folder each), from the real version-1 summary."""
    doc = json.loads(V1.read_text())
    folders = []
    for batch in batches:
        folder = tmp_path / f"mnist_cnn-global_batch_size-{batch}"
        folder.mkdir()
        run = {**doc, "job": folder.name, "global_batch_size": batch,
               "metrics": {**doc["metrics"], "accuracy": round(0.99 - batch / 1e5, 4)},
               "timing": {**doc["timing"], "examples_per_sec": doc["timing"]["examples_per_sec"] * batch / 256}}
        (folder / "summary.json").write_text(json.dumps(run))
        folders.append(folder)
    return folders


def test_the_table_fits_the_width_it_is_given_and_drops_no_column(tmp_path: Path) -> None:
    rows, _ = report.load_rows(map(str, sweep_of(tmp_path)))
    full = report.terminal(rows, rows[0], width=200)
    assert len(full.splitlines()[2].split()) == len(report.COLUMNS), "wide: one row per run, every column"
    assert "run names start with mnist_cnn-global_batch_size-" in full
    values = [report._cell(r, f) for r in rows for f, _ in report.COLUMNS[1:]]
    for width in (120, 80, 60, 40):
        text = report.terminal(rows, rows[0], width=width)
        longest = max(len(line) for line in text.splitlines())
        assert longest <= width, f"{longest} columns at width {width}:\n{text}"
        assert all(v in text for v in values), f"a value is missing at width {width}:\n{text}"
        assert all(title.split()[-1] in text for _, title in report.COLUMNS), text


def test_on_an_80_column_terminal_the_report_fits(tmp_path: Path) -> None:
    from tests.support.terminal import run_in_terminal, screen_lines

    env = cli_env()
    env.pop("COLUMNS", None)
    code, raw = run_in_terminal(["report", *map(str, sweep_of(tmp_path))], env=env, cwd=REPO, timeout=60, columns=80)
    lines = [line for line in screen_lines(raw) if line.strip()]
    assert code == 0, raw
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert any(line.split()[:4] == ["speed-up", "1.00x", "2.00x", "4.00x"] for line in lines), "\n".join(lines)
    (tmp_path / "piped").mkdir()
    # No terminal: nothing to fit, one row per run.
    piped = invoke("report", *sweep_of(tmp_path / "piped"), env=cli_env())
    assert piped.returncode == 0 and len(piped.stdout.splitlines()[2].split()) == len(report.COLUMNS), piped.stdout


def test_the_plot_names_its_runs_and_their_accuracy(tmp_path: Path) -> None:
    from PIL import Image

    rows, _ = report.load_rows(map(str, sweep_of(tmp_path)))
    png = tmp_path / "compare.png"
    assert plot.plot(rows, str(png)) == str(png)
    text = Image.open(png).text
    assert text["Title"] == "mnist_cnn-global_batch_size: epoch time and throughput by batch size"
    for row in rows:
        assert f"{row.job}: cpu x1, batch {row.batch}, accuracy {row.accuracy:.4f}" in text["Description"]


def child_without_matplotlib(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a Python where `import matplotlib` fails, as where the `plot` extra is not installed."""
    code = ("import sys; sys.modules['matplotlib'] = None; sys.argv = ['runner', *sys.argv[1:]]; "
            "from runner.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=cli_env(), cwd=REPO)


def test_without_matplotlib_a_plot_is_refused_with_what_to_install(mnist_job, tmp_path: Path) -> None:
    result = child_without_matplotlib("report", str(V1), "--plot", str(tmp_path / "x.png"))
    assert result.returncode == 2
    assert "--plot needs matplotlib, which is not installed here: pip install 'tpu-job-runner[plot]'" in result.stderr
    assert not (tmp_path / "x.png").exists()
    # A sweep refuses before any variant trains.
    spec = mnist_job("noplot")
    swept = child_without_matplotlib("sweep", str(spec), "--set", "data.global_batch_size=128,256", "--plot", "p.png")
    assert swept.returncode == 2 and "pip install 'tpu-job-runner[plot]'" in swept.stderr
    assert not (tmp_path / "runs").exists()


def test_report_loads_no_tensorflow() -> None:
    code = (
        "import sys; sys.argv = ['runner', 'report', sys.argv[1]]\n"
        "from runner.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('tensorflow loaded' if 'tensorflow' in sys.modules else 'no tensorflow')"
    )
    result = subprocess.run([sys.executable, "-c", code, str(V1)], capture_output=True, text=True, timeout=60,
                            env=cli_env(), cwd=REPO)
    assert result.stdout.splitlines()[-1] == "no tensorflow", result.stdout + result.stderr


# --- benchmarks/run_all.py: ratios against goals, and RESULTS.md's generated block ------------------


def load_run_all():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", REPO / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_all_judges_each_ratio_by_its_goal() -> None:
    run_all = load_run_all()
    assert run_all.verdict(1.04, "<= 1.05") == "met" and run_all.verdict(1.06, "<= 1.05") == "NOT met"
    assert run_all.verdict(0.97, ">= 0.97") == "met" and run_all.verdict(0.96, ">=0.97") == "NOT met"
    assert run_all.verdict(1.4, "none (measured)") == "no goal"
    assert "runner_vs_keras.py" in [p.name for p in run_all.scripts()]
    assert not [p for p in run_all.scripts() if p.name.startswith("_") or p.name == "run_all.py"]


def test_run_all_rewrites_only_its_block_and_keeps_rows_it_did_not_rerun(tmp_path: Path) -> None:
    run_all = load_run_all()
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## TFRecord notes\nhand-written, kept\n")
    old = {"benchmark": "gcs_read", "ratio": 0.9, "goal": ">= 0.8", "script": "gcs_read.py", "measured": "d1",
           "command": "c1"}
    run_all.write_results([old], {"gcs_read.py"}, results)
    results.write_text(results.read_text() + "\n## Checkpoint notes\nalso hand-written\n")
    new = {"benchmark": "runner_vs_keras", "ratio": 1.07, "goal": "<= 1.05", "detail": {"runner_wall_s": 70.1},
           "script": "runner_vs_keras.py", "measured": "d2", "command": "c2"}
    run_all.write_results([new], {"runner_vs_keras.py"}, results)
    text = results.read_text()
    assert text.startswith("# Results\n\n## TFRecord notes\nhand-written, kept\n")
    assert text.endswith("\n## Checkpoint notes\nalso hand-written\n")
    assert text.count(run_all.BEGIN) == 1 and text.count(run_all.END) == 1
    assert "| gcs_read |  | 0.900 | >= 0.8 | met |" in text, "a row not re-run is kept"
    assert "| runner_vs_keras |  | 1.070 | <= 1.05 | NOT met | runner_wall_s=70.1 | d2 | `c2` |" in text


def test_runs_fed_from_memory_and_streamed_are_flagged_beside_the_speed_up() -> None:
    doc = report.read_summary(str(V1))

    def run(job: str, mode: str | None) -> report.Row:
        fed = {"train_input": {"mode": mode, "why": "auto", "bytes": 1, "load_s": None}} if mode else {}
        return report.to_row(job, {**doc, "job": job, **fed})

    same = [run("a", "in_memory"), run("b", "in_memory"), run("v1", None)]
    assert same[2].train_input is None
    assert not any("fed training differently" in line for line in report.notes(same, same[0])), (
        "unknown is not different")
    mixed = [run("held", "in_memory"), run("streamed", "streamed")]
    assert report.notes(mixed, mixed[0])[-1] == (
        "the runs fed training differently (data.in_memory), which the speed-up includes: held: in memory; "
        "streamed: streamed"
    )


# --- which runs, with which settings: order, baseline, marks, MFU, attempts ---------------------------------


def _write_run(folder: Path, spec: dict | None = None, **changes) -> Path:
    """A run folder holding the real version-1 summary with `changes`, and `spec` as its spec.json."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({**json.loads(V1.read_text()), "job": folder.name, **changes}))
    if spec is not None:
        (folder / "spec.json").write_text(json.dumps({"name": folder.name, **spec, "pinned": {"x": 1}}))
    return folder


def test_report_and_sweep_share_the_order_and_the_baseline_whatever_the_order_given(tmp_path: Path) -> None:
    folders = sweep_of(tmp_path, batches=(1024, 256, 512))  # as a shell glob lists them: 1024 first
    rows, _ = report.load_rows(map(str, folders))
    assert [r.batch for r in rows] == [256, 512, 1024], "sorted by the swept key, numbers by value"
    assert report.swept_keys(rows) == ["data.global_batch_size"]
    assert [r.speedup for r in rows] == [1.0, 2.0, 4.0], "the baseline is the smallest batch"
    again, _ = report.load_rows(map(str, reversed(folders)))
    assert again == rows
    assert report.pick_baseline(rows, None) == rows[0]
    text = invoke("report", *folders, env=cli_env()).stdout
    assert "speed-up: examples/s over mnist_cnn-global_batch_size-256's" in text
    assert "rows sorted by data.global_batch_size" in text


def test_a_run_made_with_other_epochs_is_flagged_beside_the_others(tmp_path: Path) -> None:
    spec = {"kind": "train", "train": {"epochs": 3, "learning_rate": 0.001}, "data": {"global_batch_size": 256}}
    short = [_write_run(tmp_path / f"m-global_batch_size-{b}", {**spec, "data": {"global_batch_size": b}},
                        global_batch_size=b) for b in (256, 512)]
    long_spec = {**spec, "train": {"epochs": 12, "learning_rate": 0.001}, "data": {"global_batch_size": 1024}}
    epochs = [{**json.loads(V1.read_text())["epochs"][0], "epoch": n} for n in range(1, 13)]
    long = _write_run(tmp_path / "m-global_batch_size-1024", long_spec, global_batch_size=1024, train_epochs=12,
                      epochs=epochs)
    result = invoke("report", long, *short, "--markdown", env=cli_env())
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("| m-")]
    assert [line.split("|")[1].strip() for line in lines] == [
        "m-global_batch_size-256", "m-global_batch_size-512", "m-global_batch_size-1024\\*"]
    header = [c.strip() for c in result.stdout.splitlines()[0].strip("|").split("|")]
    assert header[4:7] == ["epochs", "learning rate", "precision"]
    assert [line.split("|")[5].strip() for line in lines] == ["3", "3", "12"]
    assert ("\\* made with other settings than the baseline m-global_batch_size-256, beyond "
            "data.global_batch_size: m-global_batch_size-1024: train.epochs 12 (baseline 3)") in result.stdout


def test_epochs_are_the_last_record_s_and_resumed_timing_is_said_to_be_the_last_attempt_s(tmp_path: Path) -> None:
    base = json.loads(V1.read_text())["epochs"][0]
    records = [{**base, "epoch": 1, "attempt": 1}, {**base, "epoch": 2, "attempt": 1, "partial": True},
               {**base, "epoch": 2, "attempt": 2}, {**base, "epoch": 3, "attempt": 2}]
    run = _write_run(tmp_path / "resumed", epochs=records, attempt=2)
    (row,), _ = report.load_rows([str(run)])
    assert row.epochs == 3, "four records, three epochs: a partial epoch and its finish are one"
    assert row.attempts == (1, 2)
    assert ("resumed runs: their timing columns cover the last attempt only: resumed (epochs trained in attempts "
            "1, 2; timing of attempt 2)") in report.notes([row], row)


def test_mfu_is_shown_where_the_summary_has_it_and_explained_where_it_is_null(tmp_path: Path) -> None:
    block = {"model_flops_per_example": 3.5e6, "flops_method": "tf_profiler: forward x3", "tflops_per_device": 0.02,
             "peak_tflops_per_device": 0.39, "peak_source": "measured", "mfu": 0.0513, "why_null": None}
    counted = _write_run(tmp_path / "counted", throughput=block)
    uncounted = _write_run(tmp_path / "uncounted", throughput={**block, "peak_tflops_per_device": None, "mfu": None,
                                                               "why_null": "no peak known for this device"})
    older = _write_run(tmp_path / "older")
    rows, _ = report.load_rows(map(str, (counted, uncounted, older)))
    assert {r.job: report._cell(r, "mfu") for r in rows} == {"counted": "5.1%", "uncounted": "-", "older": "-"}
    assert "MFU (model FLOPs utilisation, the summary's throughput block) is - where: uncounted: no peak known for " \
        "this device" in report.notes(rows, rows[0])
    png = tmp_path / "p.png"
    plot.plot(rows, str(png))
    from PIL import Image

    assert "counted: cpu x1, batch 128, accuracy 0.8262, 1,694 examples/s, MFU 5.1%, 3 epochs" in \
        Image.open(png).text["Description"]


def test_the_learning_rate_is_the_one_training_used(tmp_path: Path) -> None:
    def rate(train: dict) -> str | None:
        folder = _write_run(tmp_path / f"r{len(list(tmp_path.iterdir()))}", {"kind": "train", "train": train})
        return report.load_rows([str(folder)])[0][0].learning_rate

    assert rate({"learning_rate": 0.01, "optimizer": "adam"}) == "0.01"
    assert rate({"learning_rate": 0.001, "optimizer": {"class_name": "AdamW", "config": {"learning_rate": 0.003}}}) \
        == "0.003"
    assert rate({"learning_rate": 0.001, "schedule": {"class_name": "CosineDecay", "config": {}}}) == "CosineDecay"
    assert report.to_row("x", json.loads(V1.read_text())).learning_rate is None, "no spec.json: not known"


def test_a_setting_given_as_a_name_a_config_or_unset_is_a_difference(mnist_job, tmp_path: Path) -> None:
    """adam beside AdamW's config, no class weights beside a map: the two runs hold no sub-key in common, and
    each difference is still named, whole and readable."""
    from runner.spec.load import load_spec

    path = mnist_job("a")
    plain = load_spec(path, []).to_dict()
    tuned = load_spec(path, ["train.optimizer={class_name: AdamW, config: {weight_decay: 0.004}}",
                             "train.class_weight={0: 1.0, 1: 3.0}"]).to_dict()
    a, b = _write_run(tmp_path / "a", {**plain, "name": "a"}), _write_run(tmp_path / "b", {**tuned, "name": "b"})
    result = invoke("report", b, a, "--baseline", "a", env=cli_env())
    assert result.returncode == 0, result.stderr
    note = " ".join(result.stdout.split())
    assert ("b: train.optimizer AdamW(weight_decay=0.004) (baseline adam), train.class_weight {0: 1.0, 1: 3.0} "
            "(baseline unset)") in note, result.stdout
    assert [line.split()[0] for line in result.stdout.splitlines()[2:4]] == ["a", "b*"]


def test_report_compares_what_the_runs_learned_and_names_the_optimizer_each_used(tmp_path: Path) -> None:
    """adam beside AdamW: the optimizer is a column of its own, readable, beside the last and best loss and
    val_loss of each run; the plot draws each run's loss curves."""
    base = json.loads(V1.read_text())["epochs"][0]

    def run(name: str, optimizer, losses: list[float], val_losses: list[float]) -> Path:
        epochs = [{**base, "epoch": n + 1, "loss": loss, "metrics": {"accuracy": 0.5, "val_loss": val}}
                  for n, (loss, val) in enumerate(zip(losses, val_losses, strict=True))]
        spec = {"kind": "train", "train": {"epochs": 3, "learning_rate": 0.001, "optimizer": optimizer}}
        return _write_run(tmp_path / name, spec, epochs=epochs, train_epochs=3)

    adam = run("adam", "adam", [0.9, 0.5, 0.4], [0.8, 0.6, 0.7])
    adamw = run("adamw", {"class_name": "AdamW", "config": {"weight_decay": 0.004}}, [0.8, 0.3, 0.2],
                [0.7, 0.5, 0.45])
    result = invoke("report", adam, adamw, "--markdown", "--plot", tmp_path / "p.png", env=cli_env())
    assert result.returncode == 0, result.stderr
    header = [c.strip() for c in result.stdout.splitlines()[0].strip("|").split("|")]
    assert header[7] == "train.optimizer", header
    rows = {line.split("|")[1].strip().rstrip("\\*"): [c.strip() for c in line.strip("|").split("|")]
            for line in result.stdout.splitlines() if line.startswith(("| adam", "| adamw"))}
    learned = [header.index(t) for t in ("train.optimizer", "loss", "best loss", "val_loss", "best val_loss")]
    assert [rows["adam"][i] for i in learned] == ["adam", "0.4000", "0.4000", "0.7000", "0.6000"]
    assert [rows["adamw"][i] for i in learned] == ["AdamW(weight_decay=0.004)", "0.2000", "0.2000", "0.4500",
                                                    "0.4500"]
    from PIL import Image

    description = Image.open(tmp_path / "p.png").text["Description"]
    assert "adamw" in description and "loss 0.2000, val_loss 0.4500" in description
