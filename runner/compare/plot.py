"""`--plot`: epoch time and throughput by batch size as a PNG, with the runs named and their accuracy, and each
run's loss curve (training loss, and val_loss where it validated) by epoch from its epoch records.

matplotlib is the `plot` extra (pip install 'tpu-job-runner[plot]'): imported only here, and checked before
a sweep trains anything.
"""

from __future__ import annotations

import io
from pathlib import Path

from runner.compare.report import Row, _common_prefix
from runner.compare.summaries import _GCS_TIMEOUT_S, SummaryError
from runner.data import storage


def check_plotting() -> None:
    """Refuses `--plot` at once, before any run starts, when matplotlib (the `plot` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SummaryError(
            "--plot needs matplotlib, which is not installed here: pip install 'tpu-job-runner[plot]' "
            "(or pip install matplotlib), or leave out --plot"
        ) from None


def plot(rows: list[Row], path: str) -> str:
    """A PNG: steady (and first) epoch time and throughput against batch size, one line per device and replica
    count; titled with the jobs, each throughput point labelled with its run, evaluation accuracy and MFU, and
    the runs listed under the plots (with their epochs, precision and marks). The title and the list are also
    the PNG's Title and Description."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    usable = [r for r in rows if r.batch and (r.steady_epoch_s or r.examples_per_sec)]
    if not usable:
        raise SummaryError("nothing to plot: no run has a batch size and a steady timing (train 2 or more epochs)")
    prefix = _common_prefix([r.job for r in usable])
    title = f"{prefix.rstrip('-')}: epoch time and throughput by batch size" if prefix else (
        "Epoch time and throughput by batch size: " + ", ".join(r.job for r in usable)
    )
    legend_rows = [
        f"{r.job}{_marks(r)}: {r.device} x{r.replicas}, batch {r.batch}, "
        + ("accuracy -" if r.accuracy is None else f"accuracy {r.accuracy:.4f}")
        + ("" if r.examples_per_sec is None else f", {r.examples_per_sec:,.0f} examples/s")
        + ("" if r.mfu is None else f", MFU {r.mfu:.1%}")
        + f", {r.epochs if r.epochs is not None else '-'} epochs" + (f", {r.precision}" if r.precision else "")
        + ("" if r.loss is None else f", loss {r.loss:.4f}") + ("" if r.val_loss is None else
                                                                f", val_loss {r.val_loss:.4f}")
        for r in usable
    ]
    if any(r.beyond_swept or r.not_asked for r in usable):
        legend_rows.append("*: other settings than the baseline's beyond the swept ones; !: not as the sweep "
                           "asked (the table's notes name them)")
    groups: dict[str, list[Row]] = {}
    for row in usable:
        groups.setdefault(f"{row.device} x{row.replicas}", []).append(row)
    height = 4.6 + 0.17 * len(legend_rows)
    curves = [r for r in rows if any(loss is not None for _, loss, _ in r.curve)]
    figure, axes = plt.subplots(1, 3 if curves else 2, figsize=(16 if curves else 11, height))
    left, right = axes[0], axes[1]
    if curves:
        _loss_curves(axes[2], curves, prefix)
    for label, members in sorted(groups.items()):
        members = sorted(members, key=lambda r: r.batch)
        batches = [r.batch for r in members]
        line = left.plot(batches, [r.steady_epoch_s for r in members], marker="o", label=f"{label} steady")[0]
        left.plot(batches, [r.first_epoch_s for r in members], marker="x", linestyle="--", color=line.get_color(),
                  label=f"{label} first (compile)")
        right.plot(batches, [r.examples_per_sec for r in members], marker="o", color=line.get_color(), label=label)
        for r in members:
            if r.examples_per_sec is None:
                continue
            text = r.job[len(prefix):] if prefix else r.job
            if r.accuracy is not None:
                text += f"\nacc {r.accuracy:.4f}"
            if r.mfu is not None:
                text += f"\nMFU {r.mfu:.1%}"
            right.annotate(text, (r.batch, r.examples_per_sec), textcoords="offset points", xytext=(0, 7),
                           ha="center", fontsize=7)
    ticks = sorted({r.batch for r in usable})
    highest = {
        left: max((v for r in usable for v in (r.steady_epoch_s, r.first_epoch_s) if v), default=1.0),
        right: max((r.examples_per_sec for r in usable if r.examples_per_sec), default=1.0),
    }
    for axis, name, unit in ((left, "Epoch time", "seconds"), (right, "Training throughput", "examples/s")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
        axis.set_xlabel("global batch size")
        axis.set_ylabel(unit)
        axis.set_title(name)
        axis.grid(True, alpha=0.3)
        axis.set_ylim(0, highest[axis] * 1.25)  # room above the highest point for its label
        axis.legend(fontsize=8, loc="lower right")
    figure.suptitle(title, fontsize=11)
    figure.text(0.01, 0.01, "\n".join(legend_rows), fontsize=7.5, family="monospace", va="bottom")
    figure.tight_layout(rect=(0, (0.1 + 0.17 * len(legend_rows)) / height, 1, 1))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Title": title, "Description": "\n".join(legend_rows)})
    plt.close(figure)
    if storage.is_gcs(path):
        bucket, name = storage.split_gcs(path)
        storage.make_client().bucket(bucket).blob(name).upload_from_string(
            buffer.getvalue(), content_type="image/png", timeout=_GCS_TIMEOUT_S
        )
    else:
        Path(path).write_bytes(buffer.getvalue())
    return path


def _loss_curves(axis, rows: list[Row], prefix: str) -> None:
    """Each run's training loss (solid) and val_loss (dashed, same colour) by epoch."""
    for row in rows:
        name = row.job[len(prefix):] if prefix and row.job.startswith(prefix) else row.job
        epochs = [n for n, loss, _ in row.curve if loss is not None]
        line = axis.plot(epochs, [loss for _, loss, _ in row.curve if loss is not None], marker=".", label=name)[0]
        validated = [(n, val) for n, _, val in row.curve if val is not None]
        if validated:
            axis.plot([n for n, _ in validated], [v for _, v in validated], linestyle="--", marker=".",
                      color=line.get_color(), label=f"{name} val")
    axis.set_xlabel("epoch")
    axis.set_ylabel("loss")
    axis.set_title("Loss by epoch (dashed: val_loss)")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7, loc="upper right")


def _marks(row: Row) -> str:
    return ("*" if row.beyond_swept else "") + ("!" if row.not_asked else "")
