"""``memkit compare FILE.py:ModuleClass --modes baseline,amp,checkpoint,amp+checkpoint --steps N``."""

from __future__ import annotations

import argparse
import json

from lightning_memkit.cli.common import CliError, load_object

__all__ = ["add_parser", "run"]

DEFAULT_MODES = "baseline,amp,checkpoint,amp+checkpoint"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare", help="train a LightningModule in several memory modes and compare memory, speed and accuracy",
        description="Train a fresh copy of a LightningModule in each memory mode (same seed, same data, MemoryTracker on) "
                    "and print peak memory, step time, throughput, final loss and validation metric side by side. "
                    "Writes compare.csv, compare.json, figures, and one TensorBoard run per mode under --logdir.")
    parser.add_argument("model", metavar="FILE.py:ModuleClass", help="the LightningModule class (built with --init-args)")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated modes (default: {DEFAULT_MODES}); words: baseline, amp, bf16, fp16, "
                             "checkpoint, checkpoint:auto, checkpoint:budget=0.5, checkpoint:budget=512MiB, joined with +")
    parser.add_argument("--steps", type=int, default=20, help="training steps per mode (default: 20)")
    parser.add_argument("--datamodule", metavar="FILE.py:DataModuleClass", help="a LightningDataModule class (default: the module's own dataloaders)")
    parser.add_argument("--init-args", default="{}", help='JSON keyword arguments for the module class, e.g. \'{"layers": 8}\'')
    parser.add_argument("--datamodule-args", default="{}", help="JSON keyword arguments for the datamodule class")
    parser.add_argument("--batch-size", type=int, help="set batch_size on the datamodule (or the module when there is none)")
    parser.add_argument("--logdir", default="memkit_compare", help="TensorBoard root and output directory (default: memkit_compare)")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu (default: auto)")
    parser.add_argument("--val-batches", type=int, default=2, help="validation batches run at the end of each mode (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed for every mode (default: 0)")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG and TensorBoard figures")
    parser.set_defaults(run=run)


def _json_arg(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise CliError(f"{flag}: not JSON ({error}); write e.g. '{{\"batch_size\": 32}}'") from error
    if not isinstance(value, dict):
        raise CliError(f"{flag}: give a JSON object of keyword arguments, e.g. '{{\"batch_size\": 32}}'")
    return value


def _set_batch_size(obj, size: int, what: str) -> None:
    if not hasattr(obj, "batch_size"):
        raise CliError(f"--batch-size: the {what} {type(obj).__name__} has no batch_size attribute; pass it in --init-args instead")
    obj.batch_size = size


def run(args: argparse.Namespace) -> int:
    from lightning_memkit.modes.compare import compare_modes
    from lightning_memkit.modes.mode import parse_modes

    try:
        if args.steps < 1:
            raise CliError("--steps must be a positive integer")
        try:
            modes = parse_modes(args.modes)
        except ValueError as error:
            raise CliError(f"--modes: {error}") from error
        module_class = load_object(args.model)
        init_args = _json_arg(args.init_args, "--init-args")
        datamodule_class = load_object(args.datamodule) if args.datamodule else None
        datamodule_args = _json_arg(args.datamodule_args, "--datamodule-args")

        def model_factory():
            model = module_class(**init_args)
            if args.batch_size and datamodule_class is None:
                _set_batch_size(model, args.batch_size, "module")
            return model

        def datamodule_factory():
            datamodule = datamodule_class(**datamodule_args)
            if args.batch_size:
                _set_batch_size(datamodule, args.batch_size, "datamodule")
            return datamodule

        model_factory()  # fail here, with a clear message, rather than once per mode
        if datamodule_class is not None:
            datamodule_factory()
    except CliError as error:
        print(f"memkit compare: {error}")
        return 2
    except TypeError as error:
        print(f"memkit compare: cannot build the module or datamodule ({error}); check --init-args / --datamodule-args")
        return 2
    result = compare_modes(model_factory, datamodule_factory if datamodule_class else None, modes, args.steps,
                           accelerator=args.accelerator, root_dir=args.logdir, seed=args.seed, val_batches=args.val_batches,
                           figures=not args.no_figures, verbose=True)
    failed = [r.mode for r in result.results if r.status != "ok"]
    if failed:
        print(f"memkit compare: mode(s) failed: {', '.join(failed)} (see the error column in compare.csv)")
        return 1
    return 0
