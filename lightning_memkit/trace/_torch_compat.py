"""The private torch autograd internals the layer tracer reads, wrapped in one place.

Pinned by tests/test_trace_compat.py: if a torch release moves one, that test says which.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["in_backward", "in_checkpoint_recomputation", "queue_backward_end_callback"]


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


def in_checkpoint_recomputation() -> bool:
    """Whether non-reentrant ``torch.utils.checkpoint`` is recomputing a region on this thread.

    Recomputation can run a module's ``forward`` without its ``__call__`` (and so without module
    hooks), e.g. when a callback installs an instance ``forward`` that checkpoints the class's
    ``forward``. Reads the innermost saved-tensor hooks
    (``torch._C._autograd._top_saved_tensors_default_hooks``): during recomputation they are
    ``torch.utils.checkpoint._recomputation_hook``'s.
    """
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except (AttributeError, RuntimeError, TypeError):
        return False
    if not hooks:
        return False
    return getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook.")
