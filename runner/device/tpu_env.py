"""The TPU device API for this process, chosen per TPU generation and set before TensorFlow loads.

TensorFlow reads these settings once, while it loads, so `runner run` (and the doctor's probe) call
`apply_tpu_env` before anything imports TensorFlow; this module imports none. Per generation (docs/tpu.md
has every source and what this project has run):

  v5e (v5litepod), v5p, v6e and any later generation: PJRT. Google: "TPU v5e and future TPU generations
      only support PJRT" (https://cloud.google.com/tpu/docs/runtimes). Set as Keras's TensorFlow TPU example
      sets them before importing TensorFlow (https://keras.io/keras_rs/examples/distributed_embedding_tf):
          PJRT_DEVICE=TPU
          NEXT_PLUGGABLE_DEVICE_USE_C_API=true
          TF_PLUGGABLE_DEVICE_LIBRARY_PATH=<libtpu.get_library_path()>
          TF_XLA_FLAGS += the three MLIR-bridge flags below
  v2, v3, v4: stream executor, TensorFlow's default (nothing set). Google documents both device APIs there
      from TF 2.15 and lists what PJRT lacks on them (the TPU embedding API, tf.summary with soft placement).
      NEXT_PLUGGABLE_DEVICE_USE_C_API=true in the environment asks for PJRT instead.
  a generation this process cannot learn on a TPU VM (TPU_ACCELERATOR_TYPE unset, the metadata server
      silent): PJRT, the one device API Google documents on every generation from TF 2.15.
  a TPU reached over the network (grpc://host:port, COLAB_TPU_ADDR: the old v2/v3 Colab TPUs and the TPU
      Node architecture; or a TPU name resolved through the Cloud TPU API): the generation is unknown, the
      remote TPU worker drives the TPU and this process loads no libtpu; TensorFlow's default, stream
      executor (the only device API before TF 2.15), and nothing is set.
  Ironwood (TPU7x): refused; Google: "TensorFlow is not supported on Ironwood (TPU7x)".

Which generation takes which device API is the TPU table's `tensorflow_device_api` (runner/device/tpus.json), and
the generation is parsed there too. The generation comes from TPU_ACCELERATOR_TYPE (the variable libtpu itself
reads), else from the TPU VM's metadata server (instance/attributes/accelerator-type; GCE_METADATA_HOST points
elsewhere, as for Google's clients). What was chosen is recorded in the summary as `accelerator.tpu_runtime`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import sys
import threading
import urllib.request
from collections.abc import MutableMapping
from typing import Any

from runner.device import host, tpus

RUNTIMES_DOC = "https://cloud.google.com/tpu/docs/runtimes"
KERAS_PJRT_EXAMPLE = "https://keras.io/keras_rs/examples/distributed_embedding_tf"
MLIR_BRIDGE_FLAGS = (
    "--tf_mlir_enable_mlir_bridge=true",
    "--tf_mlir_enable_convert_control_to_data_outputs_pass=true",
    "--tf_mlir_enable_merge_control_flow_pass=true",
)
PJRT_VARIABLES = ("PJRT_DEVICE", "NEXT_PLUGGABLE_DEVICE_USE_C_API", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "TF_XLA_FLAGS")
# The runtime version the TPU VM was created with, when whoever started the job passes it along.
RUNTIME_VERSION_ENV = "RUNNER_TPU_RUNTIME_VERSION"
_METADATA_PATH = "/computeMetadata/v1/instance/attributes/accelerator-type"
_METADATA_TIMEOUT_S = 3.0
_FALSE = ("0", "false", "no", "off")

_applied: TpuRuntime | None = None


@dataclasses.dataclass(frozen=True)
class TpuRuntime:
    """The device API a TPU job runs with, why, and the settings that select it."""

    device_api: str  # pjrt | stream_executor
    why: str  # the rule that chose it, with its source
    generation: str | None = None
    accelerator_type: str | None = None
    generation_from: str = "unknown"  # TPU_ACCELERATOR_TYPE | metadata server | the TPU address | unknown
    libtpu: str | None = None  # the libtpu distribution's version, when installed
    runtime_version: str | None = None
    settings: dict[str, str] = dataclasses.field(default_factory=dict)  # set by the runner
    found: dict[str, str] = dataclasses.field(default_factory=dict)  # already in the environment, kept
    problem: str | None = None  # why the TPU cannot start this way; None when it can

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def api(self) -> str:
        return {"pjrt": "PJRT", "stream_executor": "stream executor"}[self.device_api]

    def describe(self) -> str:
        """e.g. `PJRT for v5litepod-8 (metadata server)`, `PJRT for an unknown TPU generation`."""
        what = self.api
        if self.accelerator_type:
            return f"{what} for {self.accelerator_type} ({self.generation_from})"
        if self.generation_from == "the TPU address":
            return f"{what} (TensorFlow's default) for a remote TPU"
        return f"{what} for an unknown TPU generation"


def device_api_of(accelerator_type: str) -> tuple[str, str | None]:
    """(the generation's name, the TensorFlow device API the TPU table gives it: pjrt, stream_executor or None
    where TensorFlow does not run); an unknown name comes back as written, with `unknown` for its API."""
    found = tpus.generation_of(accelerator_type)
    if found is None:
        return tpus.generation_name(accelerator_type), "unknown"
    return found.name, found.row["tensorflow_device_api"]


def metadata_accelerator_type(environ: MutableMapping[str, str], timeout: float = _METADATA_TIMEOUT_S) -> str | None:
    """The TPU VM's accelerator type from its metadata server; None when nothing answers in `timeout`.

    The default address is the server's link-local IP (no DNS lookup to hang on); no proxy is used.
    """
    host = environ.get("GCE_METADATA_HOST") or "169.254.169.254"
    request = urllib.request.Request(f"http://{host}{_METADATA_PATH}", headers={"Metadata-Flavor": "Google"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    answer: dict[str, str] = {}

    def ask() -> None:
        try:
            with opener.open(request, timeout=timeout) as response:
                answer["type"] = response.read().decode().strip()
        except (OSError, ValueError):
            pass

    # A thread bounds the whole exchange: a socket timeout alone does not bound a server that trickles.
    thread = threading.Thread(target=ask, name="tpu-metadata", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return answer.get("type") or None


def _libtpu() -> tuple[str | None, str | None]:
    """(version, path of libtpu.so) of the pip package `libtpu`; (None, None) when it is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        return None, None
    try:
        version = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        version = None
    import libtpu  # a few lines of Python: it loads nothing until TensorFlow does

    return version, libtpu.get_library_path()


