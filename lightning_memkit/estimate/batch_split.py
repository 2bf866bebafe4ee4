"""Fixed vs per sample (:class:`BatchSplit`): what a training step costs at batch size 1, and what one more sample adds
near the batch estimated, overall and by category, from the estimates at batch sizes 1, ``b`` and ``b + 1``.

The categories say which bytes the batch makes: parameters, gradients, optimizer state and autocast's weight copies
add nothing per sample; activations, inputs and most temporaries do. The estimates show it exactly, where one
estimate's categories could only be read as a guess. The growth is measured at the batch estimated, not between
batch 1 and 2: a small batch's peak often sits in the optimizer step, where the batch's tensors are gone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.step.memory_estimate import MemoryEstimate
from lightning_memkit.estimate.step.settings import reusing_fake_copies
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["BatchSplit", "estimate_batch_split"]


@dataclass
class BatchSplit:
    """What a step costs at batch size 1, and what one more sample adds at batch size ``batch_size`` (bytes), overall
    and by category (:data:`~lightning_memkit.accounting.categories.CATEGORIES`).

    Attributes:
        batch_size: the batch size ``b`` the growth is measured at: per sample is the estimate at ``b + 1`` less the
            estimate at ``b``.
        batch_one_bytes: the tensor peak at batch size 1 (``MemoryEstimate.peak_bytes``).
        batch_one_by_category: ``batch_one_bytes`` by category.
        batch_one_required_bytes: what the device must have at batch size 1 (``MemoryEstimate.required_bytes``: the
            CUDA allocator's reserved peak plus the context on a CUDA target, the tensor peak elsewhere).
        per_sample_bytes: what one more sample adds to the tensor peak at ``batch_size``.
        per_sample_by_category: ``per_sample_bytes`` by category: 0 for parameters, gradients, optimizer state and
            autocast's weight copies; the activations and inputs one sample makes.
        peak_phases: where the peaks happened, at batch 1, ``b`` and ``b + 1`` (``"forward"``, ``"backward"``,
            ``"optimizer"``...). Where ``b`` and ``b + 1`` differ, the peak moves between two moments of the step there
            and a category can grow or shrink by more than a sample makes (the totals stay exact).
        mode: the mode's name.
    """

    batch_size: int
    batch_one_bytes: int
    batch_one_by_category: dict[str, int]
    batch_one_required_bytes: int
    per_sample_bytes: int
    per_sample_by_category: dict[str, int]
    peak_phases: tuple[str, str, str]
    mode: str = "baseline"

    @classmethod
    def between(cls, one: MemoryEstimate, at: MemoryEstimate, following: MemoryEstimate) -> BatchSplit:
        """The split from the estimates of the same step at batch sizes 1 (``one``), ``b`` (``at``) and ``b + 1``
        (``following``); ``at`` may be ``one``."""
        if one.batch_size != 1 or at.batch_size is None or following.batch_size != at.batch_size + 1:
            raise ValueError(
                f"a split takes the estimates at batch sizes 1, b and b + 1, not ({one.batch_size}, {at.batch_size}, "
                f"{following.batch_size})"
            )
        return cls(
            batch_size=at.batch_size,
            batch_one_bytes=one.peak_bytes,
            batch_one_by_category={name: one.by_category.get(name, 0) for name in CATEGORIES},
            batch_one_required_bytes=one.required_bytes,
            per_sample_bytes=following.peak_bytes - at.peak_bytes,
            per_sample_by_category={
                name: following.by_category.get(name, 0) - at.by_category.get(name, 0) for name in CATEGORIES
            },
            peak_phases=(one.peak_phase, at.peak_phase, following.peak_phase),
            mode=one.mode,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (bytes as ints)."""
        data = asdict(self)
        data["peak_phases"] = list(self.peak_phases)
        return data

    def summary(self) -> str:
        """A plain-text table: each category at batch 1 and what a sample adds (rows that are zero left out)."""
        rows = [
            (name, format_bytes(self.batch_one_by_category[name]), format_bytes(self.per_sample_by_category[name]))
            for name in CATEGORIES
            if self.batch_one_by_category[name] or self.per_sample_by_category[name]
        ]
        rows.append(("peak (tensors)", format_bytes(self.batch_one_bytes), format_bytes(self.per_sample_bytes)))
        title = f"memkit estimate: mode {self.mode}, batch 1 and what a sample adds at batch {self.batch_size}"
        return title + "\n" + format_table(("", "batch 1", "per sample"), rows)


def estimate_batch_split(module: nn.Module, batch_size: int = 1, **estimate_kwargs: Any) -> BatchSplit:
    """Estimate ``module``'s step at batch sizes 1, ``batch_size`` and ``batch_size + 1``, and split it into what
    batch 1 costs and what one more sample adds at ``batch_size`` (:class:`BatchSplit`). ``estimate_kwargs`` are
    :func:`~lightning_memkit.estimate.estimate_memory`'s (``mode=``, ``device=``, ``batch=``, ``datamodule=``,
    ``gpu=``...). One fake copy serves every estimate."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: give a positive integer, the batch to measure the growth at")
    with reusing_fake_copies():
        one, at, following = (
            estimate_memory(module, size, **estimate_kwargs) for size in (1, batch_size, batch_size + 1)
        )
        return BatchSplit.between(one, at, following)
