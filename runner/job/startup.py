"""What must happen before TensorFlow is imported, in one place: TensorFlow, its gs:// client, Keras and libtpu
read these settings once, while they load. `plan` decides them for a command (a `StartupPlan`: the backend,
the variables set before anything loads, the optional imports skipped); `start` sets them and loads TensorFlow.
Every command that loads TensorFlow goes through both (runner/cli/common.py, runner/cli/data.py), and
`runner.cli.startup_plan(argv, environ)` gives the same plan for a command line without running it.

1. the gs:// client's retries and timeouts from `storage.timeout_s` (runner/data/storage.py);
2. Keras 3, never tf-keras: TensorFlow hands `tf.keras` to tf-keras (Keras 2) when TF_USE_LEGACY_KERAS is
   set, so the variable is refused before anything reads it (`refuse_legacy_keras`);
3. the backend Keras computes with, KERAS_BACKEND (runner/device/backend.py): `import tensorflow` imports
   Keras, so this is the one place it can be set. Nothing of TensorFlow's TPU path (PJRT_DEVICE,
   TF_PLUGGABLE_DEVICE_LIBRARY_PATH) is ever set: TensorFlow feeds data and never touches a TPU (docs/tpu.md);
   a TF_PLUGGABLE_DEVICE_LIBRARY_PATH naming libtpu is refused (`refuse_libtpu_for_tensorflow`).
Process-wide defaults that need no spec (TensorFlow's log level, oneDNN) are set when the runner package loads;
the plan lists them too, as the command will see them.

A process that has loaded TensorFlow ahead of the command (a fork server, such as the suite's
tests/support/zygote.py, which forks each command from a process that called `preload`) says so in
RUNNER_TENSORFLOW_PRELOADED: the JSON of the plan's `loaded_as()` it loaded under. `start` then checks that this
command's plan is the same and stops with exit 70 (EX_SOFTWARE) naming the variables that differ otherwise,
so that no command runs with settings it did not ask for; the variable is read once and removed. The check is
made before anything loads, whether or not TensorFlow is there already: a fresh process given a plan says
whether its own agrees (tests/test_zygote.py asks it so).

This module must never import TensorFlow itself.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.abc
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping

from runner import PROCESS_DEFAULTS, RunnerError, SpecError
from runner.data.storage import DEFAULT_TIMEOUT_S, configure_tensorflow, tensorflow_env
from runner.device import backend, engine
from runner.spec.types import AcceleratorSpec, JobSpec

log = logging.getLogger(__name__)

# The commands that load TensorFlow (runner/cli/run.py, runner/cli/data.py); the others never do.
LOADING_COMMANDS = ("run", "evaluate", "predict", "prepare", "verify", "manifest")
# Where a process that loaded TensorFlow ahead of the command says under which plan (module docstring).
PRELOADED = "RUNNER_TENSORFLOW_PRELOADED"
EXIT_PRELOADED_OTHERWISE = 70


class PreloadedOtherwise(RunnerError):
    """TensorFlow was loaded ahead of this command (RUNNER_TENSORFLOW_PRELOADED) under other settings."""

    exit_code = EXIT_PRELOADED_OTHERWISE


@dataclasses.dataclass(frozen=True)
class StartupPlan:
    """How a command's process must start: what it sets before TensorFlow, Keras and JAX load, and what it loads.

    `environment` holds every variable the runner sets or keeps for the load (a value already in the
    environment is the user's and is kept, except TF_CPP_MIN_LOG_LEVEL under `--debug` and KERAS_BACKEND for a
    job); TensorFlow, its gs:// client, Keras and JAX read them once, while they load."""

    command: str
    loads_tensorflow: bool
    backend: str | None = None  # the engine Keras loads with; None for a command that loads no TensorFlow
    reason: str = ""  # why that backend
    environment: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped_imports: tuple[str, ...] = ()  # optional imports that fail at once while TensorFlow loads
    debug: bool = False  # TensorFlow's start-up notices shown
    storage_timeout_s: float = DEFAULT_TIMEOUT_S  # the gs:// client's bound (storage.timeout_s, --storage-timeout)
    accelerator: AcceleratorSpec | None = dataclasses.field(default=None, compare=False, repr=False)

    def loaded_as(self) -> dict[str, object]:
        """What TensorFlow, Keras and JAX load under: the backend (KERAS_BACKEND, set or Keras's default), the
        rest of the environment, the optional imports skipped. Two plans that agree on it load the same."""
        named = _engine(self).environment_before_keras(None, {})  # what names the engine: compared as `backend`
        return {"backend": self.backend, "skipped_imports": list(self.skipped_imports),
                "environment": {k: v for k, v in sorted(self.environment.items()) if k not in named}}

    def to_dict(self) -> dict[str, object]:
        return {"command": self.command, "loads_tensorflow": self.loads_tensorflow, "backend": self.backend,
                "reason": self.reason, "environment": dict(sorted(self.environment.items())),
                "skipped_imports": list(self.skipped_imports), "debug": self.debug,
                "storage_timeout_s": self.storage_timeout_s}


def log_level(debug: bool, environ: Mapping[str, str]) -> str:
    """TF_CPP_MIN_LOG_LEVEL as the command sets it: 0 under `--debug`, else the environment's, else 2."""
    return "0" if debug else environ.get("TF_CPP_MIN_LOG_LEVEL", PROCESS_DEFAULTS["TF_CPP_MIN_LOG_LEVEL"])


