"""The engine a job computes with, behind one face: every module outside runner/device/ asks the accelerator's
engine (`accelerator.engine`, or `active()` where no accelerator is at hand), never Keras's global, the
environment or a backend's name.

An engine answers, in the order a job meets them:
  name, reason         what computes and why (runner/device/backend.py `choose`): `accelerator.backend` in the
                       summary
  set_before_keras     what Keras and the engine read when they load (backend.py `apply`: KERAS_BACKEND, JAX's
                       host devices); `environment_before_keras` the same, set nowhere (runner/job/startup.py
                       plans with it); `needs_at_load`: what TensorFlow's load must not skip
  probe                what the engine's runtime finds of its accelerator, for `runner doctor` in a child process
                       of its own (runner/doctor/jax_tpu.py: JAX's TPU runtime)
  joins_processes      whether several processes form one job through its runtime (runner/device/processes.py);
  own_input_share      and whether each process then reads its own share of every batch (runner/data/pipeline.py)
  resolve              the devices and the scope (runner/device/tf_devices.py, jax_devices.py), for strategy.py:
                       an Accelerator whose `scope()` is TensorFlow's strategy, or nothing under JAX
  use_compile_cache    a persistent cache of compiled programs in the run folder (JAX's; TensorFlow keeps none)
  check_model          a model the engine cannot run, refused before training; `build_hint` for a build that
                       failed; `build_state`, the variables made before `fit`
  count_forward        the forward pass's FLOPs as the engine's own cost analysis counts them (runner/train/flops.py)
  start/stop_profiler  a trace of the steps the engine ran (runner/train/observe.py `ProfileWindow`)
  weights_finite       every variable and optimizer slot finite, checked where they live, one bool brought back
  serving_endpoints    the exported model's serving functions (runner/rundir/serving.py)
  matmul_chain         the matmul benchmark's chain (runner/job/matmul.py)
  checkpoint_format    the checkpoint store's format (runner/rundir/checkpoints.py, orbax_store.py)
  runs_hub_models      whether a `model.hub` job (KerasHub's language models) trains on it (runner/train/hub.py)

A third engine (PyTorch on a GPU, say) is one more class here answering the same, a name in backend.BACKENDS, and
its devices module beside jax_devices.py (docs/architecture.md, "The engine").

This module imports no TensorFlow, JAX or Keras when loaded: runner/job/startup.py asks it before either loads.
tests/test_architecture.py holds the face: outside the engine modules and the checkpoint store nothing imports
jax or orbax or compares a backend's name.
"""

from __future__ import annotations

import abc
import functools
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from runner.device import backend

# Op types whose bodies TensorFlow's profiler does not descend into: a graph holding one is undercounted.
CONTROL_FLOW_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase"})