def _xla_flags(current: str) -> str:
    """TF_XLA_FLAGS with the MLIR-bridge flags added; a flag already there keeps its value."""
    present = {flag.split("=", 1)[0] for flag in current.split()}
    missing = [flag for flag in MLIR_BRIDGE_FLAGS if flag.split("=", 1)[0] not in present]
    return " ".join([*current.split(), *missing])


def _pjrt(base: dict[str, Any], environ: MutableMapping[str, str]) -> TpuRuntime:
    version, library = _libtpu()
    found = {k: environ[k] for k in PJRT_VARIABLES if environ.get(k)}
    settings: dict[str, str] = {}
    problem = None
    if (environ.get("NEXT_PLUGGABLE_DEVICE_USE_C_API", "").lower() in _FALSE
            and "NEXT_PLUGGABLE_DEVICE_USE_C_API" in found):
        problem = (f"NEXT_PLUGGABLE_DEVICE_USE_C_API={found['NEXT_PLUGGABLE_DEVICE_USE_C_API']} turns PJRT off, but "
                   f"{base.get('generation') or 'this TPU'} needs it ({RUNTIMES_DOC}): unset it")
    path = found.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH") or library
    if problem is None and path is None:
        problem = ("PJRT needs libtpu, and the pip package `libtpu` is not installed here: run the TPU image "
                   "(tensorflow-tpu with its pinned libtpu; docs/tpu.md), or set TF_PLUGGABLE_DEVICE_LIBRARY_PATH")
    elif problem is None and not os.path.isfile(path):
        problem = f"TF_PLUGGABLE_DEVICE_LIBRARY_PATH={path} is not a file: point it at libtpu.so, or unset it"
    if problem is None:
        wanted = {"PJRT_DEVICE": "TPU", "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
                  "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": path}
        settings = {k: v for k, v in wanted.items() if k not in found}
        flags = _xla_flags(environ.get("TF_XLA_FLAGS", ""))
        if flags != environ.get("TF_XLA_FLAGS", ""):
            settings["TF_XLA_FLAGS"] = flags
    return TpuRuntime("pjrt", libtpu=version, settings=settings, found=found, problem=problem, **base)


