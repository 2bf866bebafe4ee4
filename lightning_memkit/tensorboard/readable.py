"""A dashboard layout redrawn where TensorBoard would draw a chart badly: larger units, a base, frame lines.

The logged ``_MiB`` tags never change; the redrawn lines are extra tags under ``<prefix>/dashboard/``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_memkit.tensorboard.axis import tensorboard_ticks
from lightning_memkit.tensorboard.layout import layout_tags
from lightning_memkit.tensorboard.rules import (
    MAX_TICK_LABEL,
    Series,
    chart_series,
    clipping_problems,
    drawn_lines,
    tick_problems,
)
from lightning_memkit.tensorboard.tags import DASHBOARD_TAG_PART, DEFAULT_PREFIX, FRAME_TAG_PART

__all__ = ["readable_layout", "FRAME_TITLE", "SHORT_LINE_POINTS"]

#: what a framed chart's title ends with: :func:`readable_layout` draws two flat lines, at the lowest and the highest
#: value of the chart's lines, so TensorBoard's default y range (outliers ignored) holds every point of a short line.
FRAME_TITLE = "; flat lines: lowest, highest"
_FRAME_KEYS = ("<frame: lowest>", "<frame: highest>")
#: a line of at most this many points is short (a short run, a sparse logging interval, a sampled peak): its raw
#: points, drawn faint behind the smoothed line, must lie in the drawn y range too, else the chart is framed.
SHORT_LINE_POINTS = 10
#: the units a rebased line can be drawn in, smallest first, with their factor from MiB
_UNITS = (("B", 1048576.0), ("KiB", 1024.0), ("MiB", 1.0), ("GiB", 1 / 1024))


@dataclass(frozen=True)
class Display:
    """A way to draw a chart's MiB values: in ``unit`` (the logged value times ``factor``) minus ``base``.

    Attributes:
        unit: ``B``, ``KiB``, ``MiB`` or ``GiB``.
        factor: from MiB to ``unit``.
        base: subtracted from every value, in ``unit`` (0: drawn as they are).
        title_base: the base as the chart's title writes it (``"4,628.4 KiB"``).
        tag_base: the base as the tag writes it (``"4628.4"``), or None for a line in ``unit`` above no base.
    """

    unit: str
    factor: float
    base: float
    title_base: str
    tag_base: str | None

    def value(self, mib: float) -> float:
        """A logged MiB value as this display draws it."""
        return round(mib * self.factor - self.base, 6)

    def named(self) -> str:
        """The unit as the title names it: ``GiB`` or ``KiB above 4,628.4 KiB``."""
        return self.unit if self.tag_base is None else f"{self.unit} above {self.title_base}"


#: the logged lines as they are
_AS_LOGGED = Display("MiB", 1.0, 0.0, "", None)


def _rebased(regex: str, prefix: str, unit: str, base: str | None, is_regex: bool = True) -> str:
    """A chart regex (or a tag, ``is_regex=False``) of memkit's ``<prefix>/...<field>_MiB`` lines, for
    the same lines in ``unit`` above ``base`` (a plain number): ``..._MiB`` -> ``..._KiB_above_4628.4_KiB``;
    with ``base=None``, in ``unit`` alone: ``..._MiB`` -> ``..._GiB``."""
    head = re.escape(prefix) + "/"
    start = "^" if regex.startswith("^") else ""
    body = regex[len(start) :]
    if body.startswith(head):
        body = head + DASHBOARD_TAG_PART + "/" + body[len(head) :]
    elif body.startswith(prefix + "/"):
        body = prefix + "/" + DASHBOARD_TAG_PART + "/" + body[len(prefix) + 1 :]
    if base is None:
        return start + body.replace("_MiB", f"_{unit}")
    return start + body.replace("_MiB", f"_{unit}_above_{re.escape(base) if is_regex else base}_{unit}")


def _base(values: Sequence[float], unit: str | None = None) -> Display:
    """How to draw MiB values on a large base: in ``unit`` above the base.

    The unit, unless given, is bytes when the values move by less than 1 KiB, KiB when by less than 1 MiB, MiB when
    by less than 100 MiB, else GiB; the base is the lowest value rounded down to the order of magnitude of the
    values' range, so the rebased values start near zero."""
    low, high = min(values), max(values)
    if unit is None:
        unit = (
            "B"
            if high - low < 1 / 1024
            else "KiB"
            if high - low < 1
            else "MiB"
            if high - low < MAX_TICK_LABEL / 10
            else "GiB"
        )
    factor = dict(_UNITS)[unit]
    span = (high - low) * factor
    step = 10.0 ** math.floor(math.log10(span)) if span > 0 else 1.0
    base = math.floor(low * factor / step) * step
    decimals = max(0, -math.floor(math.log10(step)))
    return Display(unit, factor, base, f"{base:,.{decimals}f} {unit}", f"{base:.{decimals}f}")


