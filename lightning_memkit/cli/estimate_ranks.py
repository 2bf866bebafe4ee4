"""``memkit estimate --strategy``: one rank's memory under each multi-GPU strategy and mode, and the fewest GPUs
that fit."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from lightning_memkit.cli.estimate_output import in_cli_terms, kernels_and_notes, target_words
from lightning_memkit.estimate.data.batches import NoBatchError
from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory
from lightning_memkit.estimate.distributed.sharding import sharding_of
from lightning_memkit.estimate.distributed.user_model import has_configure_model
from lightning_memkit.estimate.mode_needs import ALTERNATIVE_MODES
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.estimate.step.settings import reusing_fake_copies
from lightning_memkit.modes.checkpoint_policy import repeated_block_classes
from lightning_memkit.modes.mode import parse_mode
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

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
    """(allocated, reserved, device needs) per rank, bytes. On CUDA: the rank's own caching allocator, replayed from
    the rank's own allocations, resizes and frees. On CPU: the rank's tensor peak."""
    if estimate.cuda is None:
        return estimate.peak_bytes, None, estimate.peak_bytes
    view = estimate.cuda
    return view.peak_allocated_bytes, view.peak_reserved_bytes, view.device_bytes


def _fully_sharded(strategy: str) -> bool:
    sharding = sharding_of(strategy, 1)
    return sharding.parameters and sharding.gradients and sharding.optimizer_state


@dataclass(frozen=True)
class _RankQuestion:
    """What every strategy and mode of one ``memkit estimate --strategy`` is estimated with: the parsed ``args``, the
    module and its datamodule, the ``--gpu`` target, FSDP's ``wrap`` classes, the bytes one rank's device may use
    (``usable``: the device memory less ``--margin``) and the world sizes the "min GPUs" answer tries."""

    args: argparse.Namespace
    module: Any
    datamodule: Any
    gpu: Any
    wrap: Any
    usable: float
    sizes: list[int]


def run_distributed(args, module, datamodule, modes, strategies, memory, gpu, wrap) -> int:
    usable = (1 - args.margin) * memory
    sizes = world_sizes_tried(args.max_world_size)
    question = _RankQuestion(args, module, datamodule, gpu, wrap, usable, sizes)
    rows, results, notes_by_mode = [], [], []
    with reusing_fake_copies():  # one fake step per mode serves every strategy and world size
        for strategy in strategies:
            for mode in modes:
                row, result, notes = _strategy_and_mode(question, strategy, mode)
                rows.append(row)
                results.append(result)
                if notes is not None:
                    notes_by_mode.append((f"{strategy} {mode.name}", notes))
        suggestions = _suggestions(question, modes, results)
    batch_words = f"batch {args.batch_size} per rank" if args.batch_size is not None else "the module's batch per rank"
    _print_table(args, gpu, memory, batch_words, rows)
    done = [r for r in results if "error" not in r]
    if done:
        _print_min_gpus(question, memory, batch_words, done)
    for line in _suggestion_lines(question, done, suggestions):
        print(line)
    lines = kernels_and_notes(notes_by_mode)
    if args.device == "cuda" and done:
        lines.append(
            "note: per rank, allocated and reserved are the rank's own caching allocator, replayed from its step"
        )
    for line in lines:
        print(line)
    if args.json_path:
        _write_json(args, memory, sizes, results)
    return 0 if len(done) == len(results) else 1  # any requested strategy and mode that failed fails the command


def _per_rank(question: _RankQuestion, strategy: str, mode: Any, world_size: int) -> tuple[Any, tuple]:
    """One rank's estimate under ``strategy`` in ``mode`` on ``world_size`` ranks, and its figures."""
    args = question.args
    estimate = estimate_distributed_memory(
        question.module,
        args.batch_size,
        strategy=strategy,
        world_size=world_size,
        wrap=question.wrap,
        mode=mode,
        device=args.device,
        datamodule=question.datamodule,
        gpu=question.gpu,
    )
    return estimate, _rank_figures(estimate)


