"""Training progress a person can follow, on a terminal or in a log, and the line that closes a run.

On a terminal (stderr is a TTY) a Rich progress bar shows the step, examples/s, the time left and the loss;
while it is live the runner's log lines are printed through the bar's console, above it, so neither breaks
the other (Keras's own bar is off: `fit(verbose=0)`). Without a terminal (a container, a TPU VM's startup
script, a CI log) a plain log line every `every_s` seconds says the same, so a long epoch is never silent.

The step count is read from the `batch` Keras hands each callback (the last step of the execution, so
`steps_per_execution` > 1 works too), never from the device, and the display is refreshed a few times a
second at most: following the run adds no synchronisation to training. The first step traces and
compiles; the rate and the time left are measured from the end of that step on.
"""

from __future__ import annotations

import logging
import posixpath
import sys
import threading
import time
from typing import Any, TextIO

import keras

from runner.rundir.summary import Recorded

log = logging.getLogger(__name__)

DEFAULT_EVERY_S = 30.0
_BAR_REFRESH_S = 0.25


def duration(seconds: float | None) -> str:
    """12 s, 4m 05s, 2h 03m: short enough for a progress line."""
    if seconds is None:
        return "?"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


class Progress(keras.callbacks.Callback):
    """Counts steps across `fit` legs (a resumed partial epoch is a leg of its own: runner/train/fit.py Plan).

    `start_step` is the global step training starts from; subclasses show what was measured in `_show`,
    called at most every `interval_s` seconds and once at the end of each leg (`final`).
    """

    interval_s = _BAR_REFRESH_S
    rate_window_s = 3.0  # examples/s is measured over at least this long, so the figure holds still

    def __init__(self, *, steps_per_epoch: int, epochs: int, start_step: int, global_batch: int):
        super().__init__()
        self.steps_per_epoch, self.epochs, self.global_batch = steps_per_epoch, epochs, global_batch
        self.total_steps = steps_per_epoch * epochs
        self.step = start_step
        self.epoch = min(epochs, start_step // steps_per_epoch + 1)  # 1-based, the epoch being run
        self.loss: float | None = None
        self.validating = False
        self._epoch_first_step = start_step
        self._started: tuple[float, int] | None = None  # (time, step) when the first (compiling) step ended
        self._window: tuple[float, int] | None = None  # (time, step) when last shown: the current rate
        self._rate: float | None = None  # steps/s since it was last shown
        self._shown_at = self._began = time.monotonic()

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._shown_at = self._began = time.monotonic()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        # Keras counts `batch` from the start of this leg's epoch, which a resumed leg enters at its saved step.
        self.epoch = epoch + 1
        self._epoch_first_step = max(self.step, epoch * self.steps_per_epoch)
        self.validating = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.monotonic()
        self.step = self._epoch_first_step + batch + 1
        if self._started is None:
            self._started = self._window = (now, self.step)
        if now - self._shown_at >= self.interval_s:
            loss = (logs or {}).get("loss")
            self.loss = self.loss if loss is None else float(loss)
            self._measure(now)
            self._show(final=False)
            self._shown_at = now

    def on_test_begin(self, logs: dict | None = None) -> None:
        self.validating = True

    def on_test_end(self, logs: dict | None = None) -> None:
        self.validating = False

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        loss = (logs or {}).get("loss")
        self.loss = self.loss if loss is None else float(loss)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._measure(time.monotonic())
        self._show(final=True)

    def close(self) -> None:
        """Ends the display; safe to call twice, and after training failed inside `fit`."""

    def _measure(self, now: float) -> None:
        if self._window is None or self.step <= self._window[1]:
            return
        if now - self._window[0] >= self.rate_window_s or self._rate is None:
            self._rate = (self.step - self._window[1]) / (now - self._window[0])
            self._window = (now, self.step)

    def examples_per_sec(self) -> float | None:
        return None if self._rate is None else self._rate * self.global_batch

    def eta_s(self) -> float | None:
        """Time left at the average pace since the first step (checkpoint saves and validation included)."""
        if self._started is None:
            return None
        began, first = self._started
        elapsed, done = time.monotonic() - began, self.step - first
        if done <= 0 or elapsed <= 0:
            return None
        return (self.total_steps - self.step) * elapsed / done

    def _show(self, final: bool) -> None:
        """Shows nothing: `--progress-every 0` without a terminal."""


class LogLines(Progress):
    """One log line every `every_s` seconds: epoch, step/steps, examples/s, time left, loss."""

    def __init__(self, *, every_s: float, **kwargs: Any):
        super().__init__(**kwargs)
        self.interval_s = self.rate_window_s = every_s

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        if self._started is None:
            log.info(
                "training %d epochs x %d steps (batch %d) from step %d; the first step compiles; a progress "
                "line every %s",
                self.epochs, self.steps_per_epoch, self.global_batch, self.step, duration(self.interval_s),
            )
            # No step ends while the first one traces and compiles (minutes for a big model on a TPU): a
            # thread says so every interval, so a log never falls silent.
            self._compiled = threading.Event()
            threading.Thread(target=self._while_compiling, daemon=True, name="progress").start()

    def _while_compiling(self) -> None:
        while not self._compiled.wait(self.interval_s):
            log.info("epoch %d/%d: the first step is still tracing and compiling (%s so far)",
                     self.epoch, self.epochs, duration(time.monotonic() - self._began))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.close()
        super().on_train_batch_end(batch, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.close()
        super().on_train_end(logs)

    def close(self) -> None:
        compiled = getattr(self, "_compiled", None)
        if compiled is not None:
            compiled.set()

    def _show(self, final: bool) -> None:
        if not final:  # the epoch lines and the closing message say the rest
            log.info("%s", self.line())

    def line(self) -> str:
        rate = self.examples_per_sec()
        if rate is None and self._started is not None:  # the first step has just ended: it traced and compiled
            return (
                f"epoch {self.epoch}/{self.epochs}, step {self.step:,}/{self.total_steps:,}: the first step (tracing "
                f"and compiling) took {duration(self._started[0] - self._began)}"
            )
        parts = [
            f"epoch {self.epoch}/{self.epochs}" + (" (validating)" if self.validating else ""),
            f"step {self.step:,}/{self.total_steps:,} ({self.step / max(self.total_steps, 1):.0%})",
            f"{rate or 0:,.0f} examples/s",
            f"ETA {duration(self.eta_s())}",
        ]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        return ", ".join(parts)


class Bar(Progress):
    """A Rich progress bar on `stream`; the runner's log lines print above it while it is live."""

    def __init__(self, *, stream: TextIO, **kwargs: Any):
        super().__init__(**kwargs)
        from rich.console import Console

        self.console = Console(file=stream)
        self._progress: Any = None
        self._task: Any = None
        self._swapped: list[tuple[logging.Handler, logging.Handler]] = []

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        if self._progress is None:
            self._start()

    def _start(self) -> None:
        from rich.progress import BarColumn, TextColumn
        from rich.progress import Progress as RichProgress

        self._progress = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed:,.0f}/{task.total:,.0f}"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("{task.fields[loss]}"),
            console=self.console,
            refresh_per_second=4,
            redirect_stdout=False,  # stdout carries the summary; only stderr shares the screen with the bar
            redirect_stderr=True,
        )
        self._task = self._progress.add_task(
            self._description(), total=self.total_steps, completed=self.step, rate="compiling", eta="?", loss=""
        )
        self._route_logging()
        self._progress.start()

    def _route_logging(self) -> None:
        """Log handlers writing to stderr (runner/cli/common.py's) are swapped for a RichHandler on the bar's
        console while it is live: their lines print above the bar instead of into it."""
        from rich.logging import RichHandler

        root = logging.getLogger()
        for handler in list(root.handlers):
            if type(handler) is not logging.StreamHandler or handler.stream not in (sys.stderr, sys.__stderr__):
                continue
            rich_handler = RichHandler(
                console=self.console, show_time=False, show_level=False, show_path=False, markup=False,
                rich_tracebacks=False,
            )
            rich_handler.setLevel(handler.level)
            rich_handler.setFormatter(handler.formatter)
            for log_filter in handler.filters:
                rich_handler.addFilter(log_filter)
            root.removeHandler(handler)
            root.addHandler(rich_handler)
            self._swapped.append((handler, rich_handler))

    def _description(self) -> str:
        return f"epoch {self.epoch}/{self.epochs}" + (" validating" if self.validating else "")

    def _show(self, final: bool) -> None:
        if self._progress is None:
            return
        rate = self.examples_per_sec()
        self._progress.update(
            self._task,
            completed=self.step,
            description=self._description(),
            rate="compiling" if rate is None else f"{rate:,.0f} examples/s",
            eta=duration(0 if final else self.eta_s()),
            loss="" if self.loss is None else f"loss {self.loss:.4f}",
        )

    def on_test_begin(self, logs: dict | None = None) -> None:
        super().on_test_begin(logs)
        self._show(final=False)

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)
        self.close()

    def close(self) -> None:
        if self._progress is None:
            return
        self._progress.stop()
        self._progress = None
        root = logging.getLogger()
        for original, rich_handler in self._swapped:
            root.removeHandler(rich_handler)
            root.addHandler(original)
        self._swapped = []


