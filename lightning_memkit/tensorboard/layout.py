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
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Iterable, Mapping, Sequence

from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX, STAGE_TAGS, metric_name

__all__ = ["TRACE_TAG_PART", "MAX_SERIES_PER_CHART", "MAX_SCALE_RATIO", "dashboard_layout", "layout_from_tags",
           "prune_layout", "layout_tags", "check_dashboard", "check_chart", "clipping_problems", "tick_problems",
           "MAX_CLIPPED_FRACTION", "tensorboard_y_range", "tensorboard_ticks", "tick_label", "readable_layout",
           "DASHBOARD_TAG_PART", "COMPARE_CATEGORY", "MAX_TICK_LABEL",
           "RANK_CATEGORY", "rank_groups", "FRAME_TITLE", "FRAME_TAG_PART", "is_frame_tag", "SHORT_LINE_POINTS"]

#: the path part of LayerTrace's scalars: ``memory/trace/{peak,end}_MiB``, ``memory/trace/{peak,end}/<category>_MiB``.
#: They are single-step values: the layout has no chart of them (the trace's figure and tables show them).
TRACE_TAG_PART = "trace"
#: the category of a ``memkit compare`` mode's layout (one line per mode's run in every chart).
COMPARE_CATEGORY = "memkit: modes compared"
#: the most lines one chart draws for one run.
MAX_SERIES_PER_CHART = 3
#: the largest ratio between the biggest and the smallest non-zero series of one chart (by largest |value|).
MAX_SCALE_RATIO = 100.0
#: tick labels at or above this are written in exponent notation by TensorBoard (d3's ``.3~g``: 1,400 -> "1.4e+3"),
#: so a chart keeps its labels below it: MiB values that reach it are drawn in GiB (:func:`readable_layout`).
MAX_TICK_LABEL = 1000.0
#: the largest share of a line's points that may lie outside the y range TensorBoard draws by
#: default (it ignores values beyond the 5th and 95th percentiles: up to 10 % of a long line).
MAX_CLIPPED_FRACTION = 0.1

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
    "allocated": ("modes overlaid: CUDA allocated at step end (MiB)", "train", ["allocated_bytes"]),
    "peak_reserved": ("modes overlaid: CUDA step peak reserved (MiB)", "train", ["peak_reserved_bytes"]),
    "fragmentation": ("modes overlaid: CUDA fragmentation (MiB)", "train", ["fragmentation_bytes"]),
    "process_device": ("modes overlaid: this process on the device, NVML (MiB)", "train", ["process_device_bytes"]),
    "host_rss": ("modes overlaid: host RSS at step end (MiB)", "train", ["host_rss_bytes"]),
}


#: the category of the per-rank charts (DDP with ``MemoryTracker(per_rank=True)``); with more ranks than
#: :data:`MAX_SERIES_PER_CHART`, one category per quantity: ``"memkit: per rank (DDP): host RSS at step end"``.
RANK_CATEGORY = "memkit: per rank (DDP)"


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


