"""A KerasHub causal LM fine-tuned as a job (`model.hub`, docs/language-models.md), for real on this CPU under
JAX: a tiny Gemma preset made offline (tests/support/hub_preset.py), prompt/response JSONL prepared with its
tokenizer read from the GCS emulator, LoRA training whose loss falls, evaluation with perplexity, generation."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner import SpecError
from runner.spec.load import load_spec
from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support import hub_preset
from tests.support.cli import invoke

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory) -> Path:
    """The tiny preset folder, made in a child process (Keras and KerasHub stay out of the test worker)."""
    folder = tmp_path_factory.mktemp("hub") / "tiny_gemma"
    result = subprocess.run([sys.executable, "-m", "tests.support.hub_preset", str(folder)], cwd=REPO,
                            env=cli_env(KERAS_BACKEND="jax"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def _upload_tree(gcs, folder: Path, bucket: str, prefix: str) -> str:
    client = gcs.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.bucket(bucket).blob(f"{prefix}/{path.relative_to(folder)}").upload_from_filename(str(path))
    return f"gs://{bucket}/{prefix}"


def test_a_lora_fine_tune_of_a_hub_preset_learns_reports_perplexity_and_generates(tiny_preset, gcs, tmp_path):
    bucket = gcs.bucket()
    remote = _upload_tree(gcs, tiny_preset, bucket, "presets/tiny_gemma")
    chats = hub_preset.write_chats(tmp_path / "chats.jsonl")
    env = cli_env(**gcs.env, KERAS_HOME=str(tmp_path / "keras_home"))
    length = hub_preset.SEQUENCE_LENGTH

    # The tokenizer read from gs:// (KerasHub copies the preset's files through TensorFlow's gfile).
    prepared = run_cli("prepare", "text", chats, "--preset", remote, "--sequence-length", length,
                       "--out", tmp_path / "data", env=env)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    said = manifest["preprocessing"]
    assert said["preset"] == remote and said["tokenizer"] == "GemmaTokenizer" and said["vocabulary_size"] == 512
    assert said["sequence_length"] == length and said["truncated"] == 0 and said["layout"].startswith("padded")
    assert manifest["inputs"] == ["token_ids", "padding_mask"] and manifest["label"] == "target_ids"
    assert {s: v["records"] for s, v in manifest["splits"].items()} == {"train": 77, "validation": 9, "test": 10}
    # Read afresh from the bucket, not from KerasHub's cache under KERAS_HOME (which never reads a gs:// preset
    # again once copied: a preset written anew would be the old one).
    assert not (tmp_path / "keras_home" / "models").exists()

    spec = write_spec(tmp_path, {
        "name": "tiny_lm",
        "model": {"hub": str(tiny_preset), "lora_rank": 4},
        "accelerator": {"backend": "jax"},
        "data": {"train": str(tmp_path / "data" / "train-*.tfrecord"), "global_batch_size": 8},
        "train": {"epochs": 3, "learning_rate": 0.01},
        "output": {"dir": str(tmp_path / "runs")},
    })
    ran = run_cli("run", spec, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = last_json(ran.stdout)
    losses = [epoch["loss"] for epoch in summary["epochs"]]
    assert losses[-1] < losses[0] - 0.5, losses  # 5.8 -> 3.8 here, in bfloat16 or float32
    metrics = summary["metrics"]
    assert set(metrics) >= {"loss", "perplexity", "token_accuracy"}
    # Perplexity is exp of the mean token loss over every weighted token of the test split; the loss is the mean
    # of its two batches' means: within a few hundredths of each other here.
    assert abs(math.log(metrics["perplexity"]) - metrics["loss"]) < 0.15, metrics
    assert metrics["perplexity"] < 512 / 4, "no better than a quarter of guessing among 512 tokens"
    throughput = summary["throughput"]
    assert throughput["tokens_per_example"] == length
    assert throughput["tokens_per_sec"] == pytest.approx(summary["timing"]["examples_per_sec"] * length, rel=1e-3)
    assert throughput["flops_method"].startswith("palm: 6N + 12LHQT")
    base = json.loads((tiny_preset / "metadata.json").read_text())["parameter_count"]
    attention = 12 * 2 * (8 * 32) * length  # L 2, H 8 heads of Q 32, T tokens
    # LoRA: the frozen weights' own gradients are not done, so between 4N and 6N (+ attention) a token.
    assert 4 * base + attention < throughput["model_flops_per_token"] < 6 * base + attention
    assert throughput["model_flops_per_example"] == pytest.approx(throughput["model_flops_per_token"] * length,
                                                                  rel=1e-3)

    evaluated = run_cli("evaluate", spec, env=env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    again = last_json(evaluated.stdout)["metrics"]
    assert again["perplexity"] == pytest.approx(metrics["perplexity"], rel=0.02)  # float32 here, the job's own
    assert again["token_accuracy"] == pytest.approx(metrics["token_accuracy"], abs=0.03)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{hub_preset.prompt('cat')}\n{hub_preset.prompt('fish')}\n")
    predicted = run_cli("predict", spec, "--input", prompts, "--max-length", length, env=env)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    lines = [json.loads(line) for line in predicted.stdout.splitlines() if line.startswith("{")]
    assert [line["prompt"] for line in lines] == [hub_preset.prompt("cat"), hub_preset.prompt("fish")]
    for line in lines:
        assert line["generated"].startswith(line["prompt"]) and line["response"], line
    assert "greedy sampler" in predicted.stderr

    # Records of another tokenizer (another vocabulary) would train on ids that mean nothing: refused, both named.
    manifest["preprocessing"]["vocabulary_size"] = 32000
    (tmp_path / "data" / "manifest.json").write_text(json.dumps(manifest))
    refused = run_cli("evaluate", spec, env=env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "a vocabulary of 32000" in refused.stderr and "backbone has 512" in refused.stderr, refused.stderr[-2000:]
    checked = invoke("validate", spec, env=env)  # and before launch, without TensorFlow: the preset's config.json
    assert checked.returncode == 2 and "a vocabulary of 32000" in checked.stderr, checked.stderr[-2000:]
    assert "backbone has 512" in checked.stderr


def _spec(tmp_path: Path, model: dict, **sections) -> Path:
    return write_spec(tmp_path, {"name": "lm", "model": model, **sections})


def test_submit_reads_a_gs_preset_to_estimate_it_and_check_its_layout(tiny_preset, gcs, monkeypatch, capsys):
    """What docs/language-models.md recommends for a TPU VM, a preset folder on gs://, is read by submit's preflight
    (its config.json, metadata.json and preprocessor.json): estimated from its own parameter count, and a layout
    its heads cannot take refused naming the bucket's file, before anything is created."""
    from runner.cli.cloud import _memory_per_chip

    remote = _upload_tree(gcs, tiny_preset, gcs.bucket(), "presets/tiny_gemma")
    for key, value in gcs.env.items():
        monkeypatch.setenv(key, value)
    job = str(REPO / "jobs" / "gemma3_1b_lora.yaml")
    given = ["output.dir=gs://b/runs", "data.train=gs://b/chats/train-*.tfrecord", f"model.hub={remote}",
             "model.sharding=hub"]
    _memory_per_chip(job, [*given, "accelerator.mesh={batch: 2, model: 4}"], "v6e-8", read_bucket=True)
    said = capsys.readouterr().err
    count = json.loads((tiny_preset / "metadata.json").read_text())["parameter_count"]
    assert f"{count:,} parameters ({remote}/metadata.json)" in said, said
    with pytest.raises(SpecError, match=rf"{remote}/config.json has num_key_value_heads 4, which mesh axis 'model'"):
        _memory_per_chip(job, [*given, "accelerator.mesh={batch: 1, model: 8}"], "v6e-8", read_bucket=True)
    _memory_per_chip(job, [*given, "accelerator.mesh={batch: 1, model: 8}"], "v6e-8")  # a dry run reads no bucket
    assert "not estimated: the preset" in capsys.readouterr().err