def for_training(
    *, steps_per_epoch: int, epochs: int, start_step: int, global_batch: int, every_s: float | None = DEFAULT_EVERY_S,
    stream: TextIO | None = None,
) -> Progress:
    """A bar when `stream` (default stderr) is a terminal, else a log line every `every_s` seconds (0 or None:
    no lines; the bar is shown on a terminal either way)."""
    stream = stream or sys.stderr
    kwargs = dict(steps_per_epoch=steps_per_epoch, epochs=epochs, start_step=start_step, global_batch=global_batch)
    if _is_terminal(stream):
        return Bar(stream=stream, **kwargs)
    if not every_s:
        return Progress(**kwargs)
    return LogLines(every_s=every_s, **kwargs)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def closing_line(summary: dict[str, Any], already_complete: bool = False, refused: bool = False) -> str:
    """One line for a person, printed to stderr before the JSON summary: status, epochs, result, time, where.
    `refused`: the job ended with a spec, flag or data error (exit 2)."""
    said = Recorded.of(summary) or Recorded()
    status, run_dir = said.status or "?", said.run_dir
    total_s = said.times.total_s
    if said.kind == "matmul_bench":  # trains nothing
        warm = said.tflops.warm
        result = "" if warm is None else f", {warm:.4g} TFLOPS warm"
        return f"{status}: matmul benchmark{result} in {duration(total_s)}; summary: {run_dir}/summary.json"
    records = said.epochs
    planned = said.train_epochs
    done = records[-1].epoch if records else None
    if already_complete:
        return (
            f"already complete: {planned} epoch{'s' * (planned != 1)}{_result(summary)}, trained earlier"
            + _model_at(summary)
        )
    epochs = f"{done or 0} of {planned} epoch{'s' * (planned != 1)}" if planned else "no epochs"
    computed = _precision(summary) + _mfu(summary)
    if said.stopped_early_after_epoch and status in ("succeeded", "learned_nothing"):
        epochs = (f"early stopping ended it after {epochs} (val_loss stopped improving; the best epoch's weights "
                  "were kept)")
    if status == "succeeded":
        return f"succeeded: {epochs}{_result(summary)} in {duration(total_s)}{computed}" + _model_at(summary)
    if status == "learned_nothing":  # trained and saved, but at chance: the warning follows
        return f"learned nothing: {epochs}{_result(summary)} in {duration(total_s)}{computed}" + _model_at(summary)
    if status in ("preempted", "interrupted", "time_limit"):  # saved, and the same command continues
        saves = said.checkpoint_saves
        saved = (saves.saves or 0) > 0 if saves else bool(records)  # a stop before training saved nothing new
        what = f"checkpoint saved in {run_dir}/checkpoints" if saved else "no new checkpoint was saved"
        if newest := said.newest_checkpoint:
            what += f" (the newest whole one: {posixpath.basename(newest.rstrip('/'))})"
        return (
            f"{status.replace('_', ' ')} {_where_stopped(summary) or 'after ' + epochs} in {duration(total_s)}: "
            f"{what}; run the same command again to continue"
        )
    where = f"; run folder: {run_dir}" if run_dir else ""
    if refused and not [r for r in records if r.attempt == said.attempt]:
        # Epochs listed are earlier attempts': this one trained nothing, so "failed after N epochs" would mislead.
        earlier = f" ({epochs} were trained earlier)" if done else ""
        return f"refused before training, in {duration(total_s)}{where}{earlier} (the error says what to change)"
    # A refusal at start (a spec or data error) trained nothing: "after 0 of 4 epochs" would suggest it did.
    when = "before training began," if not records and not said.final_step else f"after {epochs}"
    return f"{status} {when} in {duration(total_s)}{where}{_checkpoints_kept(summary)} (the error follows)"


