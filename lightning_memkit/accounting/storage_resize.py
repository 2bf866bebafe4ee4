"""Storage resizes made outside the dispatcher (``UntypedStorage.resize_``), reported to whoever counts storages.

It owns memkit's one wrap of a torch method: ``torch.UntypedStorage.resize_`` changes a storage's size
without any aten op, so a TorchDispatchMode never sees it. FSDP2 frees its all-gather buffers that way
(``resize_(0)`` after forward and backward) and grows them back (``resize_(full)``) before each
all-gather's copy-out (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``: ``free_storage`` and
``alloc_storage``); any user code may do the same. A watcher registered here is told about every such
resize, when it happens, so a peak taken at the moment a storage grows back is exact.

The wrap is installed the first time a watcher registers and stays (the wrapper calls torch's own
method first and returns its result; a watcher's failure never reaches the caller). Watchers are held
weakly: a dropped accountant stops being told. ``tests/accounting/test_accountant.py`` pins that torch's method
is the one FSDP2 calls and that the wrap sees it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Protocol

import torch

__all__ = ["ResizeWatcher", "watch_storage_resizes", "watching_storage_resizes"]


class ResizeWatcher(Protocol):
    """What a watcher implements: called after ``storage`` was resized in place (its new size is
    ``storage.nbytes()``). Runs on the caller's thread, on the resize's path: keep it cheap."""

    def storage_resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was just resized in place; its size is now ``storage.nbytes()`` bytes."""


_WATCHERS: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.Lock()
_ORIGINAL: Any = None


def _wrapped_resize(storage: torch.UntypedStorage, size: Any) -> Any:
    result = _ORIGINAL(storage, size)
    for watcher in list(_WATCHERS):
        with contextlib.suppress(Exception):  # a measurement must never break the program
            watcher.storage_resized(storage)
    return result


_wrapped_resize.__doc__ = (
    "torch.UntypedStorage.resize_, with memkit's resize watchers told after it "
    "(see lightning_memkit.accounting.storage_resize)."
)


def watch_storage_resizes(watcher: ResizeWatcher) -> None:
    """Tell ``watcher.storage_resized(storage)`` about every ``UntypedStorage.resize_`` from now on,
    for as long as ``watcher`` lives (it is held weakly). Installs the wrap on first use."""
    global _ORIGINAL
    with _LOCK:
        if _ORIGINAL is None:
            _ORIGINAL = torch.UntypedStorage.resize_
            # the wrap is the point (the module docstring says why); mypy does not allow assigning to a method
            torch.UntypedStorage.resize_ = _wrapped_resize  # type: ignore[method-assign, assignment]
        _WATCHERS.add(watcher)


def watching_storage_resizes() -> bool:
    """Whether memkit's wrap is the ``UntypedStorage.resize_`` torch calls now (pinned by a test)."""
    return torch.UntypedStorage.resize_ is _wrapped_resize