class Engine(abc.ABC):
    """The face: what differs between engines, and nothing else."""

    name: str = ""
    profiler: str = ""  # whose profiler `start_profiler` runs, as the log and the summary name it
    flops_method: str = ""  # how `count_forward` counts, as the summary's throughput names it
    checkpoint_format: str = ""  # tensorflow | orbax: runner/rundir/checkpoints.py `Saved.store`
    joins_processes: bool = False
    own_input_share: bool = False
    needs_at_load: frozenset[str] = frozenset()
    runs_hub_models: bool = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason!r})"

    @property
    def backend(self) -> backend.Backend:
        return backend.Backend(self.name, self.reason)

    def to_dict(self) -> dict[str, str]:
        return self.backend.to_dict()

    def versions(self) -> dict[str, str]:
        """The engine's own packages beside TensorFlow and Keras, for the summary."""
        return {}

    def set_before_keras(self, spec: Any, environ: MutableMapping[str, str] | None = None) -> None:
        """Sets `environment_before_keras` in `environ` (os.environ), before Keras loads; the engine is then the
        one `active()` names."""
        backend.apply(self.backend, spec, environ)

    def environment_before_keras(self, spec: Any, environ: Mapping[str, str]) -> dict[str, str]:
        """What `set_before_keras` sets for `spec` (AcceleratorSpec; None: a command that runs no job), read from
        `environ` and set nowhere: a value `environ` holds already is kept."""
        return backend.environment(self.backend, spec, environ)

    def probe(self, start: bool = True) -> dict[str, object]:
        """What the engine's own runtime finds (its version, its accelerator's library, with `start` its devices),
        as JSON: `runner doctor` runs it in a child process of its own, where a runtime that hangs is killed.
        TensorFlow's: none (it computes on the CPU and GPUs, which the doctor's TensorFlow probe lists)."""
        return {}

    @abc.abstractmethod
    def resolve(self, spec: Any, environ: Mapping[str, str], model: Any = None) -> Any:
        """The Accelerator for `spec` (runner/device/accelerator.py), carrying this engine."""

    def input_share(self, worker_index: int, workers: int) -> tuple[int, int]:
        """(this process's share, of how many) of every batch it reads itself: all of it unless the engine's
        processes each feed their own part."""
        return (worker_index, workers) if self.own_input_share else (0, 1)

    def use_compile_cache(self, in_run_folder: str) -> str | None:
        """Keeps compiled programs where a later attempt finds them; the folder, or None (nothing kept)."""
        return None

    def check_model(self, model: Any, name: str) -> None:
        """SpecError before training for a model this engine cannot run."""
        return None

    def build_hint(self, exc: BaseException, module_name: str | None) -> str | None:
        """What to do when the user's model failed to build under this engine, if the engine is why."""
        return None

    def build_state(self, model: Any, element_spec: Any) -> None:
        """Makes the optimizer's, loss's and metrics' variables from a batch's shapes before `fit`, where the
        engine would otherwise make them while it traces the first step."""
        return None

    @abc.abstractmethod
    def count_forward(self, model: Any, specs: Any, batch: int) -> tuple[float | None, str]:
        """(FLOPs of one example's forward pass at `specs`, TensorSpecs at `batch`; how) or (None, why not)."""

    @abc.abstractmethod
    def start_profiler(self, folder: str) -> None: ...

    @abc.abstractmethod
    def stop_profiler(self) -> None: ...

    def weights_finite(self, model: Any) -> bool:
        """Whether every floating-point variable of the model and its optimizer (slots included) is finite: checked
        where the variables live (keras.ops, on the device), one bool brought back."""
        import keras

        variables = [*model.weights, *model.optimizer.variables]
        checks = [keras.ops.all(keras.ops.isfinite(v.value)) for v in variables if "float" in str(v.dtype)]
        return bool(keras.ops.convert_to_numpy(keras.ops.all(keras.ops.stack(checks)))) if checks else True

    @abc.abstractmethod
    def serving_endpoints(self, archive: Any, model: Any, inputs: Any, examples_to_inputs: Callable,
                          records: Any, names: tuple[str, str]) -> None:
        """Adds `names` (the serving function on `inputs`, the one on serialized records `records`) to
        `archive` (keras.export.ExportArchive)."""

    @abc.abstractmethod
    def matmul_chain(self, matmul: Any, strategy: Any, a: Any, b: Any) -> Callable[[], Any]:
        """A compiled call computing sum(A @ B @ ... @ B) on every device, summed; its result has `.numpy()`."""


class TensorFlow(Engine):
    """Keras 3 on TensorFlow: the CPU and GPUs, tf.distribute's strategies, one process."""

    name = "tensorflow"
    profiler = "tensorflow"
    flops_method = "tf_profiler: float_ops of the traced forward pass, x3"
    checkpoint_format = "tensorflow"
    needs_at_load = frozenset()

    def resolve(self, spec: Any, environ: Mapping[str, str], model: Any = None) -> Any:
        from runner.device import tf_devices

        return tf_devices.resolve(spec, environ)

    def build_state(self, model: Any, element_spec: Any) -> None:
        # As Keras does itself before `fit` under a tf.distribute strategy (`_maybe_symbolic_build` in
        # keras/src/backend/tensorflow/trainer.py): without it TensorFlow traces the first step twice.
        symbolic_build = getattr(model, "_symbolic_build", None)
        if symbolic_build is None:
            return
        try:
            with model.distribute_strategy.scope():
                symbolic_build(data_batch=element_spec)
        except Exception:  # noqa: BLE001  (Keras's own message comes when the first step traces)
            pass

    def count_forward(self, model: Any, specs: Any, batch: int) -> tuple[float | None, str]:
        import tensorflow as tf
        from tensorflow.python.profiler import model_analyzer, option_builder
        from tensorflow.python.util import deprecation

        try:
            graph = tf.function(lambda x: model(x, training=True), autograph=False).get_concrete_function(specs).graph
        except Exception as exc:  # a model without symbolic inputs (subclassed, never built): the per-layer count
            return None, f"the forward pass could not be traced ({type(exc).__name__}: {exc})"
        loops = sorted({op.type for op in graph.get_operations() if op.type in CONTROL_FLOW_OPS})
        if loops:
            return None, f"the traced graph holds {', '.join(loops)}, whose bodies TensorFlow's profiler does not count"
        options = option_builder.ProfileOptionBuilder.float_operation()
        options["output"] = "none"  # the profiler prints a table to stdout otherwise: stdout carries the summary
        with deprecation.silence():  # its TF1 shape helper warns on every call: noise in a user's log
            total = model_analyzer.profile(graph, options=options).total_float_ops
        if not total:
            return None, "TensorFlow's profiler counted 0 float ops (shapes unknown at trace time)"
        return total / batch, "traced"

    def start_profiler(self, folder: str) -> None:
        import tensorflow as tf

        tf.profiler.experimental.start(folder)

    def stop_profiler(self) -> None:
        import tensorflow as tf

        tf.profiler.experimental.stop()

    def serving_endpoints(self, archive: Any, model: Any, inputs: Any, examples_to_inputs: Callable,
                          records: Any, names: tuple[str, str]) -> None:
        import tensorflow as tf

        archive.add_endpoint(names[0], tf.function(lambda x: model(x, training=False), input_signature=[inputs],
                                                   autograph=False))  # as Keras's own export
        archive.add_endpoint(names[1], tf.function(lambda r: model(examples_to_inputs(r), training=False),
                                                   input_signature=[records]))

    def matmul_chain(self, matmul: Any, strategy: Any, a: Any, b: Any) -> Callable[[], Any]:
        import tensorflow as tf

        with strategy.scope():
            a, b = tf.Variable(a, trainable=False), tf.Variable(b, trainable=False)

        def replica_chain() -> tf.Tensor:
            x = a.read_value()
            for _ in range(matmul.chain):
                x = tf.matmul(x, b)
            return tf.reduce_sum(tf.cast(x, tf.float32))

        @tf.function
        def call() -> tf.Tensor:
            per_replica = strategy.run(replica_chain)
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        return call