def _displays(values: Sequence[float], large: bool) -> list[Display]:
    """The ways to draw MiB ``values`` that :func:`readable_layout` tries, in order: when TensorBoard would label
    ticks of 1,000 or more (``large``), in GiB as they are; then above a base (:func:`_base`) in the unit that suits
    the values' range, then in each larger unit (values moving by 0.9 MiB are 0 to 921.6 KiB above their base, and
    an axis up to 1,000 KiB labels its top "1e+3": 0 to 0.9 MiB reads right)."""
    natural = _base(values)
    names = [unit for unit, _ in _UNITS]
    larger = names[names.index(natural.unit) + 1 :]
    return ([Display("GiB", 1 / 1024, 0.0, "", None)] if large else []) + [natural] + [_base(values, u) for u in larger]


def _short_raw_outside(series: Series, smoothing: float) -> bool:
    """Whether a chart of short lines (:data:`SHORT_LINE_POINTS`) draws a raw point outside its y range: TensorBoard
    scales to the smoothed lines, so the last raw point of a short rising line is often cut off at the top."""
    if not series or max(len(points) for points in series.values()) > SHORT_LINE_POINTS:
        return False
    _, (low, high) = drawn_lines(series, smoothing)
    return any(not low <= v <= high for points in series.values() for _, v in points)


def _frame_lines(series: Series) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """Two flat lines per run, at the lowest and the highest value of every line of the chart (all runs), at the
    steps that run's lines were logged at: with them at least a third of the chart's points lie at each end, so
    TensorBoard's 5th-95th percentile range spans every value of the lines however few their points."""
    values = [v for points in series.values() for _, v in points]
    low, high = min(values), max(values)
    frames: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for run in sorted({run for run, _ in series}):
        steps = sorted({step for (r, _), points in series.items() if r == run for step, _ in points})
        frames[(run, _FRAME_KEYS[0])] = [(step, low) for step in steps]
        frames[(run, _FRAME_KEYS[1])] = [(step, high) for step in steps]
    return frames


def _frame_tag(prefix: str, tag: str, key: str, value: float, unit: str) -> str:
    """The tag of a frame line of the chart whose first line is ``tag``: it names its value, so a chart drawn again
    with another range (a compare root that got a mode) gets new lines, not values written twice at one step."""
    head = prefix + "/"
    body = tag[len(head) :] if tag.startswith(head) else tag
    body = re.sub(r"/rank[0-9]+/", "/ranks/", body)
    body = re.sub(r"_(B|KiB|MiB|GiB)$", "", body)
    side = "low" if key == _FRAME_KEYS[0] else "high"
    return f"{prefix}/{FRAME_TAG_PART}/{body}/{side}_{value:.6f}".rstrip("0").rstrip(".") + f"_{unit}"


def _readable_display(title: str, series: Series, drawn: Series, smoothing: float) -> Display | None:
    """The first display (:func:`_displays`) whose axis reads right and keeps every line in range, for a chart of
    logged MiB lines whose axis (:func:`~lightning_memkit.tensorboard.rules.tick_problems`) does not; else None."""
    if not series or not tick_problems(title, drawn, smoothing) or not all(tag.endswith("_MiB") for _, tag in series):
        return None
    _, (low, high) = drawn_lines(drawn, smoothing)
    large = any(abs(t) >= MAX_TICK_LABEL for t in tensorboard_ticks(low, high))
    for display in _displays([v for points in series.values() for _, v in points], large):
        redrawn = {key: [(step, display.value(v)) for step, v in points] for key, points in drawn.items()}
        if not (tick_problems(title, redrawn, smoothing) or clipping_problems(title, redrawn, smoothing)):
            return display
    return None


def _frame_regex(
    series: Series, drawn: Series, display: Display, prefix: str, lines: dict[str, dict[str, list[tuple[int, float]]]]
) -> str:
    """Adds each run's frame lines to ``lines``, in ``display``; returns the regex that matches them."""
    frame_tags = set()
    for (run, key), points in drawn.items():
        if key not in _FRAME_KEYS:
            continue
        value = display.value(points[0][1])
        tag = _frame_tag(prefix, next(tag for r, tag in sorted(series) if r == run), key, value, display.unit)
        frame_tags.add(tag)
        lines.setdefault(run, {})[tag] = [(step, value) for step, _ in points]
    return "^(" + "|".join(re.escape(t) for t in sorted(frame_tags)) + ")$"


