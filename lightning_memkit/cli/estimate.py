"""``memkit estimate FILE.py:Module``: predicted peak and largest batch per mode, on fake tensors (no GPU needed);
per rank under multi-GPU strategies with the fewest GPUs that fit (``--strategy``), and a real check (``--check``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_memkit.cli.common import CliError, add_init_arguments, build_instance, json_object, load_object
from lightning_memkit.cli.estimate_check import check_estimates, check_refusal
from lightning_memkit.cli.estimate_figures import breakdown_lines, does_not_fit_lines
from lightning_memkit.cli.estimate_output import in_cli_terms, kernels_and_notes, target_words
from lightning_memkit.cli.estimate_ranks import run_distributed
from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.batch_split import BatchSplit
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget
from lightning_memkit.estimate.data.batches import NoBatchError
from lightning_memkit.estimate.data.worst_batch import worst_batch_and_length
from lightning_memkit.estimate.distributed.sharding import STRATEGIES, sharding_of
from lightning_memkit.estimate.largest_batch import DoesNotFitError, device_capacity_bytes, predict_max_batch_size
from lightning_memkit.estimate.mode_needs import ALTERNATIVE_MODES, ModeNeed, mode_needs, needing_less
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.estimate.step.settings import reusing_fake_copies
from lightning_memkit.modes.mode import parse_modes
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes, parse_bytes

__all__ = ["add_parser", "run"]

#: the largest world size ``--strategy`` tries for its "min GPUs" answer unless ``--max-world-size`` says otherwise
DEFAULT_MAX_WORLD_SIZE = 1024


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="will it fit? predict a training step's memory and the largest batch, per mode (and per strategy)",
        description="Build the LightningModule (with --init-args), run its training step on fake tensors "
        "(no real memory, no GPU) and print, per mode, the predicted peak allocated and reserved memory at its batch "
        "size and the largest batch that fits. With --strategy: one rank's memory under each strategy and mode, and "
        "the fewest GPUs that fit. With --check (on a GPU): two real training steps, estimate against measured.",
    )
    parser.add_argument("module", help="FILE.py:ModuleClass or package.module:ModuleClass (built with --init-args)")
    add_init_arguments(parser, datamodule=True)
    _add_target_arguments(parser)
    _add_strategy_arguments(parser)
    parser.add_argument(
        "--meta-init",
        action="store_true",
        help="build the module on the meta device (no weights, no host memory, no init time): for models "
        "larger than this machine; the estimate is the same",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="on a GPU: also train two real steps per mode (a Trainer on a copy of the module) and print the "
        "estimate against torch.cuda.max_memory_allocated/reserved, with the error",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    parser.set_defaults(run=run)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """What one estimate is for: the device (its memory, type and GPU), the modes, the batch and its worst case."""
    parser.add_argument(
        "--device-memory", default=None, help="device memory, e.g. 16GiB or 80GB (default: this machine's GPU)"
    )
    # '-16GiB' would otherwise be taken for an unknown option ("expected one argument"): let every value that
    # starts with '-' and a digit reach the option, so that a negative size gets its own clear message
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument(
        "--modes",
        default="baseline",
        help="comma-separated modes, e.g. baseline,amp,checkpoint,amp+checkpoint (default: baseline)",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="target device type: cuda (CUDA kernels + allocator model) or cpu (default: cuda)",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="GPU",
        help="the GPU to model with --device cuda: a name (h100, a100, v100, l4, ...) or a compute capability "
        "(sm90, 8.0); it picks the attention kernel and the cuBLAS workspace (default: this machine's "
        "GPU, else h100)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="estimate at this batch size, per rank with --strategy (default: the module's)",
    )
    parser.add_argument(
        "--margin", type=float, default=0.05, help="fraction of device memory kept free (default: 0.05)"
    )
    parser.add_argument(
        "--size-of",
        default=None,
        metavar="ATTRIBUTE",
        help="the train dataset's attribute holding each sample's size (e.g. lengths): the worst batch is "
        "then found from it without loading every sample (default: every sample is sized, or a fixed "
        "subset of a dataset too large or slow to size whole)",
    )


def _add_strategy_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-GPU estimate: the strategies, the ranks, the "min GPUs" search and FSDP's units."""
    parser.add_argument(
        "--strategy",
        default=None,
        metavar="NAMES",
        help="comma-separated multi-GPU strategies, e.g. ddp,fsdp,deepspeed_stage_3: one rank's memory on "
        "--world-size ranks per strategy and mode, and the fewest GPUs that fit",
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help="number of ranks (GPUs) for --strategy (default: 8)"
    )
    parser.add_argument(
        "--max-world-size",
        type=int,
        default=DEFAULT_MAX_WORLD_SIZE,
        help=f"the 'min GPUs' answer tries 1, 2, 4, ... up to this many GPUs (default: {DEFAULT_MAX_WORLD_SIZE})",
    )
    parser.add_argument(
        "--wrap",
        default=None,
        metavar="CLASSES",
        help="FSDP units for --strategy fsdp*/model_parallel: comma-separated class names of the module's "
        "layers (your auto_wrap_policy), e.g. TransformerEncoderLayer (default: the whole model is one unit)",
    )