def test_a_hub_spec_is_checked_before_anything_loads(tmp_path):
    """Without TensorFlow or Keras: the preset folder, the handles, and what a hub job cannot set."""
    (tmp_path / "empty").mkdir()
    cases = [
        ({"hub": "./missing"}, {}, "is not a folder"),
        ({"hub": "./empty"}, {}, "holds no config.json and no metadata.json"),
        ({"hub": "kaggle://keras/gemma"}, {}, "kaggle://OWNER/MODEL/FRAMEWORK/VARIATION"),
        ({"hub": "hf://google"}, {}, "hf://OWNER/NAME"),
        ({"hub": "s3://bucket/preset"}, {}, "s3:// is not a preset source"),
        ({"hub": "gemma3_1b", "lora_rank": 0}, {}, "LoRA rank"),
        ({"lora_rank": 4}, {}, "set model.hub"),
        ({"hub": "gemma3_1b", "name": "mnist_cnn"}, {}, "remove model.name"),
        ({"hub": "gemma3_1b"}, {"train": {"loss": "mse"}}, "remove train.loss and train.metrics"),
        ({"hub": "gemma3_1b"}, {"data": {"label": "y"}}, "data.label target_ids"),
        ({"hub": "gemma3_1b"}, {"accelerator": {"backend": "tensorflow"}}, "set accelerator.backend: jax"),
    ]
    for model, sections, expected in cases:
        with pytest.raises(SpecError) as raised:
            load_spec(_spec(tmp_path, model, **sections))
        assert expected in str(raised.value), (model, sections, str(raised.value))
    spec = load_spec(_spec(tmp_path, {"hub": "kaggle://keras/gemma3/keras/gemma3_1b/3", "lora_rank": 8}))
    assert (spec.data.inputs, spec.data.label) == (("token_ids", "padding_mask"), "target_ids")
    assert spec.train.sample_weight == "target_mask" and spec.output.saved_model is False
    assert spec.accelerator.backend == "jax", "a hub job left unset runs on JAX, not auto's TensorFlow on a CPU"


