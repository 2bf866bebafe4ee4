"""FSDP2 (Lightning's ModelParallelStrategy) on fake tensors: torch's own ``fully_shard`` run on the step's fake copy
over a fake process group of the world size, so the estimated step is the sharded step itself.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.distributed.sharding import Sharding
from lightning_memkit.estimate.step.settings import preparing_copies

__all__ = ["fsdp2_estimate"]


@contextlib.contextmanager
def _fake_process_group(world_size: int) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0; collectives move no
    data) and a 1-D CPU device mesh over it, for the length of the block.

    torch's ``FakeProcessGroup`` backend is registered by the private ``torch.testing._internal.distributed.fake_pg``
    (what TorchTitan's memory estimation uses), through estimate/_torch_compat.py; tests/compat/test_torch_compat.py
    pins it.
    """
    import torch.distributed as dist  # a torch built without it answers below

    if not dist.is_available():
        raise ValueError("this torch has no torch.distributed: FSDP2's estimate runs FSDP2 itself and needs it")
    if dist.is_initialized():
        raise ValueError(
            "a process group is already initialized in this process: estimate FSDP2 "
            "(strategy='model_parallel') before init_process_group, or in a separate process (its fake "
            "process group is the default group)"
        )
    from torch.distributed.device_mesh import init_device_mesh  # only where torch.distributed is available

    _torch_compat.register_fake_process_group()

    excepthook = sys.excepthook  # init_process_group prefixes every later traceback with "[rank0]:" and never undoes it
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))  # outside fake mode: the mesh reads its ranks' values
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


@contextlib.contextmanager
def _sharded_step_copy(shard: Callable[[nn.Module], None]) -> Iterator[None]:
    """Inside the block, :func:`~lightning_memkit.estimate.estimate_memory` shards its fake copy of the module
    with ``shard`` before the steps (and before the optimizer is made, as Lightning's ``configure_model`` runs
    before ``configure_optimizers``), and starts the peak after the sharding (set-up is not the step).

    Through :func:`~lightning_memkit.estimate.step.settings.preparing_copies` (a context variable: concurrent
    estimates don't see it), which turns the reuse of fake copies off for the block (a sharded copy must not
    serve an unsharded estimate).
    """

    def prepare(module_copy: nn.Module, acc: Any) -> None:
        with acc.labelled("setup"):
            shard(module_copy)
        acc.attributor.assign_module(module_copy)  # the shards are the parameters now
        acc.reset_peak()

    with preparing_copies(prepare):
        yield


def _fully_shard_units(module: nn.Module, wrap: Any, mesh: Any, fully_shard_kwargs: dict[str, Any]) -> None:
    """``fully_shard`` each module whose class is in ``wrap``, innermost first, then the root: what a
    ``configure_model`` under Lightning's ModelParallelStrategy does.

    Sharded on the meta device, then materialised with ``to_empty`` in the caller's (fake) modes, as FSDP2's
    meta-device initialisation does: ``fully_shard`` cuts every parameter into world-size chunks, which on
    fake tensors costs a fake tensor per chunk (23 s for a 1B model on 64 ranks, against 5 s on 2); on meta it
    is cheap. The parameters' values are not needed, only their shapes; tied parameters stay tied.
    """
    fully_shard = _torch_compat.fully_shard()

    with _torch_compat.no_dispatch_modes():  # no fake mode, no accountant: meta tensors only
        metas: dict[int, nn.Parameter] = {}
        for submodule in module.modules():
            for name, parameter in list(submodule._parameters.items()):
                if parameter is not None:
                    if id(parameter) not in metas:
                        meta = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
                        metas[id(parameter)] = nn.Parameter(meta, requires_grad=parameter.requires_grad)
                    submodule._parameters[name] = metas[id(parameter)]
        if wrap:
            classes = tuple(wrap)
            units = [m for m in module.modules() if isinstance(m, classes) and m is not module]
            for unit in reversed(units):  # post-order: an inner unit is sharded before the unit holding it
                fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
        fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    module.to_empty(device="cpu")  # the shards, as fake CPU tensors the accountant counts (FSDP2 re-reads them)


def fsdp2_estimate(
    module: nn.Module,
    batch_size: int | None,
    sharding: Sharding,
    wrap: Any,
    fully_shard_kwargs: dict[str, Any],
    estimate_kwargs: dict[str, Any],
) -> tuple[Any, dict[str, int], dict[str, int]]:
    """FSDP2 run on fake tensors: the fake copy is sharded by torch's own ``fully_shard`` over a fake process
    group of the world size, and two steps run as Lightning does. Rank 0's view (FSDP2 pads every rank's shard
    to the same size, so every rank plays this role). Returns the estimate, its categories and the buffers."""
    with (
        _fake_process_group(sharding.shard_size) as mesh,
        _sharded_step_copy(lambda copy_: _fully_shard_units(copy_, wrap, mesh, fully_shard_kwargs)),
    ):
        single = estimate_memory(module, batch_size, **estimate_kwargs)
    # FSDP2 frees each unit's gathered (unsharded) parameters with resize_(0) after use; their records read 0
    # bytes by the time the categories are taken, so what the peak holds beyond the categories is exactly them.
    # Its flat all-gather / reduce-scatter buffers are ordinary allocations, counted under temporaries.
    categories = dict(single.by_category)
    gathered = single.peak_bytes - sum(categories.values())
    buffers = {"fsdp2_gathered_parameters": gathered}
    categories["strategy_buffers"] = gathered
    return single, categories, buffers
