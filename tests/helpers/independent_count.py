"""An independent count of a training step's memory, sharing no code with memkit's estimate or accountant.

The tests compare :func:`~lightning_memkit.estimate.estimate_memory` with this count rather than with
``measure_training_step`` (which runs the estimate's own step code on real tensors, so a wrong step in that
code is wrong in both). Two parts, both plain torch and ``gc``:

* :func:`live_storages`: every distinct CPU tensor storage the garbage collector can reach (by the storage's
  C pointer), after a full collection.
* :class:`PeakCounter`: a dispatch mode that adds each storage an op returns that was not alive before
  (not an input's, not one it already counts) and subtracts it when torch frees it (a ``weakref`` on the
  storage); its peak is the highest count.

:func:`training_step_peak` runs Lightning's automatic-optimization order itself (``training_step``,
``zero_grad``, ``backward``, ``optimizer.step``) on a deep copy of the module and its first training batch.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["live_storages", "PeakCounter", "training_step_peak"]


def _key(tensor: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.device.type != "cpu":
        return None
    return storage._cdata, storage.nbytes()


def live_storages() -> dict[int, int]:
    """``{storage pointer: bytes}`` of every CPU tensor storage reachable by ``gc`` (after a collection)."""
    gc.collect()
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or type(obj).__name__ == "FakeTensor":
                continue
        except Exception:  # noqa: BLE001 - proxies that raise on isinstance
            continue
        key = _key(obj)
        if key is not None:
            found[key[0]] = key[1]
    return found


class PeakCounter(TorchDispatchMode):
    """Bytes of the CPU storages ops create while active, and their highest total (``peak``).

    ``known``: storages alive before (they are never counted, whatever view of them an op returns).
    """

    def __init__(self, known: dict[int, int]) -> None:
        super().__init__()
        self.known = set(known)
        self.counted: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, pointer: int, nbytes: int) -> None:
        if self.counted.pop(pointer, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            key = _key(tensor)
            if key is None or key[0] in self.known or key[0] in self.counted:
                continue
            pointer, nbytes = key
            self.counted[pointer] = nbytes
            weakref.finalize(tensor.untyped_storage(), self._freed, pointer, nbytes)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return out


def _first_batch(module: Any) -> Any:
    return next(iter(module.train_dataloader()))


def training_step_peak(module: Any, steps: int = 2, autocast_dtype: torch.dtype | None = None) -> int:
    """The highest bytes of live CPU storages over ``steps`` training steps of a deep copy of the
    LightningModule ``module`` (its first training batch, its ``configure_optimizers`` optimizer; under CPU
    autocast to ``autocast_dtype`` if given), counting the copy's parameters, buffers and batch and
    everything the steps make (gradients, optimizer state, activations), nothing else alive in the process."""
    before = live_storages()
    with torch.random.fork_rng():
        copied = copy.deepcopy(module)
        batch = _first_batch(copied)
        optimizer = copied.configure_optimizers()
        start = live_storages()
        # what the step starts from: the copy's parameters and buffers and the batch (not the copy's data set)
        state = [
            *copied.parameters(),
            *copied.buffers(),
            *(t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)),
        ]
        held = sum(dict(key for key in map(_key, state) if key is not None and key[0] not in before).values())
        counter = PeakCounter(start)
        autocast = (
            torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        )
        with counter:
            for step in range(steps):
                with autocast:
                    loss = copied.training_step(batch, step)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                del loss
    return held + counter.peak
