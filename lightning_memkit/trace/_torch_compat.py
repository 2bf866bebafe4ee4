"""The private torch autograd internals the layer tracer reads, wrapped in one place.

Pinned by tests/trace/test_trace_callback.py: if a torch release moves one, that test says which.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "in_backward",
    "in_checkpoint_recomputation",
    "queue_backward_end_callback",
    "WRAPPER_ATTRIBUTES",
    "user_name",
    "user_class",
    "wrapped_module",
    "is_checkpoint_wrapper",
]

#: The attribute under which torch's module wrappers keep the user's module, so a qualified name gets
#: one more segment per wrapper: FSDP1's ``FullyShardedDataParallel`` (``FSDP_WRAPPED_MODULE``, also what
#: Lightning's FSDPStrategy wraps with), torch's ``checkpoint_wrapper`` (``_CHECKPOINT_WRAPPED_MODULE``,
#: what ``FSDPStrategy(activation_checkpointing_policy=...)`` applies) and ``torch.compile``'s
#: ``OptimizedModule`` (``_orig_mod``). The first two are pinned against torch's own constants by
#: tests/callbacks/test_callbacks_fsdp.py (torch names no constant for the third).
FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
COMPILED_MODULE = "_orig_mod"
WRAPPER_ATTRIBUTES = (FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE, COMPILED_MODULE)


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


def user_name(qualified_name: str) -> str:
    """``qualified_name`` without the segments torch's wrappers add (see :data:`WRAPPER_ATTRIBUTES`):
    ``blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.fc1`` -> ``blocks.0.fc1``, the name in
    the user's own model."""
    if not qualified_name:
        return qualified_name
    return ".".join(part for part in qualified_name.split(".") if part not in WRAPPER_ATTRIBUTES)


def wrapped_module(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside any stack of torch's wrappers around ``module`` (itself if unwrapped)."""
    seen = 0
    while seen < 16:  # a wrapper of a wrapper of ...; never loop forever on a strange module
        inner = next((module._modules[a] for a in WRAPPER_ATTRIBUTES if module._modules.get(a) is not None), None)
        if inner is None:
            return module
        module, seen = inner, seen + 1
    return module


def user_class(module: torch.nn.Module) -> type:
    """The class the user wrote for ``module``: through torch's wrappers, and without FSDP2's dynamic
    subclass (``fully_shard`` turns a ``Block`` into an ``FSDPBlock(FSDPModule, Block)`` in place)."""
    cls = type(wrapped_module(module))
    try:
        from torch.distributed.fsdp import FSDPModule  # deferred: a torch built without distributed has none
    except ImportError:  # pragma: no cover - torch without distributed
        return cls
    if issubclass(cls, FSDPModule):
        for base in cls.__mro__[1:]:
            if base is not FSDPModule and not issubclass(base, FSDPModule) and issubclass(base, torch.nn.Module):
                return base
    return cls


def is_checkpoint_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torch's activation-checkpoint wrapper (``checkpoint_wrapper``; what
    ``FSDPStrategy(activation_checkpointing_policy=...)`` and ``apply_activation_checkpointing`` install)."""
    return module._modules.get(CHECKPOINT_WRAPPED_MODULE) is not None
