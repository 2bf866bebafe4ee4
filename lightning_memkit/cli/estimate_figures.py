"""What ``memkit estimate`` prints under its table for one device: each mode's tensor bytes at the peak by category,
with what is fixed and what each sample adds, and for a mode that does not fit even at batch size 1, the modes whose
estimate needs less there."""

from __future__ import annotations

from typing import Any

from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.estimate.batch_split import SPLIT_BATCH_SIZES, BatchSplit
from lightning_memkit.estimate.mode_needs import ModeNeed, needing_less
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["BREAKDOWN_HEADERS", "breakdown_lines", "does_not_fit_lines"]

#: the phases of a step that hold none of the batch's activations (a peak there grows little with the batch)
BATCH_FREE_PHASES = ("optimizer", "zero_grad")

#: the columns of a mode's breakdown table
BREAKDOWN_HEADERS = ("category", "at the peak", "fixed", "per sample")


def breakdown_lines(mode: str, estimate: Any, split: BatchSplit) -> list[str]:
    """A mode's breakdown: a title line, then a row per category (those that are zero in every column left out) and
    the peak: the bytes at the peak of the batch estimated, and what is fixed and what each sample adds."""
    rows = [
        (
            name,
            format_bytes(estimate.by_category.get(name, 0)),
            format_bytes(split.fixed_by_category[name]),
            format_bytes(split.per_sample_by_category[name]),
        )
        for name in CATEGORIES
        if estimate.by_category.get(name, 0) or split.fixed_by_category[name] or split.per_sample_by_category[name]
    ]
    rows.append(
        (
            "peak (tensors)",
            format_bytes(estimate.peak_bytes),
            format_bytes(split.fixed_bytes),
            format_bytes(split.per_sample_bytes),
        )
    )
    one, two = SPLIT_BATCH_SIZES
    lines = [
        f"{mode}: tensor bytes at the peak (batch {estimate.batch_size}, {estimate.peak_phase} of step "
        f"{estimate.peak_step}); fixed and per sample from the estimates at batch {one} and {two}",
        format_table(BREAKDOWN_HEADERS, rows),
    ]
    if split.peak_phases[0] != split.peak_phases[1]:
        lines.append(
            f"  the peak is in the {split.peak_phases[0]} at batch {one} and in the {split.peak_phases[1]} at batch "
            f"{two}: a category's fixed and per-sample bytes compare those two moments"
        )
    elif split.peak_phases[0] in BATCH_FREE_PHASES:
        lines.append(
            f"  at batch {one} and {two} the peak is in the {split.peak_phases[0]}, where the batch's activations "
            "are gone: per sample is what a sample adds there, until a larger batch moves the peak into the forward "
            "or backward"
        )
    return lines


def does_not_fit_lines(mode: str, needed_bytes: int, usable_bytes: float, needs: list[ModeNeed]) -> list[str]:
    """For ``mode``, which needs ``needed_bytes`` at batch size 1, more than ``usable_bytes``: the modes whose estimate
    needs less at batch size 1 (each with its need and whether it fits), or that none does."""
    lines = [f"{mode} does not fit even at batch size 1: it needs {format_bytes(needed_bytes)}"]
    less = [need for need in needing_less(needs, needed_bytes) if need.mode != mode]
    if not less:
        estimated = ", ".join(
            f"{need.mode} {format_bytes(need.required_bytes)}" for need in needs if not need.error and need.mode != mode
        )
        lines.append(f"  no other mode needs less at batch size 1 (estimated: {estimated or 'none'})")
        return lines
    for need in less:
        verdict = "fits" if need.fits else f"does not fit {format_bytes(usable_bytes)} either"
        lines.append(
            f"  try --modes {need.mode}: needs {format_bytes(need.required_bytes)} at batch size 1 "
            f"({format_bytes(needed_bytes - need.required_bytes)} less; {verdict})"
        )
    if not any(need.fits for need in less):
        lines.append("  none of them fits one device: --strategy gives the fewest GPUs for each mode")
    return lines
