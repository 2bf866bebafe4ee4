"""The memkit dashboard: which logged memory scalars TensorBoard draws together, and the rules every chart keeps.

The layout is a custom-scalars layout (TensorBoard's "Custom Scalars" tab) built from the tag
names in :mod:`lightning_memkit.tensorboard.tags`; ``dashboard.register_dashboard`` writes it
once per run from whichever memkit callback reaches fit start first. Every chart answers one
question with at most three lines a user can name from its title, and draws quantities of one
scale: a device's capacity is a number in the summary (Text tab), never a line that flattens the
others; single-step data (a layer trace, a comparison's summary) is a figure and a table, not a
chart. :func:`check_dashboard` states those rules as code; the tests hold every layout to them.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX, STAGE_TAGS, metric_name

__all__ = ["TRACE_TAG_PART", "MAX_SERIES_PER_CHART", "MAX_SCALE_RATIO", "dashboard_layout", "layout_from_tags",
           "prune_layout", "layout_tags", "check_dashboard", "check_chart"]

#: the path part of LayerTrace's scalars: ``memory/trace/{peak,end}_MiB``, ``memory/trace/{peak,end}/<category>_MiB``.
#: They are single-step values: the layout has no chart of them (the trace's figure and tables show them).
TRACE_TAG_PART = "trace"
#: the most lines one chart draws for one run.
MAX_SERIES_PER_CHART = 3
#: the largest ratio between the biggest and the smallest non-zero series of one chart (by largest |value|).
MAX_SCALE_RATIO = 100.0

# A chart: (title, stage, fields). Stage "train", "val" or "rank" (``<prefix>/train/rank<r>/``).
# TensorBoard tells a run's lines apart only by marker shape, with the legend folded away: a chart
# of several lines draws quantities ordered by definition (reserved >= allocated, a step's peak >=
# its end, all processes >= this process >= its allocator), and its title names them top to bottom,
# in the order of ``fields`` (tests/test_dashboard_rules.py checks the order on real logs).
_CUDA_CHARTS = [
    ("CUDA step peak, top to bottom: reserved, allocated (MiB)", "train", ["peak_reserved_bytes", "peak_allocated_bytes"]),
    ("CUDA at step end, top to bottom: reserved, allocated (MiB)", "train", ["reserved_bytes", "allocated_bytes"]),
    ("CUDA fragmentation: reserved but cut off from larger blocks (MiB)", "train", ["fragmentation_bytes"]),
    ("CUDA allocator: retries after flushing the cache, OOMs (count)", "train", ["alloc_retries", "ooms"]),
]
# NVML's capacity is not a line here: at 80 GB it flattened every other line to zero. It is in the
# summary table and the device table (Text tab); the chart compares quantities of one scale.
_NVML_CHARTS = [
    ("device (NVML), top to bottom: all processes, this process, allocator reserved (MiB)", "train",
     ["device_used_bytes", "process_device_bytes", "reserved_bytes"]),
]
# Two charts, not one: the accountant's peak may be read on fewer steps than the live bytes
# (MemoryTracker samples it), and TensorBoard's outlier clipping then hides the few peak points.
_TENSOR_CHARTS = [
    ("tensors (exact): step peak (MiB)", "train", ["peak_tensor_bytes"]),
    ("tensors (exact): live at step end (MiB)", "train", ["tensor_bytes"]),
]
_HOST_CHARTS = [
    ("host RSS, top to bottom: step peak, step end (MiB)", "train", ["host_peak_rss_bytes", "host_rss_bytes"]),
]
_CUDA_VALIDATION_CHARTS = [
    ("validation runs, top to bottom: CUDA peak reserved, peak allocated (MiB)", "val", ["peak_reserved_bytes", "peak_allocated_bytes"]),
]
# two lines, not one: a chart of a single line with two points (two validation runs) is empty in
# TensorBoard by default (both points are "outliers" of the 5th-95th percentile range)
_TENSOR_VALIDATION_CHARTS = [
    ("validation runs, exact tensors, top to bottom: peak, live at end (MiB)", "val", ["peak_tensor_bytes", "tensor_bytes"]),
]
_COMPARE_CHARTS = {  # one line per mode's run; each chart one quantity
    "peak_allocated": ("modes overlaid: CUDA step peak allocated (MiB)", "train", ["peak_allocated_bytes"]),
    "peak_tensor": ("modes overlaid: tensor step peak, exact (MiB)", "train", ["peak_tensor_bytes"]),
    "tensor": ("modes overlaid: live tensors at step end, exact (MiB)", "train", ["tensor_bytes"]),
    "peak_reserved": ("modes overlaid: CUDA step peak reserved (MiB)", "train", ["peak_reserved_bytes"]),
    "fragmentation": ("modes overlaid: CUDA fragmentation (MiB)", "train", ["fragmentation_bytes"]),
    "process_device": ("modes overlaid: this process on the device, NVML (MiB)", "train", ["process_device_bytes"]),
    "host_rss": ("modes overlaid: host RSS at step end (MiB)", "train", ["host_rss_bytes"]),
}


def _rank_charts(cuda: bool, host: bool) -> list[tuple[str, str, list[str]]]:
    # on CPU the live tensor bytes at step end: read every step (the accountant's peak may be sampled)
    peak = ("per rank: CUDA step peak allocated (MiB; one line per rank)", "rank", ["peak_allocated_bytes"]) if cuda else \
        ("per rank: live tensors at step end, exact (MiB; one line per rank)", "rank", ["tensor_bytes"])
    charts = [peak]
    if cuda:
        charts.append(("per rank: CUDA step peak reserved (MiB; one line per rank)", "rank", ["peak_reserved_bytes"]))
    if host:
        charts.append(("per rank: host RSS at step end (MiB; one line per rank)", "rank", ["host_rss_bytes"]))
    return charts


def dashboard_layout(
    prefix: str = DEFAULT_PREFIX,
    cuda: bool = False,
    tensors: bool = True,
    host: bool = True,
    validation: bool = True,
    trace: bool = False,
    ranks: bool = False,
    compare: bool = False,
    nvml: bool | None = None,
) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout as ``SummaryWriter.add_custom_scalars`` takes it.

    ``{category title: {chart title: ["Multiline", [tag regex]]}}``; each regex is anchored
    (TensorBoard matches it from the tag's start), so a chart shows exactly the tags memkit logs
    under ``prefix``. Every chart draws at most three lines per run, named in its title, of one
    scale (MiB, or counts). Switch off the groups a run cannot have, so the dashboard shows no
    empty chart (:func:`prune_layout` drops the charts a finished run left empty).

    Args:
        prefix: the first part of every memkit tag (MemoryTracker's ``prefix``).
        cuda: the CUDA allocator's charts: step peak allocated vs reserved, allocated vs reserved
            at step end, fragmentation, allocator retries and OOMs.
        tensors: the exact tensor accountant's charts (step peak; live tensor bytes at step end).
        host: host RSS (step peak vs step end).
        validation: the per-validation-run peaks.
        trace: accepted for compatibility and ignored: a layer trace is one step, shown as a figure
            (Images tab) and tables (Text tab), not as scalars at a single step.
        ranks: per-rank charts, one line per rank (DDP with ``MemoryTracker(per_rank=True)``).
        compare: a ``memkit compare`` mode's run: one category, "modes overlaid", one chart per
            quantity and one line per mode's run (each mode is a TensorBoard run under one root).
        nvml: NVML's device chart (all processes vs this process vs allocator reserved);
            default: the same as ``cuda``.
    """
    del trace  # single-step data: figures and tables, not charts
    nvml = cuda if nvml is None else nvml
    layout: dict[str, dict[str, list[Any]]] = {}
    if compare:
        keys = ["peak_allocated"] if cuda else ["peak_tensor", "tensor"]
        keys += ["peak_reserved", "fragmentation"] if cuda else []
        keys += ["process_device"] if cuda and nvml else []
        keys += ["host_rss"] if host else []
        layout["memkit: modes compared"] = _charts(prefix, [_COMPARE_CHARTS[k] for k in keys])
        return layout
    step_charts: list[tuple[str, str, list[str]]] = []
    if cuda:
        step_charts += _CUDA_CHARTS
    if cuda and nvml:
        step_charts += _NVML_CHARTS
    if tensors:
        step_charts += _TENSOR_CHARTS
    if host:
        step_charts += _HOST_CHARTS
    if validation:
        step_charts += _CUDA_VALIDATION_CHARTS if cuda else []
        step_charts += _TENSOR_VALIDATION_CHARTS if tensors and not cuda else []
    if step_charts:
        layout["memkit: memory per step"] = _charts(prefix, step_charts)
    if ranks:
        layout["memkit: per rank (DDP)"] = _charts(prefix, _rank_charts(cuda, host))
    return layout


