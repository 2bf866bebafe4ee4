"""The tensor accountant as a probe: exact live and peak tensor bytes for a step.

Unlike the other probes it may be *active* while the step runs (it is a dispatch mode), so it
adds :meth:`TensorProbe.start` and :meth:`TensorProbe.stop` around the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.accounting.process import ProcessTensors
from lightning_memkit.compiled import COMPILED_CHOICES, AllocatorPeak
from lightning_memkit.compiled._torch_compat import force_eager
from lightning_memkit.probes.base import MemoryProbe

__all__ = ["TENSOR_SCOPES", "TensorProbe"]

#: what ``tensor_bytes`` covers: ``"process"`` every live tensor storage of the process on the
#: measured device (what CUDA's allocated bytes mean); ``"step"`` only the tensors given to
#: :meth:`TensorProbe.start` and those allocated while the accountant is active.
TENSOR_SCOPES = ("process", "step")


class TensorProbe(MemoryProbe):
    """Exact bytes of live tensor storages (``tensor_bytes``) and the step's peak (``peak_tensor_bytes``).

    Args:
        accountant: the accountant to read (a new one by default).
        scope: ``"process"`` (default): ``tensor_bytes`` counts every live tensor storage of the
            process on ``device`` (found by :class:`~lightning_memkit.accounting.process.ProcessTensors`),
            whoever made it; ``"step"``: only what :meth:`start` adopts plus what the step allocates.
        device: the device whose storages a ``"process"`` scope counts.

    The peak needs the accountant active during the step (a Python call per aten op); a window in
    which it never was active reads ``peak_tensor_bytes`` as ``None`` (see :meth:`read`).

    A compiled model (:attr:`compiled`): the accountant is a dispatch mode, under which dynamo runs nothing
    compiled. ``"keep"``: the peak comes from the allocator's own events instead
    (:class:`~lightning_memkit.compiled.AllocatorPeak`: bytes live at the start, from the accountant, plus the
    highest running sum of the allocator's signed events), and the step runs compiled. ``"eager"``: the
    accountant runs as on an eager model, with compiled code run eagerly (``force_eager``) in those steps.
    ``None`` (default): no compiled model.
    """

    name = "tensor"

    def __init__(
        self, accountant: TensorAccountant | None = None, scope: str = "process", device: torch.device | str = "cpu"
    ) -> None:
        if scope not in TENSOR_SCOPES:
            raise ValueError(
                f"TensorProbe(scope={scope!r}): choose 'process' (every live tensor of the process) or 'step'"
            )
        self.accountant = accountant or TensorAccountant()
        self.accountant_device = torch.device(device)
        self.scope = scope
        self.process: ProcessTensors | None = None
        if scope == "process":
            self.process = ProcessTensors(self.accountant, torch.device(device).type).start()
        self._active = False
        self._peak_seen = False
        self._compiled: str | None = None
        self._allocator: AllocatorPeak | None = None
        self._eager: contextlib.ExitStack | None = None
        self.allocator_unavailable = False  # set when another profiler kept the allocator's events from us
        #: whether :meth:`reset_peak` first adopts the tensors made since the last look (a sweep of the young
        #: objects). :class:`~lightning_memkit.MemoryMeter` turns it off for a window with no tensor peak: what
        #: such a window reads is ``tensor_bytes`` at its end, which :meth:`read` sweeps for anyway (the tensors
        #: that lived only in between are no reading's), so one sweep a step is saved.
        self.sweep_at_reset = True

    @property
    def compiled(self) -> str | None:
        """How a compiled model is measured: ``"keep"``, ``"eager"`` or ``None`` (no compiled model); see the class."""
        return self._compiled

    @compiled.setter
    def compiled(self, value: str | None) -> None:
        if value is not None and value not in COMPILED_CHOICES:
            raise ValueError(f"TensorProbe.compiled={value!r}: choose one of {COMPILED_CHOICES} or None")
        self.stop()
        self._compiled = value
        self._allocator = AllocatorPeak(self.accountant_device) if value == "keep" else None

    def sweep(self) -> None:
        """Adopt the process's tensors made since the last look (``"process"`` scope; else nothing)."""
        if self.process is not None:
            self.process.sweep()

    def start(self, existing: Iterable[Any] = ()) -> None:
        """Adopt ``existing`` tensors and activate the accountant for the step."""
        self.accountant.adopt(existing)
        if self._active:
            return
        if self._allocator is not None:
            self.sweep()
            if self._allocator.start(self.accountant.current_bytes):
                self._active = True
                self._peak_seen = True
            else:
                self.allocator_unavailable = True
            return
        if self._compiled == "eager":
            self._eager = contextlib.ExitStack()
            self._eager.enter_context(force_eager())
        self.accountant.__enter__()
        self._active = True
        self._peak_seen = True

    def stop(self) -> None:
        """Deactivate the accountant (frees are still seen afterwards)."""
        if not self._active:
            return
        self._active = False
        if self._allocator is not None:
            self._allocator.stop()
            return
        self.accountant.__exit__(None, None, None)
        if self._eager is not None:
            self._eager.close()
            self._eager = None

    def reset_peak(self) -> None:
        if self.sweep_at_reset:
            self.sweep()
        self.accountant.reset_peak()
        if self._allocator is not None:
            self._allocator.reset()
        self._peak_seen = False

    def read(self) -> dict[str, int]:
        """``tensor_bytes`` (live now, bytes) and, when the accountant was active since the last
        :meth:`reset_peak`, ``peak_tensor_bytes`` (the highest live bytes since then)."""
        if self.accountant.errors:
            raise RuntimeError("; ".join(self.accountant.errors[:3]))
        self.sweep()
        values = {"tensor_bytes": self.accountant.current_bytes}
        if self._peak_seen and self._allocator is not None:
            if self._allocator.peak_bytes is not None:
                values["peak_tensor_bytes"] = max(self._allocator.peak_bytes, self.accountant.current_bytes)
        elif self._peak_seen:
            values["peak_tensor_bytes"] = max(self.accountant.peak_bytes, self.accountant.current_bytes)
        return values

    def close(self) -> None:
        self.stop()
        if self.process is not None:
            self.process.stop()
