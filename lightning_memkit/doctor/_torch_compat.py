"""The private torch internals the memory doctor uses, wrapped in one place.

Pinned by tests/doctor/test_doctor_compat.py: if a torch release moves one, that test says which.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils import _python_dispatch as _dispatch

from lightning_memkit.accounting._torch_compat import exit_mode_in_place

__all__ = ["enter_mode_at_bottom", "exit_mode_anywhere", "mode_is_active", "caller_frame", "saved_values"]


def enter_mode_at_bottom(mode: Any) -> None:
    """Enter the TorchDispatchMode ``mode`` *below* every mode already active on this thread.

    The doctor's window spans several Lightning hooks, so another callback's mode (MemoryTracker's
    accountant) may be entered and exited inside it in any order; modes are a stack whose
    ``__exit__`` pops whatever is on top. Keeping ours at the bottom means the others' plain
    ``__exit__`` still pops their own. Uses ``_pop_mode``/``_push_mode`` and
    ``_get_current_dispatch_mode_stack`` of ``torch.utils._python_dispatch``.
    """
    above = []
    while _dispatch._get_current_dispatch_mode_stack():
        above.append(_dispatch._pop_mode())
    try:
        mode.__enter__()
    finally:
        for other in reversed(above):
            _dispatch._push_mode(other)


def exit_mode_anywhere(mode: Any) -> bool:
    """Exit ``mode`` wherever it is on this thread's dispatch-mode stack, leaving the modes above it
    in place and in order. Returns ``False`` (and does nothing) when ``mode`` is not on the stack.
    The stack surgery is the accountant's (:func:`lightning_memkit.accounting._torch_compat.exit_mode_in_place`)."""
    return exit_mode_in_place(mode, lambda: mode.__exit__(None, None, None))


def mode_is_active(mode: Any) -> bool:
    """Whether ``mode`` is on this thread's dispatch-mode stack."""
    return any(entry is mode for entry in _dispatch._get_current_dispatch_mode_stack())


def caller_frame(depth: int) -> Any:
    """The Python frame ``depth`` levels above the caller (``sys._getframe``), or ``None``."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


def saved_values(node: Any) -> list[tuple[str, Any]]:
    """``[(name, value), ...]``: what an autograd node saved for its backward, read from its ``_saved_*``
    attributes (tensors come back as new tensor objects on the saved storages; sizes and scalars as
    numbers). Values backward already freed raise when read and are left out."""
    found = []
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            found.append((name, getattr(node, name)))
        except RuntimeError:  # "Trying to backward through the graph a second time...": freed
            continue
    return found
