"""What a run shows about itself while it trains: input wait, TensorBoard scalars, a profiler trace.

Input wait is measured, not estimated. Keras pulls each batch inside its compiled step (an
IteratorGetNext op in the graph), so no callback can time that call. Instead the input pipeline gets
one last stage that times its own GetNext: a clock dataset is zipped in front of the real one, so
the clock is read when a batch is asked for, then the real pipeline is pulled (blocking until its
prefetch buffer holds a batch), and a final map adds `now - asked_at` to a host variable. That is the
time the consumer of the pipeline was blocked on it. When the training step is itself the consumer
(one replica, steps_per_execution 1) that is the time the device waited for input. When the runtime
fetches the next batch while the device computes (several replicas or a TPU prefetch to the device;
steps_per_execution > 1) the blocked time overlaps compute, so it is an upper bound of the wait.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from runner.data.schema import plain
from runner.device.accelerator import Accelerator
from runner.device.engine import Engine
from runner.rundir.timing import EpochRecord

log = logging.getLogger(__name__)

INPUT_WAIT_METHOD = "getnext_blocked"


class InputClock:
    """Wraps a training dataset so that the time spent waiting for each batch is summed on the host."""

    def __init__(self, accelerator: Accelerator):
        with tf.device(_input_host(accelerator.strategy)):
            self._waited = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="input_wait_s")

    def wrap(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        asked = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).repeat().map(plain(lambda _: tf.timestamp()))

        def add_wait(asked_at: tf.Tensor, batch: Any) -> Any:
            update = self._waited.assign_add(tf.timestamp() - asked_at)
            with tf.control_dependencies([update]):
                return tf.nest.map_structure(tf.identity, batch)

        options = tf.data.Options()
        # tf.data would otherwise put a prefetch after the last stage, and the clock would then time the
        # prefetch thread instead of the training loop.
        options.experimental_optimization.inject_prefetch = False
        return tf.data.Dataset.zip((asked, dataset)).map(plain(add_wait)).with_options(options)

    def seconds(self) -> float:
        return float(self._waited.numpy())


def _input_host(strategy: tf.distribute.Strategy | None) -> str:
    """The host CPU of the first device, where the input pipeline runs: this machine on a TPU VM or a GPU
    machine, the TPU worker's host for a remote TPU; this process's CPU under an engine without a strategy (JAX)."""
    if strategy is None:
        return "/job:localhost/replica:0/task:0/device:CPU:0"
    try:
        first = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    except RuntimeError:  # the default strategy (one device) has no device list: this process's CPU
        return "/job:localhost/replica:0/task:0/device:CPU:0"
    return first.replace(device_type="CPU", device_index=0).to_string()


def input_clock_for(accelerator: Accelerator) -> tuple[InputClock | None, str]:
    """The clock and the method named in the summary. Several TensorFlow workers would shard files through
    tf.distribute, which the clock's extra source would block: there the wait is not measured (and the summary
    says so). Several JAX processes shard their own files first (runner/data/pipeline.py): each clocks its own."""
    if accelerator.workers > 1 and not accelerator.engine.own_input_share:
        return None, "not measured: several workers (the timing stage would stop tf.data from sharding files)"
    return InputClock(accelerator), INPUT_WAIT_METHOD


def _scalar_metadata() -> Any:
    from tensorflow.core.framework import summary_pb2

    # What tf.summary.scalar writes, without needing the tensorboard package: the "scalars" plugin
    # reads a float tensor with this metadata.
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    )


class ScalarLog:
    """TensorBoard scalars in <run>/tensorboard/{train,eval}: loss, metrics, examples/s, epoch and wait times."""

    def __init__(self, folder: str):
        self.folder = folder
        self._writers: dict[str, Any] = {}
        self._metadata = _scalar_metadata()

    def _write(self, run: str, values: dict[str, float | None], step: int) -> None:
        if run not in self._writers:
            self._writers[run] = tf.summary.create_file_writer(posixpath.join(self.folder, run))
        with self._writers[run].as_default():
            for tag, value in values.items():
                if value is not None:
                    tf.summary.write(tag, tf.constant(float(value), tf.float32), step=step, metadata=self._metadata)
        self._writers[run].flush()

    def epoch(self, record: EpochRecord) -> None:
        values = {"loss": record.loss, **record.metrics}
        values.update(
            {
                "examples_per_sec": record.examples_per_sec,
                "epoch_s": record.seconds,
                "input_wait_s": record.input_wait_s,
                "checkpoint_s": record.checkpoint_s,
            }
        )
        self._write("train", values, record.epoch)

    def evaluation(self, metrics: dict[str, float], epoch: int) -> None:
        self._write("eval", {k: v for k, v in metrics.items() if k != "examples"}, epoch)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


class ProfileWindow(keras.callbacks.Callback):
    """Traces global steps start_step .. start_step + steps - 1 (1-based) with the profiler of the engine that
    computes: TensorFlow's under `tensorflow`, JAX's (`jax.profiler`, which records XLA's computations on the
    device) under `jax`. TensorFlow's profiler under JAX would record only tf.data's host events.

    The trace is <folder>/plugins/profile/<time>/<host>.xplane.pb, which TensorBoard's profile plugin
    opens. The traced steps run slower; they stay in the epoch times, so trace a run you are not timing.
    The step is read from the optimizer once, when training begins, then counted from the batches: under JAX
    every read of a variable in a callback would copy the train state back from the device.
    """

    def __init__(self, folder: str, start_step: int, steps: int, engine: Engine):
        super().__init__()
        self.folder, self.start_step, self.steps, self.engine = folder, start_step, steps, engine
        self.traced: list[int] = []  # first and last step traced
        self.error: str | None = None
        self._active = False
        self._done = 0  # the steps trained: read once when training begins, then counted
        self._epoch_base = 0  # the steps trained when the epoch began (Keras numbers batches within an epoch)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._done = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_base = self._done

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        step = self._epoch_base + batch + 1  # with steps_per_execution, `batch` is the first of the execution's
        if self._active or self.traced or self.error or not self.start_step <= step < self.start_step + self.steps:
            return
        try:
            self.engine.start_profiler(self.folder)
        except Exception as exc:  # a trace is a diagnosis: it must never stop the training it watches
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("profiler did not start at step %d: %s", step, self.error)
            return
        self._active, self.traced = True, [step, step]
        log.info("profiling steps %d-%d into %s (%s's profiler)", step, self.start_step + self.steps - 1,
                 self.folder, self.engine.profiler)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._done = self._epoch_base + batch + 1  # `batch`: the execution's last
        if self._active:
            self.traced[1] = self._done
            if self.traced[1] >= self.start_step + self.steps - 1:
                self.close()

    def on_train_end(self, logs: dict | None = None) -> None:
        self.close()

    def close(self) -> None:
        if self._active:
            self._active = False
            try:
                self.engine.stop_profiler()
            except Exception as exc:  # noqa: BLE001 - as above: the trace is lost, the training is not
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("profiler did not stop cleanly: %s", self.error)

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_step": self.start_step,
            "steps": self.steps,
            "dir": self.folder,
            "profiler": self.engine.profiler,
            "traced_steps": self.traced or None,
            "error": self.error,
        }


def epoch_line(total_epochs: int) -> Callable[[EpochRecord], None]:
    """Logs one line per epoch: time, steps, throughput, loss and metrics."""

    def report(record: EpochRecord) -> None:
        metrics = " ".join(f"{k} {v:.4f}" for k, v in record.metrics.items())
        loss = "" if record.loss is None else f" loss {record.loss:.4f}"
        if record.partial:
            log.info(
                "epoch %d/%d interrupted after %d steps: %.2f s, %.0f examples/s,%s %s",
                record.epoch, total_epochs, record.steps, record.seconds, record.examples_per_sec, loss, metrics,
            )
            return
        log.info(
            "epoch %d/%d: %.2f s, %d steps, %.0f examples/s,%s %s",
            record.epoch, total_epochs, record.seconds, record.steps, record.examples_per_sec, loss, metrics,
        )

    return report
