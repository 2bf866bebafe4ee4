"""What an estimate answers (:class:`MemoryEstimate`: a step's peak, its categories, the CUDA allocator view) and
the error it raises when the step cannot be estimated (:class:`EstimateError`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.cuda.caching_allocator import AllocatorView
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["MemoryEstimate", "EstimateError"]


class EstimateError(MemkitError, RuntimeError):
    """The step could not be estimated; the message says why and what to do."""

    #: whether the step failed on an op whose output shape depends on tensor values (the message says what to do)
    data_dependent: bool = False


@dataclass
class MemoryEstimate:
    """The memory of one training step, at its peak (all sizes in bytes).

    Attributes:
        peak_bytes: peak of live tensor bytes over the first two steps (the second is the steady
            state: optimizer state exists, last step's gradients live until ``zero_grad``), exactly
            as :class:`~lightning_memkit.TensorAccountant` counts them (no allocator rounding).
        by_category: ``peak_bytes`` split into the accountant's categories
            (:data:`lightning_memkit.accounting.categories.CATEGORIES`: parameters, buffers,
            gradients, optimizer_state, activations = saved for backward at the peak, recomputed,
            inputs, temporaries...), attributed by
            :class:`~lightning_memkit.accounting.categories.CategoryAttributor`.
        batch_size: the batch size the step ran with (``None`` when the batch has no batch dimension).
        mode: the mode's name (``"baseline"``, ``"bf16"``, ``"checkpoint"``...).
        device: the target device type (``"cuda"``, ``"cpu"``...).
        peak_phase: where the peak happened: ``forward``, ``zero_grad``, ``backward`` or ``optimizer``.
        peak_step: which of the two steps (1 or 2) reached the peak.
        cuda: for a CUDA target, the caching-allocator view (:class:`AllocatorView`), else ``None``.
        source: ``"fake"`` (estimated, no real memory used) or ``"measured"`` (a real step on a copy).
        elapsed_s: wall time of the estimate, seconds.
        notes: caveats that apply to this estimate.
        host_bytes: with offload (``mode="offload"``, CUDA target), the peak of pinned host memory the offloaded
            saved tensors occupy, in bytes: ``numel * element_size`` of every tensor saved in one step's forward
            (torch's ``save_on_cpu`` copies each save: a tensor saved twice counts twice, parameters too), before
            the caching host allocator rounds each block up. ``0`` without offload. Not part of ``peak_bytes``,
            which counts the device.
        batch_shapes: the shapes of the batch the step ran on, e.g. ``input_ids (817, 256), labels (817,)``.
        batch_note: which batch that is and what the answer holds for: the data's worst batch (every sample sized,
            see :func:`~lightning_memkit.estimate.data.worst_batch.find_worst_batch`), a subset's, the batch given, or
            the batch seen where the data cannot be enumerated (an iterable dataset).
    """

    peak_bytes: int
    by_category: dict[str, int]
    batch_size: int | None
    mode: str = "baseline"
    device: str = "cpu"
    peak_phase: str = ""
    peak_step: int = 0
    cuda: AllocatorView | None = None
    source: str = "fake"
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0
    batch_shapes: str = ""
    batch_note: str = ""

    @property
    def required_bytes(self) -> int:
        """Bytes the target device must have: the allocator view's ``device_bytes`` on CUDA, else ``peak_bytes``."""
        return self.cuda.device_bytes if self.cuda is not None else self.peak_bytes

    def __getattr__(self, name: str) -> int:
        # parameters_bytes, gradients_bytes, ... as attributes
        if name.endswith("_bytes") and name[:-6] in CATEGORIES:
            return self.by_category.get(name[:-6], 0)
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``required_bytes`` included)."""
        data = asdict(self)
        data["cuda"] = self.cuda.to_dict() if self.cuda is not None else None
        data["required_bytes"] = self.required_bytes
        return data

    def summary(self) -> str:
        """A plain-text table of the peak and its categories."""
        rows = [(name, format_bytes(self.by_category.get(name, 0))) for name in CATEGORIES]
        rows.append(("peak (tensors)", format_bytes(self.peak_bytes)))
        if self.host_bytes:
            rows.append(("offloaded to host (pinned)", format_bytes(self.host_bytes)))
        if self.cuda is not None:
            rows += [
                ("CUDA allocated peak", format_bytes(self.cuda.peak_allocated_bytes)),
                ("CUDA reserved peak", format_bytes(self.cuda.peak_reserved_bytes)),
                ("context + workspaces", format_bytes(self.cuda.context_bytes + self.cuda.workspace_bytes)),
                ("device needs", format_bytes(self.cuda.device_bytes)),
            ]
        title = (
            f"memkit estimate: batch {self.batch_size}, mode {self.mode}, device {self.device} "
            f"({self.source}, peak in {self.peak_phase} of step {self.peak_step})"
        )
        batch_line = f"\nbatch: {self.batch_shapes} ({self.batch_note})" if self.batch_shapes else ""
        return title + batch_line + "\n" + format_table(("", "bytes"), rows)
