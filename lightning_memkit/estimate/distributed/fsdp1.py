"""FSDP (FSDP1, Lightning's FSDPStrategy) on one rank: torch's own ``FullyShardedDataParallel`` wrapped around the
rank's fake copy over a fake process group of the world size, so the estimated step is the sharded step itself.

Real code throughout, set up as Lightning's FSDPStrategy sets it up: the module's ``configure_model`` (it builds
the model), the precision plugin's ``convert_module`` (a true half precision converts the module), then
``FullyShardedDataParallel(module, auto_wrap_policy=ModuleWrapPolicy(wrap), mixed_precision=...,
sharding_strategy=..., use_orig_params=True)`` with the ``MixedPrecision`` Lightning derives from the precision
(``bf16-mixed``: parameters gathered and gradients reduced in bf16, so autocast makes no weight copies; ``32-true``:
fp32) or the user's own, and ``training_step`` run through the wrapper's forward (Lightning's forward redirection),
so the root's hooks gather its parameters. Its flat parameters, gathers into the padded unsharded flat parameter
(freed with ``resize_(0)`` after use), reduce-scatters and the optimizer's step on the shard views are FSDP's.
FSDP1 runs on the fake world's CPU device (``device_id=cpu``): its CUDA streams are not modelled (one stream).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate.distributed.rank_step import RankSetup, route_through
from lightning_memkit.estimate.distributed.user_model import convert_to_half, has_configure_model, run_configure_model
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from lightning_memkit.estimate.step.trainer_stand_in import is_lightning_module

__all__ = ["Fsdp1Setup", "FSDP_GATHERED", "FSDP_SHARDING"]

#: the buffer name of FSDP1's gathered parameters (the padded unsharded flat parameters and their low-precision
#: shards, allocated and freed in place) in a rank's breakdown
FSDP_GATHERED = "fsdp_gathered_parameters"

#: memkit's FSDP strategy names -> torch's ShardingStrategy member
FSDP_SHARDING = {
    "fsdp": "FULL_SHARD",
    "fsdp_full_shard": "FULL_SHARD",
    "fsdp_shard_grad_op": "SHARD_GRAD_OP",
    "fsdp_no_shard": "NO_SHARD",
    "fsdp_hybrid_shard": "HYBRID_SHARD",
}


class Fsdp1Setup(RankSetup):
    """A rank under Lightning's FSDPStrategy (see the module's docstring).

    Args:
        strategy: memkit's FSDP strategy name (a key of :data:`FSDP_SHARDING`).
        wrap: the auto-wrap policy's module classes (``auto_wrap_policy={Block}``); ``None``: one unit, the root.
        mixed_precision: the ``MixedPrecision`` FSDP is given (Lightning's for the precision, or the user's own).
        half: a true half precision's dtype, else ``None``.
        fsdp_kwargs: more ``FullyShardedDataParallel`` arguments (the strategy's ``**kwargs``: ``limit_all_gathers``,
            ``backward_prefetch``, ``forward_prefetch``...).
        hybrid_mesh: HYBRID_SHARD's 2-D device mesh (replicas, shard group), else ``None``.
    """

    gathered = FSDP_GATHERED

    def __init__(
        self,
        strategy: str,
        wrap: Any,
        mixed_precision: Any,
        half: torch.dtype | None,
        fsdp_kwargs: dict[str, Any],
        hybrid_mesh: Any = None,
    ) -> None:
        super().__init__()
        self.strategy = strategy
        self.wrap_classes = wrap
        self.mixed_precision = mixed_precision
        self.half = half
        self.fsdp_kwargs = dict(fsdp_kwargs)
        self.hybrid_mesh = hybrid_mesh
        if self.fsdp_kwargs.get("cpu_offload") is not None:
            raise ValueError(
                "FSDP's cpu_offload is not modelled per rank (the fake step runs on one device): estimate without it, "
                "or with strategy='deepspeed_stage_3' and offload_optimizer=True for an optimizer on the host"
            )

    def build(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """The user's ``configure_model`` (it builds the model), then the precision plugin's ``convert_module``."""
        if has_configure_model(module_copy):
            run_configure_model(module_copy, self.half)
        convert_to_half(module_copy, self.half)

    def wrap(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """``FullyShardedDataParallel`` around the copy, as FSDPStrategy's ``_setup_model`` wraps the
        LightningModule, and ``training_step`` (a plain module: ``forward``) run through the wrapper."""
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kwargs = {"use_orig_params": True, **self.fsdp_kwargs}
        if self.wrap_classes and "auto_wrap_policy" not in kwargs:
            kwargs["auto_wrap_policy"] = ModuleWrapPolicy(set(self.wrap_classes))
        if self.hybrid_mesh is not None:
            kwargs.setdefault("device_mesh", self.hybrid_mesh)
        # FSDP compares storages by their data pointer, which a fake tensor has not (0 on every one: the comparison
        # answers "the same storage", which is what a step that swaps no parameter has); for the estimate's length
        # (the runner's warnings block), the warning about it is not the user's
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")  # one rank: as FSDP does
        wrapper = FullyShardedDataParallel(
            module_copy,
            mixed_precision=self.mixed_precision,
            sharding_strategy=getattr(ShardingStrategy, FSDP_SHARDING[self.strategy]),
            device_id=torch.device("cpu"),
            **kwargs,
        )
        route_through(wrapper, module_copy, "training_step" if is_lightning_module(module_copy) else "forward")
