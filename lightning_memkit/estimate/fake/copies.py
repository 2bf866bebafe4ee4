"""The fake copy a fake step runs on: the module and batch as CPU fakes (no weight read, nothing allocated where the
module lives), in a true half precision's dtype where the mode converts them, and what estimates of one module share
inside a ``reusing_fake_copies()`` block (:class:`ReuseCache`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_memkit._lightning_compat import copy_module
from lightning_memkit.estimate.fake.session import FakeSession
from lightning_memkit.estimate.fake.tensors import REAL_VALUES_NUMEL, fake_parameter, is_fake, keeps_real_values

__all__ = ["ReuseCache", "fake_module", "cpu_fake", "rebatched", "dismantle"]


class ReuseCache:
    """What estimates of the same module inside one
    :func:`~lightning_memkit.estimate.step.settings.reusing_fake_copies` block share: the fake copy of each module
    (made once per parameter dtype, its gradients reset between estimates), each sampled batch, and each estimate
    (the same question asked twice, a table then a prediction, gets the same answer)."""

    def __init__(self) -> None:
        #: (id(module), the true half dtype or None) -> (module, its session, its fake copy)
        self.copies: dict[tuple[int, torch.dtype | None], tuple[nn.Module, FakeSession, nn.Module]] = {}
        #: (id(module), id(datamodule)) -> (its worst batch, the loader's length in batches)
        self.batches: dict[tuple[int, int], tuple[Any, int | None]] = {}
        #: the question (the runner's memo key) -> its estimate
        self.estimates: dict[Any, Any] = {}

    def close(self) -> None:
        """Dismantle every fake copy (the block ends)."""
        for _, _, module_copy in self.copies.values():
            dismantle(module_copy)
        self.copies.clear()


def dismantle(module_copy: nn.Module | None) -> None:
    """Empty every submodule of a copy the estimate made and is done with.

    A copy sits in reference cycles that are not memkit's to change (a torchmetrics ``Metric``'s wrapped
    ``update`` holds the metric; the step's trainer stub holds the copy), so dropping it freed its tensors
    (a metric's real state tensors, the fakes) only at the next full ``gc.collect()``. With every module's
    attributes gone, the cycles hold nothing and the tensors go at once.
    """
    if module_copy is None:
        return
    for each in list(module_copy.modules()):
        each.__dict__.clear()


def rebatched(session: FakeSession, tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``tensor`` grown or cut to ``size`` rows for the fake step: rows repeated for real when the result keeps real
    values (:func:`keeps_real_values`: token ids, masks, labels), else an empty fake of the new shape."""
    shape = (size, *tensor.shape[1:])
    if keeps_real_values(tensor) and math.prod(shape) <= REAL_VALUES_NUMEL:
        return tensor.index_select(0, torch.arange(size) % tensor.shape[0])
    return session.empty(shape, tensor.dtype, "cpu")


def cpu_fake(session: FakeSession, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake CPU tensor with ``tensor``'s shape, strides and dtype, wherever ``tensor`` lives (CPU, CUDA,
    meta): the fake step runs on CPU fakes only, so parameters and batch always share one device and a
    CPU-only torch never makes a fake CUDA tensor. With ``dtype`` (a true half precision's), a floating-point
    ``tensor``'s fake has that dtype instead, as ``module.to(dtype)`` leaves it."""
    if dtype is None or not tensor.is_floating_point():
        dtype = tensor.dtype
    if is_fake(tensor) and tensor.device.type == "cpu" and tensor.dtype == dtype:
        return tensor
    if tensor.device.type == "cpu" and not is_fake(tensor) and tensor.dtype == dtype:
        return session.tensor(tensor)
    with session.mode:
        fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=dtype, device="cpu")
    if tensor.requires_grad and (fake.is_floating_point() or fake.is_complex()):
        fake.requires_grad_(True)
    return fake


def _fake_copy(
    session: FakeSession, module: nn.Module, detach: tuple[Any, ...], dtype: torch.dtype | None = None
) -> nn.Module:
    """A deep copy of ``module`` whose parameters, buffers and plain tensor attributes are CPU fakes
    (no weight is read or copied, nothing is allocated where the module lives); ``detach`` objects
    (its Trainer) become ``None``. With ``dtype``, the floating-point parameters and buffers are fakes of that
    dtype, as Lightning's ``HalfPrecision.convert_module`` (``module.to(dtype)``) leaves them; plain tensor
    attributes keep theirs, as ``module.to`` does."""
    memo: dict[int, Any] = {id(obj): None for obj in detach if obj is not None}
    for parameter in module.parameters():
        if id(parameter) not in memo:
            # a new fake (or, for a parameter already fake, its new detached alias): flagged, not detached again
            memo[id(parameter)] = fake_parameter(
                cpu_fake(session, parameter.detach(), dtype), requires_grad=parameter.requires_grad
            )
    for buffer in module.buffers():
        if id(buffer) not in memo:
            memo[id(buffer)] = cpu_fake(session, buffer, dtype)
    for each in module.modules():  # a mask or a dataset held as a plain attribute: fake, not copied for real
        for value in vars(each).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = cpu_fake(session, value)
    return copy_module(module, memo, compiled=False)


def fake_module(
    module: nn.Module, trainer: Any, cache: ReuseCache | None, dtype: torch.dtype | None = None
) -> tuple[FakeSession, nn.Module]:
    """The fake session and fake copy of ``module`` (its ``trainer`` left out of the copy; its floating-point
    parameters and buffers in ``dtype`` when given, a true half precision's): the block's copy when ``cache`` holds
    one (its last gradients dropped), else a new one, kept in ``cache`` if given."""
    key = (id(module), dtype)
    if cache is not None and key in cache.copies:
        original, session, module_copy = cache.copies[key]
        if original is module:
            for parameter in module_copy.parameters():  # last estimate's gradients
                parameter.grad = None
            return session, module_copy
    session = FakeSession()
    module_copy = _fake_copy(session, module, (trainer,), dtype)
    if cache is not None:
        cache.copies[key] = (module, session, module_copy)
    return session, module_copy