def plan(command: str, job: JobSpec | None, debug: bool, environ: Mapping[str, str],
         storage_timeout_s: float | None = None) -> StartupPlan:
    """The start-up of `command`: a job's (`job`: run, evaluate, predict, manifest) or a data command's
    (prepare, verify: `storage_timeout_s`). The one place that decides it; reads nothing but its arguments.

    Raises AcceleratorError for a backend the job cannot have (backend.choose)."""
    if command not in LOADING_COMMANDS:
        return StartupPlan(command, False, debug=debug)
    env = {name: environ.get(name, value) for name, value in PROCESS_DEFAULTS.items()}
    env["TF_CPP_MIN_LOG_LEVEL"] = log_level(debug, environ)
    timeout_s = job.storage.timeout_s if job is not None else storage_timeout_s or DEFAULT_TIMEOUT_S
    env.update({name: environ.get(name, value) for name, value in tensorflow_env(timeout_s).items()})
    accelerator = job.accelerator if job is not None and command != "manifest" else None
    if accelerator is not None:  # what the job's engine sets before Keras loads (`start` checks it set no more)
        computes = engine.choose(accelerator, dict(environ))
        env.update(computes.environment_before_keras(accelerator, environ))
    else:  # the data commands set no backend: the environment's, else Keras's default
        computes = engine.of(backend.from_environment(environ))
    return StartupPlan(command, True, computes.name, computes.reason, env, _optional_imports(computes), debug,
                       timeout_s, accelerator)


def start(chosen: StartupPlan) -> None:
    """Sets everything the plan's TensorFlow must find in the environment when it loads, then loads it.

    Raises SpecError for TF_USE_LEGACY_KERAS or a libtpu plug-in, AcceleratorError for a backend that cannot be
    set, PreloadedOtherwise when TensorFlow was loaded ahead under another plan."""
    _settle(chosen, os.environ.pop(PRELOADED, None))
    load_tensorflow(chosen.debug, chosen.skipped_imports)


def preload(chosen: StartupPlan) -> None:
    """Loads TensorFlow as `start` would for this plan, ahead of the command: a fork server's, whose children
    set RUNNER_TENSORFLOW_PRELOADED to `json.dumps(chosen.loaded_as())` before they run a command."""
    refuse_legacy_keras(os.environ)
    refuse_libtpu_for_tensorflow(os.environ)
    os.environ.update(chosen.environment)
    os.environ.update(_engine(chosen).environment_before_keras(None, os.environ))  # a data command's too
    load_tensorflow(chosen.debug, chosen.skipped_imports)


def before_tensorflow(spec: JobSpec, debug: bool = False) -> None:
    """`start`'s settings for a job, without loading TensorFlow (for a caller that loads it itself)."""
    _settle(plan("run", spec, debug, os.environ), None)


def _settle(chosen: StartupPlan, preloaded: str | None) -> None:
    refuse_legacy_keras(os.environ)
    refuse_libtpu_for_tensorflow(os.environ)
    if preloaded is not None:
        loaded, wanted = json.loads(preloaded), chosen.loaded_as()
        differ = sorted(k for k in loaded["environment"].keys() | wanted["environment"].keys()
                        if loaded["environment"].get(k) != wanted["environment"].get(k))
        differ += [f"KERAS_BACKEND ({loaded['backend']}, not {wanted['backend']})"] * (loaded["backend"]
                                                                                    != wanted["backend"])
        if differ:
            raise PreloadedOtherwise(
                f"TensorFlow was loaded ahead of this command ({PRELOADED}) with other values of "
                f"{', '.join(differ)} than it sets: start the command in a new process")
    else:  # warns when TensorFlow is already imported (a library caller): the gs:// bounds then do not apply
        configure_tensorflow(chosen.storage_timeout_s)
    os.environ.update(chosen.environment)
    if chosen.accelerator is None:
        return
    before = dict(os.environ)
    _engine(chosen).set_before_keras(chosen.accelerator)
    unplanned = sorted(k for k in os.environ.keys() | before.keys() if os.environ.get(k) != before.get(k))
    if unplanned:  # the plan must say everything start-up sets (a fork server relies on it)
        raise RunnerError(f"runner/device/engine.py: the engine's set_before_keras set {', '.join(unplanned)}, "
                          "which its environment_before_keras does not list: the start-up plan is made from it")


def _engine(chosen: StartupPlan) -> engine.Engine:
    return engine.of(backend.Backend(chosen.backend or "tensorflow", chosen.reason))


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


def _optional_imports(computes: engine.Engine) -> tuple[str, ...]:
    """What TensorFlow's load skips: its optional imports, less what the engine needs (`Engine.needs_at_load`)."""
    return tuple(name for name in ("jax", "jaxlib", "matplotlib") if name not in computes.needs_at_load)


def load_tensorflow(debug: bool, skipped: tuple[str, ...] | None = None) -> None:
    """Imports TensorFlow with its start-up notices held back (shown with `--debug`); every other line it
    writes to stderr while loading is passed on. Call through `start` (`skipped`: the plan's optional imports;
    by default those of the engine this process computes with, `engine.active()`)."""
    if "tensorflow" in sys.modules:
        return
    if skipped is None:
        skipped = _optional_imports(engine.active())
    skip = _SkipOptional(frozenset(name for name in skipped if name not in sys.modules))
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
