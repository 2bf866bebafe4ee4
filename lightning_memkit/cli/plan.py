"""``memkit plan FILE.py:Module``: the fastest way to train the module's batch in a memory budget (precision only when
allowed, checkpointing, micro-batch x accumulation, offload on CUDA), estimated on fake tensors and proved by at most
three real trials; prints the table, the choice and why, then the Trainer arguments and a LightningCLI YAML snippet.

Exit status: 0 with a best configuration (or the module fits as is), 1 when nothing fit in a real trial (or, for a CUDA
plan on a machine without a GPU, nothing could run: the table is the prediction only), 2 for bad arguments."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_memkit.cli.common import CliError, add_init_arguments, build_instance, json_object, load_object
from lightning_memkit.cli.estimate import _memory
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.plan.planner import no_best_note, plan_fit
from lightning_memkit.plan.result import PlanError
from lightning_memkit.plan.strategy_arguments import strategy_text
from lightning_memkit.plan.time_model import INTERCONNECTS
from lightning_memkit.units import format_bytes

__all__ = ["add_parser", "print_best", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help=(
            "my batch does not fit: the fastest way to train it anyway (micro-batch, checkpointing, precision, offload)"
        ),
        description="Estimate every way to train the module's effective batch that the allowed modes give "
        "(fake tensors, one step each), order those that fit by a simple rule (no recompute first, a lower "
        "precision where allowed, fewer and larger micro-batches), run the first ones as real trials (at most 3, "
        "on a copy of the module) and print the choice: the rule's first that fit, unless another was measured "
        "faster by more than 5%, with its Trainer arguments and a LightningCLI YAML snippet. A module that fits "
        "as is is left as it is.",
    )
    parser.add_argument("module", help="FILE.py:ModuleClass or package.module:ModuleClass (built with --init-args)")
    add_init_arguments(parser, datamodule=True)
    parser.add_argument(
        "--device-memory",
        default=None,
        help=(
            "the memory budget, e.g. 4GiB "
            "(default: --gpu's memory, this GPU's, or on CPU half the host memory available)"
        ),
    )
    if hasattr(parser, "_negative_number_matcher"):  # '-4GiB' reaches the option and gets its own message
        parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="GPU",
        help="plan for this GPU: h100, a100, l4, sm90, ... (its kernels, roofline and memory); implies --device cuda",
    )
    parser.add_argument(
        "--device",
        default=None,
        type=_device_word,
        help="where the plan is for: cpu, cuda or cuda:N, a GPU by index (default: cuda when a GPU is "
        "here or --gpu is given, else cpu)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="the effective batch to keep, samples per optimizer step (default: the train dataloader's batch)",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help="what may change, comma-separated: micro_batch, checkpoint, bf16 (or fp16, amp: mixed precision), "
        "bf16-true (or fp16-true: true half precision, the weights and optimizer state themselves in 16 bits), "
        "offload (default: micro_batch,checkpoint: memory-only changes)",
    )
    parser.add_argument("--trials", type=int, default=3, help="the most real trials, 1 to 3 (default: 3)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the plan's time budget, seconds (default: the estimate plus 20 steps of the effective batch, at "
        "least 30 s more); the estimate and trials until one fits always run, the other phases where they fit",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print a progress line per phase (estimate, each trial, the rounds)"
    )
    _add_device_arguments(parser)
    parser.add_argument("--json", dest="json_path", default=None, help="also write the plan to this JSON file")
    parser.set_defaults(run=run)


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Several devices: how many, which strategies, the interconnect; a module built on the meta device."""
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="plan on this many devices (each trains --batch-size / N samples per step): one rank's estimate per "
        "strategy, ranked by the predicted step on a GPU target (by the rule on CPU); predicted, not trialled",
    )
    parser.add_argument(
        "--max-world-size",
        type=int,
        default=None,
        help="plan on the fewest devices where a configuration fits, trying 1, 2, 4, ... up to this many",
    )
    parser.add_argument(
        "--strategy",
        default=None,
        help="on several devices, the strategies weighed, comma-separated: ddp, deepspeed_stage_2, fsdp, "
        "model_parallel (a module whose configure_model shards it), deepspeed_stage_3 (default: every one that "
        "applies)",
    )
    parser.add_argument(
        "--interconnect",
        default=None,
        type=_interconnect,
        help="what one rank's collectives move at: nvlink (400 GB/s, the default), infiniband (50 GB/s), pcie "
        "(25 GB/s), or a number of GB/s",
    )
    parser.add_argument(
        "--meta-init",
        action="store_true",
        help="build the module on the meta device (no weights, no host memory): for models larger than this "
        "machine; nothing can be trialled, the plan is the prediction (use with --gpu or --world-size)",
    )


