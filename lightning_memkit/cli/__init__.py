"""The ``memkit`` command: one sub-command per module in this package.

Each verb module has ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from lightning_memkit.cli.common import CliError

__all__ = ["main"]

#: sub-command name -> module under lightning_memkit.cli
VERBS = {
    "demo": "demo",
    "report": "report",
    "compare": "compare",
    "trace": "trace",
    "estimate": "estimate",
    "doctor": "doctor",
    "plan": "plan",
}


def build_parser(verbs: Iterable[str] = tuple(VERBS)) -> argparse.ArgumentParser:
    """The ``memkit`` argument parser with these verbs' sub-commands (default: all of them)."""
    parser = argparse.ArgumentParser(
        prog="memkit", description="Training memory for PyTorch Lightning: measure, explain, fix."
    )
    subparsers = parser.add_subparsers(dest="verb", metavar="COMMAND")
    for verb in verbs:
        module = importlib.import_module(f"lightning_memkit.cli.{VERBS[verb]}")
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``memkit``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # a verb's own sub-command runs it (and prints its --help): the other verbs' modules are not imported
    named = argv[:1] if argv and argv[0] in VERBS else VERBS
    parser = build_parser(named)
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except CliError as error:
        print(f"memkit {args.verb}: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        if getattr(error, "filename", None) is None:
            raise
        # a path the user gave (-o, --json, --csv, --figure, --logdir, --png) that cannot be written or read
        print(
            f"memkit {args.verb}: {error.filename}: {error.strerror}; give a path in a directory you can write to",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