def _charts(prefix: str, specs: Iterable[tuple[str, str, list[str]]]) -> dict[str, list[Any]]:
    escaped = re.escape(prefix)
    parts = {"train": f"{escaped}/{STAGE_TAGS['train']}/", "val": f"{escaped}/{STAGE_TAGS['validate']}/",
             "rank": f"{escaped}/{STAGE_TAGS['train']}/rank[0-9]+/"}
    charts = {}
    for title, stage, fields in specs:
        names = [re.escape(metric_name(f)) for f in fields]
        alternatives = names[0] if len(names) == 1 else "(" + "|".join(names) + ")"
        charts[title] = ["Multiline", [f"^{parts[stage]}{alternatives}$"]]
    return charts


def layout_tags(layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> dict[str, list[str]]:
    """``{chart title: [tag regex, ...]}`` of a layout: as :func:`dashboard_layout` returns it
    (``["Multiline", [regex, ...]]`` per chart) or with a plain list of regexes per chart."""
    return {title: list(spec[1]) if len(spec) == 2 and spec[0] == "Multiline" else list(spec)
            for category in layout.values() for title, spec in category.items()}


def _matching(regexes: Sequence[str], tags: Iterable[str]) -> list[str]:
    compiled = [re.compile(r) for r in regexes]
    return sorted(t for t in tags if any(r.match(t) for r in compiled))  # TensorBoard's own match: from the start


def prune_layout(layout: Mapping[str, Mapping[str, Sequence[Any]]], steps_per_tag: Mapping[str, int]) -> dict[str, dict[str, list[Any]]]:
    """``layout`` without the charts that would be empty or single-step for these tags.

    Args:
        layout: a custom-scalars layout (:func:`dashboard_layout`).
        steps_per_tag: ``{tag: number of steps it was logged at}`` for the run.

    A chart stays when a tag it matches was logged at two steps or more (a validation chart of a
    run that validated once is dropped: that reading is in the memory-per-step figure and the
    summary table). A category left without charts is dropped.
    """
    pruned: dict[str, dict[str, list[Any]]] = {}
    for category, charts in layout.items():
        kept = {title: [spec[0], list(spec[1])] for title, spec in charts.items()
                if any(steps_per_tag[t] >= 2 for t in _matching(spec[1], steps_per_tag))}
        if kept:
            pruned[category] = kept
    return pruned


def layout_from_tags(tags: Mapping[str, int] | Iterable[str], prefix: str = DEFAULT_PREFIX, compare: bool = False) -> dict[str, dict[str, list[Any]]]:
    """The layout for a run that logged ``tags``: its groups read off the tags, then pruned.

    This is how logs written by an older memkit get today's dashboard
    (:func:`~lightning_memkit.tensorboard.dashboard.write_layout` writes it into a run): CUDA
    charts when the CUDA allocator's tags are there, NVML's when its tags are, and so on.

    Args:
        tags: the run's scalar tags, or ``{tag: number of steps logged}`` (then charts whose
            tags were logged at fewer than two steps are dropped, see :func:`prune_layout`).
        prefix: MemoryTracker's ``prefix``.
        compare: the run is one mode of a ``memkit compare`` root.
    """
    steps = dict(tags) if isinstance(tags, Mapping) else {t: 2 for t in tags}
    train = f"{prefix}/{STAGE_TAGS['train']}/"
    val = f"{prefix}/{STAGE_TAGS['validate']}/"
    has = lambda stage, field: f"{stage}{metric_name(field)}" in steps  # noqa: E731
    options = dict(
        prefix=prefix,
        cuda=has(train, "peak_allocated_bytes") or has(train, "allocated_bytes"),
        nvml=has(train, "device_used_bytes"),
        tensors=has(train, "tensor_bytes") or has(train, "peak_tensor_bytes"),
        host=has(train, "host_rss_bytes"),
        validation=any(t.startswith(val) for t in steps),
        ranks=any(re.match(re.escape(train) + r"rank[0-9]+/", t) for t in steps),
        compare=compare,
    )
    return prune_layout(dashboard_layout(**options), steps)


# ---------------------------------------------------------------------------------------------- rules
def _smoothed(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's line smoothing (a debiased exponential moving average; constant series unchanged)."""
    if all(v == values[0] for v in values):
        return list(values)
    out, last, count = [], 0.0, 0
    for v in values:
        count += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** count) if weight != 1 else last)
    return out


