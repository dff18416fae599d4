"""`train.mixed_precision: auto` chooses from the host's facts and the summary says why; bfloat16 keeps the output
float32; a job that sets none trains under Keras 3 with the precision auto chose."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.device import host
from runner.device.precision import decide
from runner.spec.load import load_spec
from tests.conftest import REPO, cli_env, last_json, run_cli

# /proc/cpuinfo texts as Linux writes them (one processor shown; the flags line is what is read).
_X86 = """processor\t: 0
vendor_id\t: {vendor}
model name\t: {model}
flags\t\t: fpu vme sse sse2 avx avx2 fma {extra}
bogomips\t: 4890.86
"""
ZEN4 = _X86.format(vendor="AuthenticAMD", model="AMD EPYC 9B14", extra="avx512f avx512bw avx512_bf16 avx512_vnni")
SAPPHIRE_RAPIDS = _X86.format(vendor="GenuineIntel", model="Intel(R) Xeon(R) Platinum 8481C",
                              extra="avx512f amx_bf16 amx_tile amx_int8")
ZEN3 = _X86.format(vendor="AuthenticAMD", model="AMD EPYC", extra="vaes vpclmulqdq rdpid fsrm")
SKYLAKE = _X86.format(vendor="GenuineIntel", model="Intel(R) Xeon(R) CPU @ 2.00GHz",
                      extra="avx512f avx512bw avx512_vnni")
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("kind", "cpuinfo", "gpus", "policy", "reason"),
    [
        ("cpu", ZEN4, [], "bfloat16", "cpu flag avx512_bf16"),
        ("cpu", SAPPHIRE_RAPIDS, [], "bfloat16", "cpu flag amx_bf16"),
        ("cpu", ZEN3, [], "float32", "no bf16 flag in /proc/cpuinfo: float32"),
        ("cpu", SKYLAKE, [], "float32", "no bf16 flag in /proc/cpuinfo: float32"),  # AVX-512 without its bf16 part
        ("cpu", GRAVITON3, [], "float32", "no bf16 flag in /proc/cpuinfo: float32"),  # no x86 flags line
        ("cpu", "", [], "float32", "no bf16 flag in /proc/cpuinfo: float32"),
        ("cpu", None, [], "float32", "could not read /proc/cpuinfo: float32"),
        ("tpu", None, [], "bfloat16", "TPU"),
        ("tpu", ZEN3, [], "bfloat16", "TPU"),  # the TPU computes, not the host's CPU
        ("gpu", ZEN3, [("NVIDIA A100-SXM4-40GB", (8, 0))], "bfloat16",
         "GPU NVIDIA A100-SXM4-40GB compute capability 8.0"),
        ("gpu", None, [("NVIDIA H100 80GB HBM3", (9, 0))] * 2, "bfloat16",
         "GPU NVIDIA H100 80GB HBM3 compute capability 9.0"),
        ("gpu", ZEN4, [("Tesla T4", (7, 5))], "float32", "GPU Tesla T4 compute capability 7.5 (below 8.0): float32"),
        ("gpu", None, [("NVIDIA L4", (8, 9)), ("Tesla V100-SXM2-16GB", (7, 0))], "float32",
         "GPU Tesla V100-SXM2-16GB compute capability 7.0 (below 8.0): float32"),  # every replica must have it
        ("gpu", None, [("a GPU", None)], "float32", "GPU a GPU compute capability unknown (below 8.0): float32"),
        ("gpu", None, [], "float32", "no GPU details from TensorFlow: float32"),
    ],
)
def test_auto_chooses_bfloat16_where_the_device_computes_it(kind, cpuinfo, gpus, policy, reason) -> None:
    chosen = decide("auto", "mnist_cnn", kind, cpuinfo, gpus)
    assert (chosen.policy, chosen.reason, chosen.auto) == (policy, reason, True)
    assert chosen.to_dict() == {"policy": policy, "reason": reason}


@pytest.mark.parametrize("asked", ["float32", "bfloat16", "float16"])
def test_an_explicit_precision_is_taken_as_asked(asked: str) -> None:
    for kind, cpuinfo in (("cpu", ZEN3), ("cpu", ZEN4), ("tpu", None)):
        chosen = decide(asked, "mnist_cnn", kind, cpuinfo)
        assert (chosen.policy, chosen.reason, chosen.auto) == (asked, f"train.mixed_precision: {asked}", False)


def test_a_model_kept_in_float32_under_auto_says_why() -> None:
    kept = {("weather_rnn", "cpu"): "bfloat16 cost it 3% of MAE (benchmarks/RESULTS.md)",
            ("imdb_lstm", "cpu"): "bfloat16 ran it slower on a CPU"}
    chosen = decide("auto", "weather_rnn", "cpu", ZEN4, float32_models=kept)
    assert chosen.policy == "float32"
    assert chosen.reason == ("cpu flag avx512_bf16, but model 'weather_rnn': bfloat16 cost it 3% of MAE "
                             "(benchmarks/RESULTS.md): float32")
    assert decide("auto", "mnist_cnn", "cpu", ZEN4, float32_models=kept).policy == "bfloat16"
    assert decide("bfloat16", "weather_rnn", "cpu", ZEN3, float32_models=kept).policy == "bfloat16"  # asked: taken
    # Kept for one kind of device only: a CPU keeps it in float32, a TPU computes it in bfloat16.
    on_cpu = decide("auto", "imdb_lstm", "cpu", ZEN4, float32_models=kept)
    assert (on_cpu.policy, on_cpu.reason) == (
        "float32", "cpu flag avx512_bf16, but model 'imdb_lstm': bfloat16 ran it slower on a CPU: float32")
    assert decide("auto", "imdb_lstm", "tpu", None, float32_models=kept).policy == "bfloat16"


def test_the_built_in_models_kept_in_float32_are_the_measured_ones() -> None:
    """The list benchmarks/RESULTS.md justifies, applied by decide() with no list given."""
    for model in ("imdb_lstm", "weather_rnn"):
        assert decide("auto", model, "cpu", ZEN4).policy == "float32"
        assert decide("auto", model, "tpu", None).policy == "bfloat16"
    assert decide("auto", "mnist_cnn", "cpu", ZEN4).policy == "bfloat16"
    assert decide("auto", "cifar10_cnn", "cpu", ZEN4).policy == "bfloat16"
    # Fashion-MNIST trains the MNIST model: what bfloat16 cost it belongs to the job, so its spec says float32.
    assert load_spec(REPO / "jobs" / "fashion_mnist_cnn.yaml").train.mixed_precision == "float32"
    assert load_spec(REPO / "jobs" / "mnist_cnn.yaml").train.mixed_precision == "auto"


@pytest.mark.parametrize("cpuinfo", [ZEN4, ZEN3, GRAVITON3, None])
def test_runner_cpu_bf16_makes_auto_act_as_on_a_cpu_with_or_without_the_flag(cpuinfo) -> None:
    """RUNNER_CPU_BF16=1 runs on a CPU without avx512_bf16 what a CPU with it runs (the suite included), and 0
    the other way; for a CPU only, and only under auto."""
    assert host.cpu_bf16_override({"RUNNER_CPU_BF16": "1"}) is True
    assert host.cpu_bf16_override({"RUNNER_CPU_BF16": "0"}) is False
    assert host.cpu_bf16_override({"RUNNER_CPU_BF16": ""}) is host.cpu_bf16_override({}) is None
    with_flag = decide("auto", "mnist_cnn", "cpu", cpuinfo, cpu_bf16=True)
    assert with_flag.to_dict() == {"policy": "bfloat16", "reason": "RUNNER_CPU_BF16=1: as on a CPU with avx512_bf16"}
    without = decide("auto", "mnist_cnn", "cpu", cpuinfo, cpu_bf16=False)
    assert without.to_dict() == {
        "policy": "float32", "reason": "RUNNER_CPU_BF16=0: as on a CPU without a bf16 flag: float32"}
    # A model kept in float32 on a CPU stays so, as on a CPU with the flag.
    kept = decide("auto", "imdb_lstm", "cpu", cpuinfo, cpu_bf16=True)
    assert kept.policy == "float32"
    assert kept.reason.startswith("RUNNER_CPU_BF16=1: as on a CPU with avx512_bf16, but model 'imdb_lstm': ")
    assert decide("auto", "mnist_cnn", "tpu", cpuinfo, cpu_bf16=False).policy == "bfloat16"  # a TPU is a TPU
    assert decide("float32", "mnist_cnn", "cpu", cpuinfo, cpu_bf16=True).policy == "float32"  # asked: taken


def test_a_runner_cpu_bf16_that_is_neither_1_nor_0_is_refused_naming_both() -> None:
    from runner import SpecError

    with pytest.raises(SpecError) as refused:
        host.cpu_bf16_override({"RUNNER_CPU_BF16": "yes"})
    assert str(refused.value) == (
        "RUNNER_CPU_BF16 is 'yes': set it to 1 (train.mixed_precision: auto acts as on a CPU with avx512_bf16), "
        "0 (as on a CPU without a bf16 flag), or unset it (the flags in /proc/cpuinfo decide)")


def test_cpu_flags_are_read_from_the_flags_line() -> None:
    assert {"avx512_bf16", "avx2"} <= host.cpu_flags(ZEN4)
    assert host.cpu_flags(GRAVITON3) == set()
    assert host.read_cpuinfo("/nonexistent/cpuinfo") is None


@pytest.mark.slow
def test_float32_is_one_set_away(mnist_job) -> None:
    spec = mnist_job("f32", train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True}, data={"eval": None})
    result = run_cli("run", spec, "--set", "train.mixed_precision=float32")
    assert result.returncode == 0, result.stderr
    assert last_json(result.stdout)["accelerator"]["precision"] == {
        "policy": "float32", "reason": "train.mixed_precision: float32"}


@pytest.mark.slow
def test_bfloat16_computes_in_bf16_with_a_float32_output(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("bf16", train={"epochs": 1, "steps_per_epoch": 4, "mixed_precision": "bfloat16"},
                     data={"eval": None})
    result = run_cli("run", spec)
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded"
    assert summary["accelerator"]["precision"] == {"policy": "bfloat16", "reason": "train.mixed_precision: bfloat16"}
    import tensorflow as tf

    model = tf.keras.models.load_model(tmp_path / "runs" / "bf16" / "model.keras")
    conv = next(layer for layer in model.layers if "conv" in layer.name)
    assert conv.compute_dtype == "bfloat16" and conv.variable_dtype == "float32"
    assert model.layers[-1].compute_dtype == "float32"
    assert model.output.dtype == "float32"


@pytest.mark.slow
def test_a_job_without_mixed_precision_trains_under_keras_3_with_autos_choice(mnist_job, tmp_path: Path) -> None:
    """The job sets no train.mixed_precision: its run is also the check that auto is the default and that the
    summary says what it chose (once a run of its own)."""
    spec = mnist_job("keras3", train={"epochs": 2})
    result = run_cli("run", spec, env=cli_env())
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["accelerator"]["keras"].startswith("keras 3.")
    assert [e["steps"] for e in summary["epochs"]] == [16, 16]
    assert summary["final_step"] == 32
    assert summary["metrics"]["accuracy"] > 0.5
    assert set(summary["timing"]) >= {"first_epoch_s", "steady_epoch_s", "step_time_ms", "examples_per_sec"}
    # auto is the default: what this machine's /proc/cpuinfo (or RUNNER_CPU_BF16) says, decided by the same rule
    # the tests above pin down.
    policy, reason = host.cpu_precision()
    assert summary["accelerator"]["precision"] == {"policy": policy, "reason": reason}
    assert summary["accelerator"]["onednn"] is True  # runner/__init__.py turns oneDNN's CPU kernels on
    import tensorflow as tf

    model = tf.keras.models.load_model(tmp_path / "runs" / "keras3" / "model.keras")
    conv = next(layer for layer in model.layers if "conv" in layer.name)
    assert conv.compute_dtype == policy and conv.variable_dtype == "float32"
    assert model.layers[-1].compute_dtype == "float32"


# --- the output layer stays float32 (built in this process: a few seconds, no training) -----------------


@pytest.fixture
def under(request):
    """Builds under a Keras policy (`under("mixed_bfloat16")`) and puts float32 back afterwards."""
    import tensorflow as tf

    yield tf.keras.mixed_precision.set_global_policy
    tf.keras.mixed_precision.set_global_policy("float32")


def _features() -> dict:
    from runner.data.schema import Feature

    return {
        "image": Feature("float32", (28, 28, 1)), "tokens": Feature("int64", (40,)),
        "series": Feature("float32", (24, 5)),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "inputs", "params"),
    [
        ("mnist_cnn", ("image",), {}), ("cifar10_cnn", ("image",), {}), ("imdb_lstm", ("tokens",), {"vocab_size": 100}),
        ("weather_rnn", ("series",), {}), ("weather_rnn", ("series",), {"target_feature": 0}),
    ],
)
def test_every_built_in_model_computes_in_bfloat16_with_a_float32_output(under, name, inputs, params) -> None:
    from runner import models
    from runner.device import precision
    from runner.spec.types import JobSpec

    under("mixed_bfloat16")
    spec = JobSpec.model_validate({"model": {"name": name, "params": params}})
    model = models.build(name, dict(params), _features(), inputs)
    assert precision.output_not_float32(model) is None
    assert any(layer.compute_dtype == "bfloat16" for layer in model.layers)  # the rest does compute in bfloat16
    assert model.output.dtype == "float32"
    assert spec.train.mixed_precision == "auto"


def _own_models(tmp_path: Path) -> tuple[str, Path]:
    name = f"ownpkg_{tmp_path.name.replace('-', '_')}"
    package = tmp_path / "src" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(
        "import tensorflow as tf\n"
        "keras = tf.keras\n\n"
        "def _net(inputs, dtype):\n"
        "    inp = keras.Input((28, 28, 1), name=inputs[0])\n"
        "    x = keras.layers.Dense(8, activation='relu')(keras.layers.Flatten()(inp))\n"
        "    return keras.Model(inp, keras.layers.Dense(10, activation='softmax', dtype=dtype, name='probs')(x))\n\n"
        "def plain(params, features, inputs):\n"
        "    return _net(inputs, None)\n\n"
        "def float32_out(params, features, inputs):\n"
        "    return _net(inputs, 'float32')\n\n"
        "def unnamed(params, features, inputs):\n"
        "    inp = keras.Input((28, 28, 1), name=inputs[0])\n"
        "    return keras.Model(inp, keras.layers.Dense(10, activation='softmax')(keras.layers.Flatten()(inp)))\n"
    )
    return name, tmp_path / "src"


@pytest.mark.slow
def test_an_own_model_whose_output_would_be_bfloat16_trains_in_float32_under_auto(
        under, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import tensorflow as tf

    from runner.device import engine
    from runner.device.precision import Precision
    from runner.device.strategy import Accelerator
    from runner.spec.types import JobSpec
    from runner.train.build import build_compiled

    package, src = _own_models(tmp_path)
    cpu = Accelerator(tf.distribute.get_strategy(), "cpu", 1, engine=engine.active())
    features = {"image": _features()["image"]}

    def build(function: str, chosen: Precision) -> tf.keras.Model:
        chosen.apply()
        spec = JobSpec.model_validate({
            "model": {"name": f"{package}.nets:{function}"}, "data": {"inputs": ["image"]},
            "code": {"folder": str(src)},
        })
        return build_compiled(spec, features, cpu, chosen)

    # auto chose bfloat16 (as on a CPU with avx512_bf16), but the model's softmax would compute in bfloat16.
    chosen = Precision("bfloat16", "cpu flag avx512_bf16", auto=True)
    tf.keras.utils.set_random_seed(7)
    with caplog.at_level("INFO", logger="runner"):
        model = build("plain", chosen)
    # One line, the final decision with its reason: not bfloat16 first and float32 at the close.
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision: ")]
    assert said == [f"precision: float32 ({chosen.reason})"], said
    assert chosen.policy == "float32"
    assert chosen.reason == (
        f"cpu flag avx512_bf16, but model '{package}.nets:plain': its output layer 'probs' computes in bfloat16 "
        "(give that layer dtype='float32' to train the rest in bfloat16): float32"
    )
    assert all(layer.compute_dtype == "float32" for layer in model.layers)
    # Built again in float32, it starts from the weights auto's float32 (a CPU without the flag) gives it: the
    # same seed trains the same model on both (the rebuild drew the next seeds, and a test's accuracy 0.742 was
    # 0.697 on a CPU with avx512_bf16).
    tf.keras.utils.set_random_seed(7)
    at_once = build("plain", Precision("float32", "no bf16 flag in /proc/cpuinfo: float32", auto=True))
    for fallen, direct in zip(model.get_weights(), at_once.get_weights(), strict=True):
        assert (fallen == direct).all()
    # A layer Keras names itself is named anew when the model is built again (dense -> dense_1): the precision line
    # names the layer of the model that trains, as a later message about its output does.
    chosen = Precision("bfloat16", "cpu flag avx512_bf16", auto=True)
    model = build("unnamed", chosen)
    assert f"its output layer {model.layers[-1].name!r} computes in bfloat16" in chosen.reason, chosen.reason
    # With dtype='float32' on its output layer, auto keeps bfloat16 for the rest.
    chosen = Precision("bfloat16", "cpu flag avx512_bf16", auto=True)
    model = build("float32_out", chosen)
    assert (chosen.policy, chosen.reason) == ("bfloat16", "cpu flag avx512_bf16")
    assert model.layers[-2].compute_dtype == "bfloat16" and model.output.dtype == "float32"
    # Asked for explicitly, bfloat16 is kept as asked (with a warning in the log).
    chosen = Precision("bfloat16", "train.mixed_precision: bfloat16")
    model = build("plain", chosen)
    assert chosen.policy == "bfloat16" and model.output.dtype == "bfloat16"