def _memory(text: str) -> int:
    if text.strip().startswith("-"):
        raise CliError(f"--device-memory {text}: a memory size is positive; write e.g. --device-memory 16GiB")
    try:
        memory = parse_bytes(text)
    except ValueError as error:
        raise CliError(f"--device-memory: {error}") from None
    if memory <= 0:
        raise CliError(f"--device-memory {text}: a memory size is positive; write e.g. --device-memory 16GiB")
    if re.fullmatch(r"\s*[0-9.eE+]+\s*", text):
        # a device's memory is never a few bytes: a bare number is a unit left out, not a byte count
        number = text.strip()
        raise CliError(
            f"--device-memory {number} has no unit; write --device-memory {number}GiB (or {number}GB, "
            f"decimal; a byte count as {number}B)"
        )
    return memory


def _gpu(args: argparse.Namespace) -> Any:
    """The ``--gpu`` target (a :class:`GpuTarget`), or ``None`` for the default."""
    if args.gpu is None:
        return None
    if args.device != "cuda":
        raise CliError(
            f"--gpu {args.gpu} picks CUDA kernels; it needs --device cuda (or drop --gpu for a CPU estimate)"
        )
    try:
        return GpuTarget.parse(args.gpu)
    except ValueError as error:
        raise CliError(f"--gpu: {error}") from None


def _strategies(args: argparse.Namespace) -> list[str]:
    if args.strategy is None:
        for flag, value in (("--world-size", args.world_size), ("--wrap", args.wrap)):
            if value is not None:
                raise CliError(
                    f"{flag} is for multi-GPU estimates: give --strategy too, e.g. --strategy fsdp {flag} {value}"
                )
        return []
    names = [name.strip() for name in args.strategy.split(",") if name.strip()]
    if not names:
        raise CliError(f"--strategy {args.strategy!r}: give one or more of: {', '.join(STRATEGIES)}")
    if args.world_size is None:
        args.world_size = 8
    if args.world_size < 1:
        raise CliError(f"--world-size {args.world_size}: the number of ranks is at least 1, e.g. --world-size 8")
    if args.max_world_size < 1:
        raise CliError(
            f"--max-world-size {args.max_world_size}: give at least 1, e.g. --max-world-size {DEFAULT_MAX_WORLD_SIZE}"
        )
    canonical = []
    for name in names:
        try:
            canonical.append(sharding_of(name, args.world_size).strategy)
        except ValueError:
            raise CliError(f"--strategy {name}: unknown strategy; choose from: {', '.join(STRATEGIES)}") from None
    return list(dict.fromkeys(canonical))


def _wrap_classes(module: Any, text: str | None) -> set[type] | None:
    """The module's layer classes named by ``--wrap`` (matched by class name over its submodules)."""
    if text is None:
        return None
    by_name: dict[str, type] = {}
    for each in module.modules():
        by_name.setdefault(type(each).__name__, type(each))
    classes = set()
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name not in by_name:
            raise CliError(
                f"--wrap {name}: {type(module).__name__} has no layer of that class; its layer classes are: "
                f"{', '.join(sorted(by_name))}"
            )
        classes.add(by_name[name])
    return classes


