"""An independent count of a real step's tensor memory, for tests: a dispatch mode written apart from memkit's
accountant (it shares no code with lightning_memkit) that sees every CPU storage an op creates and, through a
``weakref.finalize`` on the storage, when it is freed.

Usage in a test::

    from tests.helpers.dispatch_counter import StorageCounter
    counter = StorageCounter(existing=[*model.parameters(), *model.buffers(), *batch])
    with counter:
        ...                              # the real steps
    counter.peak_bytes                   # bytes of `existing` plus the highest live bytes of new storages
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage(tensor: Any):
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    return storage if storage.nbytes() else None


class StorageCounter(TorchDispatchMode):
    """Counts, in bytes, the storages alive before (``existing``: counted once by data pointer) and those every op
    creates while active (an output sharing an input's storage, a view or an in-place result, is not new, except
    ``lift_fresh``'s: ``torch.tensor(data)`` shows the dispatcher a tensor it made outside it);
    ``peak_bytes`` is the highest total seen."""

    def __init__(self, existing: Iterable[Any] = ()) -> None:
        super().__init__()
        self.known: dict[int, int] = {}  # data pointer -> bytes, of every storage counted and alive
        for tensor in tree_flatten(list(existing))[0]:
            storage = _storage(tensor)
            if storage is not None:
                self.known[storage.data_ptr()] = storage.nbytes()
        self.current = sum(self.known.values())
        self.peak_bytes = self.current

    def _free(self, pointer: int) -> None:
        self.current -= self.known.pop(pointer, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        inputs = set()
        if (
            func is not torch.ops.aten.lift_fresh.default
        ):  # torch.tensor(data): made outside the dispatcher, new all the same
            inputs = {
                storage.data_ptr() for storage in map(_storage, tree_flatten((args, kwargs))[0]) if storage is not None
            }
        for tensor in tree_flatten(out)[0]:
            storage = _storage(tensor)
            if storage is None or storage.data_ptr() in self.known or storage.data_ptr() in inputs:
                continue  # a view, an in-place result or a storage from before
            pointer = storage.data_ptr()
            self.known[pointer] = storage.nbytes()
            weakref.finalize(storage, self._free, pointer)
            self.current += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current)
        return out
