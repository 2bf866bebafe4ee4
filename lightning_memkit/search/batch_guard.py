"""The batch a search or plan proved, and a guard that reports a training batch larger than it before its step runs.

A search proves that batches up to a shape fit; a run whose data can produce a larger one (a longer text, a larger
image than any the trials ran) has not been proved. The guard compares each training batch's bytes with the proved
batch's and says so once, with both shapes, before that step runs: on a GPU the step that follows may run out of
memory hours into the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_memkit.estimate.data.worst_batch import batch_nbytes, batch_shapes
from lightning_memkit.units import format_bytes

__all__ = ["ProvedBatch", "BatchGuard"]


@dataclass(frozen=True)
class ProvedBatch:
    """The largest batch a search's or plan's real trials ran and fitted.

    Attributes:
        nbytes: the bytes of its tensors.
        shapes: its tensors' shapes, e.g. ``input_ids (14, 256), labels (14,)``.
        proved_by: what proved it, e.g. ``MaxBatchSize's trial at batch size 14``.
    """

    nbytes: int
    shapes: str
    proved_by: str

    @classmethod
    def of(cls, batch: Any, proved_by: str) -> ProvedBatch:
        """The proved batch for ``batch`` (real or fake tensors: only shapes and dtypes are read)."""
        return cls(batch_nbytes(batch), batch_shapes(batch), proved_by)


class BatchGuard:
    """Compares training batches with a :class:`ProvedBatch`; the first larger one gets a message, once per fit.

    Cheap for every step: the bytes of the batch's tensors are summed from their shapes (no data is read).
    """

    def __init__(self, proved: ProvedBatch) -> None:
        self.proved = proved
        self.reported = False

    def check(self, batch: Any, step: int) -> str | None:
        """The message for ``batch`` (about to train at global step ``step``) when it is the first larger than the
        proved one, else ``None``."""
        if self.reported:
            return None
        nbytes = batch_nbytes(batch)
        if nbytes <= self.proved.nbytes:
            return None
        self.reported = True
        return (
            f"memkit: the batch of step {step} ({batch_shapes(batch)}, {format_bytes(nbytes)}) is larger than the "
            f"largest batch {self.proved.proved_by} proved ({self.proved.shapes}, "
            f"{format_bytes(self.proved.nbytes)}): this step's memory was not proved and may not fit; search again "
            "on the worst batch of the data (give the search the data that makes it), or cap the batch's shape "
            "(e.g. a maximum sequence length)"
        )
