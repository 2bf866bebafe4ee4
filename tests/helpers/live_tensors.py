"""What the whole process holds, counted with ``gc``: the tests' independent check that memkit leaves
nothing behind (it never asks memkit's own accountant, which sees only what it was shown).

Usage in a test::

    from tests.helpers.live_tensors import live_tensor_bytes, tensors_with_grad_fn
    before = live_tensor_bytes()
    ...                                   # run the feature
    assert tensors_with_grad_fn() == []   # no autograd graph survives
    assert live_tensor_bytes() - before == 0
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch


def live_tensors(device: str | None = None, collect: bool = True) -> list[torch.Tensor]:
    """Every tensor object the garbage collector can reach (parameters and buffers included),
    after a full collection; ``device`` (``"cpu"``, ``"cuda"``, ``"meta"``) keeps only that type.
    Fake and meta tensors hold no memory and are left out unless ``device="meta"`` asks for them.
    ``collect=False``: no collection first, so tensors kept only by reference cycles count too
    (what a process holds until the collector next runs)."""
    if collect:
        gc.collect()
    found: list[torch.Tensor] = []
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
        except Exception:  # noqa: BLE001 - some proxies raise on isinstance
            continue
        if type(obj).__name__ == "FakeTensor":
            continue
        kind = obj.device.type
        if device is None and kind == "meta":
            continue
        if device is not None and kind != device:
            continue
        found.append(obj)
    return found


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
            if storage.device.type == "meta":
                continue
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts; a wrapper
            continue  # subclass's (DTensor's) own storage, which holds no memory (its local tensor is counted)
        seen[(str(storage.device), pointer)] = storage.nbytes()
    return sum(seen.values())


def live_tensor_bytes(device: str | None = "cpu", collect: bool = True) -> int:
    """Bytes of every distinct storage the process's live tensors hold (``cpu`` by default);
    ``collect=False`` counts those only reference cycles keep as well."""
    return storage_bytes(live_tensors(device, collect))


def tensors_with_grad_fn() -> list[torch.Tensor]:
    """Live tensors still attached to an autograd graph: what a kept graph (a leak) looks like."""
    return [t for t in live_tensors() if t.grad_fn is not None]


def describe(tensors: Iterable[torch.Tensor], limit: int = 10) -> str:
    """A short list for an assertion message: shape, dtype, grad_fn, largest first."""
    rows = sorted(tensors, key=lambda t: -t.numel() * t.element_size())
    return "; ".join(
        f"{tuple(t.shape)} {t.dtype} {type(t.grad_fn).__name__ if t.grad_fn else ''}" for t in rows[:limit]
    )
