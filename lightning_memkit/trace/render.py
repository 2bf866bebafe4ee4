"""Sinks of a layer trace: the indented text table, the category table, the figure, the scalars.

They only read a :class:`~lightning_memkit.trace.trace_records.LayerTraceResult`; nothing here measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.summary_table import format_table
from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX
from lightning_memkit.units import MiB, format_bytes

if TYPE_CHECKING:  # annotations only, never run: records.py imports this module for its display methods
    from lightning_memkit.trace.trace_records import LayerTraceResult, TraceEvent

__all__ = ["format_trace_table", "format_category_table", "trace_figure", "trace_metrics", "PHASE_COLORS"]

#: Colour of each phase's points in the figure.
PHASE_COLORS = {"forward": "#1f77b4", "recompute": "#9467bd", "backward": "#ff7f0e", "optimizer": "#2ca02c"}


def _mib(nbytes: int, signed: bool = False) -> str:
    if signed:
        if nbytes == 0:
            return ""
        if abs(nbytes) < MiB / 2000:  # would print as +0.000: say it is small, not zero
            return "+<0.001" if nbytes > 0 else "-<0.001"
        return f"{nbytes / MiB:+.3f}"
    return f"{nbytes / MiB:.3f}"


def _shape_text(event: TraceEvent) -> str:
    if not event.shapes:
        return ""
    text = "(" + ", ".join(str(d) for d in event.shapes[0]) + ") " + event.dtypes[0]
    if len(event.shapes) > 1:
        text += f" +{len(event.shapes) - 1} more"
    return text


def _name(event: TraceEvent, root_class: str) -> str:
    if event.is_marker:
        return f"[{event.phase}]"
    name = event.module_class if not event.module else f"{event.module} ({event.module_class})"
    if event.call:
        name += f" #{event.call}"
    return "  " * event.depth + name


def _phase(event: TraceEvent) -> str:
    if event.is_marker:
        return ""
    return event.phase + (" (recompute)" if event.recompute else "")


def format_trace_table(result: LayerTraceResult, max_depth: int | None = None, markers: bool = True) -> str:
    """The layer-trace table: one line per event, modules indented by depth.

    Columns: module (``name (Class)``, ``#n`` for the n-th call of a module used more than
    once), phase, delta MiB (blank when nothing changed), live MiB, saved MiB (forward events:
    bytes first saved for backward by that call), shape (first tensor of the event, dtype).
    Step markers (``[backward-end]``, ``[optimizer-step]``...) are in brackets. MiB = 2**20 bytes.
    """
    rows = []
    for event in result.events:
        if event.is_marker and not markers:
            continue
        if max_depth is not None and not event.is_marker and event.depth > max_depth:
            continue
        rows.append(
            (
                _name(event, result.model),
                _phase(event),
                _mib(event.delta_bytes, signed=True),
                _mib(event.live_bytes),
                (
                    ""
                    if event.phase != "forward" or not event.saved_bytes
                    else "<0.001"
                    if event.saved_bytes < MiB / 2000
                    else _mib(event.saved_bytes)
                ),  # small, not zero
                _shape_text(event) + ("  <- peak" if event.index == result.peak_event_index else ""),
            )
        )
    header = (
        f"layer trace of {result.model}, step {result.step}, rank {result.rank}, {result.device}: "
        f"peak {format_bytes(result.peak_bytes)} (before event {result.peak_event_index}), "
        f"start {format_bytes(result.start_bytes)}, end {format_bytes(result.end_bytes)}"
    )
    table = format_table(("module", "phase", "delta MiB", "live MiB", "saved MiB", "shape"), rows)
    notes = "".join(f"\nnote: {note}" for note in getattr(result, "notes", ()))
    return header + notes + "\n" + table


def format_category_table(result: LayerTraceResult) -> str:
    """Bytes per category at the step's peak and at its end (MiB, and exact bytes)."""
    rows = []
    for category in CATEGORIES:
        peak, end = result.at_peak[category], result.at_end[category]
        rows.append((category, _mib(peak), _mib(end), str(peak), str(end)))
    rows.append(
        (
            "total",
            _mib(result.at_peak.total_bytes),
            _mib(result.at_end.total_bytes),
            str(result.at_peak.total_bytes),
            str(result.at_end.total_bytes),
        )
    )
    for field, label in (
        ("reserved_minus_allocated_bytes", "CUDA reserved - allocated"),
        ("nvml_unseen_bytes", "NVML, unseen by allocator"),
    ):
        peak, end = getattr(result.at_peak, field), getattr(result.at_end, field)
        if peak is not None or end is not None:
            rows.append(
                (
                    label,
                    _mib(peak) if peak is not None else "-",
                    _mib(end) if end is not None else "-",
                    str(peak) if peak is not None else "-",
                    str(end) if end is not None else "-",
                )
            )
    return format_table(("category", "peak MiB", "end MiB", "peak bytes", "end bytes"), rows)


