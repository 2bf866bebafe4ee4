"""FSDP2 (Lightning's ModelParallelStrategy) on one rank: torch's own ``fully_shard`` run on the rank's fake copy over a
fake process group of the world size, so the estimated step is the sharded step itself.

Real code throughout: the module's own ``configure_model`` shards it (``fully_shard`` on its blocks, then on the
inner model), given ``self.device_mesh`` as ModelParallelStrategy gives it; without one, ``wrap=`` stands in
(``fully_shard`` on each module of those classes, then on the innermost module holding every parameter). Then two
steps run through FSDP2's hooks: its shards (dim 0 padded to a multiple of the world size), its all-gathers into
unsharded parameters (freed with ``resize_(0)`` after use: ``reshard_after_forward`` either way), its
``MixedPrecisionPolicy`` casts, its reduce-scatters and the optimizer's step on the shards (DTensors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.distributed.fake_group import DATA_PARALLEL
from lightning_memkit.estimate.distributed.rank_step import RankSetup
from lightning_memkit.estimate.distributed.user_model import (
    convert_to_half,
    has_configure_model,
    materialized,
    on_meta,
    run_configure_model,
    smallest_root,
)
from lightning_memkit.estimate.step.step_accountant import StepAccountant

__all__ = ["Fsdp2Setup", "FSDP2_GATHERED"]

#: the buffer name of FSDP2's unsharded (gathered) parameters in a rank's breakdown
FSDP2_GATHERED = "fsdp2_gathered_parameters"


class Fsdp2Setup(RankSetup):
    """A rank under ModelParallelStrategy: the copy's ``configure_model`` (or ``wrap=``'s stand-in) shards it with
    ``fully_shard`` on the meta device, then the shards are materialised as fake tensors and, under a true half
    precision, converted as the precision plugin's ``convert_module`` does after ``configure_model``.

    Args:
        mesh: the fake world's 2-D device mesh (``self.device_mesh``; the stand-in shards over its
            ``"data_parallel"`` dimension).
        wrap: the stand-in's module classes (used only without a ``configure_model``).
        fully_shard_kwargs: the stand-in's ``fully_shard`` arguments other than ``mesh`` (``reshard_after_forward``,
            ``mp_policy``...).
        half: a true half precision's dtype, else ``None``.
    """

    gathered = FSDP2_GATHERED

    def __init__(self, mesh: Any, wrap: Any, fully_shard_kwargs: dict[str, Any], half: torch.dtype | None) -> None:
        super().__init__()
        self.mesh = mesh
        self.wrap_classes = wrap
        self.fully_shard_kwargs = fully_shard_kwargs
        self.half = half
        self.user_sharded = False

    def build(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """The user's ``configure_model`` (its ``fully_shard`` calls included), on the meta device."""
        if not has_configure_model(module_copy):
            return
        self.user_sharded = True
        with on_meta(module_copy):
            run_configure_model(module_copy, self.half, self.mesh)
        self._materialize(module_copy)

    def wrap(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """``wrap=``'s stand-in where the module has no ``configure_model``: ``fully_shard`` on each module of those
        classes, innermost first, then on the root."""
        if self.user_sharded:
            return
        fully_shard = _torch_compat.fully_shard()
        mesh = self.mesh[DATA_PARALLEL]
        root = smallest_root(module_copy)
        with on_meta(module_copy):
            if self.wrap_classes:
                classes = tuple(self.wrap_classes)
                units = [m for m in root.modules() if isinstance(m, classes) and m is not root]
                for unit in reversed(units):  # post-order: an inner unit is sharded before the unit holding it
                    fully_shard(unit, mesh=mesh, **self.fully_shard_kwargs)
            fully_shard(root, mesh=mesh, **self.fully_shard_kwargs)
        self._materialize(module_copy)

    def _materialize(self, module_copy: nn.Module) -> None:
        materialized(module_copy)
        convert_to_half(module_copy, self.half)  # the precision plugin's convert_module, after configure_model
