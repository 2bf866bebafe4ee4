"""The private torch internals the tensor accounting uses, wrapped in one place.

Each function names the private API it reads and takes the path this torch offers; one that switches a
feature off says so once (a warning) rather than hiding it. Pinned by tests/compat/test_torch_compat.py and
tests/accounting/test_accountant.py (``test_torch_compat_*``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils import _python_dispatch as _dispatch

__all__ = [
    "dispatch_mode_stack",
    "exit_mode_in_place",
    "is_traceable_wrapper_subclass_type",
    "saved_tensor_attributes",
    "saved_value",
    "SAVED_FREED",
    "version_of",
]


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


# Whether a tensor type is a traceable wrapper subclass (``__tensor_flatten__``: DTensor, a float8 tensor...);
# torch 2.4 lacked it (the package's import guard keeps torch below the declared range out).
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type  # noqa: E402

#: What :func:`saved_value` returns for a saved value backward has already freed.
SAVED_FREED = None

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def saved_tensor_attributes(node: Any) -> tuple[str, ...]:
    """The names of the autograd node ``node``'s saved values: its private ``_raw_saved_*`` attributes
    (torch's generated bindings), each a ``torch._C._autograd.SavedTensor`` or a list of them."""
    return tuple(name for name in dir(node) if name.startswith("_raw_saved_"))


def saved_value(saved: Any) -> Any:
    """What the ``SavedTensor`` ``saved`` holds, without unpacking it: its ``data`` (a plainly saved tensor
    sharing its storage, or whatever a ``saved_tensors_hooks`` pack hook returned), or :data:`SAVED_FREED`
    once backward freed it.

    A torch whose ``SavedTensor`` has no ``data`` (2.8 has none) cannot show saved values: the whole-process
    reading then warns once that saved-for-backward tensors are not counted, and returns :data:`SAVED_FREED`.
    A value that cannot be read for another reason is skipped as freed.
    """
    if not hasattr(type(saved), "data"):
        _warn_once(
            "saved-data",
            f"this torch ({torch.__version__}) has no SavedTensor.data: memkit's whole-process reading "
            "cannot see tensors saved for backward, and counts without them; use a torch in "
            "lightning_memkit's declared range",
        )
        return SAVED_FREED
    try:
        return saved.data
    except Exception:  # noqa: BLE001 - this one value is unreadable (freed); the feature itself is on
        return SAVED_FREED


def version_of(tensor: Any) -> int | None:
    """``tensor``'s version counter (the private ``Tensor._version``): every in-place op on the tensor or on a
    view of it adds one, and an in-place op is the only way a live tensor gets a new ``grad_fn`` (autograd's
    "rebase history"). ``None`` where it cannot be read (an inference tensor keeps no version counter)."""
    try:
        return int(tensor._version)
    except Exception:  # noqa: BLE001 - inference tensors raise; None: "unknown, look again"
        return None
