"""The report's charts as PNG bytes: loss, MFU, step time, throughput, goodput against step."""

import io

import numpy as np
from matplotlib.figure import Figure

from observability.run_series import RunSeries


def _figure(title: str, ylabel: str, series: RunSeries):
    fig = Figure(figsize=(8, 3), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    for i, step in enumerate(series.restart_steps):
        ax.axvline(
            step, color="grey", linestyle="--", linewidth=1, label="restart" if i == 0 else None
        )
    return fig, ax


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _finish(fig, ax) -> bytes:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    return _png(fig)


def loss_plot(series: RunSeries) -> bytes:
    fig, ax = _figure("Loss", "loss", series)
    steps, loss = series.steps, series.values["loss"]
    finite = np.isfinite(loss)
    ax.plot(steps[finite], loss[finite], linewidth=1, label="train")
    if len(series.eval_steps):
        ax.plot(series.eval_steps, series.eval_loss, "o-", markersize=3, label="eval")
    if not finite.all():
        top = np.nanmax(loss[finite]) if finite.any() else 1.0
        ax.plot(steps[~finite], np.full((~finite).sum(), top), "rx", label="NaN / Inf")
    return _finish(fig, ax)


def mfu_plot(series: RunSeries, basis: str) -> bytes:
    title = "MFU" + (f" (peak FLOP/s from {basis})" if basis else "")
    fig, ax = _figure(title, "MFU (%)", series)
    ax.plot(series.steps, 100 * series.values["mfu"], linewidth=1)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax)


def step_time_plot(series: RunSeries) -> bytes:
    fig, ax = _figure("Step time", "seconds", series)
    ax.plot(series.steps, series.values["step_time_seconds"], linewidth=1, label="step")
    ax.plot(series.steps, series.values["data_time_seconds"], linewidth=1, label="waiting for data")
    ax.set_ylim(bottom=0)
    return _finish(fig, ax)


def throughput_plot(series: RunSeries) -> bytes:
    fig, ax = _figure("Throughput", "tokens/s", series)
    ax.plot(series.steps, series.values["tokens_per_second"], linewidth=1)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax)


def goodput_plot(series: RunSeries) -> bytes:
    fig, ax = _figure("Goodput", "goodput (%)", series)
    ax.plot(series.steps, 100 * series.values["goodput"], linewidth=1)
    ax.set_ylim(0, 100)
    return _finish(fig, ax)


def all_plots(series: RunSeries, mfu_basis: str) -> list[tuple[str, bytes | None]]:
    """(title, PNG) in report order; PNG is None when the run did not log that quantity."""
    v = series.values
    plots = [
        ("Loss", loss_plot, v["loss"]),
        ("MFU", lambda s: mfu_plot(s, mfu_basis), v["mfu"]),
        ("Step time", step_time_plot, v["step_time_seconds"]),
        ("Throughput", throughput_plot, v["tokens_per_second"]),
        ("Goodput", goodput_plot, v["goodput"]),
    ]
    return [(title, plot(series) if np.any(values != 0) else None) for title, plot, values in plots]
