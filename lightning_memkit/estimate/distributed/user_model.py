"""The user's own set-up of a rank: a LightningModule's ``configure_model`` run on the rank's fake copy as the
strategy runs it (with ``self.device_mesh`` under ModelParallelStrategy, under the precision's init dtype), and the
meta-device round trip FSDP2 is sharded through (:func:`on_meta`, :func:`materialized`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_memkit._lightning_compat import give_device_mesh
from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.step.hook_errors import hook
from lightning_memkit.estimate.step.lightning_step import default_dtype
from lightning_memkit.estimate.step.trainer_stand_in import is_lightning_module

__all__ = ["has_configure_model", "run_configure_model", "on_meta", "materialized", "smallest_root", "convert_to_half"]


def has_configure_model(module: nn.Module) -> bool:
    """Whether Lightning calls ``module.configure_model`` in the fit's set-up (a LightningModule overriding it)."""
    if not is_lightning_module(module):
        return False
    from lightning.pytorch.utilities.model_helpers import is_overridden  # a LightningModule: Lightning is here

    return is_overridden("configure_model", module)


def run_configure_model(module_copy: nn.Module, half: torch.dtype | None, mesh: Any = None) -> None:
    """``module_copy.configure_model()`` as Lightning's fit calls it: with ``self.device_mesh`` set to ``mesh`` (what
    ModelParallelStrategy gives it; ``None`` elsewhere), modules it creates in ``half`` under a true half precision
    (the precision plugin's ``module_init_context``). Tensors it creates are the caller's (fake, or meta inside
    :func:`on_meta`)."""
    if mesh is not None:
        give_device_mesh(module_copy, mesh)
    init_dtype = default_dtype(half) if half is not None else contextlib.nullcontext()
    with init_dtype, hook(f"{type(module_copy).__name__}.configure_model"):
        module_copy.configure_model()  # type: ignore[operator]  # has_configure_model checked it is a method


@contextlib.contextmanager
def on_meta(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module``'s parameters are meta tensors of the same shapes (tied ones stay tied), no
    dispatch mode runs (no fake mode, no accountant) and new tensors are made on the meta device: sharding there
    costs nothing (``fully_shard`` cuts each parameter into world-size chunks, a fake tensor each on the fake
    world: 23 s for a 1B model on 64 ranks, against 5 s on 2). :func:`materialized` gives the result storage."""
    with _torch_compat.no_dispatch_modes():
        metas: dict[int, nn.Parameter] = {}
        for submodule in module.modules():
            for name, parameter in list(submodule._parameters.items()):
                if parameter is not None:
                    if id(parameter) not in metas:
                        meta = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
                        metas[id(parameter)] = nn.Parameter(meta, requires_grad=parameter.requires_grad)
                    submodule._parameters[name] = metas[id(parameter)]
        with torch.device("meta"):
            yield


def materialized(module: nn.Module) -> None:
    """``module``'s meta parameters and buffers made fake CPU tensors of the caller's mode (``to_empty``, as
    FSDP2's meta-device initialisation does): shards where FSDP2 sharded, what the accountant counts. Values are
    not needed, only shapes."""
    module.to_empty(device="cpu")


def smallest_root(module: nn.Module) -> nn.Module:
    """The innermost submodule that holds every parameter of ``module`` (``module`` itself when no child does):
    where ``fully_shard`` goes last when no ``configure_model`` says, as Lightning's documented pattern shards the
    inner model (``fully_shard(self.model)``), whose forward ``training_step`` calls."""
    every = {id(p) for p in module.parameters()}
    root = module
    while every:
        holders = [child for child in root.children() if every <= {id(p) for p in child.parameters()}]
        if len(holders) != 1:
            return root
        root = holders[0]
    return root


def convert_to_half(module: nn.Module, half: torch.dtype | None) -> None:
    """``module.to(half)`` where a floating-point parameter or buffer is not in ``half`` yet: a true half precision
    plugin's ``convert_module`` (``None``: nothing to do)."""
    if half is None:
        return
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.is_floating_point() and t.dtype != half for t in tensors):
        module.to(dtype=half)
