"""The memkit dashboard's layout: which logged memory scalars TensorBoard draws together, chart by chart.

The layout is a custom-scalars layout (TensorBoard's "Custom Scalars" tab) built from the tag
names in :mod:`lightning_memkit.tensorboard.tags`; ``dashboard.register_dashboard`` writes it
once per run from whichever memkit callback reaches fit start first. Every chart answers one
question with at most three lines a user can name from its title, and draws quantities of one
scale: a device's capacity is a number in the summary (Text tab), never a line that flattens the
others; single-step data (a layer trace, a comparison's summary) is a figure and a table, not a
chart. :mod:`~lightning_memkit.tensorboard.rules` states those rules as code; the tests hold every layout to them,
and :mod:`~lightning_memkit.tensorboard.readable` redraws a chart TensorBoard would draw badly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX, STAGE_TAGS, metric_name

__all__ = [
    "TRACE_TAG_PART",
    "MAX_SERIES_PER_CHART",
    "dashboard_layout",
    "layout_from_tags",
    "prune_layout",
    "layout_tags",
    "matching_tags",
    "COMPARE_CATEGORY",
    "RANK_CATEGORY",
    "rank_groups",
]

#: the path part of LayerTrace's scalars: ``memory/trace/{peak,end}_MiB``, ``memory/trace/{peak,end}/<category>_MiB``.
#: They are single-step values: the layout has no chart of them (the trace's figure and tables show them).
TRACE_TAG_PART = "trace"
#: the category of a ``memkit compare`` mode's layout (one line per mode's run in every chart).
COMPARE_CATEGORY = "memkit: modes compared"
#: the most lines one chart draws for one run.
MAX_SERIES_PER_CHART = 3

# A chart: (title, stage, fields). Stage "train", "val" or "rank" (``<prefix>/train/rank<r>/``).
# TensorBoard tells a run's lines apart only by marker shape, with the legend folded away: a chart
# of several lines draws quantities ordered by definition (reserved >= allocated, a step's peak >=
# its end, all processes >= this process >= its allocator), and its title names them top to bottom,
# in the order of ``fields`` (tests/tensorboard/test_dashboard_rules.py checks the order on real logs).
_CUDA_CHARTS = [
    (
        "CUDA step peak, top to bottom: reserved, allocated (MiB)",
        "train",
        ["peak_reserved_bytes", "peak_allocated_bytes"],
    ),
    ("CUDA at step end, top to bottom: reserved, allocated (MiB)", "train", ["reserved_bytes", "allocated_bytes"]),
    ("CUDA fragmentation: reserved but cut off from larger blocks (MiB)", "train", ["fragmentation_bytes"]),
    ("CUDA allocator: retries after flushing the cache, OOMs (count)", "train", ["alloc_retries", "ooms"]),
]
# NVML's capacity is not a line here: at 80 GB it flattened every other line to zero. It is in the
# summary table and the device table (Text tab); the chart compares quantities of one scale.
_NVML_CHARTS = [
    (
        "device (NVML), top to bottom: all processes, this process, allocator reserved (MiB)",
        "train",
        ["device_used_bytes", "process_device_bytes", "reserved_bytes"],
    ),
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
    (
        "validation runs, top to bottom: CUDA peak reserved, peak allocated (MiB)",
        "val",
        ["peak_reserved_bytes", "peak_allocated_bytes"],
    ),
]
# two lines, not one: a chart of a single line with two points (two validation runs) is empty in
# TensorBoard by default (both points are "outliers" of the 5th-95th percentile range)
_TENSOR_VALIDATION_CHARTS = [
    (
        "validation runs, exact tensors, top to bottom: peak, live at end (MiB)",
        "val",
        ["peak_tensor_bytes", "tensor_bytes"],
    ),
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
    if cuda:
        peak = ("per rank: CUDA step peak allocated (MiB; one line per rank)", "rank", ["peak_allocated_bytes"])
    else:
        peak = ("per rank: live tensors at step end, exact (MiB; one line per rank)", "rank", ["tensor_bytes"])
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
        quantity = title[len("per rank: ") : title.index(" (MiB")]
        names = [re.escape(metric_name(f)) for f in fields]
        alternatives = names[0] if len(names) == 1 else "(" + "|".join(names) + ")"
        category = layout.setdefault(f"{RANK_CATEGORY}: {quantity}", {})
        for group in rank_groups(world_size):
            label = f"rank {group[0]}" if len(group) == 1 else f"ranks {group[0]}-{group[-1]}"
            ranks = "(" + "|".join(str(r) for r in group) + ")"
            category[f"per rank: {quantity} (MiB; {label}, one line each)"] = [
                "Multiline",
                [f"^{escaped}/{STAGE_TAGS['train']}/rank{ranks}/{alternatives}$"],
            ]
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
    parts = {
        "train": f"{escaped}/{STAGE_TAGS['train']}/",
        "val": f"{escaped}/{STAGE_TAGS['validate']}/",
        "rank": f"{escaped}/{STAGE_TAGS['train']}/rank[0-9]+/",
    }
    charts = {}
    for title, stage, fields in specs:
        names = [re.escape(metric_name(f)) for f in fields]
        alternatives = names[0] if len(names) == 1 else "(" + "|".join(names) + ")"
        charts[title] = ["Multiline", [f"^{parts[stage]}{alternatives}$"]]
    return charts


def layout_tags(layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> dict[str, list[str]]:
    """``{chart title: [tag regex, ...]}`` of a layout: as :func:`dashboard_layout` returns it
    (``["Multiline", [regex, ...]]`` per chart) or with a plain list of regexes per chart."""
    return {
        title: list(spec[1]) if len(spec) == 2 and spec[0] == "Multiline" else list(spec)
        for category in layout.values()
        for title, spec in category.items()
    }


def matching_tags(regexes: Sequence[str], tags: Iterable[str]) -> list[str]:
    compiled = [re.compile(r) for r in regexes]
    return sorted(t for t in tags if any(r.match(t) for r in compiled))  # TensorBoard's own match: from the start


def prune_layout(
    layout: Mapping[str, Mapping[str, Sequence[Any]]], steps_per_tag: Mapping[str, int]
) -> dict[str, dict[str, list[Any]]]:
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
        kept = {
            title: [spec[0], list(spec[1])]
            for title, spec in charts.items()
            if any(steps_per_tag[t] >= 2 for t in matching_tags(spec[1], steps_per_tag))
        }
        if kept:
            pruned[category] = kept
    return pruned


def layout_from_tags(
    tags: Mapping[str, int] | Iterable[str], prefix: str = DEFAULT_PREFIX, compare: bool = False
) -> dict[str, dict[str, list[Any]]]:
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
    steps = dict(tags) if isinstance(tags, Mapping) else dict.fromkeys(tags, 2)
    train = f"{prefix}/{STAGE_TAGS['train']}/"
    val = f"{prefix}/{STAGE_TAGS['validate']}/"
    has = lambda stage, field: f"{stage}{metric_name(field)}" in steps  # noqa: E731
    layout = dashboard_layout(
        prefix=prefix,
        cuda=has(train, "peak_allocated_bytes") or has(train, "allocated_bytes"),
        nvml=has(train, "device_used_bytes"),
        tensors=has(train, "tensor_bytes") or has(train, "peak_tensor_bytes"),
        host=has(train, "host_rss_bytes"),
        validation=any(t.startswith(val) for t in steps),
        ranks=max(
            (int(m.group(1)) + 1 for m in (re.match(re.escape(train) + r"rank([0-9]+)/", t) for t in steps) if m),
            default=0,
        ),
        compare=compare,
    )
    return prune_layout(layout, steps)
