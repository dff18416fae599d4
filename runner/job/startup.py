"""What must happen before TensorFlow is imported, in one place: TensorFlow, its gs:// client, Keras and libtpu
read these settings once, while they load, so a command calls `before_tensorflow` and then `load_tensorflow`.

1. the gs:// client's retries and timeouts from `storage.timeout_s` (runner/data/storage.py);
2. Keras 3, never tf-keras: TensorFlow hands `tf.keras` to tf-keras (Keras 2) when TF_USE_LEGACY_KERAS is
   set, so the variable is refused before anything reads it (`refuse_legacy_keras`);
3. the backend Keras computes with, KERAS_BACKEND (runner/device/backend.py): `import tensorflow` imports
   Keras, so this is the one place it can be set. Nothing of TensorFlow's TPU path (PJRT_DEVICE,
   TF_PLUGGABLE_DEVICE_LIBRARY_PATH) is ever set: TensorFlow feeds data and never touches a TPU (docs/tpu.md);
   a TF_PLUGGABLE_DEVICE_LIBRARY_PATH naming libtpu is refused (`refuse_libtpu_for_tensorflow`).
Process-wide defaults that need no spec (TensorFlow's log level, oneDNN) are set when the runner package loads.

This module must never import TensorFlow itself.
"""

from __future__ import annotations

import gc
import importlib.abc
import os
import re
import sys
import tempfile
from collections.abc import Mapping

from runner import SpecError
from runner.data.storage import configure_tensorflow
from runner.device import backend
from runner.spec.types import JobSpec


def before_tensorflow(spec: JobSpec) -> None:
    """Sets, in order, everything the job's TensorFlow must find in the environment when it loads.

    Raises SpecError for TF_USE_LEGACY_KERAS, AcceleratorError for a backend that cannot be set."""
    configure_tensorflow(spec.storage.timeout_s)
    refuse_legacy_keras(os.environ)
    refuse_libtpu_for_tensorflow(os.environ)
    backend.apply(backend.choose(spec.accelerator), spec.accelerator)


def refuse_legacy_keras(environ: Mapping[str, str]) -> None:
    """Refuses the values TensorFlow reads as "use tf-keras" (tensorflow/__init__.py: "true", "True", "1").

    Exit 2, not 3: the variable is the user's setting, and a relaunch (which the cloud engines give exit 3)
    would meet it again. Refused rather than cleared: a job that asked for Keras 2 is told it gets none."""
    value = environ.get("TF_USE_LEGACY_KERAS", "")
    if value in ("true", "True", "1"):
        raise SpecError(
            f"TF_USE_LEGACY_KERAS={value} asks TensorFlow for tf-keras (Keras 2), which the runner no longer "
            "supports: it trains with Keras 3 only. Unset TF_USE_LEGACY_KERAS (`unset TF_USE_LEGACY_KERAS`, or "
            "drop it from the container's environment) and run again"
        )


def refuse_libtpu_for_tensorflow(environ: Mapping[str, str]) -> None:
    """Refuses a TF_PLUGGABLE_DEVICE_LIBRARY_PATH that names libtpu: tensorflow-cpu loads that library while it
    imports, and libtpu would then hold the TPU that JAX drives (TensorFlow's TPU path is retired: docs/tpu.md).
    Exit 2, as for TF_USE_LEGACY_KERAS: the environment is the user's, and a relaunch would meet it again."""
    path = environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "")
    if "libtpu" in os.path.basename(path):
        raise SpecError(
            f"TF_PLUGGABLE_DEVICE_LIBRARY_PATH={path} points TensorFlow at libtpu, which it would load while it "
            "imports and so take the TPU from JAX: a TPU computes with JAX only, TensorFlow feeds data on the host "
            "(docs/tpu.md). Unset TF_PLUGGABLE_DEVICE_LIBRARY_PATH (and PJRT_DEVICE) and run again"
        )


# What TensorFlow's C++ start-up writes to stderr before its log level applies: absl's warning about logging
# before InitializeLog, and the oneDNN and CPU-feature notices (absl prints them whatever TF_CPP_MIN_LOG_LEVEL
# says once TF_ENABLE_ONEDNN_OPTS is set, as runner/__init__.py does).
_STARTUP_NOTICE = re.compile(r"absl::InitializeLog|oneDNN custom operations|cpu_feature_guard|TF_ENABLE_ONEDNN_OPTS")


class _SkipOptional(importlib.abc.MetaPathFinder):
    """While TensorFlow loads: the optional imports it and Keras try (`try: import ... except ImportError`) for
    features the runner never calls fail at once instead of loading. TensorFlow Lite imports JAX for its JAX
    converter and Keras imports matplotlib.pyplot for `keras.visualization`: 1.2-1.9 s of a 5.8 s start on a
    2-core AMD EPYC. Under the JAX backend Keras needs JAX, so only matplotlib is skipped. Removed once
    TensorFlow is loaded: a later `import jax` or `import matplotlib` (runner plot) loads them as usual."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ImportError(f"{fullname} is not loaded with TensorFlow (runner/job/startup.py)", name=fullname)
        return None


def _optional_imports() -> frozenset[str]:
    skipped = {"matplotlib"} if os.environ.get("KERAS_BACKEND") == "jax" else {"matplotlib", "jax", "jaxlib"}
    return frozenset(name for name in skipped if name not in sys.modules)


def load_tensorflow(debug: bool) -> None:
    """Imports TensorFlow with its start-up notices held back (shown with `--debug`); every other line it
    writes to stderr while loading is passed on. Call after `before_tensorflow`."""
    if "tensorflow" in sys.modules:
        return
    skip = _SkipOptional(_optional_imports())
    sys.meta_path.insert(0, skip)
    try:
        _import_frozen(debug)
    finally:
        sys.meta_path.remove(skip)


def _import_frozen(debug: bool) -> None:
    """`_import_quietly`, with Python's cyclic garbage collector paused while TensorFlow and Keras load, and
    what they made then frozen (`gc.freeze`): their module-level objects (half a million: functions, classes,
    op wrappers) live as long as the process, yet every full collection walked them all again, during the
    import and then through the job's tracing, input pipeline and steps. Frozen, collections skip them. On a
    2-core AMD EPYC the load took 4.8 CPU-s instead of 8.1, with the same training results (benchmarks/RESULTS.md,
    "The garbage collector at start-up"). A process forked after the import (as a test harness does) shares the
    frozen pages instead of copying them when a collection touches them."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        _import_quietly(debug)
    finally:
        if collecting:
            gc.enable()
    gc.freeze()


def _import_quietly(debug: bool) -> None:
    if debug:
        import tensorflow  # noqa: F401
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not _STARTUP_NOTICE.search(line)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