class Jax(Engine):
    """Keras 3 on JAX: TPUs, GPUs and the CPU, several processes through JAX's runtime; tf.data on the host."""

    name = "jax"
    profiler = "jax"
    flops_method = "xla: cost_analysis of the lowered forward pass, x3"
    checkpoint_format = "orbax"
    joins_processes = True
    own_input_share = True  # each process makes its own part of every batch (runner/data/pipeline.py)
    needs_at_load = frozenset({"jax", "jaxlib"})  # TensorFlow's load skips them otherwise
    runs_hub_models = True  # KerasHub's language models on a TPU are JAX's (docs/language-models.md)

    def versions(self) -> dict[str, str]:
        import importlib.metadata

        try:
            return {"jax": importlib.metadata.version("jax")}
        except importlib.metadata.PackageNotFoundError:
            return {"jax": "unknown"}

    def resolve(self, spec: Any, environ: Mapping[str, str], model: Any = None) -> Any:
        from runner.device import jax_devices

        # `model`: the job's model, laid out over accelerator.mesh (runner/device/sharding.py); none: data-parallel
        return jax_devices.resolve(spec, environ) if model is None else jax_devices.resolve(spec, environ, model)

    def probe(self, start: bool = True) -> dict[str, object]:
        """libtpu's path (the package's and JAX's own lookup), jax's version and (`start`) the TPU devices;
        `import jax` alone starts no backend. On a slice `start` is False: libtpu waits there for every host."""
        seen: dict[str, object] = {}
        try:
            import libtpu

            seen["libtpu_path"] = libtpu.get_library_path()
        except ImportError:
            seen["libtpu_path"] = None
        try:  # JAX's own lookup (private, so guarded): TPU_LIBRARY_PATH, else the libtpu package
            from jax._src.cloud_tpu_init import get_tpu_library_path

            seen["jax_library_path"] = get_tpu_library_path()
        except ImportError:
            seen["jax_library_path"] = seen["libtpu_path"]
        import jax

        seen["jax"] = jax.__version__
        if not start:
            return seen
        try:
            devices = jax.devices("tpu")
            seen.update(tpu_devices=len(devices), device_kind=devices[0].device_kind)
        except RuntimeError as error:  # no TPU backend: libtpu missing, or loaded and no chip found
            seen.update(tpu_devices=0, error=str(error).strip())
        return seen

    def use_compile_cache(self, in_run_folder: str) -> str | None:
        """XLA's compiled programs kept in JAX's own JAX_COMPILATION_CACHE_DIR when it is set (one cache for every
        job on the machine or bucket, which jobs of one model share), else in the run folder's `jax_cache/`
        (local or gs://): a resumed or relaunched job loads what it compiled instead of compiling again."""
        import jax

        folder = os.environ.get("JAX_COMPILATION_CACHE_DIR") or in_run_folder
        jax.config.update("jax_compilation_cache_dir", folder)
        # Every program, however quick its compile: on a TPU the train step's compile is what a relaunch pays for.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        return folder

    def check_model(self, model: Any, name: str) -> None:
        from runner.device import jax_devices

        jax_devices.check_traceable(model, name)

    def build_hint(self, exc: BaseException, module_name: str | None) -> str | None:
        from runner.device import jax_devices

        return jax_devices.calls_tensorflow(exc, module_name)

    def count_forward(self, model: Any, specs: Any, batch: int) -> tuple[float | None, str]:
        """XLA's cost analysis of the lowered (not yet compiled, so not optimised and costing no compile) pass."""
        import jax

        try:
            structs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype.as_numpy_dtype), specs)
            trainable = [v.value for v in model.trainable_variables]
            other = [v.value for v in model.non_trainable_variables]

            def forward(trainable: Any, other: Any, x: Any) -> Any:
                return model.stateless_call(trainable, other, x, training=True)[0]

            cost = jax.jit(forward).lower(trainable, other, structs).cost_analysis()
        except Exception as exc:  # a model without symbolic inputs (subclassed, never built): the per-layer count
            return None, f"the forward pass could not be lowered ({type(exc).__name__}: {exc})"
        cost = cost[0] if isinstance(cost, list) else cost  # jax before 0.4.38 returned a list of one
        total = float((cost or {}).get("flops", 0.0))
        if total <= 0:
            return None, "XLA's cost analysis counted 0 flops"
        return total / batch, "lowered"

    def start_profiler(self, folder: str) -> None:
        import jax

        jax.profiler.start_trace(folder)

    def stop_profiler(self) -> None:
        import jax

        jax.effects_barrier()  # the traced steps' computations finish inside the trace
        jax.profiler.stop_trace()

    def weights_finite(self, model: Any) -> bool:
        """One jitted program over every floating-point variable, its answer replicated: a sharded model's
        processes run the same single collective, not one per variable in whatever order each reaches them."""
        values = [v.value for v in [*model.weights, *model.optimizer.variables] if "float" in str(v.dtype)]
        return bool(_all_finite()(values)) if values else True

    def serving_endpoints(self, archive: Any, model: Any, inputs: Any, examples_to_inputs: Callable,
                          records: Any, names: tuple[str, str]) -> None:
        import tensorflow as tf

        # Keras converts a JAX model's call to TensorFlow (jax2tf) when handed the plain function; the parser,
        # TensorFlow already, then calls that converted endpoint.
        serve = archive.add_endpoint(names[0], lambda x: model(x, training=False), input_signature=[inputs])
        examples = tf.function(lambda r: serve(examples_to_inputs(r)), input_signature=[records])
        examples.get_concrete_function()
        archive.add_endpoint(names[1], examples)

    def matmul_chain(self, matmul: Any, strategy: Any, a: Any, b: Any) -> Callable[[], Any]:
        """One copy of the operands per local device, summed across them (`strategy`: None, JAX's own devices)."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        devices = jax.local_devices()
        # One copy per device along a leading axis sharded over them: XLA's SPMD partitioner gives each its chain.
        spread = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)),
                                            jax.sharding.PartitionSpec("d"))
        a, b = (jax.device_put(jnp.stack([jnp.asarray(x.numpy())] * len(devices)), spread) for x in (a, b))

        def one_chain(x: jax.Array, b: jax.Array) -> jax.Array:
            for _ in range(matmul.chain):
                x = x @ b
            return jnp.sum(x.astype(jnp.float32))

        device_chain = jax.jit(jax.vmap(one_chain))

        class _Sum:  # what the benchmark reads: .numpy() waits for the devices, as a TensorFlow tensor's does
            def __init__(self, value: jax.Array):
                self.value = value

            def numpy(self) -> np.ndarray:
                return np.asarray(self.value.sum())

        return lambda: _Sum(device_chain(a, b))


ENGINES: dict[str, type[Engine]] = {"tensorflow": TensorFlow, "jax": Jax}
assert set(ENGINES) == set(backend.BACKENDS)


@functools.cache
def _all_finite() -> Callable[[list], Any]:
    """One jitted function (traced once per list of shapes and shardings, not once per call)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda values: jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in values])))


def of(chosen: backend.Backend) -> Engine:
    """The engine for a backend choice (runner/device/backend.py `choose`)."""
    return ENGINES[chosen.name](chosen.reason)


def choose(spec: Any, environ: MutableMapping[str, str] | None = None) -> Engine:
    """The engine for `spec` (AcceleratorSpec), decided before Keras loads (backend.py's order)."""
    return of(backend.choose(spec, environ))


_active: tuple[backend.Backend, Engine] | None = None


def active(environ: MutableMapping[str, str] | None = None) -> Engine:
    """The engine this process computes with (as `set_before_keras` set it, else as the environment says): the
    one `accelerator.engine` is, for code that has no accelerator at hand (the saver, export, a library caller)."""
    global _active
    chosen = backend.active(environ)
    if _active is None or _active[0] != chosen:
        _active = (chosen, of(chosen))
    return _active[1]