def _quantile(ordered: Sequence[float], p: float) -> float:
    """d3.quantile: linear interpolation between the two closest ranks."""
    i = (len(ordered) - 1) * p
    lo = math.floor(i)
    return ordered[lo] if lo + 1 >= len(ordered) else ordered[lo] + (ordered[lo + 1] - ordered[lo]) * (i - lo)


def _default_y_domain(series: Sequence[Sequence[float]]) -> tuple[float, float]:
    """The y range TensorBoard draws by default, as its line chart computes it: the values
    within the 5th-95th percentile of all the chart's (smoothed) values ("Ignore outliers in
    chart scaling", ticked by default); none left (two distinct values: each is an "outlier")
    gives the empty chart's [0, 1]; one value v gives [0, 2v]; else the range padded by 5 %
    each side (TensorBoard rounds it outwards further)."""
    values = sorted(v for s in series for v in s)
    low_q, high_q = _quantile(values, 0.05), _quantile(values, 0.95)
    kept = [v for v in values if low_q <= v <= high_q]
    if not kept:
        return 0.0, 1.0
    low, high = kept[0], kept[-1]
    if low == high:
        return (-1.0, 1.0) if low == 0 else (min(0.0, 2 * low), max(0.0, 2 * low))
    pad = (high - low) * 0.05
    return low - pad, high + pad