def run(args: argparse.Namespace) -> int:
    try:
        modes = parse_modes(args.modes)
        gpu = _gpu(args)
        strategies = _strategies(args)
        if args.check:
            check_refusal(args, gpu)
        if args.device_memory is not None:
            memory = _memory(args.device_memory)
        else:
            try:
                memory = device_capacity_bytes(args.device)
            except ValueError:
                raise CliError(
                    f"cannot read the memory of a {args.device} device here; "
                    "give --device-memory, e.g. --device-memory 16GiB"
                ) from None
        if not 0 <= args.margin < 1:
            raise CliError(f"--margin {args.margin}: give a fraction in [0, 1), e.g. 0.05")
        if args.batch_size is not None and args.batch_size < 1:
            raise CliError(f"--batch-size {args.batch_size}: give a positive integer")
        cls = load_object(args.module)
        if args.meta_init:
            with torch.device("meta"):
                module = build_instance(cls, json_object(args.init_args, "--init-args"))
        else:
            module = build_instance(cls, json_object(args.init_args, "--init-args"))
        if not isinstance(module, pl.LightningModule):
            raise CliError(
                f"{args.module} is not a LightningModule class; memkit estimate needs one (for a plain nn.Module "
                "call lightning_memkit.estimate_memory(module, batch=..., optimizer=...) from Python)"
            )
        datamodule = None
        if args.datamodule:
            datamodule = build_instance(
                load_object(args.datamodule), json_object(args.datamodule_args, "--datamodule-args"), what="datamodule"
            )
        elif getattr(type(module), "train_dataloader", None) is pl.LightningModule.train_dataloader:
            raise CliError(
                f"{type(module).__name__} defines no train_dataloader(); give the datamodule that feeds it with "
                "--datamodule FILE.py:DataModuleClass (memkit estimate sizes the samples of its train dataloader "
                "and estimates the largest batch they make at --batch-size: docs/worst_batch.md)"
            )
        wrap = _wrap_classes(module, args.wrap)
    except (CliError, ValueError) as error:
        print(f"memkit estimate: {error}", file=sys.stderr)
        return 2
    if strategies:
        return run_distributed(args, module, datamodule, modes, strategies, memory, gpu, wrap)
    return _run_single(args, module, datamodule, modes, memory, gpu)


# ------------------------------------------------------------------------------------------ one GPU
def _figures(estimate: Any) -> tuple[int, int | None, int]:
    """(allocated, reserved, device needs) in bytes: the CUDA allocator view's peaks, or the tensor peak on CPU."""
    if estimate.cuda is None:
        return estimate.peak_bytes, None, estimate.required_bytes
    return estimate.cuda.peak_allocated_bytes, estimate.cuda.peak_reserved_bytes, estimate.required_bytes


def _run_single(args, module, datamodule, modes, memory, gpu) -> int:
    rows, results, estimates, shapes, breakdowns, too_large = [], [], {}, [], [], []
    batch = _named_worst_batch(args, module, datamodule)
    same = {"batch": batch, "device": args.device, "datamodule": datamodule, "gpu": gpu}
    with reusing_fake_copies():  # one fake copy of the module and one worst batch serve every mode and size
        for mode in modes:
            try:
                estimate = estimate_memory(module, args.batch_size, mode=mode, **same)
                prediction = not_fitting = None
                try:
                    prediction = predict_max_batch_size(module, memory, mode=mode, margin=args.margin, **same)
                except DoesNotFitError as error:  # the figures are still shown, and what would fit is computed below
                    not_fitting = error
                if estimate.batch_size is None:
                    raise EstimateError("the batch has no batch dimension: give a batch whose tensors have one")
                sizes = (1, estimate.batch_size, estimate.batch_size + 1)
                split = BatchSplit.between(*(estimate_memory(module, size, mode=mode, **same) for size in sizes))
            except (NoBatchError, EstimateError, ValueError) as error:
                failure = in_cli_terms(error, args)
                rows.append((mode.name, *["-"] * 7))
                results.append({"mode": mode.name, "error": str(failure)})
                print(f"memkit estimate: mode {mode.name}: {failure}", file=sys.stderr)
                continue
            rows.append(_row(mode.name, estimate, split, prediction))
            results.append(_result(mode.name, estimate, split, prediction))
            breakdowns.append((mode.name, estimate, split))
            shapes.append((mode.name, estimate, prediction))
            if not_fitting is not None:
                too_large.append((mode.name, not_fitting))
            else:
                estimates[mode.name] = (mode, estimate)
        needs = mode_needs(module, memory, modes=_alternatives(modes), margin=args.margin, **same) if too_large else []
    print(
        f"memkit estimate: {args.module} on {target_words(args, gpu)}, {format_bytes(memory)} device memory, "
        f"{args.margin:.0%} kept free (fake tensors)"
    )
    print(format_table(SINGLE_HEADERS, rows))
    for line in _batch_lines(shapes):
        print(line)
    for mode_name, estimate, split in breakdowns:
        print("\n".join(breakdown_lines(mode_name, estimate, split)))
    for mode_name, too_big in too_large:
        print("\n".join(does_not_fit_lines(mode_name, too_big.needed_bytes, too_big.target_bytes, needs)))
        print(
            f"memkit estimate: mode {mode_name}: {too_big.describe('its figures are printed above')}", file=sys.stderr
        )
        result = next(r for r in results if r["mode"] == mode_name)
        result["suggestions"] = [n.mode for n in needing_less(needs, too_big.needed_bytes) if n.mode != mode_name]
    for line in kernels_and_notes([(r["mode"], r["estimate"]["notes"]) for r in results if "estimate" in r]):
        print(line)
    return _single_status(args, module, memory, results, estimates, needs)