def _fewest_gpus(question: _RankQuestion, strategy: str, mode: Any) -> tuple[Any, tuple, int | None, dict[int, int]]:
    """``strategy`` in ``mode``: one rank's estimate and figures at ``--world-size``, the fewest GPUs that fit (``None``
    when none of the sizes tried does) and the device needs of each size estimated on the way. Raises what the
    estimate raises.

    A strategy that shards a model state needs no more per rank on more ranks, so the fewest is found by bisection
    over the sizes tried, starting from ``--world-size``'s answer: a few rank steps, not one per size. DDP's rank is
    the same on every size above one (one step answers them all), and one rank alone has no buckets: its sizes are
    taken in order."""
    world_size, sizes = question.args.world_size, question.sizes
    estimate, figures = _per_rank(question, strategy, mode, world_size)
    needs_by_size: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in needs_by_size:
            needs_by_size[size] = figures[2] if size == world_size else _per_rank(question, strategy, mode, size)[1][2]
        return needs_by_size[size] <= question.usable

    sharding = sharding_of(strategy, world_size)
    if not (sharding.parameters or sharding.gradients or sharding.optimizer_state):
        return estimate, figures, next((size for size in sizes if fits(size)), None), needs_by_size
    low, high = 0, len(sizes)  # the answer's index lies in [low, high]; len(sizes): none fits
    if world_size in sizes:
        low, high = (0, sizes.index(world_size)) if fits(world_size) else (sizes.index(world_size) + 1, high)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(sizes[middle]) else (middle + 1, high)
    return estimate, figures, sizes[low] if low < len(sizes) else None, dict(sorted(needs_by_size.items()))


