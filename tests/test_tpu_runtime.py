"""A TPU computes with JAX only: TensorFlow's TPU path is retired (docs/tpu.md), so nothing of it is set before
TensorFlow loads, under either backend, and a TensorFlow job on a TPU VM trains on the CPU and says why; and the
multi-host slices whose host count the TPU table has no source for are refused.

No TPU exists here. What is real: the processes (`runner run`, `runner submit`) and TensorFlow (the CPU wheel,
which loads whatever TF_PLUGGABLE_DEVICE_LIBRARY_PATH names while it imports). Stood in for: libtpu's Python
package (a folder with the same layout and version metadata, its library a file no loader accepts: pointed at
it, `import tensorflow` fails with "file too short").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from runner import SpecError
from runner.cloud.tpu_types import multi_host_types, parse_tpu_type, refuse_unknown_slice, single_host_types
from tests.conftest import REPO, cli_env, last_json, run_cli, write_spec
from tests.support.cli import invoke

SCHEMA = json.loads((REPO / "runner" / "rundir" / "summary.schema.json").read_text())
# What TensorFlow's TPU path set before TensorFlow loaded (Keras's TensorFlow TPU example); never set now.
TENSORFLOW_TPU_VARIABLES = ("PJRT_DEVICE", "NEXT_PLUGGABLE_DEVICE_USE_C_API", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH",
                            "TF_XLA_FLAGS")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def standin_libtpu(folder: Path, version: str = "0.0.42.1") -> dict[str, str]:
    """libtpu's Python package as pip lays it out (the real one is 684 MB): get_library_path() and metadata."""
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


def on_a_tpu_vm(folder: Path) -> dict[str, str]:
    """A v5e TPU VM's environment as far as this machine can give one: TPU_NAME=local, the type, libtpu."""
    env = cli_env(**standin_libtpu(folder), TPU_NAME="local", TPU_ACCELERATOR_TYPE="v5litepod-8",
                  TPU_SKIP_MDS_QUERY="1")
    for key in TENSORFLOW_TPU_VARIABLES:
        env.pop(key, None)
    return env


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_nothing_of_tensorflows_tpu_path_is_set_before_tensorflow_loads(tmp_path: Path, backend: str) -> None:
    code = f"""
        import json, os, sys
        from runner.job.startup import before_tensorflow
        from runner.spec.types import JobSpec
        before_tensorflow(JobSpec.model_validate({{"accelerator": {{"backend": "{backend}"}}}}))
        print(json.dumps({{"set": {{k: os.environ[k] for k in {TENSORFLOW_TPU_VARIABLES!r} if k in os.environ}},
                          "tensorflow_loaded": "tensorflow" in sys.modules}}))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True,
                            text=True, timeout=120, env=on_a_tpu_vm(tmp_path / "site"), cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"set": {}, "tensorflow_loaded": False}, seen


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_an_environment_that_points_tensorflow_at_libtpu_is_refused_before_it_loads(mnist_job, tmp_path: Path,
                                                                                    backend: str) -> None:
    """A TPU VM image or a shell that still sets TensorFlow's TPU variable: tensorflow-cpu would load libtpu while
    it imports and hold the TPU that JAX drives. `runner run` refuses it (exit 2) before TensorFlow loads."""
    env = on_a_tpu_vm(tmp_path / "site")
    env["TF_PLUGGABLE_DEVICE_LIBRARY_PATH"] = str(tmp_path / "site" / "libtpu" / "libtpu.so")
    result = run_cli("run", mnist_job("pointed", accelerator={"backend": backend}), env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"TF_PLUGGABLE_DEVICE_LIBRARY_PATH={tmp_path / 'site' / 'libtpu' / 'libtpu.so'} points TensorFlow at "
            "libtpu") in result.stderr and "Unset TF_PLUGGABLE_DEVICE_LIBRARY_PATH" in result.stderr


@pytest.mark.slow
def test_a_tensorflow_job_on_a_tpu_vm_trains_on_the_cpu_and_says_why(mnist_job, tmp_path: Path) -> None:
    spec = mnist_job("tf-on-tpu-vm", accelerator={"kind": "auto", "backend": "tensorflow"},
                     train={"epochs": 1, "steps_per_epoch": 2, "allow_chance": True}, data={"eval": None})
    result = run_cli("run", spec, env=on_a_tpu_vm(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("a TPU is indicated (local), but accelerator.backend is tensorflow, which computes on GPUs or the CPU "
            "only") in result.stderr
    summary = last_json(result.stdout)
    jsonschema.validate(summary, SCHEMA)
    assert summary["accelerator"]["kind"] == "cpu" and "tpu_runtime" not in summary["accelerator"]
    assert summary["final_step"] == 2


# --- multi-host slices --------------------------------------------------------------------------


SINGLE_HOST = ("v6e-1, v6e-4, v6e-8, v5litepod-1, v5litepod-4, v5litepod-8, v5p-8, v4-8, v3-8, v2-8")
MULTI_HOST = "v6e-16, v6e-32, v5litepod-16, v5litepod-32, v5p-16, v5p-32"


@pytest.mark.parametrize("tpu_type, chips, hosts, per_vm, sourced", [
    ("v5litepod-64", 64, 16, 4, "it has one only for v5litepod-16, v5litepod-32"),
    ("v5litepod-256", 256, 64, 4, "it has one only for v5litepod-16, v5litepod-32"),
    ("v6e-64", 64, 16, 4, "it has one only for v6e-16, v6e-32"),
    ("v6e-256", 256, 64, 4, "it has one only for v6e-16, v6e-32"),
    ("v5p-128", 64, 16, 4, "it has one only for v5p-16, v5p-32"),
    ("v4-16", 8, 2, 4, "it has none for any multi-host v4 slice"),
    ("v4-32", 16, 4, 4, "it has none for any multi-host v4 slice"),
    ("v3-32", 16, 4, 4, "it has none for any multi-host v3 slice"),
    ("v2-32", 16, 4, 4, "it has none for any multi-host v2 slice"),
    ("tpu7x-16", 8, 2, 4, "it has none for any multi-host tpu7x slice"),
])
def test_a_multi_host_type_the_table_gives_no_hosts_for_is_refused_with_what_works(tpu_type, chips, hosts, per_vm,
                                                                                   sourced) -> None:
    with pytest.raises(SpecError) as refused:
        refuse_unknown_slice(tpu_type)
    generation = tpu_type.rsplit("-", 1)[0]
    # The host count is the table's chips per VM applied, said as such; never "(16 hosts) ... gives no hosts for".
    assert str(refused.value) == (
        f"--tpu-type {tpu_type} is a multi-host slice of {chips} chips ({hosts} hosts of {per_vm} chips, if its VMs "
        f"are as the TPU table's other {generation} VMs), but the table has no source for its host count ({sourced}): "
        "every host runs the job as one JAX process (jax.distributed.initialize), so the startup script must know how "
        f"many there are, and the runner does not guess it. Multi-host types work: {MULTI_HOST}. Single-host types "
        f"work: {SINGLE_HOST}; tpu7x-8 with --on gke (see docs/tpu.md)"
    )
    assert "gives no hosts for" not in str(refused.value)
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
    assert "--tpu-type v5litepod-64 is a multi-host slice of 64 chips (16 hosts of 4 chips" in result.stderr
    assert "Single-host types work: v6e-1, v6e-4, v6e-8, v5litepod-1" in result.stderr
    help_text = invoke("submit", "--help").stdout
    assert "TPU_NAME=local" not in help_text
