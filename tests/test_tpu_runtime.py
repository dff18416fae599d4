"""The TPU device API (runner/device/tpu_env.py): chosen per generation, set before TensorFlow loads, recorded in the
summary, a crash of TPU initialisation reported by the doctor, and the multi-host slices the TPU table gives no
hosts for refused.

No TPU exists here. What is real: the processes (`runner run`, `runner doctor`, `runner submit`), the metadata
server's protocol (tests/support/metadata_fake.py on 127.0.0.1), TensorFlow (the CPU wheel), and a process that
dies by SIGSEGV. Stood in for: libtpu's Python package (a folder with the same layout and version metadata,
where a test must not load it into TensorFlow) and, for the crash, a TensorFlow whose TPU initialisation
segfaults, as tensorflow-tpu 2.20.0 with libtpu 0.0.19 does under PJRT on a machine without a TPU (with
a Keras that is only a version number, so the doctor's import check stays apart from the crash).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from runner import SpecError
from runner.cloud.tpu_types import multi_host_types, parse_tpu_type, refuse_unknown_slice, single_host_types
from runner.device.tpu_env import MLIR_BRIDGE_FLAGS, choose_tpu_env
from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke
from tests.support.metadata_fake import start_metadata_fake

SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def no_metadata() -> dict[str, str]:
    """A metadata server address where nothing listens: this machine is no TPU VM."""
    return {"GCE_METADATA_HOST": f"127.0.0.1:{closed_port()}"}


@pytest.fixture
def libtpu_so(tmp_path: Path) -> str:
    """A file where TF_PLUGGABLE_DEVICE_LIBRARY_PATH can point (never loaded by these tests)."""
    path = tmp_path / "libtpu.so"
    path.write_bytes(b"\x7fELF stand-in")
    return str(path)


# --- the device API per generation ---------------------------------------------------------------


@pytest.mark.parametrize("accelerator_type", ["v5litepod-8", "v5e-4", "v5p-8", "v6e-8", "v6e-1"])
def test_v5e_v5p_v6e_get_pjrt_with_the_settings_of_kerass_example(accelerator_type: str, libtpu_so: str) -> None:
    env = {"TPU_ACCELERATOR_TYPE": accelerator_type, "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": libtpu_so}
    chosen = choose_tpu_env("local", env)
    assert chosen.device_api == "pjrt" and chosen.problem is None, chosen
    assert chosen.generation_from == "TPU_ACCELERATOR_TYPE" and chosen.accelerator_type == accelerator_type
    assert chosen.settings == {
        "PJRT_DEVICE": "TPU",
        "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
        "TF_XLA_FLAGS": " ".join(MLIR_BRIDGE_FLAGS),
    }
    assert chosen.found == {"TF_PLUGGABLE_DEVICE_LIBRARY_PATH": libtpu_so}  # set by the user: kept
    assert "https://cloud.google.com/tpu/docs/runtimes" in chosen.why


@pytest.mark.parametrize("accelerator_type", ["v4-8", "v3-8", "v2-8"])
def test_v2_v3_v4_keep_tensorflows_default_stream_executor(accelerator_type: str) -> None:
    chosen = choose_tpu_env("local", {"TPU_ACCELERATOR_TYPE": accelerator_type})
    assert (chosen.device_api, chosen.settings, chosen.problem) == ("stream_executor", {}, None)
    assert "TPU embedding API" in chosen.why  # what PJRT lacks there, per Google's table
    asked = choose_tpu_env("local", {"TPU_ACCELERATOR_TYPE": accelerator_type,
                                     "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true"})
    assert asked.device_api == "pjrt" and "asked for" in asked.why


def test_a_tpu_at_a_grpc_address_keeps_the_documented_default_and_says_why() -> None:
    chosen = choose_tpu_env("grpc://10.0.0.2:8470", {})
    assert (chosen.device_api, chosen.settings, chosen.generation) == ("stream_executor", {}, None)
    assert "generation unknown" in chosen.why and "COLAB_TPU_ADDR" in chosen.why
    assert chosen.describe() == "stream executor (TensorFlow's default) for a remote TPU"


def test_an_unknown_generation_on_a_tpu_vm_gets_pjrt_and_says_so(no_metadata, libtpu_so: str) -> None:
    chosen = choose_tpu_env("local", {**no_metadata, "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": libtpu_so})
    assert chosen.device_api == "pjrt" and chosen.generation is None and chosen.generation_from == "unknown"
    assert "every TPU generation from TF 2.15" in chosen.why and "TPU_ACCELERATOR_TYPE" in chosen.why


def test_the_generation_comes_from_the_tpu_vms_metadata_server(tmp_path: Path) -> None:
    with start_metadata_fake(tmp_path, ttl_s=60, accelerator_type="v4-8") as metadata:
        chosen = choose_tpu_env("local", {"GCE_METADATA_HOST": metadata.host})
        asked = [r for r in metadata.requests() if r["path"].endswith("/accelerator-type")]
    assert (chosen.accelerator_type, chosen.generation_from, chosen.device_api) == (
        "v4-8", "metadata server", "stream_executor")
    assert asked and all(r["flavoured"] for r in asked), "Metadata-Flavor: Google must be sent"


def test_pjrt_without_libtpu_and_pjrt_turned_off_and_ironwood_are_refused(libtpu_so: str) -> None:
    bare = choose_tpu_env("local", {"TPU_ACCELERATOR_TYPE": "v5litepod-8"})  # this venv has no libtpu
    assert bare.problem.startswith("PJRT needs libtpu") and bare.settings == {}
    off = choose_tpu_env("local", {"TPU_ACCELERATOR_TYPE": "v6e-8", "NEXT_PLUGGABLE_DEVICE_USE_C_API": "false",
                                   "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": libtpu_so})
    assert "NEXT_PLUGGABLE_DEVICE_USE_C_API=false turns PJRT off, but v6e needs it" in off.problem
    gone = choose_tpu_env("local", {"TPU_ACCELERATOR_TYPE": "v5p-8",
                                    "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/nonexistent/libtpu.so"})
    assert "TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/nonexistent/libtpu.so is not a file" in gone.problem
    ironwood = choose_tpu_env("local", {"TPU_ACCELERATOR_TYPE": "tpu7x-8"})
    assert "TensorFlow does not run on this TPU generation" in ironwood.problem


def test_xla_flags_already_set_are_kept_and_the_bridge_flags_added(libtpu_so: str) -> None:
    mine = "--tf_xla_sparse_core_disable_table_stacking=true --tf_mlir_enable_mlir_bridge=false"
    chosen = choose_tpu_env("local", {"TPU_ACCELERATOR_TYPE": "v5p-8", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": libtpu_so,
                                      "TF_XLA_FLAGS": mine})
    flags = chosen.settings["TF_XLA_FLAGS"].split()
    assert flags[:2] == mine.split(), "a flag the user set keeps its value"
    assert flags[2:] == list(MLIR_BRIDGE_FLAGS[1:])


def standin_libtpu(folder: Path, version: str = "0.0.10") -> dict[str, str]:
    """libtpu's Python package as pip lays it out (the real one is 320 MB): get_library_path() and metadata."""
    package = folder / "libtpu"
    package.mkdir(parents=True)
    (package / "libtpu.so").write_bytes(b"\x7fELF stand-in")
    (package / "__init__.py").write_text(
        "import os\n\ndef get_library_path():\n    return os.path.join(os.path.dirname(__file__), 'libtpu.so')\n"
    )
    info = folder / f"libtpu-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: libtpu\nVersion: {version}\n")
    return {"PYTHONPATH": f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def in_child(code: str, env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True,
                            timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_pjrt_points_tensorflow_at_libtpus_own_library_path(tmp_path: Path, no_metadata) -> None:
    env = cli_env(**standin_libtpu(tmp_path / "site"), **no_metadata, TPU_ACCELERATOR_TYPE="v5litepod-8")
    env.pop("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", None)
    applied = in_child("""
        import json, os, sys
        from runner.device.tpu_env import prepare_tpu_env
        runtime = prepare_tpu_env("tpu", "local")
        keys = ("PJRT_DEVICE", "NEXT_PLUGGABLE_DEVICE_USE_C_API", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "TF_XLA_FLAGS")
        print(json.dumps({"runtime": runtime.to_dict(), "environ": {k: os.environ.get(k) for k in keys},
                          "tensorflow_loaded": "tensorflow" in sys.modules}))
    """, env)
    library = str(tmp_path / "site" / "libtpu" / "libtpu.so")
    assert applied["runtime"]["libtpu"] == "0.0.10"
    assert applied["environ"] == {"PJRT_DEVICE": "TPU", "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
                                  "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": library,
                                  "TF_XLA_FLAGS": " ".join(MLIR_BRIDGE_FLAGS)}
    assert applied["tensorflow_loaded"] is False, "choosing the device API must not load TensorFlow"


def test_settings_that_come_after_tensorflow_loaded_are_refused_not_set(tmp_path: Path, libtpu_so: str) -> None:
    env = cli_env(TPU_ACCELERATOR_TYPE="v5p-8", LIBTPU_SO=libtpu_so)
    late = in_child("""
        import json, os
        import tensorflow  # it loads TF_PLUGGABLE_DEVICE_LIBRARY_PATH now, if set: here it is not yet
        os.environ["TF_PLUGGABLE_DEVICE_LIBRARY_PATH"] = os.environ["LIBTPU_SO"]
        from runner.device.tpu_env import apply_tpu_env
        runtime = apply_tpu_env("local")
        print(json.dumps({"problem": runtime.problem, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE")}))
    """, env)
    assert late["problem"].startswith("TensorFlow was imported before the TPU settings could be set")
    assert late["PJRT_DEVICE"] is None


# --- `runner run`: the choice in the summary --------------------------------------------------


def quick_job(mnist_job, name: str, **accelerator: Any) -> Path:
    return mnist_job(name, accelerator=accelerator, train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True},
                     data={"eval": None})


@pytest.mark.slow
def test_the_summary_records_the_device_api_a_tpu_was_tried_with(mnist_job, no_metadata) -> None:
    spec = quick_job(mnist_job, "v4se", kind="auto", backend="tensorflow", timeout_s=20)
    result = run_cli("run", spec, env=cli_env(TPU_NAME="local", TPU_ACCELERATOR_TYPE="v4-8",
                                              RUNNER_TPU_RUNTIME_VERSION="tpu-ubuntu2204-base", **no_metadata))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no TPU, falling back" in result.stderr
    assert "tried: device API: stream executor for v4-8 (TPU_ACCELERATOR_TYPE) -> TPUClusterResolver" in result.stderr
    summary = last_json(result.stdout)
    jsonschema.validate(summary, SCHEMA)
    runtime = summary["accelerator"]["tpu_runtime"]
    assert summary["accelerator"]["kind"] == "cpu"
    assert (runtime["device_api"], runtime["accelerator_type"], runtime["generation_from"]) == (
        "stream_executor", "v4-8", "TPU_ACCELERATOR_TYPE")
    assert runtime["runtime_version"] == "tpu-ubuntu2204-base" and runtime["settings"] == {}


@pytest.mark.slow
def test_a_v5e_found_through_the_metadata_server_without_libtpu_fails_naming_it(mnist_job, tmp_path: Path) -> None:
    # TensorFlow's TPU path (retired on TPUs: a TPU runs JAX), asked for explicitly, falls back to the CPU.
    spec = quick_job(mnist_job, "v5e", kind="auto", backend="tensorflow", timeout_s=20)
    with start_metadata_fake(tmp_path, ttl_s=120, accelerator_type="v5litepod-8") as metadata:
        result = run_cli("run", spec, env=cli_env(TPU_NAME="local", GCE_METADATA_HOST=metadata.host))
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("could not start the TPU 'local' (device API PJRT for v5litepod-8 (metadata server)): "
            "PJRT needs libtpu") in result.stderr
    summary = last_json(result.stdout)
    jsonschema.validate(summary, SCHEMA)
    assert summary["accelerator"]["kind"] == "cpu" and summary["accelerator"]["tpu_runtime"]["device_api"] == "pjrt"


@pytest.mark.slow
def test_a_cpu_job_records_no_tpu_runtime(mnist_job) -> None:
    result = run_cli("run", quick_job(mnist_job, "cpu", kind="cpu"), env=cli_env(TPU_NAME="local"))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = last_json(result.stdout)
    assert summary["accelerator"]["tpu_runtime"] is None
    assert "PJRT_DEVICE" not in result.stderr


# --- multi-host slices --------------------------------------------------------------------------


SINGLE_HOST = ("v6e-1, v6e-4, v6e-8, v5litepod-1, v5litepod-4, v5litepod-8, v5p-8, v4-8, v3-8, v2-8")
MULTI_HOST = "v6e-16, v6e-32, v5litepod-16, v5litepod-32, v5p-16, v5p-32"


@pytest.mark.parametrize("tpu_type, chips, hosts", [
    ("v5litepod-64", 64, 16), ("v5litepod-256", 256, 64), ("v6e-64", 64, 16), ("v6e-256", 256, 64),
    ("v5p-128", 64, 16), ("v4-16", 8, 2), ("v4-32", 16, 4), ("v3-32", 16, 4), ("v2-32", 16, 4), ("tpu7x-16", 8, 2),
])
def test_a_multi_host_type_the_table_gives_no_hosts_for_is_refused_with_what_works(tpu_type, chips, hosts) -> None:
    with pytest.raises(SpecError) as refused:
        refuse_unknown_slice(tpu_type)
    assert str(refused.value) == (
        f"--tpu-type {tpu_type} is a multi-host slice ({chips} chips on {hosts} hosts) that this runner's TPU table "
        "gives no hosts for: every host runs the job as one JAX process (jax.distributed.initialize), so the startup "
        f"script must know how many there are. Multi-host types work: {MULTI_HOST}. Single-host types work: "
        f"{SINGLE_HOST}; tpu7x-8 with --on gke (see docs/tpu.md)"
    )
    assert refused.value.exit_code == 2


def test_the_single_and_multi_host_types_pass_and_are_the_ones_listed() -> None:
    assert ", ".join(single_host_types()) == f"{SINGLE_HOST}, tpu7x-8"
    assert ", ".join(multi_host_types()) == MULTI_HOST
    for name in single_host_types():
        refuse_unknown_slice(name)
        assert parse_tpu_type(name).hosts == 1
    for name in multi_host_types():
        refuse_unknown_slice(name)
        assert parse_tpu_type(name).hosts > 1


def test_submit_refuses_a_multi_host_type_without_hosts_before_any_call(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {
        "name": "pod", "accelerator": {"kind": "tpu"},
        "data": {"train": "gs://bucket/mnist/train-*.tfrecord", "eval": None, "global_batch_size": 128},
        "output": {"dir": "gs://bucket/runs"},
    })
    endpoint = f"http://127.0.0.1:{closed_port()}/"  # a request sent anyway would fail with exit 3, not 2
    result = invoke("submit", spec, "--tpu-type", "v5litepod-64", "--zone", "us-central1-a", "--project", "p",
                    "--image", "us-central1-docker.pkg.dev/p/runner/runner:tpu",
                    env=cli_env(CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=endpoint, CLOUDSDK_AUTH_ACCESS_TOKEN="fake"))
    assert result.returncode == 2, result.stderr
    assert "--tpu-type v5litepod-64 is a multi-host slice (64 chips on 16 hosts)" in result.stderr
    assert "Single-host types work: v6e-1, v6e-4, v6e-8, v5litepod-1" in result.stderr
    help_text = invoke("submit", "--help").stdout
    assert "TPU_NAME=local" not in help_text
