"""One fake-tensor world (:class:`FakeSession`): tensors and modules converted into it, and code run inside it with
placeholder scalars and kept loss buffers, or with the fake mode alone for a caller doing that work itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_memkit._lightning_compat import copy_module
from lightning_memkit._torch_compat import tree_map
from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.fake.outputs import LossBuffers, ScalarPlaceholders, losses_keeping_their_buffer
from lightning_memkit.estimate.fake.tensors import fake_parameter, is_fake

__all__ = ["FakeSession"]


class FakeSession:
    """One fake-tensor world: convert tensors and modules into it, and run code inside it.

    Usage::

        session = FakeSession()
        fake_model = session.module_copy(model)        # parameters are fake; model is untouched
        fake_batch = session.tree(batch)
        with session.active():
            loss = fake_model(fake_batch).sum(); loss.backward()

    Real tensors that meet fake ones inside :meth:`active` (a constant held as a plain attribute,
    a metric's state) are converted on the fly rather than rejected.
    """

    def __init__(self) -> None:
        self.mode = _torch_compat.fake_tensor_module().FakeTensorMode(allow_non_fake_inputs=True)
        losses_keeping_their_buffer()  # ask the real kernels once, outside the fake world

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake tensor with ``tensor``'s shape, strides, dtype and device (a fake stays as it is)."""
        if is_fake(tensor):
            return tensor
        return self.mode.from_tensor(tensor, static_shapes=True)

    def tree(self, tree: Any) -> Any:
        """``tree`` (nested lists, tuples, dicts) with every tensor leaf made fake."""
        return tree_map(lambda leaf: self.tensor(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new fake tensor of ``shape`` (no memory is used)."""
        with self.mode:
            return torch.empty(shape, dtype=dtype, device=device)

    def module_copy(self, module: nn.Module, detach_from: tuple[Any, ...] = ()) -> nn.Module:
        """A deep copy of ``module`` whose parameters and buffers are fake; ``module`` is not touched.

        Parameters keep ``requires_grad``; other attributes are deep-copied as usual (real small
        tensors stay real). Objects in ``detach_from`` (a Trainer, say) become ``None`` in the copy
        rather than being copied.
        """
        memo: dict[int, Any] = {id(obj): None for obj in detach_from if obj is not None}
        for parameter in module.parameters():
            if id(parameter) not in memo:
                fake = self.tensor(parameter.detach())  # a new fake (or the new alias of a fake parameter)
                memo[id(parameter)] = fake_parameter(fake, requires_grad=parameter.requires_grad)
        for buffer in module.buffers():
            if id(buffer) not in memo:
                memo[id(buffer)] = self.tensor(buffer)
        return copy_module(module, memo, compiled=False)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the ``with`` body in the fake world (factory functions create fake tensors)."""
        with self.mode, ScalarPlaceholders(), LossBuffers():
            yield

    @contextlib.contextmanager
    def fake_mode_only(self) -> Iterator[None]:
        """The fake world without :class:`ScalarPlaceholders` and :class:`LossBuffers`: for a caller whose
        own dispatch mode, entered inside this block, does their work through :class:`FakeStepOps`."""
        with self.mode:
            yield
