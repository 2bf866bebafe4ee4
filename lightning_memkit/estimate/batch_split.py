"""What a training step costs at batch size 1 and what each further sample adds (:class:`BatchSplit`), by category,
from two estimates: at batch sizes 1 and 2.

The categories say which bytes the batch makes: parameters, gradients, optimizer state and autocast's weight copies
are the same at every batch size; activations, inputs and most temporaries grow with it. Two estimates show it
exactly, where one estimate's categories could only be read as a guess.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.estimate.core import estimate_memory
from lightning_memkit.estimate.result import MemoryEstimate
from lightning_memkit.estimate.settings import reusing_fake_copies
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["BatchSplit", "estimate_batch_split", "SPLIT_BATCH_SIZES"]

#: the two batch sizes a split is estimated at: batch 1 is what the smallest step costs, and the difference to
#: batch 2 is what one more sample adds, in whole bytes
SPLIT_BATCH_SIZES = (1, 2)


@dataclass
class BatchSplit:
    """A step's tensor peak as ``fixed_bytes + per_sample_bytes * batch_size``, overall and by category (bytes),
    from the estimates at batch sizes 1 and 2 (:data:`SPLIT_BATCH_SIZES`).

    Attributes:
        batch_one_bytes: the tensor peak at batch size 1 (``MemoryEstimate.peak_bytes``).
        per_sample_bytes: what one more sample adds to the peak: the peak at batch 2 less the peak at batch 1.
        fixed_bytes: ``batch_one_bytes - per_sample_bytes``: what the step holds whatever the batch (the line's
            value at batch 0).
        fixed_by_category: ``fixed_bytes`` by category (:data:`~lightning_memkit.accounting.categories.CATEGORIES`):
            parameters, gradients, optimizer state and autocast's weight copies are fixed.
        per_sample_by_category: ``per_sample_bytes`` by category: activations and inputs grow with the batch.
        batch_one_required_bytes: what the device must have at batch size 1 (``MemoryEstimate.required_bytes``:
            the CUDA allocator's reserved peak plus the context on a CUDA target, the tensor peak elsewhere).
        peak_phases: where each peak happened, at batch 1 and at batch 2 (``"forward"``, ``"backward"``,
            ``"optimizer"``...). When they differ, the per-category figures compare two moments of the step (a peak in
            the optimizer step at batch 1 holds its temporaries, one in the forward at batch 2 does not), so a
            category can grow or shrink by more than the batch makes; the totals stay exact.
        mode: the mode's name.
    """

    batch_one_bytes: int
    per_sample_bytes: int
    fixed_bytes: int
    fixed_by_category: dict[str, int]
    per_sample_by_category: dict[str, int]
    batch_one_required_bytes: int
    peak_phases: tuple[str, str]
    mode: str = "baseline"

    @classmethod
    def between(cls, one: MemoryEstimate, two: MemoryEstimate) -> BatchSplit:
        """The split from the estimates of the same step at batch sizes 1 (``one``) and 2 (``two``)."""
        if (one.batch_size, two.batch_size) != SPLIT_BATCH_SIZES:
            raise ValueError(
                f"a split takes the estimates at batch sizes {SPLIT_BATCH_SIZES}, not "
                f"({one.batch_size}, {two.batch_size})"
            )
        per_sample = {name: two.by_category.get(name, 0) - one.by_category.get(name, 0) for name in CATEGORIES}
        fixed = {name: one.by_category.get(name, 0) - per_sample[name] for name in CATEGORIES}
        growth = two.peak_bytes - one.peak_bytes
        return cls(
            batch_one_bytes=one.peak_bytes,
            per_sample_bytes=growth,
            fixed_bytes=one.peak_bytes - growth,
            fixed_by_category=fixed,
            per_sample_by_category=per_sample,
            batch_one_required_bytes=one.required_bytes,
            peak_phases=(one.peak_phase, two.peak_phase),
            mode=one.mode,
        )

    def bytes_at(self, batch_size: int) -> int:
        """The tensor peak the line gives at ``batch_size`` (exact at 1 and 2), bytes."""
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (bytes as ints)."""
        data = asdict(self)
        data["peak_phases"] = list(self.peak_phases)
        return data

    def summary(self) -> str:
        """A plain-text table: each category's fixed bytes and its bytes per sample (rows that are zero left out)."""
        rows = [
            (name, format_bytes(self.fixed_by_category[name]), format_bytes(self.per_sample_by_category[name]))
            for name in CATEGORIES
            if self.fixed_by_category[name] or self.per_sample_by_category[name]
        ]
        rows.append(("peak (tensors)", format_bytes(self.fixed_bytes), format_bytes(self.per_sample_bytes)))
        return f"memkit estimate: fixed vs per sample, mode {self.mode}\n" + format_table(
            ("", "fixed", "per sample"), rows
        )


def estimate_batch_split(module: nn.Module, **estimate_kwargs: Any) -> BatchSplit:
    """Estimate ``module``'s step at batch sizes 1 and 2 and split its peak into what is fixed and what each sample
    adds (:class:`BatchSplit`). ``estimate_kwargs`` are :func:`~lightning_memkit.estimate.estimate_memory`'s
    (``mode=``, ``device=``, ``batch=``, ``datamodule=``, ``gpu=``...; not ``batch_size``). One fake copy serves
    both estimates."""
    if "batch_size" in estimate_kwargs:
        raise ValueError(f"estimate_batch_split estimates batch sizes {SPLIT_BATCH_SIZES}; leave batch_size= out")
    with reusing_fake_copies():
        one, two = (estimate_memory(module, size, **estimate_kwargs) for size in SPLIT_BATCH_SIZES)
        return BatchSplit.between(one, two)
