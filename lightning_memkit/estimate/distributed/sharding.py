"""What a multi-device strategy shards (:func:`sharding_of`: DDP, FSDP, FSDP2, DeepSpeed ZeRO 1/2/3) and the per-rank
bytes of the model states it leaves on each rank (:func:`model_state_bytes`: the ZeRO paper's arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate.fake.session import FakeSession

__all__ = [
    "STRATEGIES",
    "Sharding",
    "sharding_of",
    "ModelStates",
    "optimizer_state_bytes_per_parameter",
    "model_state_bytes",
]

# What each strategy shards: (parameters, gradients, optimizer state) sharded over the data-parallel group?
# and whose precision layout it uses ("torch": autocast over fp32 parameters, as Lightning's DDP/FSDP
# mixed precision runs; "deepspeed": half-precision weights and gradients, fp32 master weights in the optimizer).
_SHARDED = {
    "ddp": (False, False, False, "torch"),
    "fsdp_no_shard": (False, False, False, "torch"),
    "deepspeed_stage_1": (False, False, True, "deepspeed"),
    "deepspeed_stage_2": (False, True, True, "deepspeed"),
    "fsdp_shard_grad_op": (False, True, True, "torch"),
    "deepspeed_stage_3": (True, True, True, "deepspeed"),
    "fsdp": (True, True, True, "torch"),  # Lightning's default sharding_strategy is FULL_SHARD
    "fsdp_full_shard": (True, True, True, "torch"),
    "fsdp_hybrid_shard": (True, True, True, "torch"),
    # ModelParallelStrategy: FSDP2 fully_shard over the data-parallel mesh
    "model_parallel": (True, True, True, "torch"),
}
_ALIASES = {
    "ddp_spawn": "ddp",
    "ddp_fork": "ddp",
    "ddp_notebook": "ddp",
    "deepspeed": "deepspeed_stage_2",
    "fsdp_full": "fsdp_full_shard",
    "fsdp2": "model_parallel",
    "fully_shard": "model_parallel",
}
STRATEGIES: tuple[str, ...] = tuple(_SHARDED)
"""The strategy names :func:`estimate_distributed_memory` understands (Lightning's registry names, FSDP's
``sharding_strategy`` as ``fsdp_<name>``; aliases: ``ddp_spawn``, ``deepspeed`` = stage 2, ``fsdp2``)."""


@dataclass(frozen=True)
class Sharding:
    """How one strategy lays out the model states on a rank.

    Attributes:
        strategy: the canonical strategy name (one of :data:`STRATEGIES`).
        parameters, gradients, optimizer_state: whether each is sharded over the ``shard_size`` ranks.
        layout: ``"torch"`` (fp32 parameters and gradients; autocast makes half-precision copies in the
            step) or ``"deepspeed"`` (under a half precision: half-precision parameters and gradients,
            the fp32 master weights counted in the optimizer state, as the ZeRO paper does).
        shard_size: ranks one copy of the states is sharded over (the world size; HYBRID_SHARD: the ranks of a node).
    """

    strategy: str
    parameters: bool
    gradients: bool
    optimizer_state: bool
    layout: str
    shard_size: int


def sharding_of(strategy: Any, world_size: int, shard_size: int | None = None) -> Sharding:
    """The :class:`Sharding` of ``strategy`` (a name, or a Lightning strategy object) on ``world_size`` ranks.

    ``shard_size`` is HYBRID_SHARD's group (default: ``world_size``, one node); other strategies ignore it.
    Raises ``ValueError`` naming the known strategies when ``strategy`` is not one of them.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (the number of ranks), not {world_size!r}")
    name = _strategy_name(strategy)
    if name not in _SHARDED:
        raise ValueError(
            f"unknown strategy {strategy!r}; choose from: {', '.join(STRATEGIES)} (or a Lightning "
            "DDPStrategy, "
            "FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy object)"
        )
    params, grads, optim, layout = _SHARDED[name]
    group = world_size
    if name == "fsdp_hybrid_shard" and shard_size is not None:
        if shard_size < 1 or world_size % shard_size:
            raise ValueError(f"shard_size must divide world_size ({world_size}), not {shard_size!r}")
        group = shard_size
    return Sharding(name, params, grads, optim, layout, group)


def _strategy_name(strategy: Any) -> str:
    if isinstance(strategy, str):
        name = strategy.lower().replace("-", "_")
        return _ALIASES.get(name, name)
    kind = type(strategy).__name__
    if kind in ("DDPStrategy",):
        return "ddp"
    if kind == "DeepSpeedStrategy":
        stage = int(getattr(strategy, "config", {}).get("zero_optimization", {}).get("stage", 2))
        return f"deepspeed_stage_{stage}" if stage else "ddp"
    if kind == "FSDPStrategy":
        sharding = getattr(strategy, "sharding_strategy", None)
        sharding_name = getattr(sharding, "name", str(sharding or "FULL_SHARD")).lower()
        return f"fsdp_{sharding_name}"
    if kind == "ModelParallelStrategy":
        return "model_parallel"
    return kind


