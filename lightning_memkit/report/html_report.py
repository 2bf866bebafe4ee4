"""The offline report: one self-contained HTML file (inline CSS, PNGs as base64) from ReportSources.

Every table and figure is produced by the same functions that feed TensorBoard
(``format_summary``, ``memory_per_step_figure``, the trace and compare modules' own
renderers when present), so the report and the dashboard never disagree.
"""

from __future__ import annotations

import base64
import datetime
import html
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit._version import __version__
from lightning_memkit.doctor.verdict import DoctorReport
from lightning_memkit.modes.compare_result import ModeStatus, read_compare
from lightning_memkit.records import MEMORY_FIELDS, RunSummary, StepReading
from lightning_memkit.report.sources import CompareFile, DoctorFile, OomFile, ReportSources, RunRecords, TraceFile
from lightning_memkit.summary_table import format_summary, format_table
from lightning_memkit.tensorboard.dashboard import device_table
from lightning_memkit.tensorboard.figures import compare_figures, figure_png, memory_per_step_figure
from lightning_memkit.trace.trace_records import LayerTraceResult
from lightning_memkit.units import MiB

__all__ = ["ReportFigure", "Report", "build_report", "readings_table"]

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222;
padding:0 1em}
h1{border-bottom:3px solid #f57c00;padding-bottom:.3em}
h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
pre{background:#f6f8fa;border:1px solid #e1e4e8;border-radius:4px;padding:.8em;overflow-x:auto;font-size:13px;
line-height:1.35}
table.data{border-collapse:collapse;font-size:13px;margin:.5em 0}
table.data th,table.data td{border:1px solid #ddd;padding:.25em .6em;text-align:right}
table.data th{background:#f6f8fa}
table.data td:first-child,table.data th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.missing li{color:#8a6d3b}.problems li{color:#a94442}.found li{color:#2e7d32}
.meta{color:#666;font-size:13px}
"""


@dataclass
class ReportFigure:
    """A rendered figure: ``slug`` (file name stem for ``--png``), ``title``, PNG bytes."""

    slug: str
    title: str
    png: bytes


@dataclass
class Report:
    """The rendered report: ``html`` (self-contained) and the ``figures`` it embeds."""

    html: str
    figures: list[ReportFigure] = field(default_factory=list)

    def write(self, path: str, png_dir: str | None = None) -> list[str]:
        """Write the HTML to ``path`` and, with ``png_dir``, each figure as ``<png_dir>/<slug>.png``; the paths
        written."""
        written = []
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.html)
        written.append(path)
        if png_dir:
            os.makedirs(png_dir, exist_ok=True)
            for figure in self.figures:
                target = os.path.join(png_dir, figure.slug + ".png")
                with open(target, "wb") as file:
                    file.write(figure.png)
                written.append(target)
        return written


def _slug(*parts: str) -> str:
    text = "_".join(p for p in parts if p and p != ".")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def readings_table(history: list[StepReading]) -> str:
    """The readings as a fixed-width table: step, stage, then each measured field (MiB or count)."""
    fields = [f for f in StepReading.value_fields() if any(getattr(r, f) is not None for r in history)]
    headers = ["step", "stage"] + [f[: -len("_bytes")] + " MiB" if f in MEMORY_FIELDS else f for f in fields]
    rows = []
    for reading in history:
        row: list[Any] = [reading.step, reading.stage]
        for name in fields:
            value = getattr(reading, name)
            row.append("-" if value is None else (f"{value / MiB:.2f}" if name in MEMORY_FIELDS else str(value)))
        rows.append(row)
    return format_table(headers, rows)


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _img(figure: ReportFigure) -> str:
    data = base64.b64encode(figure.png).decode("ascii")
    title = html.escape(figure.title)
    return f'<img alt="{title}" title="{title}" src="data:image/png;base64,{data}">'


def _html_table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="data"><tr>{head}</tr>{body}</table>'


class _Builder:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.figures: list[ReportFigure] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, slug: str, title: str, make: Callable[[], Any]) -> None:
        """Render ``make()`` (a matplotlib Figure) to PNG and embed it; a failure is said, not raised."""
        try:
            png = figure_png(make())
        except Exception as error:  # noqa: BLE001 - a broken figure must not lose the rest of the report
            self.add(
                f'<p class="problems">figure "{html.escape(title)}" could not be drawn: {html.escape(repr(error))}</p>'
            )
            return
        figure = ReportFigure(slug, title, png)
        self.figures.append(figure)
        self.add(_img(figure))


def _run_section(builder: _Builder, run: RunRecords) -> None:

    builder.add(f"<h2>Run <code>{html.escape(run.name)}</code></h2>")
    source = (
        ""
        if not run.rebuilt_from
        else f" (rebuilt from {run.rebuilt_from}: float64 MiB, exact bytes)"
        if run.exact
        else f" (rebuilt from {run.rebuilt_from}: float32 MiB, not exact bytes)"
    )
    builder.add(f'<p class="meta">from {html.escape(os.path.basename(run.path))}{html.escape(source)}</p>')
    ended_by = run.summary.extra.get("ended_by")
    if ended_by:  # MemoryTracker writes its records when the fit raises, too
        builder.add(
            f'<p class="problems">the fit did not finish: {html.escape(str(ended_by))}; the readings end at '
            f"the failure</p>"
        )
    builder.add(_pre(format_summary(run.summary, run.history)))
    device = device_table(run.history)
    if device:  # capacity and headroom as numbers: a capacity line would flatten every other line
        builder.add(_pre(device))
    if run.history:
        builder.figure(
            _slug(run.name, "memory_per_step"),
            f"memory per step: {run.name}",
            lambda: memory_per_step_figure(run.summary, run.history, title=f"memkit: memory per step ({run.name})"),
        )
        builder.add(
            f"<details><summary>all {len(run.history)} readings</summary>{_pre(readings_table(run.history))}</details>"
        )


def _oom_section(builder: _Builder, oom: OomFile) -> None:
    data = oom.data
    builder.add(
        f"<h2>Out of memory: <code>{html.escape(oom.name)}</code>, step {html.escape(str(data.get('step')))}, "
        f"rank {oom.rank}</h2>"
    )
    builder.add(
        f'<p class="problems">{html.escape(str(data.get("error_type")))}: '
        f"{html.escape(str(data.get('error', ''))[:600])}</p>"
    )
    builder.add(
        f'<p class="meta">device {html.escape(str(data.get("device")))}, '
        f"at {html.escape(str(data.get('time', '?')))}, "
        f"from {html.escape(os.path.basename(oom.path))}</p>"
    )
    readings = [StepReading.from_dict(r) for r in data.get("last_readings") or []]
    if data.get("failing_step_reading"):
        readings.append(StepReading.from_dict(data["failing_step_reading"]))
    try:
        summary = RunSummary.from_dict(data.get("summary") or {})
        builder.add(_pre(format_summary(summary, readings)))
    except (TypeError, ValueError) as error:
        builder.add(f'<p class="problems">its summary cannot be read ({html.escape(str(error))})</p>')
    if readings:
        builder.add(
            "<p>The last readings; the last row is the step that ran out (measured up to the failure):</p>"
            + _pre(readings_table(readings))
        )
    if data.get("cuda_snapshot"):
        builder.add(
            f"<p>A CUDA memory snapshot was saved to <code>{html.escape(str(data['cuda_snapshot']))}</code>: "
            "open it at https://pytorch.org/memory_viz (memkit report never opens pickles).</p>"
        )
    if data.get("cuda_memory_summary"):
        builder.add(
            "<details><summary>CUDA allocator summary at the failure</summary>"
            f"{_pre(str(data['cuda_memory_summary']))}</details>"
        )


def _doctor_section(builder: _Builder, doctor: DoctorFile) -> None:
    report = DoctorReport.from_dict(doctor.data)
    verdict = "healthy" if report.healthy else "memory survives steps"
    builder.add(f"<h2>Memory doctor <code>{html.escape(doctor.name)}</code>: {verdict}</h2>")
    builder.add(_pre(report.format()))


def _trace_section(builder: _Builder, trace: TraceFile) -> None:
    rank = f", rank {trace.rank}" if trace.rank else ""
    builder.add(f"<h2>Layer trace <code>{html.escape(trace.name)}</code>, step {trace.step}{rank}</h2>")
    try:
        result = LayerTraceResult.from_dict(trace.data)
    except (ValueError, KeyError, TypeError) as error:
        builder.add(
            f'<p class="problems">{html.escape(os.path.basename(trace.path))}: cannot read it '
            f"({html.escape(str(error))})</p>"
        )
        return
    builder.add(
        f'<p class="meta">{html.escape(result.model)} on {html.escape(result.device)}, '
        f"{len(result.events)} events, from {html.escape(os.path.basename(trace.path))}</p>"
    )
    builder.figure(
        _slug(trace.name, f"trace_step{trace.step}" + (f"_rank{trace.rank}" if trace.rank else "")),
        f"layer trace: {trace.name}, step {trace.step}",
        result.figure,
    )
    builder.add("<h3>Memory by category</h3>" + _pre(result.format_categories()))
    builder.add("<h3>Module by module</h3>" + _pre(result.format_table()))


def _compare_section(builder: _Builder, compare: CompareFile) -> None:
    name = compare.name if compare.name != "." else os.path.basename(compare.root.rstrip(os.sep))
    builder.add(f"<h2>Mode comparison <code>{html.escape(name)}</code></h2>")
    result = None
    if compare.data is not None:
        try:
            result = read_compare(os.path.join(compare.root, "compare.json"))
        except (OSError, ValueError, KeyError, TypeError) as error:
            builder.add(f'<p class="problems">compare.json: cannot read it ({html.escape(str(error))})</p>')
    if result is None:
        if compare.rows:  # compare.csv alone: show it as it is
            builder.add('<p class="meta">from compare.csv</p>')
            rows = [[row.get(h, "") for h in compare.csv_header] for row in compare.rows]
            builder.add(_html_table(compare.csv_header, rows))
        else:
            builder.add(
                "<p>compare.json cannot be rendered by this memkit, and there is no compare.csv next to it.</p>"
            )
        return
    builder.add(
        f'<p class="meta">{len(result.results)} mode(s) on {html.escape(result.device)}, '
        f"{result.max_steps} steps each, baseline {html.escape(str(result.baseline))}; each mode is a run "
        "below</p>"
    )
    builder.add(_pre(result.format_table()))
    failed = [r for r in result.results if r.status != ModeStatus.OK]
    if failed:
        items = "".join(f"<li>{html.escape(r.mode)}: {html.escape(r.error or 'failed')}</li>" for r in failed)
        builder.add('<ul class="problems">' + items + "</ul>")
    try:
        figures = compare_figures(result)
    except Exception as error:  # noqa: BLE001 - the table is already there; say why the figures are not
        builder.add(f'<p class="problems">the comparison figures could not be drawn: {html.escape(repr(error))}</p>')
        figures = {}
    for key, figure in figures.items():
        builder.figure(_slug(compare.name, "compare", key), f"mode comparison: {key}", _drawn(figure))


def _drawn(figure: Any) -> Callable[[], Any]:
    """A figure already drawn, as the maker :meth:`_Builder.figure` takes."""
    return lambda: figure


def _items(texts: list[str]) -> str:
    return "".join(f"<li>{html.escape(text)}</li>" for text in texts)


def build_report(sources: ReportSources, title: str = "memkit memory report") -> Report:
    """Render everything in ``sources`` into a :class:`Report` (self-contained HTML plus figures)."""
    builder = _Builder()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    builder.add(f"<h1>{html.escape(title)}</h1>")
    builder.add(
        f'<p class="meta">log dir <code>{html.escape(sources.logdir)}</code> &middot; {now} &middot; '
        f"lightning-memkit {html.escape(__version__)}</p>"
    )
    found = []
    if sources.runs:
        found.append(f"{len(sources.runs)} run(s) with memory readings: " + ", ".join(r.name for r in sources.runs))
    if sources.traces:
        found.append(f"{len(sources.traces)} layer trace(s)")
    if sources.compares:
        found.append(f"{len(sources.compares)} mode comparison(s)")
    if sources.ooms:
        found.append(f"{len(sources.ooms)} out-of-memory report(s)")
    if sources.doctors:
        found.append(f"{len(sources.doctors)} memory doctor verdict(s)")
    builder.add('<h2>What was found</h2><ul class="found">' + _items(found) + "</ul>")
    if sources.missing:
        builder.add('<p>Not found:</p><ul class="missing">' + _items(sources.missing) + "</ul>")
    if sources.problems:
        builder.add('<p>Could not read:</p><ul class="problems">' + _items(sources.problems) + "</ul>")
    for oom in sources.ooms:
        _oom_section(builder, oom)
    for doctor in sources.doctors:
        _doctor_section(builder, doctor)
    for compare in sources.compares:
        _compare_section(builder, compare)
    for run in sources.runs:
        _run_section(builder, run)
    for trace in sources.traces:
        _trace_section(builder, trace)
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(builder.parts)
        + "</body></html>\n"
    )
    return Report(page, builder.figures)
