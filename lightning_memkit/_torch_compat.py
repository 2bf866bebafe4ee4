"""torch's private building blocks that memkit's packages share, named once here: its pytree (flattening a batch
or an op's arguments into tensors) and ``TorchDispatchMode`` (seeing every op), both under ``torch.utils._*`` with no
public home in the torch versions memkit supports, and ``DisableTorchFunctionSubclass``. A package's own private
needs live in its ``_torch_compat.py``; tests/compat/test_torch_compat.py pins these, and
tests/project/test_private_apis.py keeps every other module off torch's and Lightning's private names.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

__all__ = [
    "TorchDispatchMode",
    "disable_torch_function_subclass",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map",
    "tree_unflatten",
]


def disable_torch_function_subclass() -> AbstractContextManager[None]:
    """A context in which a tensor subclass's ``__torch_function__`` does not run (reading a subclass's attributes
    without recursing into it)."""
    return torch._C.DisableTorchFunctionSubclass()
