"""The tensor accountant as a probe: exact live and peak tensor bytes for a step.

Unlike the other probes it must be *active* while the step runs (it is a dispatch mode),
so it adds :meth:`TensorProbe.start` and :meth:`TensorProbe.stop` around the step.
"""

from __future__ import annotations

from typing import Any, Iterable

from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.probes.base import MemoryProbe

__all__ = ["TensorProbe"]


class TensorProbe(MemoryProbe):
    """Exact bytes of live tensor storages (``tensor_bytes``) and the step's peak.

    The baseline is whatever :meth:`start` is told to adopt (parameters, gradients,
    optimizer state, the batch): those count once and stay counted until torch frees them.
    Its cost is a Python call per aten op while active; see docs/memory_tracker.md.
    """

    name = "tensor"

    def __init__(self, accountant: TensorAccountant | None = None) -> None:
        self.accountant = accountant or TensorAccountant()
        self._active = False

    def start(self, existing: Iterable[Any] = ()) -> None:
        """Adopt ``existing`` tensors and activate the accountant for the step."""
        self.accountant.adopt(existing)
        if not self._active:
            self.accountant.__enter__()
            self._active = True

    def stop(self) -> None:
        """Deactivate the accountant (frees are still seen afterwards)."""
        if self._active:
            self._active = False
            self.accountant.__exit__(None, None, None)

    def reset_peak(self) -> None:
        self.accountant.reset_peak()

    def read(self) -> dict[str, int]:
        if self.accountant.errors:
            raise RuntimeError("; ".join(self.accountant.errors[:3]))
        return {"tensor_bytes": self.accountant.current_bytes, "peak_tensor_bytes": self.accountant.peak_bytes}

    def close(self) -> None:
        self.stop()
