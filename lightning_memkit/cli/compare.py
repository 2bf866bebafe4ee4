"""``memkit compare FILE.py:ModuleClass --modes baseline,amp,checkpoint,amp+checkpoint --steps N``."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import lightning.pytorch as pl

from lightning_memkit.cli.common import CliError, add_init_arguments, build_instance, json_object, load_object
from lightning_memkit.modes.compare_result import ModeStatus
from lightning_memkit.modes.comparison import CheckpointWarning, compare_modes
from lightning_memkit.modes.mode import parse_modes

__all__ = ["add_parser", "run"]

DEFAULT_MODES = "baseline,amp,checkpoint,amp+checkpoint"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `memkit compare` and its flags on the ``memkit`` parser's ``subparsers``."""
    parser = subparsers.add_parser(
        "compare",
        help="train a LightningModule in several memory modes and compare memory, speed and accuracy",
        description="Train a fresh copy of a LightningModule in each memory mode (same seed, same data, "
        "MemoryTracker on) and print peak memory, step time, throughput, final loss and validation metric "
        "side by side. Writes compare.csv, compare.json, figures, and one TensorBoard run per mode "
        "under --logdir.",
    )
    parser.add_argument(
        "model", metavar="FILE.py:ModuleClass", help="the LightningModule class (built with --init-args)"
    )
    parser.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"comma-separated modes (default: {DEFAULT_MODES}); words: baseline, amp, bf16, fp16, "
        "checkpoint, checkpoint:auto, checkpoint:budget=0.5, checkpoint:budget=512MiB, offload (CUDA), "
        "joined with +",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="training steps per mode (default: 20); the step time is the median after --warmup-steps",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=3,
        help="first steps left out of the step timing, at most half of --steps (default: 3)",
    )
    add_init_arguments(parser)
    parser.add_argument(
        "--batch-size", type=int, help="set batch_size on the datamodule (or the module when there is none)"
    )
    parser.add_argument(
        "--logdir", default="memkit_compare", help="TensorBoard root and output directory (default: memkit_compare)"
    )
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu (default: auto)")
    parser.add_argument(
        "--val-batches", type=int, default=2, help="validation batches run at the end of each mode (default: 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for every mode (default: 0)")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG and TensorBoard figures")
    parser.add_argument(
        "--no-progress", action="store_true", help="no line per mode as it ends (peak, step time, seconds)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run `memkit compare` with the parsed ``args``; returns the exit status (0 on success; bad input exits 2 with
    one line saying what to write)."""
    try:
        if args.steps < 1:
            raise CliError("--steps must be a positive integer")
        if args.batch_size is not None and args.batch_size < 1:
            raise CliError(f"--batch-size {args.batch_size}: give a positive integer")
        if args.warmup_steps < 0:
            raise CliError(f"--warmup-steps {args.warmup_steps}: give 0 or more")
        if args.val_batches < 0:
            raise CliError(f"--val-batches {args.val_batches}: give 0 (no validation) or more")
        try:
            modes = parse_modes(args.modes)
        except ValueError as error:
            raise CliError(f"--modes: {error}") from error
        module_class = load_object(args.model)
        if not (isinstance(module_class, type) and issubclass(module_class, pl.LightningModule)):
            raise CliError(f"{args.model} is not a LightningModule class; memkit compare trains one in each mode")
        init_args = json_object(args.init_args, "--init-args")
        datamodule_class = load_object(args.datamodule) if args.datamodule else None
        datamodule_args = json_object(args.datamodule_args, "--datamodule-args")

        def model_factory():
            return build_instance(module_class, init_args, None if datamodule_class else args.batch_size, "module")

        def datamodule_factory():
            return build_instance(datamodule_class, datamodule_args, args.batch_size, "datamodule")

        model_factory()  # fail here, with a clear message, rather than once per mode
        # an unwritable --logdir: one message (cli.main), not a traceback per mode
        os.makedirs(args.logdir, exist_ok=True)
        if datamodule_class is not None:
            datamodule_factory()
    except CliError as error:
        print(f"memkit compare: {error}", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # printed below as one line, not with a source line
        result = compare_modes(
            model_factory,
            datamodule_factory if datamodule_class else None,
            modes,
            args.steps,
            accelerator=args.accelerator,
            root_dir=args.logdir,
            seed=args.seed,
            val_batches=args.val_batches,
            figures=not args.no_figures,
            verbose=True,
            warmup_steps=args.warmup_steps,
            progress=not args.no_progress,
        )
    for mode_result in result.results:
        if mode_result.checkpoint_warning():
            print(f"memkit compare: warning: {mode_result.checkpoint_warning()}", file=sys.stderr)
    failed = [r for r in result.results if r.status != ModeStatus.OK]
    for mode_result in failed:
        print(f"memkit compare: mode {mode_result.mode} failed: {mode_result.error}", file=sys.stderr)
    if failed:
        print(
            f"memkit compare: mode(s) failed: {', '.join(r.mode for r in failed)} (also in the error column of "
            f"compare.csv)",
            file=sys.stderr,
        )
        return 1
    return 0