def _single_status(
    args: argparse.Namespace,
    module: Any,
    memory: int,
    results: list[dict],
    estimates: dict[str, tuple[Any, Any]],
    needs: list[ModeNeed],
) -> int:
    """The command's exit status (after ``--check``'s measured steps, when asked), the ``--json`` document written."""
    # any requested mode that failed or does not fit even at batch size 1 fails the command
    status = 0 if all("error" not in r and r["fits"] for r in results) else 1
    if args.check and estimates:
        checks = check_estimates(args, module, estimates)
        for result in results:
            if result["mode"] in checks:
                result["check"] = checks[result["mode"]]
        if any("error" in c for c in checks.values()):
            status = 1
    if args.json_path:
        document = {"module": args.module, "device": args.device, "device_memory_bytes": memory, "results": results}
        if needs:
            document["mode_needs"] = [need.to_dict() for need in needs]
        with open(args.json_path, "w") as file:
            json.dump(document, file, indent=2, default=str)
    return status


#: the columns of the one-device table
SINGLE_HEADERS = (
    "mode",
    "batch",
    "allocated",
    "reserved",
    "device needs",
    "batch 1 needs",
    "max batch",
    "needs at max",
)


def _row(mode: str, estimate: Any, split: BatchSplit, prediction: Any) -> tuple:
    """A mode's row: its figures at the batch estimated and at batch size 1, and its largest batch (or that it
    does not fit)."""
    allocated, reserved, needs = _figures(estimate)
    return (
        mode,
        estimate.batch_size,
        format_bytes(allocated),
        format_bytes(reserved),
        format_bytes(needs),
        format_bytes(split.batch_one_required_bytes),
        prediction.batch_size if prediction is not None else "does not fit",
        format_bytes(prediction.predicted_bytes) if prediction is not None else "-",
    )


def _result(mode: str, estimate: Any, split: BatchSplit, prediction: Any) -> dict[str, Any]:
    """A mode's JSON result: every figure, whether or not it fits."""
    return {
        "mode": mode,
        "estimate": estimate.to_dict(),
        "batch_split": split.to_dict(),
        "fits": prediction is not None,
        "max_batch": prediction.to_dict() if prediction is not None else None,
    }


def _alternatives(modes: list[Any]) -> list[Any]:
    """The modes estimated at batch size 1 when one does not fit: those asked for, then the other alternatives."""
    names = {mode.name for mode in modes}
    return list(modes) + [name for name in ALTERNATIVE_MODES if name not in names]


def _named_worst_batch(args: argparse.Namespace, module: Any, datamodule: Any) -> Any:
    """With ``--size-of``, the worst batch found from the sizes named (else ``None``: the estimate finds it)."""
    if args.size_of is None:
        return None
    return worst_batch_and_length(module, datamodule, size_of=args.size_of)[0]


def _batch_lines(shapes: list[tuple[str, Any, Any]]) -> list[str]:
    """Which batch each answer used: the shapes estimated and at the max batch, and what they hold for."""
    if not shapes:
        return []
    lines = [f"batch: {shapes[0][1].batch_note}"]
    for mode, estimate, prediction in shapes:
        if prediction is None:
            lines.append(f"  {mode}: estimated on {estimate.batch_shapes}; does not fit even at batch size 1")
            continue
        lines.append(
            f"  {mode}: estimated on {estimate.batch_shapes}; max batch {prediction.batch_size} on "
            f"{prediction.batch_shapes}"
        )
    return lines


# ------------------------------------------------------------------------------------------ --check