def _interconnect(text: str) -> str | float:
    if text in INTERCONNECTS:
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value > 0:
        return value * 1e9
    raise argparse.ArgumentTypeError(f"{text!r}: give {', '.join(INTERCONNECTS)}, or a positive number of GB/s")


def _device_word(text: str) -> str:
    if re.fullmatch(r"cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: give cpu, cuda or cuda:N (a GPU by index)")


def _plan_json(plan: Any) -> dict:
    rows = [
        {
            "configuration": row.candidate.describe(),
            "micro_batch": row.candidate.micro_batch,
            "accumulation": row.candidate.accumulation,
            "precision": row.candidate.precision,
            "checkpoint": row.candidate.checkpoint_text,
            "offload": row.candidate.offload,
            "predicted_peak_bytes": row.predicted_peak_bytes,
            "predicted_step_s": row.predicted_step_s,
            "predicted_samples_per_s": row.predicted_samples_per_s,
            "fits": row.fits,
            "measured_peak_bytes": row.measured_peak_bytes,
            "measured_samples_per_s": row.measured_samples_per_s,
            "measured_allocated_bytes": row.measured_allocated_bytes,
            "measured_reserved_bytes": row.measured_reserved_bytes,
            "status": row.status.value,
            "note": row.note,
        }
        for row in plan.rows
    ]
    arguments = {k: v for k, v in plan.trainer_arguments().items() if k != "callbacks"}
    return {
        "best": plan.best.describe() if plan.best is not None else None,
        "fits_as_is": plan.fits_as_is,
        "budget_bytes": plan.budget_bytes,
        "effective_batch": plan.effective_batch,
        "trials": plan.trials,
        "device": plan.device,
        "trainer_arguments": arguments,
        "yaml": plan.yaml(),
        "rows": rows,
        "notes": plan.notes,
        "reason": plan.reason,
        "seconds": plan.seconds,
        "max_seconds": plan.max_seconds,
        "phases": [
            {"name": p.name, "seconds": p.seconds, "skipped": p.skipped, "detail": p.detail} for p in plan.phases
        ],
    }


def _checked(args: argparse.Namespace) -> tuple[int | None, GpuTarget | None]:
    """The budget (bytes) and the GPU the arguments name; a :class:`CliError` saying what to give when one is wrong."""
    memory = _memory(args.device_memory) if args.device_memory is not None else None
    if args.batch_size is not None and args.batch_size < 1:
        raise CliError(f"--batch-size {args.batch_size}: give a positive integer (samples per optimizer step)")
    if not 1 <= args.trials <= 3:
        raise CliError(f"--trials {args.trials}: give 1 to 3")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise CliError(
            f"--max-seconds {args.max_seconds:g}: give a positive number of seconds (the plan's time budget)"
        )
    if args.gpu is None:
        return memory, None
    if args.device == "cpu":
        raise CliError(f"--gpu {args.gpu} plans for a GPU; drop --device cpu (or --gpu)")
    try:
        return memory, GpuTarget.parse(args.gpu)
    except ValueError as error:
        raise CliError(f"--gpu: {error}") from None