def choose_tpu_env(target: str, environ: MutableMapping[str, str] | None = None,
                   metadata_timeout: float = _METADATA_TIMEOUT_S) -> TpuRuntime:
    """The device API for the TPU `target` (local, a TPU name or grpc://host:port); changes nothing."""
    environ = os.environ if environ is None else environ
    runtime_version = environ.get(RUNTIME_VERSION_ENV) or None
    if target != "local":
        how = "a grpc:// address" if target.startswith("grpc://") else "a TPU name, resolved through the Cloud TPU API"
        why = (f"generation unknown: the TPU is reached over the network ({how}; COLAB_TPU_ADDR: the old v2/v3 Colab "
               "TPUs, the TPU Node architecture), where the TPU worker drives it and this process loads no libtpu; "
               f"TensorFlow's default, stream executor, the only device API before TF 2.15 ({RUNTIMES_DOC}); "
               "nothing is set")
        found = {k: environ[k] for k in PJRT_VARIABLES if environ.get(k)}
        return TpuRuntime("stream_executor", why, generation_from="the TPU address", runtime_version=runtime_version,
                          found=found)
    if environ.get("TPU_LOAD_LIBRARY") == "0":
        why = "TPU_LOAD_LIBRARY=0: this process loads no libtpu; TensorFlow's default, nothing is set"
        return TpuRuntime("stream_executor", why, runtime_version=runtime_version)
    accelerator_type, source = environ.get("TPU_ACCELERATOR_TYPE") or None, "TPU_ACCELERATOR_TYPE"
    if accelerator_type is None:
        accelerator_type, source = metadata_accelerator_type(environ, metadata_timeout), "metadata server"
    generation, device_api = device_api_of(accelerator_type) if accelerator_type else (None, "unknown")
    base: dict[str, Any] = {
        "generation": generation, "accelerator_type": accelerator_type,
        "generation_from": source if accelerator_type else "unknown", "runtime_version": runtime_version,
    }
    if device_api is None:
        why = f"Google: TensorFlow is not supported on Ironwood (TPU7x) ({RUNTIMES_DOC})"
        return TpuRuntime("pjrt", why, problem=f"{accelerator_type}: TensorFlow does not run on this TPU generation "
                          f"({RUNTIMES_DOC}); use a v5e, v5p or v6e type", **base)
    asked_pjrt = environ.get("NEXT_PLUGGABLE_DEVICE_USE_C_API", "").lower() == "true"
    if device_api == "stream_executor" and not asked_pjrt:
        why = (f"{generation}: stream executor, TensorFlow's default; Google documents it and PJRT there from TF 2.15, "
               f"and PJRT lacks the TPU embedding API and tf.summary with soft placement on {generation} "
               f"({RUNTIMES_DOC}); NEXT_PLUGGABLE_DEVICE_USE_C_API=true asks for PJRT")
        version, _ = _libtpu()
        found = {k: environ[k] for k in PJRT_VARIABLES if environ.get(k)}
        return TpuRuntime("stream_executor", why, libtpu=version, found=found, **base)
    if device_api == "stream_executor":
        why = (f"{generation}: PJRT, asked for by NEXT_PLUGGABLE_DEVICE_USE_C_API=true "
               f"(documented from TF 2.15; {RUNTIMES_DOC})")
    elif device_api == "pjrt":
        why = (f"{generation}: PJRT, the only device API Google supports from v5e on ({RUNTIMES_DOC}); "
               f"settings as {KERAS_PJRT_EXAMPLE}")
    elif generation is not None:
        why = (f"{generation}: a generation after v6e, PJRT "
               f"(Google: future generations only support PJRT; {RUNTIMES_DOC})")
    else:
        why = ("generation unknown (TPU_ACCELERATOR_TYPE unset, no answer from the metadata server): PJRT, the device "
               f"API Google documents on every TPU generation from TF 2.15 ({RUNTIMES_DOC}); set TPU_ACCELERATOR_TYPE "
               "to choose by generation")
    return _pjrt({"why": why, **base}, environ)


def apply_tpu_env(target: str | None, environ: MutableMapping[str, str] | None = None,
                  metadata_timeout: float = _METADATA_TIMEOUT_S) -> TpuRuntime | None:
    """Chooses the device API for `target` and sets its variables in `environ` (os.environ by default).

    Must run before TensorFlow is imported (it reads them once while loading); afterwards it records the
    choice as a problem instead of setting anything. None (and nothing set) when no TPU is targeted.
    """
    global _applied
    if target is None:
        return None
    environ = os.environ if environ is None else environ
    chosen = choose_tpu_env(target, environ, metadata_timeout)
    if chosen.settings and "tensorflow" in sys.modules and environ is os.environ:
        chosen = dataclasses.replace(chosen, settings={}, problem=(
            "TensorFlow was imported before the TPU settings could be set; they must be in place before it "
            f"loads: {', '.join(f'{k}={v}' for k, v in chosen.settings.items())}"
        ))
    if chosen.problem is None:
        environ.update(chosen.settings)
    _applied = chosen
    return chosen


def prepare_tpu_env(kind: str, tpu: str | None, environ: MutableMapping[str, str] | None = None) -> TpuRuntime | None:
    """For a job spec's `accelerator.kind` and `accelerator.tpu`: the device API of the TPU it would try
    (runner/device/host.py's order), set in the environment; None when the job tries no TPU."""
    if kind not in ("auto", "tpu"):
        return None
    return apply_tpu_env(host.tpu_target(tpu, os.environ if environ is None else environ), environ)


def applied_tpu_env() -> TpuRuntime | None:
    """What `apply_tpu_env` chose in this process, if it ran."""
    return _applied
