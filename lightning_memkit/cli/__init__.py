"""The ``memkit`` command: one sub-command per module in this package.

Each verb module has ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def build_parser() -> argparse.ArgumentParser:
    """The full ``memkit`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="memkit", description="Training memory for PyTorch Lightning: measure, explain, fix."
    )
    subparsers = parser.add_subparsers(dest="verb", metavar="COMMAND")
    for verb, module_name in VERBS.items():
        module = importlib.import_module(f"lightning_memkit.cli.{module_name}")
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``memkit``; returns the exit status."""
    parser = build_parser()
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