def test_prepare_text_names_the_line_it_cannot_read(tmp_path):
    """Before any preset loads: a line that is not a prompt/response (or text) object, and a missing --preset."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "answer": "b"}\n')
    bad = run_cli("prepare", "text", chats, "--preset", tmp_path / "nowhere", "--sequence-length", 8,
                  "--out", tmp_path / "data")
    assert bad.returncode == 2 and f"{chats}:2:" in bad.stderr and '"response": TEXT' in bad.stderr, bad.stderr
    unset = run_cli("prepare", "text", chats, "--sequence-length", 8, "--out", tmp_path / "data")
    assert unset.returncode == 2 and "needs --preset" in unset.stderr, unset.stderr
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").glob("*.tfrecord"))


def test_prompts_to_generate_from_are_read_as_prepare_reads_lines(tmp_path):
    """`runner predict` on a model.hub job reads a .jsonl of prompts through the same line reader as `runner
    prepare text` (runner/data/rows.py `json_lines`): blank lines skipped, a bad line named by number."""
    from runner import DataError
    from runner.job.generate import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    assert read_prompts(str(prompts)) == ["a", "b"]
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b",\n')
    with pytest.raises(DataError, match=rf"{re.escape(str(prompts))}:2: not a JSON object"):
        read_prompts(str(prompts))
    prompts.write_text('{"prompt": "a"}\n{"answer": "b"}\n')
    with pytest.raises(DataError, match=r':2: .* holds no "prompt"'):
        read_prompts(str(prompts))