def check_dashboard(layout: Mapping[str, Mapping[str, Sequence[Any]]], runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
                    smoothing: float = 0.6) -> list[str]:
    """The rules every memkit chart keeps, checked on real logs; returns the broken ones, in words.

    Args:
        layout: a custom-scalars layout (:func:`dashboard_layout`, or one read from event files).
        runs: ``{run name: {tag: [(step, value), ...]}}``: the scalars of every run the Custom
            Scalars tab draws together (one run, or every mode's run under a compare root).
        smoothing: TensorBoard's smoothing weight (0.6 by default).

    Each chart of the layout is held to :func:`check_chart` with the lines it draws (every tag
    its regexes match, in every run); a chart that matches no logged tag is "no data".
    """
    problems = []
    for title, regexes in layout_tags(layout).items():
        series = {(run, tag): list(tags[tag]) for run, tags in runs.items() for tag in _matching(regexes, tags) if tags[tag]}
        if not series:
            problems.append(f"{title!r}: no data (its regexes {regexes} match no logged tag)")
            continue
        problems += check_chart(title, series, smoothing)
    return problems


def check_chart(title: str, series: Mapping[tuple[str, str], Sequence[tuple[float, float]]], smoothing: float = 0.6,
                tensorboard_y_range: bool = True) -> list[str]:
    """The rules one chart keeps; returns the broken ones, in words.

    Args:
        title: the chart's title (for the messages).
        series: ``{(run, line name): [(step, value), ...]}``, every line the chart draws.
        smoothing: TensorBoard's smoothing weight (0.6 by default).
        tensorboard_y_range: check the lines against the y range TensorBoard draws by default
            (False for a figure's axes: matplotlib's range holds every point).

    Rules: the chart has a line; at most :data:`MAX_SERIES_PER_CHART` lines per run; not every
    line is a single step (one step is a figure or a table, not a chart); no line's largest
    |value| is more than :data:`MAX_SCALE_RATIO` times another non-zero line's (a capacity drawn
    with usage flattens the usage to zero); and with TensorBoard's default settings (smoothing,
    outliers ignored in the y range) every line has a point inside the drawn y range.
    """
    series = {key: points for key, points in series.items() if len(points)}
    if not series:
        return [f"{title!r}: no data"]
    problems = []
    for run in sorted({run for run, _ in series}):
        lines = sorted(name for r, name in series if r == run)
        if len(lines) > MAX_SERIES_PER_CHART:
            problems.append(f"{title!r}: {len(lines)} lines for run {run!r} (at most {MAX_SERIES_PER_CHART}): {lines}")
    if all(len({step for step, _ in points}) < 2 for points in series.values()):
        problems.append(f"{title!r}: every line is a single step (show single-step data as a figure or a table)")
    scales = {key: max(abs(v) for _, v in points) for key, points in series.items()}
    biggest = max(scales, key=scales.get)
    for key, scale in scales.items():
        if 0 < scale and scales[biggest] > MAX_SCALE_RATIO * scale:
            problems.append(f"{title!r}: {biggest[1]} ({scales[biggest]:.6g}) is {scales[biggest] / scale:.0f}x "
                            f"{key[1]} ({scale:.6g}) of run {key[0]!r}: the smaller line is flat")
    if not tensorboard_y_range:
        return problems
    smoothed = {key: _smoothed([v for _, v in points], smoothing) for key, points in series.items()}
    low, high = _default_y_domain(list(smoothed.values()))
    for key, values in smoothed.items():
        if not any(low <= v <= high for v in values):
            problems.append(f"{title!r}: {key[1]} of run {key[0]!r} lies outside the y range TensorBoard draws by "
                            f"default [{low:.6g}, {high:.6g}] (outliers ignored)")
    return problems
