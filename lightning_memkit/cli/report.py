"""``memkit report LOGDIR``: an offline, self-contained HTML report of what memkit wrote under LOGDIR."""

from __future__ import annotations

import argparse
import os
import sys

from lightning_memkit.cli.common import CliError
from lightning_memkit.report import write_report
from lightning_memkit.report.sources import ReportInputError
from lightning_memkit.tensorboard.dashboard import update_dashboards

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `memkit report` and its flags on the ``memkit`` parser's ``subparsers``."""
    parser = subparsers.add_parser(
        "report",
        help="write a self-contained HTML memory report from a log dir",
        description="Read memkit's files under LOGDIR (memkit_memory.json, memkit_trace_step<N>.json, "
        "compare.json/.csv, "
        "TensorBoard event files; never pickles) and write one HTML file with the summary table, figures, "
        "layer table and mode comparison. Exits 1 when LOGDIR holds nothing "
        "memkit wrote, 2 when it is not a directory.",
    )
    parser.add_argument("logdir", help="the log dir (searched recursively), e.g. lightning_logs or memkit_logs")
    parser.add_argument(
        "-o", "--output", default="memkit_report.html", help="HTML file to write (default: memkit_report.html)"
    )
    parser.add_argument("--png", metavar="DIR", default=None, help="also write each figure as a PNG into DIR")
    parser.add_argument(
        "--update-dashboards",
        action="store_true",
        help="also give every memkit run under LOGDIR today's TensorBoard dashboard, built from the tags it "
        "logged (for logs written by an older memkit; adds one small event file per run)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run `memkit report` with the parsed ``args``; returns the exit status (0 on success; bad input exits 2 with one
    line saying what to write)."""
    if not os.path.isdir(args.logdir):  # a wrong argument (exit 2, as every verb's), not an empty log dir (exit 1)
        raise CliError(
            f"{args.logdir!r} is not a directory; give the log dir of a run trained with memkit "
            "(e.g. the --logdir of `memkit demo`, or lightning_logs)"
        )
    try:
        sources, written = write_report(args.logdir, args.output, args.png)
    except ReportInputError as error:
        print(f"memkit report: {error}", file=sys.stderr)
        return 1
    print(
        f"memkit report: {len(sources.runs)} run(s), {len(sources.traces)} layer trace(s), "
        f"{len(sources.compares)} mode comparison(s), {len(sources.ooms)} out-of-memory report(s) from {sources.logdir}"
    )
    for line in sources.missing:
        print(f"  not found: {line}")
    for line in sources.problems:
        print(f"  could not read: {line}")
    for path in written:
        print(f"wrote {path}")
    if args.update_dashboards:
        try:
            updated = update_dashboards(args.logdir)
        except OSError as error:
            print(f"memkit report: could not update the dashboards under {args.logdir}: {error}", file=sys.stderr)
            return 1
        for run_dir, layout in updated.items():
            charts = sum(len(category) for category in layout.values())
            print(f"updated the dashboard of {os.path.relpath(run_dir, args.logdir)}: {charts} chart(s)")
    return 0
