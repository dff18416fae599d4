"""The training core: Keras `fit` with the runner's callbacks. It is handed built objects and does no I/O
of its own; checkpoint saves go through the `save` function it is given, and a preemption notice
(runner/train/preemption.py) arrives as a flag it reads between steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import keras
import tensorflow as tf

from runner import Diverged
from runner.device import engine
from runner.rundir.timing import EpochRecord
from runner.train.preemption import PreemptionNotice


@dataclasses.dataclass
class Plan:
    """Where training starts and ends, in steps; an epoch is `steps_per_epoch` steps."""

    steps_per_epoch: int
    epochs: int
    start_step: int = 0

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    def legs(self) -> list[tuple[int, int, int]]:
        """(initial_epoch, epochs, steps_per_epoch) for each `fit` call: a resumed partial epoch runs alone first."""
        epoch, into = divmod(self.start_step, self.steps_per_epoch)
        legs = []
        if into:
            legs.append((epoch, epoch + 1, self.steps_per_epoch - into))
            epoch += 1
        if epoch < self.epochs:
            legs.append((epoch, self.epochs, self.steps_per_epoch))
        return legs


class StepCount(keras.callbacks.Callback):
    """The global step (`self.step`, the steps trained so far): read from the optimizer once when a `fit` begins,
    then counted from the batches, which Keras numbers within each epoch (with steps_per_execution, `batch` at a
    batch's end is the execution's last). Under JAX every read of a variable in a callback copies the whole train
    state back from the devices (keras/src/backend/jax/trainer.py `jax_state_sync`); counting reads nothing.
    A subclass that overrides these hooks calls them first."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self._epoch_base = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_base = self.step

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.step = self._epoch_base + batch + 1


class Recorder(StepCount):
    """Times epochs and the first device execution; records loss and metrics per epoch.

    `checkpoint_clock` and `input_clock` return running totals (seconds spent saving checkpoints, seconds
    the loop waited on input); each epoch records its share, and its `seconds` exclude the saves.
    """

    def __init__(
        self,
        global_batch: int,
        on_epoch: Callable[[EpochRecord], None] = lambda r: None,
        checkpoint_clock: Callable[[], float] = lambda: 0.0,
        input_clock: Callable[[], float | None] = lambda: None,
    ):
        super().__init__()
        self.global_batch = global_batch
        self._checkpoint_clock, self._input_clock = checkpoint_clock, input_clock
        self._saved_at_begin, self._waited_at_begin = 0.0, None
        self.epochs: list[EpochRecord] = []
        self.plan: Plan | None = None  # set by the loop: an epoch ending off its plan's step boundary is partial
        self.train_s = 0.0
        self._on_epoch = on_epoch
        self._first_step_s: float | None = None
        self._epoch_start = self._batch_start = 0.0
        self._step_at_begin = 0
        # Per-epoch validation runs inside fit's epoch; its seconds are kept out of training throughput.
        self.validation_s = 0.0
        self._validation_in_epoch = self._test_start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_begin(epoch, logs)
        self._step_at_begin = self.step
        self._first_in_epoch: float | None = None
        self._validation_in_epoch = 0.0
        self._saved_at_begin, self._waited_at_begin = self._checkpoint_clock(), self._input_clock()
        self._epoch_start = time.monotonic()

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._test_start = time.monotonic()

    def on_test_end(self, logs: dict | None = None) -> None:
        seconds = time.monotonic() - self._test_start
        self._validation_in_epoch += seconds
        self.validation_s += seconds

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._first_step_s is None:
            self._batch_start = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_end(batch, logs)
        if self._first_step_s is None:
            self._first_step_s = self._first_in_epoch = time.monotonic() - self._batch_start

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        saved = self._checkpoint_clock() - self._saved_at_begin
        seconds = time.monotonic() - self._epoch_start - self._validation_in_epoch - saved
        waited = self._input_clock()
        self.train_s += seconds
        logs = dict(logs or {})
        loss = logs.pop("loss", None)
        steps = self.step - self._step_at_begin
        record = EpochRecord(
            epoch=epoch + 1,
            seconds=round(seconds, 4),
            steps=steps,
            examples_per_sec=round(steps * self.global_batch / seconds, 1) if seconds > 0 else 0.0,
            loss=None if loss is None else float(loss),
            metrics={k: float(v) for k, v in logs.items()},
            first_step_s=None if self._first_in_epoch is None else round(self._first_in_epoch, 4),
            checkpoint_s=round(saved, 4),
            input_wait_s=(
                None if waited is None or self._waited_at_begin is None else round(waited - self._waited_at_begin, 4)
            ),
            partial=self.plan is not None and self.step % self.plan.steps_per_epoch != 0,
        )
        self.epochs.append(record)
        self._on_epoch(record)


def _diverged(what: str, epoch: int, step: int) -> Diverged:
    return Diverged(f"training diverged: {what} at epoch {epoch}, step {step}")


def weights_finite(model: keras.Model) -> bool:
    """Whether every floating-point variable of the model and its optimizer (slots included) is finite: checked
    where the variables live (keras.ops, on the device under either backend), one bool brought back."""
    return engine.active().weights_finite(model)


