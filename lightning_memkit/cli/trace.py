"""``memkit trace FILE.py:ModuleClass --batch-size N``: print a LightningModule's layer trace.

Runs a short real ``Trainer.fit`` with :class:`~lightning_memkit.LayerTrace` on the chosen step
and prints the module table and the category split; no code from the user.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl

from lightning_memkit.callbacks.layer_trace import LayerTrace
from lightning_memkit.cli.common import (
    CliError,
    add_init_arguments,
    build_module_and_datamodule,
    build_trainer,
    load_object,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `memkit trace` and its flags on the ``memkit`` parser's ``subparsers``."""
    parser = subparsers.add_parser(
        "trace",
        help="print the per-module memory table of one training step of a LightningModule",
        description="Train a LightningModule for a few steps with LayerTrace and print the memory of each module "
        "at pre-forward, forward, pre-backward and backward, and the bytes per category "
        "(parameters, gradients, optimizer state, activations, ...). MiB = 2**20 bytes.",
    )
    parser.add_argument(
        "module",
        metavar="FILE.py:ModuleClass",
        help="the LightningModule class (it must define train_dataloader, or give --datamodule)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batch size, passed as batch_size= or set as the batch_size attribute",
    )
    add_init_arguments(parser)
    parser.add_argument(
        "--step", type=int, default=1, help="which training step to trace (default: 1, after Adam's state exists)"
    )
    parser.add_argument(
        "--max-depth", type=int, default=None, help="trace modules at most this deep (root = 0; default: all)"
    )
    parser.add_argument(
        "--accelerator", default="cpu", help="Lightning accelerator: cpu, gpu, auto (default: cpu, exact bytes)"
    )
    parser.add_argument(
        "--precision", default=None, help="Lightning precision, e.g. bf16-mixed (default: the Trainer's)"
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the raw trace as JSON")
    parser.add_argument("--csv", metavar="PATH", default=None, help="also write the raw events as CSV")
    parser.add_argument("--figure", metavar="PATH.png", default=None, help="also save the live-memory figure")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run `memkit trace` with the parsed ``args``; returns the exit status (0 on success; bad input exits 2 with one
    line saying what to write)."""
    if args.batch_size is not None and args.batch_size < 1:
        print("memkit trace: --batch-size must be a positive integer", file=sys.stderr)
        return 2
    if args.step < 0 or (args.max_depth is not None and args.max_depth < 0):
        print("memkit trace: --step and --max-depth must be >= 0", file=sys.stderr)
        return 2
    try:
        model, datamodule = _build(args)
    except CliError as error:
        print(f"memkit trace: {error}", file=sys.stderr)
        return 2

    callback = LayerTrace(
        at_steps=(args.step,), max_depth=args.max_depth, verbose=False
    )  # this command prints the result itself
    with tempfile.TemporaryDirectory(prefix="memkit_trace_") as root:
        try:
            trainer = build_trainer(**_trainer_options(args, callback, root))
        except CliError as error:
            print(f"memkit trace: {error}", file=sys.stderr)
            return 2
        with warnings.catch_warnings():  # an unreached step is said below, in this command's terms
            warnings.filterwarnings("ignore", message="memkit LayerTrace: .* never reached")
            trainer.fit(model, datamodule=datamodule)
    if not callback.results:
        _say_unreached(args, callback.last_step)
        return 1
    _print_result(args, callback.results[-1])
    return 0


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The LightningModule ``args.module`` names and the datamodule (``None`` without ``--datamodule``), built with
    their ``--init-args`` / ``--datamodule-args`` and ``--batch-size``; a :class:`CliError` says what is wrong."""
    cls = load_object(args.module)
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise CliError(
            f"{args.module} is not a LightningModule class; memkit trace needs one (use "
            "LayerTracer from Python for a plain nn.Module)"
        )
    if not args.datamodule and not _overrides(cls, "train_dataloader"):
        # checked before building: with --batch-size, building would blame the module's missing batch_size instead
        raise CliError(
            f"{cls.__name__} defines no train_dataloader(), so its batches"
            + (" (and their size)" if args.batch_size is not None else "")
            + " come from a datamodule: pass --datamodule FILE.py:DataModuleClass"
            + (" (--batch-size then goes to the datamodule)" if args.batch_size is not None else "")
            + ", or add a train_dataloader() to the module"
        )
    model, datamodule = build_module_and_datamodule(cls, args)
    return model, datamodule


def _trainer_options(args: argparse.Namespace, callback: Any, root: str) -> dict[str, Any]:
    """The Trainer that runs up to the traced step and no further: one device, no validation, nothing written
    outside ``root`` (a temporary directory)."""
    options = {
        "accelerator": args.accelerator,
        "devices": 1,
        "max_steps": args.step + 1,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "callbacks": [callback],
        "default_root_dir": root,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
    }
    if args.precision:
        options["precision"] = args.precision
    return options


def _say_unreached(args: argparse.Namespace, last: int | None) -> None:
    """Why no step was traced: none ran, or training stopped before ``--step`` (``last``: its last step)."""
    if last is None:
        print("memkit trace: no training step ran (is the train dataloader empty?)", file=sys.stderr)
    else:
        print(
            f"memkit trace: step {args.step} was never reached: training stopped after "
            f"step {last}; pass --step {last} or less",
            file=sys.stderr,
        )


def _print_result(args: argparse.Namespace, result: Any) -> None:
    """The module table and the category split, then the files ``--json``, ``--csv`` and ``--figure`` ask for."""
    print(result.format_table())
    print()
    print(f"bytes by category (Ψ = {result.parameter_count} parameters)")
    print(result.format_categories())
    for path, write in ((args.json, result.to_json), (args.csv, result.to_csv)):
        if path:
            write(path)
            print(f"wrote {os.path.abspath(path)}")
    if args.figure:
        result.figure().savefig(args.figure)
        print(f"wrote {os.path.abspath(args.figure)}")


def _overrides(cls: type, method: str) -> bool:
    return getattr(cls, method, None) is not getattr(pl.LightningModule, method, None)