def run(args: argparse.Namespace) -> int:
    try:
        memory, gpu = _checked(args)
        cls = load_object(args.module)
        if args.meta_init:
            with torch.device("meta"):
                module = build_instance(cls, json_object(args.init_args, "--init-args"))
        else:
            module = build_instance(cls, json_object(args.init_args, "--init-args"))
        if not isinstance(module, pl.LightningModule):
            raise CliError(
                f"{args.module} is not a LightningModule class; memkit plan trains real trials with a Trainer: "
                "give a LightningModule"
            )
        datamodule = None
        if args.datamodule:
            datamodule = build_instance(
                load_object(args.datamodule), json_object(args.datamodule_args, "--datamodule-args"), what="datamodule"
            )
        elif getattr(type(module), "train_dataloader", None) is pl.LightningModule.train_dataloader:
            raise CliError(
                f"{type(module).__name__} defines no train_dataloader(); give the datamodule that feeds it with "
                "--datamodule FILE.py:DataModuleClass"
            )
        if not args.verbose:
            print(
                f"memkit plan: estimating the candidates, then at most {args.trials} real trial"
                f"{'s' if args.trials != 1 else ''} (--verbose: a line per phase) ...",
                flush=True,
            )
        plan = plan_fit(
            module,
            batch_size=args.batch_size,
            device_memory=memory,
            gpu=gpu,
            device=args.device,
            modes=args.modes,
            datamodule=datamodule,
            trials=args.trials,
            verbose=args.verbose,
            max_seconds=args.max_seconds,
            world_size=args.world_size or 1,
            strategy=args.strategy,
            max_world_size=args.max_world_size,
            interconnect=args.interconnect,
        )
    except (CliError, PlanError) as error:
        print(f"memkit plan: {error}", file=sys.stderr)
        return 2
    print(plan.table())
    if plan.fits_as_is:
        print(
            f"\nThe module fits in {_size(plan.budget_bytes)} as is (batch {plan.effective_batch}): nothing to change."
        )
    elif plan.best is not None:
        print_best(plan)
    elif plan.rows and all(row.predicted_peak_bytes is None for row in plan.rows):
        print(f"memkit plan: {no_best_note(plan.rows)}", file=sys.stderr)  # the estimate, not memory, stopped it
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(_plan_json(plan), handle, indent=2, default=str)
    return 0 if plan.best is not None else 1


def print_best(plan: Any) -> None:
    """Print how to train ``plan.best``: the dataloader's batch size, the ``Trainer(...)`` arguments with every
    callback its trial ran with (checkpointing, offload), and the LightningCLI YAML snippet."""
    best = plan.best
    arguments = plan.trainer_arguments()
    if best.strategy is not None:  # the strategy as code, not an object's repr
        arguments["strategy"] = _Text(strategy_text(best.strategy, plan.wrap, best.world_size))
    shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items() if k != "callbacks")
    callbacks = []
    if best.checkpoint is not None:
        # as the trial ran it: a measuring forward would add its own peak, unless a budget needs it to choose blocks
        measure = "" if isinstance(best.checkpoint, CheckpointBudget) else ", measure=False"
        callbacks.append(f"ActivationCheckpointing(policy={best.checkpoint_text!r}{measure})")
    if best.offload:
        callbacks.append("ActivationOffload()")
    listed = f", callbacks=[{', '.join(callbacks)}]" if callbacks else ""
    print(f"\nBest: {best.describe()}. Set the dataloader's batch size to {best.micro_batch} and train with:")
    print(f"  Trainer({shown}{listed})")
    print("LightningCLI config:")
    print(plan.yaml(), end="")


class _Text(str):
    """Text printed as is inside ``repr`` of the arguments (an expression, not a string literal)."""

    def __repr__(self) -> str:
        return str(self)


def _size(nbytes: int) -> str:
    return format_bytes(nbytes)
