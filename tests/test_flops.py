"""Model FLOPs, device peaks and MFU: counted from real Keras models, looked up in the sourced table, and a CPU
peak measured on this host once and read back from its cache."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import tensorflow as tf

from runner.device import peak
from runner.train import flops
from tests.conftest import REPO

keras = tf.keras
SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())


def dense_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((100,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


def test_a_dense_model_is_counted_within_2_percent_of_the_hand_count() -> None:
    # A multiply-add is 2 FLOPs; forward = 2 * sum(inputs * units); training = forward + 2x forward.
    by_hand = 3 * 2 * (100 * 64 + 64 * 32 + 32 * 10)
    counted, method = flops.count(dense_model(), batch_size=32)
    assert method.startswith("tf_profiler"), method
    assert counted == pytest.approx(by_hand, rel=0.02)


def conv_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),  # 16x16x8 outputs, 3x3x3 window each
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 3),  # valid: 6x6x16 outputs, 3x3x8 window each
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


CONV_BY_HAND = 3 * 2 * (16 * 16 * 8 * 3 * 3 * 3 + 6 * 6 * 16 * 3 * 3 * 8 + 6 * 6 * 16 * 10)


def test_a_conv_model_is_counted_within_5_percent_of_the_hand_count() -> None:
    counted, method = flops.count(conv_model(), batch_size=16)
    assert method.startswith("tf_profiler"), method
    assert counted == pytest.approx(CONV_BY_HAND, rel=0.05)


def test_the_per_layer_arithmetic_gives_the_hand_count_of_matmuls_and_convolutions() -> None:
    model = conv_model()
    assert 3 * sum(flops.layer_forward_flops(layer) for layer in model.layers) == CONV_BY_HAND


def test_a_recurrent_model_is_counted_per_layer_because_the_profiler_skips_loop_bodies() -> None:
    inputs = keras.Input((20,), dtype="int64")
    x = keras.layers.Embedding(500, 16)(inputs)
    x = keras.layers.LSTM(24)(x)  # a While loop in the traced graph on a CPU
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    counted, method = flops.count(model, batch_size=8)
    assert method.startswith("layers:") and "While" in method, method
    # 20 steps x 4 gates x 2 x units x (features + units); the embedding is a lookup (0); the Dense 2 x 24.
    assert counted == 3 * (20 * 4 * 2 * 24 * (16 + 24) + 2 * 24)


def test_a_model_the_arithmetic_cannot_count_gets_no_number_and_the_reason() -> None:
    inputs = keras.Input((20, 4))
    x = keras.layers.SeparableConv1D(8, 3)(inputs)  # weights the per-layer arithmetic does not know
    x = keras.layers.GRU(8)(x)  # and a loop, so the profiler cannot count it either
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    counted, method = flops.count(model, batch_size=4)
    assert counted is None
    assert method.startswith("not counted") and "SeparableConv1D" in method, method


def validate(block: dict) -> None:
    jsonschema.validate({"throughput": block}, {
        "type": "object", "properties": {"throughput": SCHEMA["properties"]["throughput"]}})


def test_the_throughput_block_does_the_arithmetic_of_achieved_tflops_and_mfu() -> None:
    # 1 GFLOP per example x 4,000 examples/s over 2 devices = 2 TFLOP/s per device; against a peak of 8: 0.25.
    block = flops.throughput_block(1e9, "tf_profiler: x", 4000.0, 2, 8.0, "a vendor page")
    assert block == {
        "model_flops_per_example": 1e9, "flops_method": "tf_profiler: x", "tflops_per_device": 2.0,
        "peak_tflops_per_device": 8.0, "peak_source": "a vendor page", "mfu": 0.25, "why_null": None,
    }
    validate(block)


def test_the_throughput_block_says_why_a_field_is_null() -> None:
    no_peak = flops.throughput_block(1e9, "tf_profiler: x", 4000.0, 1, None, "TPU 'v9' is not in the table")
    assert no_peak["tflops_per_device"] == 4.0 and no_peak["mfu"] is None
    assert "TPU 'v9' is not in the table" in no_peak["why_null"]
    no_steady = flops.throughput_block(1e9, "tf_profiler: x", None, 1, 8.0, "a vendor page")
    assert no_steady["tflops_per_device"] is None and no_steady["mfu"] is None
    assert "steady" in no_steady["why_null"]
    uncounted = flops.throughput_block(None, "not counted: a layer", 4000.0, 1, 8.0, "a vendor page")
    assert uncounted["mfu"] is None and "not counted: a layer" in uncounted["why_null"]
    for block in (no_peak, no_steady, uncounted):
        validate(block)


def test_every_row_of_the_peak_table_has_a_value_and_a_source() -> None:
    for row in peak.TABLE:
        assert row.tflops_per_device > 0 and row.kind in ("tpu", "gpu"), row
        assert ("cloud.google.com/tpu/docs/" in row.source) == (row.kind == "tpu"), row
        assert "NVIDIA" in row.source or row.kind == "tpu", row
    keys = [(row.kind, row.match, row.precision) for row in peak.TABLE]
    assert len(keys) == len(set(keys)), "a device and dtype listed twice"


@pytest.mark.parametrize(("kind", "detail", "precision", "expected"), [
    ("tpu", "v5litepod-8", "bfloat16", 197.0),
    ("tpu", "v5e-4", "bfloat16", 197.0),  # the alias gcloud also accepts
    ("tpu", "v5p-8", "bfloat16", 459.0),
    ("tpu", "v4-8", "bfloat16", 275.0),
    ("tpu", "v3-8", "bfloat16", 61.5),  # two TensorCores per chip, each a device
    ("tpu", "v6e", "bfloat16", 918.0),
    ("gpu", "NVIDIA H100 80GB HBM3", "bfloat16", 989.5),
    ("gpu", "NVIDIA H100 PCIe", "bfloat16", 756.5),  # not read as the SXM part
    ("gpu", "NVIDIA A100-SXM4-40GB", "float32", 156.0),  # float32 runs as TF32
])
def test_published_peaks_are_found_by_generation_or_name(kind, detail, precision, expected) -> None:
    value, source = peak.peak_tflops(kind, detail, precision)
    assert value == expected, source


def test_a_device_or_dtype_without_a_published_peak_has_none_and_says_why() -> None:
    assert peak.peak_tflops("tpu", "v5litepod-8", "float32") == (
        None, "no published float32 peak for TPU 'v5litepod-8' in the table (it has bfloat16)")
    value, why = peak.peak_tflops("gpu", "Tesla T4", "float16")
    assert value is None and "not in" in why
    value, why = peak.peak_tflops("tpu", None, "bfloat16")
    assert value is None and "unknown" in why


def test_the_cpu_peak_is_measured_once_cached_by_cpu_model_and_read_back(tmp_path) -> None:
    value, source = peak.cpu_peak("float32", tmp_path, sizes=(256,))  # small: the suite shares 2 cores
    cache = tmp_path / peak.CACHE_FILE
    assert value and value > 0 and "measured now" in source and str(cache) in source
    stored = json.loads(cache.read_text())
    key = peak.cpu_key("float32")
    assert peak.cpu_model() in key and stored[key]["tflops"] == value
    written = cache.stat().st_mtime_ns
    # Read back, not measured again: the file is untouched and an edited figure is what comes back.
    assert peak.peak_tflops("cpu", None, "float32", cache_dir=tmp_path)[0] == value
    assert cache.stat().st_mtime_ns == written
    stored[key]["tflops"] = 1.25
    cache.write_text(json.dumps(stored))
    value, source = peak.peak_tflops("cpu", None, "float32", cache_dir=tmp_path, cpu_devices=2)
    assert value == pytest.approx(0.625) and "cached" in source and "2 logical CPU devices" in source


def test_the_cpu_cache_lives_under_xdg_cache_home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peak.cache_folder() == tmp_path / "runner"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert peak.cache_folder().parts[-2:] == (".cache", "runner")


def test_the_cpu_measurement_is_a_real_matmul_rate() -> None:
    entry = peak.measure_cpu("float32", sizes=(128, 256))
    assert entry["size"] in (128, 256) and entry["calls"] == 2 * peak.WARM_CALLS
    assert 0 < entry["median_tflops"] <= entry["tflops"] and math.isfinite(entry["tflops"])
