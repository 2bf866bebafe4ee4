"""The rules every dashboard chart keeps, checked on the values a run logged: one check per rule, in words.

At most three lines per run, of one scale, inside the y range TensorBoard draws, with tick labels that read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_memkit.tensorboard.axis import smoothed, tensorboard_ticks, tensorboard_y_range, tick_label
from lightning_memkit.tensorboard.layout import MAX_SERIES_PER_CHART, layout_tags, matching_tags
from lightning_memkit.tensorboard.tags import is_frame_tag, is_rebased_tag

__all__ = [
    "MAX_SCALE_RATIO",
    "MAX_TICK_LABEL",
    "MAX_CLIPPED_FRACTION",
    "check_dashboard",
    "check_chart",
    "clipping_problems",
    "tick_problems",
    "chart_series",
    "drawn_lines",
]

#: the largest ratio between the biggest and the smallest non-zero series of one chart (by largest |value|).
MAX_SCALE_RATIO = 100.0
#: tick labels at or above this are written in exponent notation by TensorBoard (d3's ``.3~g``: 1,400 -> "1.4e+3"),
#: so a chart keeps its labels below it: MiB values that reach it are drawn in GiB
#: (:func:`~lightning_memkit.tensorboard.readable.readable_layout`).
MAX_TICK_LABEL = 1000.0
#: the largest share of a line's points that may lie outside the y range TensorBoard draws by
#: default (it ignores values beyond the 5th and 95th percentiles: up to 10 % of a long line).
MAX_CLIPPED_FRACTION = 0.1

#: ``{(run, line name): [(step, value), ...]}``: every line one chart draws (steps are TensorBoard's, whole numbers).
Series = Mapping[tuple[str, str], Sequence[tuple[int, float]]]


def chart_series(
    regexes: Sequence[str], runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]]
) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """The lines a chart of these tag ``regexes`` draws: every matching tag with a value, in every run."""
    return {
        (run, tag): list(tags[tag]) for run, tags in runs.items() for tag in matching_tags(regexes, tags) if tags[tag]
    }


def drawn_lines(series: Series, smoothing: float) -> tuple[dict[Any, list[float]], tuple[float, float]]:
    """Each line's smoothed values (what TensorBoard draws and scales to) and the y range it draws."""
    lines = {key: smoothed([v for _, v in sorted(points)], smoothing) for key, points in series.items() if points}
    return lines, tensorboard_y_range([v for values in lines.values() for v in values])


def check_dashboard(
    layout: Mapping[str, Mapping[str, Sequence[Any]]],
    runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    smoothing: float = 0.6,
) -> list[str]:
    """The rules every memkit chart keeps, checked on real logs; returns the broken ones, in words.

    Args:
        layout: a custom-scalars layout (:func:`~lightning_memkit.tensorboard.layout.dashboard_layout`, or one read
            from event files).
        runs: ``{run name: {tag: [(step, value), ...]}}``: the scalars of every run the Custom
            Scalars tab draws together (one run, or every mode's run under a compare root).
        smoothing: TensorBoard's smoothing weight (0.6 by default).

    Each chart of the layout is held to :func:`check_chart` with the lines it draws (every tag
    its regexes match, in every run); a chart that matches no logged tag is "no data".
    """
    problems = []
    for title, regexes in layout_tags(layout).items():
        series = chart_series(regexes, runs)
        if not series:
            problems.append(f"{title!r}: no data (its regexes {regexes} match no logged tag)")
            continue
        problems += check_chart(title, series, smoothing)
    return problems


def _scale_problems(title: str, series: Series) -> list[str]:
    """The scale rule: no line's largest |value| more than :data:`MAX_SCALE_RATIO` times another non-zero line's.

    It is about logged readings: a frame line marks the range, and a line redrawn above a base
    (``..._above_...``) starts near zero by design (its logged line, above no base, is what the rule compares).
    """
    scales = {
        key: max(abs(v) for _, v in points)
        for key, points in series.items()
        if not is_frame_tag(key[1]) and not is_rebased_tag(key[1])
    }
    if not scales:
        return []
    biggest = max(scales, key=scales.__getitem__)
    problems = []
    for key, scale in scales.items():
        if scale > 0 and scales[biggest] > MAX_SCALE_RATIO * scale:
            problems.append(
                f"{title!r}: {biggest[1]} ({scales[biggest]:.6g}) is {scales[biggest] / scale:.0f}x "
                f"{key[1]} ({scale:.6g}) of run {key[0]!r}: the smaller line is flat"
            )
    return problems


def check_chart(title: str, series: Series, smoothing: float = 0.6, tensorboard_y_range: bool = True) -> list[str]:
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
    problems += _scale_problems(title, series)
    if not tensorboard_y_range:
        return problems
    return problems + clipping_problems(title, series, smoothing) + tick_problems(title, series, smoothing)


def clipping_problems(title: str, series: Series, smoothing: float = 0.6) -> list[str]:
    """:func:`check_chart`'s clipping rule alone: the lines that have more than
    :data:`MAX_CLIPPED_FRACTION` of their (smoothed) points outside TensorBoard's default y range."""
    lines, (low, high) = drawn_lines(series, smoothing)
    problems = []
    for key, values in lines.items():
        outside = sum(not low <= v <= high for v in values)
        if outside > MAX_CLIPPED_FRACTION * len(values):
            problems.append(
                f"{title!r}: {outside} of the {len(values)} points of {key[1]} of run {key[0]!r} lie "
                f"outside the y range TensorBoard draws by default [{low:.6g}, {high:.6g}] "
                f"(outliers ignored)"
            )
    return problems


def tick_problems(title: str, series: Series, smoothing: float = 0.6) -> list[str]:
    """:func:`check_chart`'s axis rules alone: the y axis's tick labels, as TensorBoard writes them
    over its default y range, must all differ, and none may be at or above :data:`MAX_TICK_LABEL`
    (TensorBoard writes 1,400 as "1.4e+3": a chart of MiB values that reach 1,000 is drawn in GiB)."""
    _, (low, high) = drawn_lines(series, smoothing)
    ticks = tensorboard_ticks(low, high)
    labels = [tick_label(t) for t in ticks]
    problems = []
    if len(set(labels)) != len(labels):
        problems.append(
            f"{title!r}: the y axis over [{low:.6g}, {high:.6g}] labels its ticks {labels}: "
            f"three significant digits cannot tell them apart"
        )
    large = [label for t, label in zip(ticks, labels, strict=True) if abs(t) >= MAX_TICK_LABEL]
    if large:
        problems.append(
            f"{title!r}: the y axis over [{low:.6g}, {high:.6g}] labels ticks {large} in exponent "
            f"notation (values of {MAX_TICK_LABEL:,.0f} or more): draw them in a larger unit"
        )
    return problems
