"""The torch internals the planner's time model reads, in one place (pinned by tests/plan/test_plan.py).

- ``torch.utils.flop_counter.flop_registry``: torch's FLOP formulas per aten op (what ``FlopCounterMode`` counts
  with), called on the fake step's fake tensors (shapes only).
- ``OpOverload._schema.returns[i].alias_info``: whether an op returns a view of an input (no bytes moved).
- ``torch.accelerator.empty_host_cache`` (``torch._C._host_emptyCache`` before it): the caching host allocator's
  free pinned blocks given back (an offload trial's pinned memory), only where a CUDA device is.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["op_flops", "is_view_op", "empty_host_cache", "host_cache_release"]

try:
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except ImportError:  # pragma: no cover - a torch without the flop counter: no FLOPs, bytes and op counts only
    _FLOP_REGISTRY = {}

_VIEW_CACHE: dict[Any, bool] = {}


def op_flops(func: Any, args: Any, kwargs: Any, result: Any) -> int:
    """FLOPs of one aten op call by torch's own formulas (0 for ops torch has no formula for: elementwise ops,
    whose cost is the bytes they move)."""
    formula = _FLOP_REGISTRY.get(getattr(func, "_overloadpacket", None))
    if formula is None:
        return 0
    return int(formula(*args, **(kwargs or {}), out_val=result))


def is_view_op(func: Any) -> bool:
    """Whether ``func`` returns a view of an input (``view``, ``t``, ``expand``...): no kernel moves bytes."""
    cached = _VIEW_CACHE.get(func)
    if cached is None:
        schema = getattr(func, "_schema", None)
        returns = getattr(schema, "returns", ()) or ()
        cached = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        _VIEW_CACHE[func] = cached
    return cached


def host_cache_release() -> Any:
    """The torch function that gives the caching host allocator's free pinned blocks back to the system:
    ``torch.accelerator.empty_host_cache`` (public in recent torch), else the private ``torch._C._host_emptyCache``;
    ``None`` in a torch with neither."""
    accelerator = getattr(torch, "accelerator", None)
    function = getattr(accelerator, "empty_host_cache", None)
    if function is None:
        function = getattr(torch._C, "_host_emptyCache", None)
    return function


def empty_host_cache() -> bool:
    """Give the caching host allocator's free pinned blocks back (what offload's ``save_on_cpu(pin_memory=True)``
    left cached: the allocator keeps the largest trial's blocks for the rest of the process otherwise). Only where a
    CUDA device is (without one, nothing was pinned, and torch's function refuses to run); ``False`` when nothing was
    called."""
    function = host_cache_release()
    if function is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    function()
    return True
