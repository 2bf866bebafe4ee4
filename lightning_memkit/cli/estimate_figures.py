"""What ``memkit estimate`` prints under its table for one device: each mode's tensor bytes at the peak by category,
beside what batch 1 costs and what one more sample adds, and for a mode that does not fit even at batch size 1, the
modes whose estimate needs less there."""

from __future__ import annotations

from typing import Any

from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.estimate.batch_split import BatchSplit
from lightning_memkit.estimate.mode_needs import ModeNeed, needing_less
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["BREAKDOWN_HEADERS", "breakdown_lines", "does_not_fit_lines"]

#: the phases of a step that hold none of the batch's activations (a peak there grows little with the batch)
BATCH_FREE_PHASES = ("optimizer", "zero_grad")

#: the columns of a mode's breakdown table
BREAKDOWN_HEADERS = ("category", "at the peak", "batch 1", "per sample")


def breakdown_lines(mode: str, estimate: Any, split: BatchSplit) -> list[str]:
    """A mode's breakdown: a title line, then a row per category (those that are zero in every column left out) and
    the peak: the bytes at the peak of the batch estimated, at batch 1, and what one more sample adds."""
    columns = (estimate.by_category, split.batch_one_by_category, split.per_sample_by_category)
    rows = [
        (name, *(format_bytes(column.get(name, 0)) for column in columns))
        for name in CATEGORIES
        if any(column.get(name, 0) for column in columns)
    ]
    peaks = (estimate.peak_bytes, split.batch_one_bytes, split.per_sample_bytes)
    rows.append(("peak (tensors)", *(format_bytes(value) for value in peaks)))
    one, at, following = split.peak_phases
    size = split.batch_size
    lines = [
        f"{mode}: tensor bytes at the peak (batch {estimate.batch_size}, {estimate.peak_phase} of step "
        f"{estimate.peak_step}), at batch 1 (peak in the {one}), and what one more sample adds at batch {size}",
        format_table(BREAKDOWN_HEADERS, rows),
    ]
    if at != following:
        lines.append(
            f"  the peak moves from the {at} at batch {size} to the {following} at batch {size + 1}: a category's "
            "bytes per sample compare those two moments"
        )
    elif at in BATCH_FREE_PHASES:
        lines.append(
            f"  at batch {size} the peak is in the {at}, where the batch's activations are gone: per sample is what a "
            "sample adds there, until a larger batch moves the peak into the forward or backward"
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
