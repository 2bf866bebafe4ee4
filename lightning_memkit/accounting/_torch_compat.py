"""The private torch internals the tensor accounting uses, wrapped in one place.

Each function names the private API it reads and takes the path this torch offers; one that switches a
feature off says so once (a warning) rather than hiding it. Pinned by tests/test_torch_compat.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["is_traceable_wrapper_subclass_type", "saved_tensor_attributes", "saved_value", "SAVED_FREED"]

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
        _warn_once("saved-data", f"this torch ({torch.__version__}) has no SavedTensor.data: memkit's whole-process reading "
                                 "cannot see tensors saved for backward, and counts without them; use a torch in "
                                 "lightning_memkit's declared range")
        return SAVED_FREED
    try:
        return saved.data
    except Exception:  # noqa: BLE001 - this one value is unreadable (freed); the feature itself is on
        return SAVED_FREED
