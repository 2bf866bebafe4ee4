"""``memkit estimate --strategy``: one rank's memory under each multi-GPU strategy and mode, and the fewest GPUs
that fit."""

from __future__ import annotations

import json
import sys
from typing import Any

from lightning_memkit.cli.estimate_output import in_cli_terms, kernels_and_notes, target_words

__all__ = ["run_distributed", "world_sizes_tried"]


def world_sizes_tried(limit: int) -> list[int]:
    """The world sizes the "min GPUs" answer tries: 1, 2, 4, ... up to ``limit`` (``limit`` itself included)."""
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return sizes


def _rank_figures(estimate: Any) -> tuple[int, int | None, int]:
    """(allocated, reserved, device needs) per rank, bytes. On CUDA: the one-process allocator view shifted by the
    rank's tensor difference (its shards and buffers against the one-process step); the per-rank allocator
    itself is not replayed. On CPU: the rank's tensor peak."""
    single = estimate.single
    if single.cuda is None:
        return estimate.peak_bytes, None, estimate.peak_bytes
    shift = estimate.peak_bytes - single.peak_bytes
    allocated = single.cuda.peak_allocated_bytes + shift
    reserved = max(allocated, single.cuda.peak_reserved_bytes + shift)
    return allocated, reserved, reserved + single.cuda.context_bytes + single.cuda.workspace_bytes


def _fully_sharded(strategy: str) -> bool:
    from lightning_memkit.estimate.distributed import sharding_of

    sharding = sharding_of(strategy, 1)
    return sharding.parameters and sharding.gradients and sharding.optimizer_state


def run_distributed(args, module, datamodule, modes, strategies, memory, gpu, wrap) -> int:
    from lightning_memkit.estimate import EstimateError, NoBatchError
    from lightning_memkit.estimate.core import reusing_fake_copies
    from lightning_memkit.estimate.distributed import estimate_distributed_memory
    from lightning_memkit.summary_table import format_table
    from lightning_memkit.units import format_bytes

    usable = (1 - args.margin) * memory
    sizes = world_sizes_tried(args.max_world_size)
    rows, results, notes_by_mode = [], [], []
    with reusing_fake_copies():  # one fake step per mode serves every strategy and world size
        for strategy in strategies:
            for mode in modes:

                def per_rank(world_size: int):
                    estimate = estimate_distributed_memory(
                        module,
                        args.batch_size,
                        strategy=strategy,
                        world_size=world_size,
                        wrap=wrap,
                        mode=mode,
                        device=args.device,
                        datamodule=datamodule,
                        gpu=gpu,
                    )
                    return estimate, _rank_figures(estimate)

                try:
                    estimate, (allocated, reserved, needs) = per_rank(args.world_size)
                    needs_by_size = {}
                    minimum = None
                    for size in sizes:
                        needs_by_size[size] = per_rank(size)[1][2]
                        if needs_by_size[size] <= usable:
                            minimum = size
                            break
                except (NoBatchError, EstimateError, ValueError) as error:
                    error = in_cli_terms(error, args)
                    rows.append((strategy, mode.name, args.world_size, "-", "-", "-", "-", "-", "-"))
                    results.append({"strategy": strategy, "mode": mode.name, "error": str(error)})
                    print(f"memkit estimate: {strategy}, mode {mode.name}: {error}", file=sys.stderr)
                    continue
                rows.append(
                    (
                        strategy,
                        mode.name,
                        args.world_size,
                        estimate.single.batch_size,
                        format_bytes(allocated),
                        format_bytes(reserved),
                        format_bytes(needs),
                        "yes" if needs <= usable else "no",
                        minimum if minimum is not None else f"none <= {args.max_world_size}",
                    )
                )
                results.append(
                    {
                        "strategy": strategy,
                        "mode": mode.name,
                        "world_size": args.world_size,
                        "batch_size_per_rank": estimate.single.batch_size,
                        "per_rank": {"allocated_bytes": allocated, "reserved_bytes": reserved, "device_bytes": needs},
                        "fits": needs <= usable,
                        "min_world_size": minimum,
                        "device_bytes_by_world_size": needs_by_size,
                        "estimate": estimate.to_dict(),
                    }
                )
                notes_by_mode.append((mode.name, estimate.notes))
    batch_words = f"batch {args.batch_size} per rank" if args.batch_size is not None else "the module's batch per rank"
    print(
        f"memkit estimate: {args.module} per rank on {args.world_size} ranks, {batch_words}, "
        f"{target_words(args, gpu)}, {format_bytes(memory)} device memory, {args.margin:.0%} kept free (fake tensors)"
    )
    print(
        format_table(
            (
                "strategy",
                "mode",
                "ranks",
                "batch/rank",
                "allocated/rank",
                "reserved/rank",
                "device needs/rank",
                "fits",
                "min GPUs",
            ),
            rows,
            left_columns=2,
        )
    )
    done = [r for r in results if "error" not in r]
    if done:
        tried = ", ".join(str(s) for s in sizes)
        print(
            f"min GPUs: the fewest of {tried} GPUs on which one rank's device needs fit {format_bytes(usable)} "
            f"({1 - args.margin:.0%} of {format_bytes(memory)}) at {batch_words}:"
        )
        for result in done:
            size = result["min_world_size"]
            if size is not None:
                print(f"  {result['strategy']} {result['mode']}: {size}")
            else:
                needs = result["device_bytes_by_world_size"][sizes[-1]]
                print(
                    f"  {result['strategy']} {result['mode']}: none fits on up to {sizes[-1]} GPUs: one rank still "
                    f"needs {format_bytes(needs)} on {sizes[-1]} (what {result['strategy']} does not divide: "
                    f"activations, {'unsharded model states, ' if not _fully_sharded(result['strategy']) else ''}"
                    "workspaces, the CUDA context); try --modes checkpoint or --modes bf16, a smaller --batch-size, "
                    "more memory per GPU"
                    f"{', or a sharding --strategy (fsdp)' if not _fully_sharded(result['strategy']) else ''}"
                )
    lines = kernels_and_notes(notes_by_mode)
    if args.device == "cuda" and done:
        lines.append(
            "note: per rank, allocated and reserved are the one-process allocator view shifted by the rank's shards "
            "and buffers (the per-rank allocator is not replayed)"
        )
    for line in lines:
        print(line)
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump(
                {
                    "module": args.module,
                    "device": args.device,
                    "device_memory_bytes": memory,
                    "world_size": args.world_size,
                    "world_sizes_tried": sizes,
                    "results": results,
                },
                file,
                indent=2,
                default=str,
            )
    return 0 if len(done) == len(results) else 1  # any requested strategy and mode that failed fails the command
