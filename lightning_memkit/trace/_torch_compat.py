"""The private torch autograd internals the layer tracer reads, wrapped in one place.

Pinned by tests/test_trace_compat.py: if a torch release moves one, that test says which.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["in_backward", "queue_backward_end_callback"]


def in_backward() -> bool:
    """Whether the calling thread is executing an autograd graph task (a ``backward()`` call).

    Reads ``torch._C._current_graph_task_id()`` (``-1`` outside backward), as
    ``torch.utils.module_tracker.ModuleTracker.is_bw`` does.
    """
    return torch._C._current_graph_task_id() != -1


def queue_backward_end_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now executing has finished.

    Must be called from inside backward (a gradient hook). Uses the autograd engine's
    ``queue_callback``, as FSDP and ``torch.utils.module_tracker`` do.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)