def readable_layout(
    layout: Mapping[str, Mapping[str, Sequence[Any]]],
    runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    prefix: str = DEFAULT_PREFIX,
    smoothing: float = 0.6,
) -> tuple[dict[str, dict[str, list[Any]]], dict[str, dict[str, list[tuple[int, float]]]]]:
    """``layout`` made readable at TensorBoard's default settings, for the values the runs logged.

    Args:
        layout: a custom-scalars layout (:func:`~lightning_memkit.tensorboard.layout.dashboard_layout`).
        runs: ``{run name: {tag: [(step, value), ...]}}`` as TensorBoard reads them.
        prefix: MemoryTracker's ``prefix``.
        smoothing: TensorBoard's smoothing weight.

    Returns:
        ``(layout, lines)``: the layout, and ``{run: {tag: [(step, value), ...]}}`` of the rebased
        lines it draws, to be written into each run
        (:func:`~lightning_memkit.tensorboard.dashboard.update_dashboards` and MemoryTracker's fit end do).

    The changes, each where :func:`~lightning_memkit.tensorboard.rules.check_chart` says TensorBoard would draw a
    chart badly:

    - no chart is left out. A chart whose lines TensorBoard would cut
      (:func:`~lightning_memkit.tensorboard.rules.clipping_problems`: a line of a few points, e.g. an exact peak
      read on one step in ten of a short run, loses its ends to the outlier clipping), or whose short lines
      (:data:`SHORT_LINE_POINTS`) have raw points outside the range drawn for the smoothed ones, gets two flat
      lines per run at the lowest and the highest value of its lines (``<prefix>/dashboard/frame/...``, named in
      the title by :data:`FRAME_TITLE`), so the range holds every point;
    - a chart whose y axis would label a tick at 1,000 or more
      (:func:`~lightning_memkit.tensorboard.rules.tick_problems`: TensorBoard writes 1,400 MiB as "1.4e+3") draws
      its lines in GiB: "device (NVML), ... (GiB)", lines ``<prefix>/dashboard/train/device_used_GiB`` (the
      logged MiB / 1024, at the same steps);
    - a chart whose y axis would repeat a tick label (a value moving by a few KiB around 4.43 MiB reads "4.43" on
      every tick), in GiB too, draws its lines above a base that its title names, in KiB when they move by less
      than 1 MiB (bytes, less than 1 KiB; GiB from 100 MiB): "live at step end (KiB above 4,628.4 KiB)". The
      rebased line (``<prefix>/dashboard/train/tensor_KiB_above_4628.4_KiB``) is the logged one in that unit
      minus the base, at the same steps.

    The logged ``_MiB`` tags are never changed (CSV, the Scalars tab and ``memkit report`` read them as
    they are); the redrawn lines are extra tags under ``<prefix>/dashboard/``.

    Pass every run the layout is drawn with (a ``memkit compare`` root's modes): one base for all
    of them, so each mode's run gets the same layout.
    """
    readable: dict[str, dict[str, list[Any]]] = {}
    lines: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for category, charts in layout.items():
        for title, regexes in layout_tags({category: charts}).items():
            series = chart_series(regexes, runs)
            framed = bool(series) and bool(
                clipping_problems(title, series, smoothing) or _short_raw_outside(series, smoothing)
            )
            drawn: Series = {**series, **_frame_lines(series)} if framed else dict(series)
            display = _readable_display(title, series, drawn, smoothing)
            if display is not None:
                named = display.named()
                title = title.replace("(MiB", f"({named}", 1) if "(MiB" in title else f"{title} ({named})"
                regexes = [_rebased(r, prefix, display.unit, display.tag_base) for r in regexes]
                for (run, tag), points in series.items():
                    rebased = _rebased(tag, prefix, display.unit, display.tag_base, is_regex=False)
                    lines.setdefault(run, {})[rebased] = [(step, display.value(v)) for step, v in points]
            if framed:
                regexes = regexes + [_frame_regex(series, drawn, display or _AS_LOGGED, prefix, lines)]
                title += FRAME_TITLE
            readable.setdefault(category, {})[title] = ["Multiline", regexes]
    return readable, lines