def _event_phase_group(event: TraceEvent, after_backward: bool) -> str:
    if event.recompute:
        return "recompute"
    if event.phase in ("pre-backward", "backward", "backward-end"):
        return "backward"
    if after_backward or event.phase in ("optimizer-step", "step-end"):
        return "optimizer"
    return "forward"


def trace_figure(result: LayerTraceResult, title: str | None = None):
    """Live tensor memory (MiB) against event index, coloured by phase, the peak marked.

    Forward climbs (activations are kept for backward), backward descends (they are freed),
    the optimizer step adds its state. The red marker is ``result.peak_bytes`` drawn half-way
    before ``result.peak_event_index``: the peak happened between that event and the one before
    it (inside an op), which the dashed running-peak line also shows.
    """
    from lightning_memkit.tensorboard.figures import PEAK_COLOR, mark_peak, new_figure  # matplotlib: heavy

    figure, (ax,) = new_figure(title or f"memkit layer trace: {result.model}, step {result.step} ({result.device})")
    xs = [e.index for e in result.events]
    ys = [e.live_bytes / MiB for e in result.events]
    ax.plot(xs, ys, "-", color="#7f7f7f", linewidth=1.0, zorder=1)
    groups: dict[str, tuple[list[int], list[float]]] = {}
    after_backward = False
    for event in result.events:
        group = _event_phase_group(event, after_backward)
        if event.phase == "backward-end":
            after_backward = True
        elif event.phase == "pre-forward" and not event.recompute:
            after_backward = False
        groups.setdefault(group, ([], []))
        groups[group][0].append(event.index)
        groups[group][1].append(event.live_bytes / MiB)
    labels = {
        "forward": "forward (pre-forward / forward events)",
        "recompute": "recomputation in backward (checkpointing)",
        "backward": "backward (pre-backward / backward events)",
        "optimizer": "after backward: optimizer step",
    }
    for group in ("forward", "recompute", "backward", "optimizer"):
        if group in groups:
            ax.plot(*groups[group], "o", markersize=4, color=PHASE_COLORS[group], label=labels[group], zorder=3)
    ax.step(
        xs,
        [e.peak_bytes / MiB for e in result.events],
        where="post",
        color=PEAK_COLOR,
        linestyle="--",
        linewidth=1,
        alpha=0.6,
        label="running peak (between events too)",
    )
    ax.axhline(
        result.start_bytes / MiB,
        color="#7f7f7f",
        linestyle=":",
        linewidth=1,
        label=f"step start ({format_bytes(result.start_bytes)})",
    )
    ax.set_xlabel("event index (module hooks in execution order)")
    ax.set_ylabel("live tensor memory (MiB)")
    low, high = ax.get_ylim()
    ax.set_ylim(0, max(high, result.peak_bytes / MiB * 1.05))
    if result.peak_event_index is not None:
        # the peak happened after the previous event and by this one: draw it in between
        mark_peak(
            ax,
            max(0.0, result.peak_event_index - 0.5),
            result.peak_bytes,
            f"peak {format_bytes(result.peak_bytes)} before event {result.peak_event_index}",
        )
    ax.legend(loc="best", fontsize=8, framealpha=0.85)
    peak = result.at_peak
    top = sorted(((peak[c], c) for c in CATEGORIES if peak[c]), reverse=True)[:4]
    ax.set_title("at peak: " + ", ".join(f"{c} {format_bytes(b)}" for b, c in top), fontsize=9)
    return figure


def trace_metrics(result: LayerTraceResult, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """Scalars in MiB: ``{prefix}/trace/peak_MiB``, ``{prefix}/trace/peak/<category>_MiB`` and
    ``{prefix}/trace/end/<category>_MiB`` for every category (and the CUDA extras where read)."""
    metrics = {f"{prefix}/trace/peak_MiB": result.peak_bytes / MiB, f"{prefix}/trace/end_MiB": result.end_bytes / MiB}
    for moment, breakdown in (("peak", result.at_peak), ("end", result.at_end)):
        for category in CATEGORIES:
            metrics[f"{prefix}/trace/{moment}/{category}_MiB"] = breakdown[category] / MiB
        for field in ("reserved_minus_allocated_bytes", "nvml_unseen_bytes"):
            value = getattr(breakdown, field)
            if value is not None:
                metrics[f"{prefix}/trace/{moment}/{field[: -len('_bytes')]}_MiB"] = value / MiB
    return metrics
