"""Figures of memkit's records (matplotlib, no pyplot state), for TensorBoard and the report.

Every figure reads records only; the peak it marks is the one the record already holds
(``RunSummary.peak_bytes`` at ``peak_step``), never a second computation of it.
Shared helpers (:func:`new_figure`, :func:`mark_peak`, :func:`figure_png`, :func:`figure_rgb`)
give memkit's other figures the same look.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

# Figure + the Agg canvas, never pyplot: no global backend switch, no figure registry to leak into
# (a notebook user's own plots are left alone), safe off the main thread.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.units import MiB, format_bytes

__all__ = [
    "PEAK_COLOR",
    "SERIES_STYLE",
    "PANELS",
    "new_figure",
    "mark_peak",
    "figure_png",
    "figure_rgb",
    "memory_per_step_figure",
    "compare_figures",
]

#: the colour of every "peak" marker memkit draws.
PEAK_COLOR = "#d62728"

#: StepReading field -> (legend label, colour, line style). Peaks solid, end-of-step values dashed.
SERIES_STYLE: dict[str, tuple[str, str, str]] = {
    "peak_allocated_bytes": ("CUDA peak allocated (per step)", "#1f77b4", "-"),
    "allocated_bytes": ("CUDA allocated (step end)", "#1f77b4", "--"),
    "peak_reserved_bytes": ("CUDA peak reserved (per step)", "#ff7f0e", "-"),
    "reserved_bytes": ("CUDA reserved (step end)", "#ff7f0e", "--"),
    "fragmentation_bytes": ("CUDA fragmentation", "#8c564b", ":"),
    "process_device_bytes": ("NVML: this process", "#7f7f7f", "-."),
    "peak_tensor_bytes": ("tensors: peak (per step, exact)", "#2ca02c", "-"),
    "tensor_bytes": ("tensors: live at step end (exact)", "#2ca02c", "--"),
    "host_peak_rss_bytes": ("host RSS: peak (per step)", "#9467bd", "-"),
    "host_rss_bytes": ("host RSS (step end)", "#9467bd", "--"),
}
#: The panels of the memory-per-step figure: (question, fields, fields also drawn for validation runs).
#: Each panel draws at most three lines of one scale (a capacity or a process's whole device memory
#: is never on the allocator's panel, where it flattened the allocator's lines to zero).
PANELS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        "CUDA step peak, top to bottom: reserved, allocated",
        ("peak_reserved_bytes", "peak_allocated_bytes"),
        ("peak_allocated_bytes",),
    ),
    ("CUDA at step end, top to bottom: reserved, allocated", ("reserved_bytes", "allocated_bytes"), ()),
    (
        "device (NVML), top to bottom: all processes, this process, allocator reserved",
        ("device_used_bytes", "process_device_bytes", "reserved_bytes"),
        (),
    ),
    (
        "tensors (exact), top to bottom: step peak, live at step end",
        ("peak_tensor_bytes", "tensor_bytes"),
        ("peak_tensor_bytes",),
    ),
    (
        "host RSS, top to bottom: step peak, step end",
        ("host_peak_rss_bytes", "host_rss_bytes"),
        ("host_peak_rss_bytes",),
    ),
)
SERIES_STYLE.update(
    {
        "device_used_bytes": ("NVML: all processes", "#17becf", "-"),
    }
)


def new_figure(
    title: str, nrows: int = 1, width: float = 10.0, row_height: float = 3.4, sharex: bool = True
) -> tuple[Figure, list]:
    """A figure with ``nrows`` stacked axes, a bold title and a light grid; returns (figure, axes)."""
    figure = Figure(figsize=(width, row_height * nrows + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, 1, sharex=sharex, squeeze=False)[:, 0].tolist()
    figure.suptitle(title, fontsize=13, fontweight="bold")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return figure, axes


def mark_peak(ax, x: float, nbytes: int, text: str | None = None) -> None:
    """Mark a peak of ``nbytes`` bytes at ``x`` (drawn in MiB) with a red dot and its value."""
    y = nbytes / MiB
    ax.plot([x], [y], marker="o", markersize=9, color=PEAK_COLOR, zorder=5, linestyle="none")
    label = text or f"peak {format_bytes(nbytes)}"
    ax.annotate(
        label,
        xy=(x, y),
        xytext=(0, 12),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=9,
        fontweight="bold",
        color=PEAK_COLOR,
        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": PEAK_COLOR, "alpha": 0.9},
    )
    low, high = ax.get_ylim()
    if y * 1.15 > high:  # room for the label above the marker
        ax.set_ylim(low, y * 1.18)


def figure_png(figure: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def figure_rgb(figure: Figure):
    """The figure as an ``(height, width, 3)`` uint8 array, as ``SummaryWriter.add_image(dataformats="HWC")``
    takes it."""
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _series(readings: Sequence[StepReading], field: str) -> tuple[list[int], list[float]]:
    points = [(r.step, getattr(r, field)) for r in readings if getattr(r, field) is not None]
    return [p[0] for p in points], [p[1] / MiB for p in points]


def memory_per_step_figure(summary: RunSummary, history: Sequence[StepReading], title: str | None = None) -> Figure:
    """Memory per training step (MiB), with the run's peak marked.

    One panel per question (:data:`PANELS`), each with at most three lines of one scale, for the
    sources the readings have: on CUDA the allocator's step peak (allocated vs reserved), its
    step end, NVML's device memory (all processes vs this process vs the allocator's reserved);
    the exact tensor accountant's peak vs step end; host RSS. Validation runs show as ``x``
    markers at the training step they followed. The red marker is ``summary.peak_bytes`` at
    ``summary.peak_step`` (from ``summary.peak_source``), on the panel of that source.
    """
    train = [r for r in history if r.stage == "train"]
    val = [r for r in history if r.stage != "train"]
    has = lambda field: any(getattr(r, field) is not None for r in history)  # noqa: E731
    # a panel is drawn when its first (headline) field was read: the NVML panel needs NVML's own reading
    panels = [
        (question, [f for f in fields if has(f)], [f for f in val_fields if has(f)])
        for question, fields, val_fields in PANELS
        if has(fields[0])
    ]
    device = summary.device or "?"
    figure, axes = new_figure(
        title or f"memkit: memory per step ({device})",
        nrows=max(1, len(panels)),
        row_height=3.4 if len(panels) <= 2 else 2.7,
    )
    if not panels:
        axes[0].text(0.5, 0.5, "no readings", ha="center", va="center", transform=axes[0].transAxes)
        return figure
    for ax, (question, fields, val_fields) in zip(axes, panels, strict=True):
        for field in fields:
            label, color, style = SERIES_STYLE[field]
            steps, values = _series(train, field)
            if steps and _sampled(train, steps):
                # read on some steps only (the accountant's peak, every tensor_peak_every_n_steps): a line would
                # draw values between the samples that were never measured, so markers only
                ax.plot(steps, values, "o", color=color, label=label + " (sampled steps)", markersize=5)
            elif steps:
                ax.plot(
                    steps,
                    values,
                    style,
                    color=color,
                    label=label,
                    linewidth=1.8,
                    marker="." if len(steps) < 40 else None,
                )
            if field in val_fields:
                vsteps, vvalues = _series(val, field)
                if vsteps:
                    ax.plot(
                        vsteps,
                        vvalues,
                        "x",
                        color=color,
                        markersize=8,
                        markeredgewidth=2,
                        label=label.split(" (")[0] + " (validation run)",
                    )
        ax.set_ylabel("MiB")
        ax.set_title(question + " (MiB)", fontsize=9, loc="left")
        if summary.peak_bytes is not None and summary.peak_step is not None and summary.peak_source in fields:
            stage = "" if summary.peak_stage in (None, "train") else f", {summary.peak_stage}"
            mark_peak(
                ax,
                summary.peak_step,
                summary.peak_bytes,
                f"run peak {format_bytes(summary.peak_bytes)} at step {summary.peak_step}{stage}",
            )
        low, high = ax.get_ylim()
        top = max((v for f in fields for v in _series(history, f)[1]), default=high)
        ax.set_ylim(min(0.0, low), max(high, top * 1.15))  # headroom for the peak label
        # beside the plot, never on a line
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    axes[-1].set_xlabel("training step")
    # under the whole figure (constrained layout gives it its own row), not beside the first panel's title,
    # which a long panel title overlapped
    figure.supxlabel(
        f"{summary.steps_measured} readings; run peak from {summary.peak_source or 'no reading'}", fontsize=9
    )
    return figure


def _sampled(train: Sequence[StepReading], steps: list[int]) -> bool:
    """Whether a series read at ``steps`` skips training readings between its first and last step."""
    inside = sum(1 for r in train if steps[0] <= r.step <= steps[-1])
    return len(steps) < inside


def compare_figures(compare) -> dict[str, Figure]:
    """The mode comparison's figures from a :class:`~lightning_memkit.modes.compare_result.CompareResult`.

    ``peak_figure``: each mode's per-step peak (MiB) as a bar with its ratio to the baseline, the
    lowest marked (its ratio in the marker's label, so the red dot covers no text). ``steps_figure``:
    every mode's per-step peak against the training step, the highest marked. Values are the records' own
    (``ModeResult.peak_allocated_bytes``, ``step_peaks``).
    """
    ok = [r for r in compare.results if r.status == "ok" and r.peak_allocated_bytes is not None]
    source = ok[0].peak_source if ok else "no successful mode"
    peak_figure, (bar_ax,) = new_figure(
        f"memkit compare: peak memory per mode ({compare.device})", width=2.4 + 1.4 * max(len(ok), 1), row_height=3.6
    )
    if ok:
        positions = list(range(len(ok)))
        bars = bar_ax.bar(positions, [r.peak_allocated_bytes / MiB for r in ok], color="#4c72b0")
        bar_ax.set_xticks(positions, [r.mode for r in ok], rotation=20)
        lowest = min(positions, key=lambda i: ok[i].peak_allocated_bytes)
        for position, (bar, result) in enumerate(zip(bars, ok, strict=True)):
            if result.peak_ratio is not None and position != lowest:  # the lowest bar's ratio is in its marker's label
                bar_ax.annotate(
                    f"{result.peak_ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ratio = "" if ok[lowest].peak_ratio is None else f"\n{ok[lowest].peak_ratio:.2f}x"
        mark_peak(
            bar_ax,
            lowest,
            ok[lowest].peak_allocated_bytes,
            f"lowest: {format_bytes(ok[lowest].peak_allocated_bytes)}{ratio}",
        )
    bar_ax.set_ylabel(f"peak per step (MiB, {source})")
    steps_figure, (line_ax,) = new_figure("memkit compare: memory per step per mode", width=8.0, row_height=3.6)
    highest = None
    for result in ok:
        if result.step_peaks:
            steps = [step for step, _ in result.step_peaks]
            line_ax.plot(steps, [nbytes / MiB for _, nbytes in result.step_peaks], marker=".", label=result.mode)
            top = max(result.step_peaks, key=lambda point: point[1])
            if highest is None or top[1] > highest[1]:
                highest = (top[0], top[1], result.mode)
    if highest is not None:
        mark_peak(line_ax, highest[0], highest[1], f"highest: {format_bytes(highest[1])} ({highest[2]})")
        line_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    line_ax.xaxis.get_major_locator().set_params(integer=True)
    line_ax.set_xlabel("training step")
    line_ax.set_ylabel("peak in step (MiB)")
    return {"peak_figure": peak_figure, "steps_figure": steps_figure}
