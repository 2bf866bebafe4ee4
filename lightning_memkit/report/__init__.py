"""The offline memory report: memkit's own files under a log dir -> one self-contained HTML file.

``memkit report LOGDIR -o report.html [--png DIR]`` is the command; :func:`write_report` the function.
"""

from __future__ import annotations

from lightning_memkit.report.html_report import build_report
from lightning_memkit.report.sources import ReportSources, find_sources

__all__ = ["write_report"]


def write_report(logdir: str, output: str, png_dir: str | None = None) -> tuple[ReportSources, list[str]]:
    """Find memkit's files under ``logdir``, write the HTML report to ``output`` (and PNGs to ``png_dir``).

    Returns:
        the sources found (with ``missing`` and ``problems`` in words) and the paths written.

    Raises:
        ReportInputError: when ``logdir`` holds nothing memkit wrote; the message says what is missing.
    """
    sources = find_sources(logdir)
    report = build_report(sources)
    return sources, report.write(output, png_dir)
