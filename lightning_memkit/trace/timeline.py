"""The events of one traced step, in order, with their bytes: from the accountant as they happen, or from the
allocator's events after the step (a compiled model, whose code no dispatch mode may see).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.compiled import AllocatorPeak
from lightning_memkit.trace.selection import TracedModule
from lightning_memkit.trace.trace_records import TraceEvent

__all__ = ["StepTimeline", "shapes_of"]


def shapes_of(tensors: Sequence[torch.Tensor | None]) -> tuple[list[list[int]], list[str]]:
    """The shapes and dtype names (``"float32"``) of the tensors among ``tensors``."""
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    return [list(t.shape) for t in present], [str(t.dtype).replace("torch.", "") for t in present]


@dataclass
class _RegionForward:
    """A compiled region's call: its pre-forward and forward events, and the bytes of its outputs' storages."""

    pre_index: int
    forward_index: int
    outputs_bytes: int


class StepTimeline:
    """The step's :class:`~lightning_memkit.trace.trace_records.TraceEvent` list, each event with the live bytes, their
    change since the event before and the running peak.

    With an ``allocator`` (a compiled model) each event only marks the allocator's event stream, and
    :meth:`fill_from_allocator` reads the bytes after the step: the profiler cannot stop inside backward.
    """

    def __init__(self, accountant: TensorAccountant, start_bytes: int, allocator: AllocatorPeak | None = None) -> None:
        self.accountant = accountant
        self.allocator = allocator
        self.start_bytes = start_bytes
        self.events: list[TraceEvent] = []
        self._last_live = start_bytes
        self._region_forwards: list[_RegionForward] = []

    def release(self) -> None:
        """Drop the accountant once the step is traced: its records reach the model, the state and the batch."""
        del self.accountant

    def emit(
        self,
        phase: str,
        info: TracedModule | None,
        call: int = 0,
        recompute: bool = False,
        tensors: Sequence[torch.Tensor | None] = (),
        saved_bytes: int = 0,
        described: tuple[list[list[int]], list[str]] | None = None,
    ) -> None:
        """Append an event of ``phase`` for ``info`` (``None``: a step marker); ``tensors`` give its shapes, or
        ``described`` gives them already read."""
        if self.allocator is not None:
            self.allocator.mark(str(len(self.events)))  # bytes filled in after the step (fill_from_allocator)
            live = peak = 0
        else:
            live, peak = self.accountant.current_bytes, self.accountant.peak_bytes
        shapes, dtypes = shapes_of(tensors) if described is None else described
        self.events.append(
            TraceEvent(
                index=len(self.events),
                phase=phase,
                module=info.name if info else "",
                module_class=info.cls if info else "",
                depth=info.depth if info else 0,
                call=call,
                recompute=recompute,
                live_bytes=live,
                delta_bytes=live - self._last_live,
                peak_bytes=peak,
                saved_bytes=saved_bytes,
                shapes=shapes,
                dtypes=dtypes,
            )
        )
        self._last_live = live

    def marker(self, phase: str) -> None:
        """Append a step marker (``step-start``, ``backward-end``, ``optimizer-step``, ``step-end``)."""
        self.emit(phase, None)

    def region_forward(self, pre_index: int, outputs_bytes: int) -> None:
        """The next event is the forward of a compiled region whose pre-forward was event ``pre_index``: its saved
        bytes are what its graph left alive for backward, its forward's growth less its outputs' storages."""
        self._region_forwards.append(_RegionForward(pre_index, len(self.events), outputs_bytes))

    def fill_from_allocator(self) -> None:
        """A compiled model: each event's bytes from the allocator's events up to its mark, read after the step."""
        if self.allocator is None:  # not a compiled model: the bytes were read as the events happened
            return
        marks = self.allocator.marks
        last = self.start_bytes
        for event in self.events:
            live, peak = marks.get(str(event.index), (last, max(last, event.peak_bytes)))
            event.live_bytes, event.peak_bytes, event.delta_bytes = live, peak, live - last
            last = live
        for region in self._region_forwards:
            before = self.events[region.pre_index].live_bytes
            forward = self.events[region.forward_index]
            forward.saved_bytes = max(0, forward.live_bytes - before - region.outputs_bytes)