def rank_groups(world_size: int) -> list[list[int]]:
    """The ranks each per-rank chart draws: all of them up to :data:`MAX_SERIES_PER_CHART`, else
    ``ceil(world_size / 3)`` charts of consecutive ranks, as even as can be (4 -> [0, 1], [2, 3];
    7 -> [0, 1, 2], [3, 4], [5, 6]), so no chart draws more than three lines."""
    if world_size <= MAX_SERIES_PER_CHART:
        return [list(range(world_size))]
    count = -(-world_size // MAX_SERIES_PER_CHART)
    small, extra = divmod(world_size, count)
    groups, start = [], 0
    for index in range(count):
        size = small + (index < extra)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def _rank_layout(prefix: str, cuda: bool, host: bool, world_size: int | None) -> dict[str, dict[str, list[Any]]]:
    """The per-rank categories: one chart per quantity with every rank's line (``world_size`` unknown, or
    at most three ranks), else one category per quantity with a chart per group of ranks (:func:`rank_groups`)."""
    charts = _rank_charts(cuda, host)
    if world_size is None or world_size <= MAX_SERIES_PER_CHART:
        return {RANK_CATEGORY: _charts(prefix, charts)}
    escaped = re.escape(prefix)
    layout: dict[str, dict[str, list[Any]]] = {}
    for title, _, fields in charts:
        quantity = title[len("per rank: "):title.index(" (MiB")]
        names = [re.escape(metric_name(f)) for f in fields]
        alternatives = names[0] if len(names) == 1 else "(" + "|".join(names) + ")"
        category = layout.setdefault(f"{RANK_CATEGORY}: {quantity}", {})
        for group in rank_groups(world_size):
            label = f"rank {group[0]}" if len(group) == 1 else f"ranks {group[0]}-{group[-1]}"
            ranks = "(" + "|".join(str(r) for r in group) + ")"
            category[f"per rank: {quantity} (MiB; {label}, one line each)"] = [
                "Multiline", [f"^{escaped}/{STAGE_TAGS['train']}/rank{ranks}/{alternatives}$"]]
    return layout


def dashboard_layout(
    prefix: str = DEFAULT_PREFIX,
    cuda: bool = False,
    tensors: bool = True,
    host: bool = True,
    validation: bool = True,
    trace: bool = False,
    ranks: bool | int = False,
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
        ranks: per-rank charts, one line per rank (DDP with ``MemoryTracker(per_rank=True)``): ``True``
            for one chart per quantity with every rank, or the world size (an int): with more than
            :data:`MAX_SERIES_PER_CHART` ranks each quantity gets its own category and a chart per
            group of at most three consecutive ranks (:func:`rank_groups`), so no chart draws more
            than three lines.
        compare: a ``memkit compare`` mode's run: one category, "modes overlaid", one chart per
            quantity and one line per mode's run (each mode is a TensorBoard run under one root).
        nvml: NVML's device chart (all processes vs this process vs allocator reserved);
            default: the same as ``cuda``.
    """
    del trace  # single-step data: figures and tables, not charts
    nvml = cuda if nvml is None else nvml
    layout: dict[str, dict[str, list[Any]]] = {}
    if compare:
        # every run's primary charts: its step peak, its live memory at step end, the process (device or host)
        keys = ["peak_allocated", "allocated"] if cuda else ["peak_tensor", "tensor"]
        keys += ["peak_reserved", "fragmentation"] if cuda else []
        keys += ["process_device"] if cuda and nvml else []
        keys += ["host_rss"] if host else []
        layout[COMPARE_CATEGORY] = _charts(prefix, [_COMPARE_CHARTS[k] for k in keys])
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
        world_size = None if ranks is True else int(ranks)
        if world_size is None or world_size > 1:
            layout.update(_rank_layout(prefix, cuda, host, world_size))
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
        ranks=max((int(m.group(1)) + 1 for m in (re.match(re.escape(train) + r"rank([0-9]+)/", t) for t in steps) if m), default=0),
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


def _tick_increment(start: float, stop: float, count: int) -> float:
    """d3's tickIncrement: the tick step for ``count`` ticks (1, 2 or 5 times a power of ten; negative: 1/step)."""
    step = (stop - start) / count
    if not step > 0:  # an empty domain (start == stop after rounding): d3 answers NaN and its nice() stops
        return math.nan
    power = math.floor(math.log10(step))
    error = step / 10 ** power
    factor = 10 if error >= _E10 else 5 if error >= _E5 else 2 if error >= _E2 else 1
    return factor * 10 ** power if power >= 0 else -(10 ** -power) / factor


_E10, _E5, _E2 = math.sqrt(50), math.sqrt(10), math.sqrt(2)


def _nice(start: float, stop: float, count: int = 10) -> tuple[float, float]:
    """d3's linear ``scale.nice()``: the domain rounded outwards to the tick step."""
    previous = None
    given = start, stop
    for _ in range(10):
        step = _tick_increment(start, stop, count)
        if math.isnan(step):  # d3 breaks out without setting the domain: the one it was given stays
            return given
        if step == previous:
            break
        if step > 0:
            start, stop = math.floor(start / step) * step, math.ceil(stop / step) * step
        else:
            start, stop = math.ceil(start * step) / step, math.floor(stop * step) / step
        previous = step
    return start, stop


def tensorboard_y_range(values: Iterable[float], ignore_outliers: bool = True) -> tuple[float, float]:
    """The y range TensorBoard's line chart draws for these values (MiB, or whatever they are).

    As TensorBoard 2.x computes it (its ``LinearScale``): with "Ignore outliers in chart scaling"
    (ticked by default) only the values between the 5th and 95th percentile count (d3's
    interpolated quantiles), none left (e.g. two distinct values) gives ``[0, 1]``; one value v
    gives ``[0, 2v]`` (``[-1, 1]`` for 0); else the extent padded by 5 % each side and rounded
    outwards to d3's tick step. Pass the smoothed values: TensorBoard scales to the smoothed line.
    """
    ordered = sorted(v for v in values if math.isfinite(v))
    if not ordered:
        return 0.0, 1.0
    if ignore_outliers:
        low_q, high_q = _quantile(ordered, 0.05), _quantile(ordered, 0.95)
        ordered = [v for v in ordered if low_q <= v <= high_q]
        if not ordered:
            return 0.0, 1.0
    low, high = ordered[0], ordered[-1]
    if low == high:
        return (-1.0, 1.0) if low == 0 else ((2 * low, 0.0) if low < 0 else (0.0, 2 * low))
    pad = (high - low + 2.220446049250313e-16) * 0.05
    return _nice(low - pad, high + pad)


def tensorboard_ticks(low: float, high: float, count: int = 10) -> list[float]:
    """The y-axis ticks TensorBoard draws over ``[low, high]`` (d3's ``ticks(10)``)."""
    if not high > low:
        return [low]
    step = (high - low) / count
    power = math.floor(math.log10(step))
    error = step / 10 ** power
    factor = 10 if error >= _E10 else 5 if error >= _E5 else 2 if error >= _E2 else 1
    js_round = lambda x: math.floor(x + 0.5)  # noqa: E731  (Math.round)
    if power < 0:
        inc = 10 ** -power / factor
        first, last = js_round(low * inc), js_round(high * inc)
        first += first / inc < low
        last -= last / inc > high
        return [(first + i) / inc for i in range(last - first + 1)]
    inc = 10 ** power * factor
    first, last = js_round(low / inc), js_round(high / inc)
    first += first * inc < low
    last -= last * inc > high
    return [(first + i) * inc for i in range(last - first + 1)]


def _significant(x: float, digits: int) -> tuple[str, int]:
    """The ``digits`` significant digits of |x| and its exponent, rounded as JavaScript does (ties away from zero)."""
    exact = abs(Decimal(x))
    exponent = exact.adjusted()
    scaled = int(exact.scaleb(digits - 1 - exponent).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    if scaled >= 10 ** digits:
        exponent += 1
        scaled = int(exact.scaleb(digits - 1 - exponent).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    return str(scaled), exponent


def tick_label(x: float, digits: int = 3) -> str:
    """A y-axis tick label as TensorBoard writes it: d3's ``.3~g``, or ``.3~e`` from 10,000 up and below 0.01.

    ``4.4296`` -> ``4.43``, ``1494`` -> ``1.49e+3``, ``12345`` -> ``1.235e+4``, ``0.005`` -> ``5e-3``.
    """
    magnitude = abs(x)
    if magnitude < 1e-15:
        return "0"
    sign = "-" if x < 0 else ""
    exponential = magnitude >= 1e4 or magnitude < 0.01
    figures, exponent = _significant(x, digits + 1 if exponential else digits)
    if exponential or exponent < -6 or exponent >= digits:
        mantissa = figures[0] + "." + figures[1:]
    elif exponent >= 0:
        mantissa = figures[:exponent + 1] + "." + figures[exponent + 1:]
    else:
        mantissa = "0." + "0" * (-exponent - 1) + figures
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    if exponential or exponent < -6 or exponent >= digits:
        return f"{sign}{mantissa}e{'+' if exponent >= 0 else '-'}{abs(exponent)}"
    return sign + mantissa


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
        tensorboard_y_range: check the lines against the y range and the axis labels TensorBoard
            draws by default (False for a figure's axes: matplotlib's range holds every point).

    Rules: the chart has a line; at most :data:`MAX_SERIES_PER_CHART` lines per run; not every
    line is a single step (one step is a figure or a table, not a chart); no line's largest
    |value| is more than :data:`MAX_SCALE_RATIO` times another non-zero line's (a capacity drawn
    with usage flattens the usage to zero). With TensorBoard's default settings (smoothing,
    "Ignore outliers in chart scaling"): no line has more than :data:`MAX_CLIPPED_FRACTION` of
    its points outside the drawn y range (TensorBoard leaves out the values beyond the 5th and
    95th percentile, meant for a few spikes of a long line: a line of a few points, such as a
    peak read on one step in ten, loses its ends), and the y axis's tick labels (three significant
    digits) are all different (a value moving by a few KiB around 4.43 MiB gets "4.43" on every tick)
    and below :data:`MAX_TICK_LABEL` (1,400 is labelled "1.4e+3").
    """
    series = {key: points for key, points in series.items() if len(points)}
    if not series:
        return [f"{title!r}: no data"]
    problems = []
    for run in sorted({run for run, _ in series}):
        lines = sorted(name for r, name in series if r == run and not is_frame_tag(name))
        if len(lines) > MAX_SERIES_PER_CHART:
            problems.append(f"{title!r}: {len(lines)} lines for run {run!r} (at most {MAX_SERIES_PER_CHART}): {lines}")
    if all(len({step for step, _ in points}) < 2 for points in series.values()):
        problems.append(f"{title!r}: every line is a single step (show single-step data as a figure or a table)")
    # The scale rule is about logged readings: a frame line marks the range, and a line redrawn above a base (``..._above_...``)
    # starts near zero by design (its logged line, above no base, is what the rule compares).
    scales = {key: max(abs(v) for _, v in points) for key, points in series.items() if not is_frame_tag(key[1]) and not _is_rebased(key[1])}
    biggest = max(scales, key=scales.get) if scales else None
    for key, scale in scales.items():
        if 0 < scale and scales[biggest] > MAX_SCALE_RATIO * scale:
            problems.append(f"{title!r}: {biggest[1]} ({scales[biggest]:.6g}) is {scales[biggest] / scale:.0f}x "
                            f"{key[1]} ({scale:.6g}) of run {key[0]!r}: the smaller line is flat")
    if not tensorboard_y_range:
        return problems
    return problems + clipping_problems(title, series, smoothing) + tick_problems(title, series, smoothing)


def _is_rebased(tag: str) -> bool:
    """Whether ``tag`` is a line :func:`readable_layout` redrew above a base (``..._KiB_above_4628.4_KiB``)."""
    return re.search(r"_above_[0-9.]+_(B|KiB|MiB|GiB)$", tag) is not None


def _drawn(series: Mapping[Any, Sequence[tuple[float, float]]], smoothing: float) -> tuple[dict[Any, list[float]], tuple[float, float]]:
    """Each line's smoothed values (what TensorBoard draws and scales to) and the y range it draws."""
    smoothed = {key: _smoothed([v for _, v in sorted(points)], smoothing) for key, points in series.items() if points}
    return smoothed, tensorboard_y_range([v for values in smoothed.values() for v in values])


def clipping_problems(title: str, series: Mapping[tuple[str, str], Sequence[tuple[float, float]]], smoothing: float = 0.6) -> list[str]:
    """:func:`check_chart`'s clipping rule alone: the lines that have more than
    :data:`MAX_CLIPPED_FRACTION` of their (smoothed) points outside TensorBoard's default y range."""
    smoothed, (low, high) = _drawn(series, smoothing)
    problems = []
    for key, values in smoothed.items():
        outside = sum(not low <= v <= high for v in values)
        if outside > MAX_CLIPPED_FRACTION * len(values):
            problems.append(f"{title!r}: {outside} of the {len(values)} points of {key[1]} of run {key[0]!r} lie outside the y range "
                            f"TensorBoard draws by default [{low:.6g}, {high:.6g}] (outliers ignored)")
    return problems


def tick_problems(title: str, series: Mapping[tuple[str, str], Sequence[tuple[float, float]]], smoothing: float = 0.6) -> list[str]:
    """:func:`check_chart`'s axis rules alone: the y axis's tick labels, as TensorBoard writes them
    over its default y range, must all differ, and none may be at or above :data:`MAX_TICK_LABEL`
    (TensorBoard writes 1,400 as "1.4e+3": a chart of MiB values that reach 1,000 is drawn in GiB)."""
    _, (low, high) = _drawn(series, smoothing)
    ticks = tensorboard_ticks(low, high)
    labels = [tick_label(t) for t in ticks]
    problems = []
    if len(set(labels)) != len(labels):
        problems.append(f"{title!r}: the y axis over [{low:.6g}, {high:.6g}] labels its ticks {labels}: three significant digits "
                        f"cannot tell them apart")
    large = [label for t, label in zip(ticks, labels) if abs(t) >= MAX_TICK_LABEL]
    if large:
        problems.append(f"{title!r}: the y axis over [{low:.6g}, {high:.6g}] labels ticks {large} in exponent notation "
                        f"(values of {MAX_TICK_LABEL:,.0f} or more): draw them in a larger unit")
    return problems


# ---------------------------------------------------------------------------------------------- readable at a glance
#: the path part of the dashboard's rebased lines: ``<prefix>/dashboard/train/host_rss_MiB_above_1490_MiB`` is
#: ``memory/train/host_rss_MiB`` minus 1,490 MiB, the base its chart's title names (written at fit end, see :func:`readable_layout`).
DASHBOARD_TAG_PART = "dashboard"


def _rebased(regex: str, prefix: str, unit: str, base: str | None, is_regex: bool = True) -> str:
    """A chart regex (or a tag, ``is_regex=False``) of memkit's ``<prefix>/...<field>_MiB`` lines, for
    the same lines in ``unit`` above ``base`` (a plain number): ``..._MiB`` -> ``..._KiB_above_4628.4_KiB``;
    with ``base=None``, in ``unit`` alone: ``..._MiB`` -> ``..._GiB``."""
    head = re.escape(prefix) + "/"
    start = "^" if regex.startswith("^") else ""
    body = regex[len(start):]
    if body.startswith(head):
        body = head + DASHBOARD_TAG_PART + "/" + body[len(head):]
    elif body.startswith(prefix + "/"):
        body = prefix + "/" + DASHBOARD_TAG_PART + "/" + body[len(prefix) + 1:]
    if base is None:
        return start + body.replace("_MiB", f"_{unit}")
    return start + body.replace("_MiB", f"_{unit}_above_{re.escape(base) if is_regex else base}_{unit}")


#: the units a rebased line can be drawn in, smallest first, with their factor from MiB
_UNITS = (("B", 1048576.0), ("KiB", 1024.0), ("MiB", 1.0), ("GiB", 1 / 1024))


def _base(values: Sequence[float], unit: str | None = None) -> tuple[str, float, float, str, str]:
    """(unit, factor from MiB, base in that unit, the base as the title writes it, as the tag writes it) for MiB values on a large base.

    The unit, unless given, is bytes when the values move by less than 1 KiB, KiB when by less than 1 MiB, MiB when by
    less than 100 MiB, else GiB; the base is the lowest value rounded down to the order of magnitude of the values' range, so the rebased
    values start near zero."""
    low, high = min(values), max(values)
    if unit is None:
        unit = "B" if high - low < 1 / 1024 else "KiB" if high - low < 1 else "MiB" if high - low < MAX_TICK_LABEL / 10 else "GiB"
    factor = dict(_UNITS)[unit]
    span = (high - low) * factor
    step = 10.0 ** math.floor(math.log10(span)) if span > 0 else 1.0
    base = math.floor(low * factor / step) * step
    decimals = max(0, -math.floor(math.log10(step)))
    return unit, factor, base, f"{base:,.{decimals}f} {unit}", f"{base:.{decimals}f}"


def _displays(values: Sequence[float], large: bool) -> list[tuple[str, float, float, str, str | None]]:
    """The ways to draw MiB ``values`` that :func:`readable_layout` tries, in order, as ``(unit, factor
    from MiB, base in that unit, the base as the title writes it, as the tag writes it or None)``:
    when TensorBoard would label ticks of 1,000 or more (``large``), in GiB as they are; then above a
    base (:func:`_base`) in the unit that suits the values' range, then in each larger unit (values moving by
    0.9 MiB are 0 to 921.6 KiB above their base, and an axis up to 1,000 KiB labels its top "1e+3": 0 to 0.9 MiB reads right)."""
    natural = _base(values)
    larger = [unit for unit, _ in _UNITS][[unit for unit, _ in _UNITS].index(natural[0]) + 1:]
    return ([("GiB", 1 / 1024, 0.0, "", None)] if large else []) + [natural] + [_base(values, unit) for unit in larger]


def readable_layout(layout: Mapping[str, Mapping[str, Sequence[Any]]], runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
                    prefix: str = DEFAULT_PREFIX, smoothing: float = 0.6) -> tuple[dict[str, dict[str, list[Any]]], dict[str, dict[str, list[tuple[int, float]]]]]:
    """``layout`` made readable at TensorBoard's default settings, for the values the runs logged.

    Args:
        layout: a custom-scalars layout (:func:`dashboard_layout`).
        runs: ``{run name: {tag: [(step, value), ...]}}`` as TensorBoard reads them.
        prefix: MemoryTracker's ``prefix``.
        smoothing: TensorBoard's smoothing weight.

    Returns:
        ``(layout, lines)``: the layout, and ``{run: {tag: [(step, value), ...]}}`` of the rebased
        lines it draws, to be written into each run (:func:`~lightning_memkit.tensorboard.dashboard.update_dashboards`
        and MemoryTracker's fit end do).

    The changes, each where :func:`check_chart` says TensorBoard would draw a chart badly:

    - no chart is left out. A chart whose lines TensorBoard would cut (:func:`clipping_problems`: a line of a few
      points, e.g. an exact peak read on one step in ten of a short run, loses its ends to the outlier
      clipping), or whose short lines (:data:`SHORT_LINE_POINTS`) have raw points outside the range drawn for
      the smoothed ones, gets two flat lines per run at the lowest and the highest value of its lines
      (``<prefix>/dashboard/frame/...``, named in the title by :data:`FRAME_TITLE`), so the range holds every point;
    - a chart whose y axis would label a tick at 1,000 or more (:func:`tick_problems`: TensorBoard
      writes 1,400 MiB as "1.4e+3") draws its lines in GiB: "device (NVML), ... (GiB)", lines
      ``<prefix>/dashboard/train/device_used_GiB`` (the logged MiB / 1024, at the same steps);
    - a chart whose y axis would repeat a tick label (:func:`tick_problems`: a value moving by a
      few KiB around 4.43 MiB reads "4.43" on every tick), in GiB too, draws its lines above a base that its
      title names, in KiB when they move by less than 1 MiB (bytes, less than 1 KiB; GiB from 100 MiB):
      "live at step end (KiB above 4,628.4 KiB)". The rebased line (``<prefix>/dashboard/train/tensor_KiB_above_4628.4_KiB``) is
      the logged one in that unit minus the base, at the same steps.

    The logged ``_MiB`` tags are never changed (CSV, the Scalars tab and ``memkit report`` read them as
    they are); the redrawn lines are extra tags under ``<prefix>/dashboard/``.

    Pass every run the layout is drawn with (a ``memkit compare`` root's modes): one base for all
    of them, so each mode's run gets the same layout.
    """
    readable: dict[str, dict[str, list[Any]]] = {}
    lines: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for category, charts in layout.items():
        for title, spec in charts.items():
            regexes = list(spec[1]) if len(spec) == 2 and spec[0] == "Multiline" else list(spec)
            series = {(run, tag): list(tags[tag]) for run, tags in runs.items() for tag in _matching(regexes, tags) if tags[tag]}
            framed = bool(series) and bool(clipping_problems(title, series, smoothing) or _short_raw_outside(series, smoothing))
            drawn = {**series, **_frame_lines(series)} if framed else dict(series)
            display = None  # (unit, factor from MiB, base, the base as the title writes it, as the tag writes it)
            if series and tick_problems(title, drawn, smoothing) and all(tag.endswith("_MiB") for _, tag in series):
                _, (low, high) = _drawn(drawn, smoothing)
                large = any(abs(t) >= MAX_TICK_LABEL for t in tensorboard_ticks(low, high))
                for candidate in _displays([v for points in series.values() for _, v in points], large):
                    unit, factor, base, _, _ = candidate
                    redrawn = {key: [(step, round(v * factor - base, 6)) for step, v in points] for key, points in drawn.items()}
                    if not (tick_problems(title, redrawn, smoothing) or clipping_problems(title, redrawn, smoothing)):
                        display = candidate
                        break
            if display is not None:
                unit, factor, base, text, plain = display
                named = unit if plain is None else f"{unit} above {text}"
                title = title.replace("(MiB", f"({named}", 1) if "(MiB" in title else f"{title} ({named})"
                regexes = [_rebased(r, prefix, unit, plain) for r in regexes]
                for (run, tag), points in series.items():
                    lines.setdefault(run, {})[_rebased(tag, prefix, unit, plain, is_regex=False)] = \
                        [(step, round(v * factor - base, 6)) for step, v in points]
            if framed:
                unit, factor, base = display[:3] if display is not None else ("MiB", 1.0, 0.0)
                frame_tags = set()
                for (run, key), points in drawn.items():
                    if key not in _FRAME_KEYS:
                        continue
                    value = round(points[0][1] * factor - base, 6)
                    tag = _frame_tag(prefix, next(tag for r, tag in sorted(series) if r == run), key, value, unit)
                    frame_tags.add(tag)
                    lines.setdefault(run, {})[tag] = [(step, value) for step, _ in points]
                regexes = regexes + ["^(" + "|".join(re.escape(t) for t in sorted(frame_tags)) + ")$"]
                title += FRAME_TITLE
            readable.setdefault(category, {})[title] = ["Multiline", regexes]
    return readable, lines


#: what a framed chart's title ends with: :func:`readable_layout` draws two flat lines, at the lowest and the highest value
#: of the chart's lines, so TensorBoard's default y range (outliers ignored) holds every point of a short line.
FRAME_TITLE = "; flat lines: lowest, highest"
#: the path part of a frame line's tag: ``<prefix>/dashboard/frame/train/peak_tensor/low_4.43_MiB``.
FRAME_TAG_PART = DASHBOARD_TAG_PART + "/frame"
_FRAME_KEYS = ("<frame: lowest>", "<frame: highest>")


#: a line of at most this many points is short (a short run, a sparse logging interval, a sampled peak): its raw
#: points, drawn faint behind the smoothed line, must lie in the drawn y range too, else the chart is framed.
SHORT_LINE_POINTS = 10


def _short_raw_outside(series: Mapping[tuple[str, str], Sequence[tuple[float, float]]], smoothing: float) -> bool:
    """Whether a chart of short lines (:data:`SHORT_LINE_POINTS`) draws a raw point outside its y range: TensorBoard
    scales to the smoothed lines, so the last raw point of a short rising line is often cut off at the top."""
    if not series or max(len(points) for points in series.values()) > SHORT_LINE_POINTS:
        return False
    _, (low, high) = _drawn(series, smoothing)
    return any(not low <= v <= high for points in series.values() for _, v in points)


def is_frame_tag(tag: str) -> bool:
    """Whether ``tag`` is a frame line of the dashboard (:data:`FRAME_TITLE`), not a reading."""
    return f"/{FRAME_TAG_PART}/" in tag


def _frame_lines(series: Mapping[tuple[str, str], Sequence[tuple[float, float]]]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Two flat lines per run, at the lowest and the highest value of every line of the chart (all runs), at the
    steps that run's lines were logged at: with them at least a third of the chart's points lie at each end, so
    TensorBoard's 5th-95th percentile range spans every value of the lines however few their points."""
    values = [v for points in series.values() for _, v in points]
    low, high = min(values), max(values)
    frames: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for run in sorted({run for run, _ in series}):
        steps = sorted({step for (r, _), points in series.items() if r == run for step, _ in points})
        frames[(run, _FRAME_KEYS[0])] = [(step, low) for step in steps]
        frames[(run, _FRAME_KEYS[1])] = [(step, high) for step in steps]
    return frames


def _frame_tag(prefix: str, tag: str, key: str, value: float, unit: str) -> str:
    """The tag of a frame line of the chart whose first line is ``tag``: it names its value, so a chart drawn again
    with another range (a compare root that got a mode) gets new lines, not values written twice at one step."""
    head = prefix + "/"
    body = tag[len(head):] if tag.startswith(head) else tag
    body = re.sub(r"/rank[0-9]+/", "/ranks/", body)
    body = re.sub(r"_(B|KiB|MiB|GiB)$", "", body)
    side = "low" if key == _FRAME_KEYS[0] else "high"
    return f"{prefix}/{FRAME_TAG_PART}/{body}/{side}_{value:.6f}".rstrip("0").rstrip(".") + f"_{unit}"