@dataclass(frozen=True)
class ModelStates:
    """Per-rank bytes of the model states (parameters, gradients, optimizer state) under one strategy.

    Attributes:
        parameters_bytes, gradients_bytes, optimizer_state_bytes: bytes each rank holds (shards where sharded).
    """

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int

    @property
    def total_bytes(self) -> int:
        """Sum of the three, bytes."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes


def optimizer_state_bytes_per_parameter(
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | type = torch.optim.Adam,
    dtype: torch.dtype = torch.float32,
) -> tuple[float, int]:
    """Bytes of optimizer state per parameter element and per parameter tensor, learnt from the real optimizer.

    The optimizer's ``step`` runs twice on fake parameters of two sizes (no memory is used) and its state
    is counted: ``(bytes per element, bytes per tensor)`` — Adam in fp32: ``(8.0, 4)`` (``exp_avg`` and
    ``exp_avg_sq``; ``step`` is a 4-byte scalar per tensor); SGD without momentum: ``(0.0, 0)``.

    Args:
        optimizer: an optimizer class or ``params -> optimizer``.
        dtype: the parameters' dtype.
    """
    session = FakeSession()
    totals = []
    sizes = (1024, 4096)
    for size in sizes:
        with session.active():
            parameter = nn.Parameter(torch.empty(size, dtype=dtype))
            instance = optimizer([parameter])
            for _ in range(2):
                parameter.grad = torch.empty(size, dtype=dtype)
                instance.step()
        seen: set[int] = set()
        nbytes = 0
        for state in instance.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    nbytes += value.numel() * value.element_size()
        totals.append(nbytes)
    per_element = (totals[1] - totals[0]) / (sizes[1] - sizes[0])
    per_tensor = int(round(totals[0] - per_element * sizes[0]))
    return per_element, per_tensor


def model_state_bytes(
    num_parameters: int,
    strategy: Any = "ddp",
    world_size: int = 1,
    *,
    precision: str = "16-mixed",
    optimizer: Callable | type = torch.optim.Adam,
    shard_size: int | None = None,
) -> ModelStates:
    """Per-rank model-state bytes of ``num_parameters`` trainable parameters (the ZeRO paper's section 3 arithmetic).

    The optimizer's state per parameter is learnt from the real optimizer
    (:func:`optimizer_state_bytes_per_parameter`, fp32 state: Adam 8 bytes). Under a half ``precision``
    (``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``...) with the DeepSpeed layout, parameters and gradients are
    2 bytes and the optimizer holds a 4-byte fp32 master copy besides its state: mixed-precision Adam is
    2 + 2 + 12 = 16 bytes per parameter, sharded as ZeRO does: DDP 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2
    2Ψ + 14Ψ/N, stage 3 16Ψ/N. The torch layout (DDP, FSDP, FSDP2 under autocast) keeps fp32 parameters
    and gradients: 4 + 4 + 8 = 16 bytes for Adam. ``"32-true"``: 4 + 4 + state. Shards are rounded up
    (rank 0 holds the largest). Per-tensor state (Adam's ``step``) is left out: it is bytes per tensor, not per
    parameter.

    Args:
        num_parameters: trainable parameters (elements, Ψ).
        strategy: a name of :data:`STRATEGIES` (``"ddp"``, ``"fsdp"``, ``"model_parallel"`` for FSDP2,
            ``"deepspeed_stage_3"``...) or a Lightning strategy.
        world_size: ranks (N).
        precision: Lightning's precision string.
        optimizer: the optimizer class or factory whose state per parameter is learnt (default Adam).
        shard_size: ranks the states are sharded over (default ``world_size``; smaller for hybrid sharding).
    """
    if not isinstance(num_parameters, int) or num_parameters < 0:
        raise ValueError(f"num_parameters must be a non-negative integer, not {num_parameters!r}")
    sharding = sharding_of(strategy, world_size, shard_size)
    half = precision.startswith(("16", "bf16"))
    state_per_element, _ = optimizer_state_bytes_per_parameter(optimizer)
    if half and sharding.layout == "deepspeed":
        param_bytes, grad_bytes, optim_bytes = 2, 2, 4 + state_per_element
    elif precision in ("16-true", "bf16-true"):
        param_bytes, grad_bytes, optim_bytes = 2, 2, state_per_element / 2
    else:
        param_bytes, grad_bytes, optim_bytes = 4, 4, state_per_element
    n = sharding.shard_size

    def share(nbytes: float, sharded: bool) -> int:
        total = nbytes * num_parameters
        return int(math.ceil(total / n)) if sharded else int(math.ceil(total))

    return ModelStates(
        share(param_bytes, sharding.parameters),
        share(grad_bytes, sharding.gradients),
        share(optim_bytes, sharding.optimizer_state),
    )
