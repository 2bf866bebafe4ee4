"""``memkit estimate FILE.py:Module``: predicted peak and largest batch per mode, on fake tensors (no GPU needed)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from lightning_memkit.cli.common import add_init_arguments

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate", help="will it fit? predict a training step's memory and the largest batch, per mode",
        description="Build the LightningModule (with --init-args), run its training step on fake tensors (no real memory, "
                    "no GPU) and print, per mode, the predicted peak at its batch size and the largest batch that fits.")
    parser.add_argument("module", help="FILE.py:ModuleClass or package.module:ModuleClass (built with --init-args)")
    add_init_arguments(parser, datamodule=True)
    parser.add_argument("--device-memory", default=None, help="device memory, e.g. 16GiB or 80GB (default: this machine's GPU)")
    # '-16GiB' would otherwise be taken for an unknown option ("expected one argument"): let every value that
    # starts with '-' and a digit reach the option, so that a negative size gets its own clear message
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("--modes", default="baseline",
                        help="comma-separated modes, e.g. baseline,amp,checkpoint,amp+checkpoint (default: baseline)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="target device type: cuda (allocator model + allowances) or cpu (default: cuda)")
    parser.add_argument("--batch-size", type=int, default=None, help="estimate at this batch size (default: the module's)")
    parser.add_argument("--margin", type=float, default=0.05, help="fraction of device memory kept free (default: 0.05)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    parser.set_defaults(run=run)


def _memory(text: str) -> int:
    from lightning_memkit.cli.common import CliError
    from lightning_memkit.units import parse_bytes

    if text.strip().startswith("-"):
        raise CliError(f"--device-memory {text}: a memory size is positive; write e.g. --device-memory 16GiB")
    try:
        memory = parse_bytes(text)
    except ValueError as error:
        raise CliError(f"--device-memory: {error}") from None
    if memory <= 0:
        raise CliError(f"--device-memory {text}: a memory size is positive; write e.g. --device-memory 16GiB")
    return memory


def run(args: argparse.Namespace) -> int:
    from lightning_memkit.cli.common import CliError, build_instance, json_object, load_object
    from lightning_memkit.estimate import EstimateError, NoBatchError, estimate_memory, predict_max_batch_size
    from lightning_memkit.estimate.core import reusing_fake_copies
    from lightning_memkit.estimate.predict import device_capacity_bytes
    from lightning_memkit.modes.mode import parse_modes
    from lightning_memkit.summary_table import format_table
    from lightning_memkit.units import format_bytes

    try:
        modes = parse_modes(args.modes)
        if args.device_memory is not None:
            memory = _memory(args.device_memory)
        else:
            try:
                memory = device_capacity_bytes(args.device)
            except ValueError:
                raise CliError(f"cannot read the memory of a {args.device} device here; "
                               "give --device-memory, e.g. --device-memory 16GiB") from None
        if not 0 <= args.margin < 1:
            raise CliError(f"--margin {args.margin}: give a fraction in [0, 1), e.g. 0.05")
        if args.batch_size is not None and args.batch_size < 1:
            raise CliError(f"--batch-size {args.batch_size}: give a positive integer")
        cls = load_object(args.module)
        module = build_instance(cls, json_object(args.init_args, "--init-args"))
        import lightning.pytorch as pl

        if not isinstance(module, pl.LightningModule):
            raise CliError(f"{args.module} is not a LightningModule class; memkit estimate needs one (for a plain nn.Module "
                           "call lightning_memkit.estimate_memory(module, batch=..., optimizer=...) from Python)")
        datamodule = None
        if args.datamodule:
            datamodule = build_instance(load_object(args.datamodule), json_object(args.datamodule_args, "--datamodule-args"),
                                        what="datamodule")
        elif getattr(type(module), "train_dataloader", None) is pl.LightningModule.train_dataloader:
            raise CliError(f"{type(module).__name__} defines no train_dataloader(); give the datamodule that feeds it with "
                           "--datamodule FILE.py:DataModuleClass (memkit estimate takes one batch from it and re-shapes it "
                           "to --batch-size)")
    except (CliError, ValueError) as error:
        print(f"memkit estimate: {error}", file=sys.stderr)
        return 2
    rows, results = [], []
    with reusing_fake_copies():  # one fake copy of the module and one sample batch serve every mode and size
        for mode in modes:
            try:
                estimate = estimate_memory(module, args.batch_size, mode=mode, device=args.device, datamodule=datamodule)
                prediction = predict_max_batch_size(module, memory, mode=mode, margin=args.margin, device=args.device,
                                                    datamodule=datamodule)
                rows.append((mode.name, estimate.batch_size, format_bytes(estimate.peak_bytes), format_bytes(estimate.required_bytes),
                             prediction.batch_size, format_bytes(prediction.predicted_bytes)))
                results.append({"mode": mode.name, "estimate": estimate.to_dict(), "max_batch": prediction.to_dict()})
            except (NoBatchError, EstimateError, ValueError) as error:
                rows.append((mode.name, "-", "-", "-", "-", "-"))
                results.append({"mode": mode.name, "error": str(error)})
                print(f"memkit estimate: mode {mode.name}: {error}", file=sys.stderr)
    print(f"memkit estimate: {args.module} on {args.device}, {format_bytes(memory)} device memory, {args.margin:.0%} kept free (fake tensors)")
    print(format_table(("mode", "batch", "peak (tensors)", "device needs", "max batch", "needs at max"), rows))
    notes = dict.fromkeys(n for r in results if "estimate" in r for n in r["estimate"]["notes"])  # each once, in order
    for note in notes:
        print(f"note: {note}")
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump({"module": args.module, "device": args.device, "device_memory_bytes": memory, "results": results}, file, indent=2, default=str)
    return 0 if any("error" not in r for r in results) else 1
