"""An independent count of one rank's real tensor memory, for the multi-process checks: plain torch, no code shared
with lightning_memkit (its accountant and its estimate are what the count checks).

:class:`RankCounter` is a dispatch mode that counts every CPU storage an op creates (a DTensor's by its local tensor;
``torch.tensor(data)``'s, which the dispatcher sees as ``lift_fresh`` of a tensor made outside it), follows every
``UntypedStorage.resize_`` of a counted storage (FSDP frees and re-grows its gathered parameters that way, outside
the dispatcher), and subtracts a storage when torch frees it (``weakref.finalize`` on the storage, whose Python
object torch keeps for the storage's life). Storages that exist when it starts are counted only when
:meth:`RankCounter.hold` is given their tensors (the module's parameters and buffers).

Usage in a rank::

    counter = RankCounter()
    counter.hold([*module.parameters(), *module.buffers()])
    with counter:
        ...                       # the strategy's wrap, the optimizer
        counter.start_peak()      # the steps start here
        ...                       # two training steps
    counter.peak_bytes            # the highest live bytes since start_peak()
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["RankCounter"]

_COUNTERS: list[RankCounter] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize(storage: torch.UntypedStorage, size: Any) -> Any:
    result = _ORIGINAL_RESIZE(storage, size)
    for counter in _COUNTERS:
        counter.resized(storage)
    return result


def _storage(tensor: Any) -> torch.UntypedStorage | None:
    if not isinstance(tensor, torch.Tensor):
        return None
    local = getattr(tensor, "_local_tensor", None)  # a DTensor holds its memory in its local tensor
    if local is not None:
        tensor = local
    if tensor.layout is not torch.strided or tensor.device.type != "cpu":
        return None
    return tensor.untyped_storage()


class RankCounter(TorchDispatchMode):
    """Live bytes of the CPU storages it counts (``current_bytes``), and the highest since :meth:`start_peak`
    (``peak_bytes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage's StorageImpl address -> bytes now
        self.current_bytes = 0
        self.peak_bytes = 0

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.current_bytes += storage.nbytes()
        weakref.finalize(storage, self._freed, key)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _freed(self, key: int) -> None:
        self.current_bytes -= self.sizes.pop(key, 0)

    def hold(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (existing before the counter: the module's parameters, buffers)."""
        for tensor in tree_flatten(list(tensors))[0]:
            storage = _storage(tensor)
            if storage is not None:
                self._count(storage)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A counted storage was resized in place: it holds ``storage.nbytes()`` now."""
        key = storage._cdata
        if key in self.sizes:
            self.current_bytes += storage.nbytes() - self.sizes[key]
            self.sizes[key] = storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def start_peak(self) -> None:
        """The peak starts again from the bytes live now."""
        self.peak_bytes = self.current_bytes

    def __enter__(self) -> RankCounter:
        _COUNTERS.append(self)
        torch.UntypedStorage.resize_ = _resize
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _COUNTERS.remove(self)
        if not _COUNTERS:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        inputs = set()
        if func is not torch.ops.aten.lift_fresh.default:  # torch.tensor(data) is made outside the dispatcher: new
            inputs = {s._cdata for s in map(_storage, tree_flatten((args, kwargs))[0]) if s is not None}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            storage = _storage(tensor)
            if storage is None:
                continue
            if storage._cdata in self.sizes:
                self.resized(storage)  # an op resized it in place (an out= argument, resize_)
            elif storage._cdata not in inputs and storage.nbytes():  # a view of an uncounted tensor is not new
                self._count(storage)
        return out