class FiniteLoss(keras.callbacks.Callback):
    """Stops training at the first step whose loss is NaN or infinite, raising Diverged (exit 1).

    It runs before the other callbacks, so a diverged step is never recorded nor saved. The loss Keras
    reports at a step is the epoch's running mean, finite until a step's loss is not; with
    steps_per_execution > 1 it is checked once per execution, naming its last step. Reading it waits for
    the step to finish (as the progress bar does); the checkpoint saves check the weights themselves.
    """

    def __init__(self) -> None:
        super().__init__()
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch + 1

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._check(logs, "loss")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._check(logs, "loss", "val_loss")

    def _check(self, logs: dict | None, *keys: str) -> None:
        for key in keys:
            value = (logs or {}).get(key)
            if value is not None and not math.isfinite(float(value)):
                what = "the loss" if key == "loss" else "the validation loss"
                step = int(self.model.optimizer.iterations.numpy())
                raise _diverged(f"{what} is not finite ({float(value)})", self._epoch, step)


class Checkpointer(StepCount):
    """Saves every `every_steps` steps and at each epoch end; on a preemption notice, saves and stops.
    Weights that are not finite are never saved: Diverged (exit 1) instead."""

    def __init__(self, save: Callable[[int], None], every_steps: int | None, notice: PreemptionNotice):
        super().__init__()
        self._save, self._every, self._notice = save, every_steps, notice
        self.preempted = False
        self.saved_after_notice_s: float | None = None
        self._last_saved = -1
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_begin(epoch, logs)
        self._epoch = epoch + 1

    def _save_once(self) -> None:
        step = self.step
        if step != self._last_saved:
            # A step can leave NaN weights behind a finite loss (the loss is computed before the update).
            if not weights_finite(self.model):
                raise _diverged("the weights are not finite (the loss before the update was)", self._epoch, step)
            self._save(step)
            self._last_saved = step

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_end(batch, logs)
        # Several processes stop together, at the step they agreed on; one process stops at its next step.
        notice = self._notice
        noticed = notice.reached_sync_point(self.step) if notice.shared else notice.received.is_set()
        if noticed:
            self._save_once()
            self.saved_after_notice_s = self._notice.seconds_since()
            self.preempted = True
            self.model.stop_training = True
        elif self._every and self.step % self._every == 0:
            self._save_once()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self.preempted:
            self._save_once()


def plateau_callbacks(
    early_stopping_patience: int | None, reduce_lr_patience: int | None, reduce_lr_factor: float
) -> list[keras.callbacks.Callback]:
    """Callbacks that watch val_loss: early stopping (keeping the best weights) and learning-rate cuts."""
    callbacks: list[keras.callbacks.Callback] = []
    if reduce_lr_patience is not None:
        callbacks.append(
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=reduce_lr_factor, patience=reduce_lr_patience)
        )
    if early_stopping_patience is not None:
        callbacks.append(
            keras.callbacks.EarlyStopping(
                monitor="val_loss", patience=early_stopping_patience, restore_best_weights=True
            )
        )
    return callbacks


def build_state(model: keras.Model, element_spec: object) -> None:
    """Creates the optimizer's and the compiled loss's and metrics' variables from the shapes of a batch before
    the first step, as Keras does itself before `fit` under a tf.distribute strategy (`_maybe_symbolic_build` in
    keras/src/backend/tensorflow/trainer.py; Keras on JAX does it before every `fit`). Without a strategy, Keras
    on TensorFlow creates them while it traces the first step, and TensorFlow then traces that step again (a
    function that made variables is traced a second time without them): about half of the first step's time
    (benchmarks/RESULTS.md, "The first step"). Restored optimizer slots are assigned as they are created. A
    model Keras cannot build from shapes alone (a subclassed model whose call needs real values) is left to
    build while the first step traces, as it did without this."""
    engine.active().build_state(model, element_spec)


def fit(
    model: keras.Model,
    dataset: tf.data.Dataset,
    plan: Plan,
    recorder: Recorder,
    checkpointer: Checkpointer,
    extra_callbacks: list[keras.callbacks.Callback] = (),
    verbose: int = 0,
    validation: tuple[tf.data.Dataset, int] | None = None,
    class_weight: dict[int, float] | None = None,
    validation_every: int = 1,
) -> None:
    """Runs `fit` leg by leg from `plan.start_step`; stops early (without error) on a preemption notice
    or when a callback (early stopping) ends training, and with Diverged when the loss is NaN or infinite.
    `validation` is (dataset, steps), run after every `validation_every`-th epoch. Keras counts them from the
    job's first epoch (`initial_epoch` included: keras/src/trainers/trainer.py `_should_eval`), so a resumed
    job validates on the same epochs as one that ran through."""
    val_data, val_steps = validation if validation is not None else (None, None)
    finite = FiniteLoss()
    build_state(model, dataset.element_spec)
    for initial_epoch, epochs, steps in plan.legs():
        model.fit(
            dataset,
            initial_epoch=initial_epoch,
            epochs=epochs,
            steps_per_epoch=steps,
            validation_data=val_data,
            validation_steps=val_steps,
            validation_freq=validation_every,
            # A non-finite loss stops training before any other callback records or saves the step; the
            # checkpointer comes before the extra callbacks: each epoch is saved before they act on it.
            callbacks=[finite, recorder, checkpointer, *extra_callbacks],
            class_weight=class_weight,
            verbose=verbose,
            shuffle=False,  # the dataset shuffles itself; Keras would only warn
        )
        # A leg stopped by a notice or by early stopping ends the job; the next leg would need a fresh epoch.
        if checkpointer.preempted or model.stop_training:
            return