def _checkpoints_kept(summary: dict[str, Any]) -> str:
    """What a failed attempt leaves to resume from, as far as its summary knows: a checkpoint it restored or saved
    (the run folder keeps the newest), none, or nothing said when it stopped before reading its checkpoints."""
    said = Recorded.of(summary) or Recorded()
    if newest := said.newest_checkpoint:  # read from the run folder: a save this attempt did not count
        return (
            f"; checkpoints kept in {said.run_dir}/checkpoints, the newest whole one "
            f"{posixpath.basename(newest.rstrip('/'))}: once the error is dealt with, the same command continues "
            "from it"
        )
    if said.resumed_from_step is None:
        return ""
    saves = said.checkpoint_saves.saves if said.checkpoint_saves else 0
    if said.resumed_from_step > 0 or (saves or 0) > 0:
        return (
            f"; checkpoints kept in {said.run_dir}/checkpoints: once the error is dealt with, the same "
            "command continues from the newest"
        )
    return "; no checkpoint was saved"


def _mfu(summary: dict[str, Any]) -> str:
    """`, MFU 7.4%`: model FLOPs utilisation over the steady epochs (runner/train/flops.py), when known."""
    mfu = (Recorded.of(summary) or Recorded()).throughput.mfu
    return f", MFU {percent(mfu)}" if mfu is not None else ""


