"""Fake tensors behind memkit's own small interface: a fake copy of a module, fake batches, placeholder scalars.

torch's FakeTensorMode is private (``torch._subclasses.fake_tensor``); every use of it in memkit goes
through this module, and tests/test_estimate_fake.py pins the behaviour memkit relies on.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["FakeSession", "is_fake", "ScalarPlaceholders"]


def _fake_tensor_module():
    try:
        from torch._subclasses import fake_tensor
    except ImportError as error:  # pragma: no cover - every supported torch has it
        raise RuntimeError(f"this torch ({torch.__version__}) has no fake tensors; memkit's estimate needs torch >= 2.1") from error
    return fake_tensor


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (shape, dtype and storage size, no data)."""
    return isinstance(tensor, _fake_tensor_module().FakeTensor)


class ScalarPlaceholders(TorchDispatchMode):
    """Answer ``tensor.item()`` on fake tensors with a placeholder (1, 1.0 or True).

    A fake tensor has no values, so ``.item()`` would raise; optimizers read their step counter
    with it, and user code sometimes branches on a loss value. Memory does not depend on the
    value in either case, so 1 is as good as any. Data-dependent *shapes* (``nonzero``,
    boolean masks) cannot be answered this way and raise a clear error from the estimate.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
            dtype = args[0].dtype
            if dtype is torch.bool:
                return True
            return 1.0 if (dtype.is_floating_point or dtype.is_complex) else 1
        return func(*args, **(kwargs or {}))


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
        fake_tensor = _fake_tensor_module()
        self.mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)

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
                fake = self.tensor(parameter.detach())
                memo[id(parameter)] = nn.Parameter(fake, requires_grad=parameter.requires_grad)
        for buffer in module.buffers():
            if id(buffer) not in memo:
                memo[id(buffer)] = self.tensor(buffer)
        return copy.deepcopy(module, memo)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the ``with`` body in the fake world (factory functions create fake tensors)."""
        with self.mode, ScalarPlaceholders():
            yield