def _strategy_and_mode(question: _RankQuestion, strategy: str, mode: Any) -> tuple[tuple, dict, Any]:
    """The table row and JSON result of ``strategy`` in ``mode`` at ``--world-size``, with the fewest GPUs that fit,
    and the estimate's notes (``None`` when the estimate failed: the row says ``-``, the error goes to stderr)."""
    args, usable = question.args, question.usable
    try:
        estimate, (allocated, reserved, needs), minimum, needs_by_size = _fewest_gpus(question, strategy, mode)
    except (NoBatchError, EstimateError, ValueError) as error:
        error = in_cli_terms(error, args)
        print(f"memkit estimate: {strategy}, mode {mode.name}: {error}", file=sys.stderr)
        row: tuple[object, ...] = (strategy, mode.name, args.world_size, "-", "-", "-", "-", "-", "-")
        return row, {"strategy": strategy, "mode": mode.name, "error": str(error)}, None
    row = (
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
    result = {
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
    return row, result, estimate.notes


def _print_table(args: argparse.Namespace, gpu: Any, memory: int, batch_words: str, rows: list[tuple]) -> None:
    """The heading line and the table: a row per strategy and mode."""
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


def _print_min_gpus(question: _RankQuestion, memory: int, batch_words: str, done: list[dict]) -> None:
    """The "min GPUs" answer of each strategy and mode estimated, and what to try where none fits."""
    args, sizes, usable = question.args, question.sizes, question.usable
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
            strategy = result["strategy"]
            unit, wrap = _one_unit(question, strategy)
            print(
                f"  {strategy} {result['mode']}: none fits on up to {sizes[-1]} GPUs: one rank still "
                f"needs {format_bytes(needs)} on {sizes[-1]} (what {strategy} does not divide: {unit}"
                f"activations, {'unsharded model states, ' if not _fully_sharded(strategy) else ''}"
                f"workspaces, the CUDA context); {wrap}a smaller --batch-size, more memory per GPU"
                f"{', or a sharding --strategy (fsdp)' if not _fully_sharded(strategy) else ''}"
            )


def _one_unit(question: _RankQuestion, strategy: str) -> tuple[str, str]:
    """Where FSDP runs the whole model as one unit (no ``--wrap``, no ``configure_model``: every parameter gathered
    at once), the words for it and the ``--wrap`` to try (the module's repeated blocks); else two empty strings."""
    if not strategy.startswith("fsdp") or question.wrap or has_configure_model(question.module):
        return "", ""
    blocks = sorted(cls.__name__ for cls in repeated_block_classes(question.module))
    try_wrap = f"--wrap {','.join(blocks)} (FSDP's units, its auto_wrap_policy), " if blocks else ""
    return "the whole model gathered at once, one FSDP unit without --wrap; ", try_wrap


def _suggestions(question: _RankQuestion, modes: list[Any], results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """For each strategy and mode estimated that does not fit at ``--world-size``: the other modes (those asked for,
    then :data:`~lightning_memkit.estimate.mode_needs.ALTERNATIVE_MODES`) whose rank needs less there, least first, each
    with its device needs per rank and its fewest GPUs. Each result that does not fit gets them under
    ``"suggestions"``."""
    asked = {mode.name for mode in modes}
    candidates = [*modes, *(parse_mode(name) for name in ALTERNATIVE_MODES if name not in asked)]
    # per (strategy, mode): its suggestion, or None where the mode cannot be estimated
    answers: dict[tuple[str, str], dict | None] = {
        (r["strategy"], r["mode"]): _suggestion(r) for r in results if "error" not in r
    }
    by_name = {mode.name: mode for mode in candidates}
    found = {}
    for result in results:
        if "error" in result or result["fits"]:
            continue
        strategy, needs = result["strategy"], result["per_rank"]["device_bytes"]
        for mode in candidates:
            if (strategy, mode.name) not in answers:
                try:
                    figures = _per_rank(question, strategy, mode, question.args.world_size)[1]
                except (NoBatchError, EstimateError, ValueError):  # a mode that cannot be estimated is no suggestion
                    answers[(strategy, mode.name)] = None
                    continue
                answers[(strategy, mode.name)] = {
                    "mode": mode.name,
                    "device_bytes_per_rank": figures[2],
                    "fits": figures[2] <= question.usable,
                }
        known = [answer for m in candidates if (answer := answers[(strategy, m.name)]) is not None]
        less = sorted(
            (a for a in known if a["device_bytes_per_rank"] < needs), key=lambda a: a["device_bytes_per_rank"]
        )
        for answer in less:  # the fewest GPUs only of the modes shown (a search of rank steps each)
            if "min_world_size" not in answer:
                answer["min_world_size"] = _fewest_gpus(question, strategy, by_name[answer["mode"]])[2]
        result["suggestions"] = found[(strategy, result["mode"])] = less
    return found


def _suggestion(result: dict) -> dict:
    """A mode already in the table, as a suggestion for another mode of its strategy."""
    return {
        "mode": result["mode"],
        "device_bytes_per_rank": result["per_rank"]["device_bytes"],
        "fits": result["fits"],
        "min_world_size": result["min_world_size"],
    }


def _suggestion_lines(
    question: _RankQuestion, done: list[dict], suggestions: dict[tuple[str, str], list[dict]]
) -> list:
    """For each strategy and mode that does not fit on ``--world-size`` GPUs, the modes whose rank needs less there."""
    args = question.args
    lines = []
    for result in done:
        key = (result["strategy"], result["mode"])
        if key not in suggestions:
            continue
        less = suggestions[key]
        if not less:
            lines.append(f"  {key[0]} {key[1]}: no other mode needs less per rank on {args.world_size} GPUs")
        for each in less:
            fewest = each["min_world_size"] if each["min_world_size"] is not None else f"none <= {args.max_world_size}"
            lines.append(
                f"  {key[0]} {key[1]}: try --modes {each['mode']}: one rank needs "
                f"{format_bytes(each['device_bytes_per_rank'])} on {args.world_size} GPUs "
                f"({'fits' if each['fits'] else 'does not fit'}); min GPUs {fewest}"
            )
    if lines:
        lines.insert(0, f"what needs less per rank where a mode does not fit on {args.world_size} GPUs (estimated):")
    return lines


def _write_json(args: argparse.Namespace, memory: int, sizes: list[int], results: list[dict]) -> None:
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