def percent(share: float) -> str:
    """A share as a percentage with one decimal, or two significant digits below 0.1% (a small tabular model's
    0.004%, not 0.0%)."""
    if 0 < abs(share) < 0.001:
        return f"{share * 100:.2g}%"
    return f"{share:.1%}"


def _precision(summary: dict[str, Any]) -> str:
    """`, bfloat16 (cpu flag avx512_bf16)`: what the job computed in, and why."""
    chosen = (Recorded.of(summary) or Recorded()).accelerator.precision
    return f", {chosen.policy} ({chosen.reason or ''})" if chosen.policy else ""


def _model_at(summary: dict[str, Any]) -> str:
    said = Recorded.of(summary) or Recorded()
    mine = said.processes
    if mine.index:  # process 0 of a job of several writes the model; this one took part
        return f"; process {mine.index} of {mine.count}: process 0 writes {said.run_dir}"
    where = said.model or said.run_dir
    return f"; model: {where}" if where else ""


def _where_stopped(summary: dict[str, Any]) -> str:
    """`at step 40 of 174 (epoch 1 of 3)`: a stop inside an epoch is not a finished epoch."""
    said = Recorded.of(summary) or Recorded()
    per_epoch, planned = said.steps_per_epoch, said.train_epochs
    if not per_epoch or not planned:
        return ""
    mine = [e for e in said.epochs if e.attempt in (None, said.attempt)]
    step = (said.resumed_from_step or 0) + sum(e.steps or 0 for e in mine)
    return f"at step {step:,} of {per_epoch * planned:,} (epoch {min(planned, step // per_epoch + 1)} of {planned})"


def _result(summary: dict[str, Any]) -> str:
    """The evaluation's headline: accuracy when measured, else its first other metric, else the loss."""
    metrics = (Recorded.of(summary) or Recorded()).evaluated
    if not metrics:
        return ""
    name = "accuracy" if "accuracy" in metrics else next((k for k in metrics if k != "loss"), "loss")
    value = metrics.get(name)
    return f", {name} {value:.4f}" if value is not None else ""
