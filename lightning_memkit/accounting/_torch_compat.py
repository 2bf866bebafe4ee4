"""The private torch internals the accountant uses, wrapped in one place.

Pinned by tests/test_accountant.py (``test_torch_compat_*``): if a torch release moves one, that test says which.
"""

from __future__ import annotations

from typing import Any

from torch.utils import _python_dispatch as _dispatch

__all__ = ["dispatch_mode_stack", "exit_mode_in_place"]


def dispatch_mode_stack() -> list[Any]:
    """This thread's TorchDispatchMode stack, bottom first (``_get_current_dispatch_mode_stack``)."""
    return _dispatch._get_current_dispatch_mode_stack()


def exit_mode_in_place(mode: Any, exit_mode: Any) -> bool:
    """Exit ``mode`` where it is on this thread's dispatch-mode stack, leaving the modes above it active and in order.

    ``TorchDispatchMode.__exit__`` pops the *top* of the stack, whatever mode that is: a mode exited while
    another callback's mode sits above it (MemoryTracker pausing its accountant between two micro-batches
    while LayerTrace's is on top) would pop the other one instead. Here the modes above ``mode`` are popped
    (``_pop_mode``), ``exit_mode()`` (the class's own ``__exit__``) runs with ``mode`` on top, and the others
    are pushed back (``_push_mode``). Returns ``False``, doing nothing, when ``mode`` is not on the stack.
    """
    stack = _dispatch._get_current_dispatch_mode_stack()
    if not any(entry is mode for entry in stack):
        return False
    above = []
    try:
        while _dispatch._get_current_dispatch_mode_stack()[-1] is not mode:
            above.append(_dispatch._pop_mode())
        exit_mode()
    finally:
        for other in reversed(above):
            _dispatch._push_mode(other)
    return True
