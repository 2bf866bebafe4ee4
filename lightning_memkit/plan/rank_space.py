"""The planner on several devices: the strategies it weighs, the candidates of a world size, and what each
candidate's rank sends to the others per optimizer step.

A candidate on ``world_size`` devices is a single-device candidate at the per-rank batch (the effective batch over
``world_size``: micro-batch x accumulation, precision, checkpointing) under one of :data:`PLAN_STRATEGIES`.

**What a rank sends** (:func:`comm_bytes`), by the strategy's collectives as Lightning configures them, each a ring
that sends ``(N - 1) / N`` of the tensor per rank:

- ``ddp``: one all-reduce of the trainable gradients per optimizer step (Lightning skips the sync of the micro-batches
  it accumulates), twice ``(N - 1) / N`` of their bytes;
- ``fsdp``, ``model_parallel`` (FSDP2), ``deepspeed_stage_3``: per micro-batch, every parameter gathered for the
  forward and again for the backward, and the trainable gradients reduce-scattered;
- ``deepspeed_stage_2``: per micro-batch the trainable gradients reduce-scattered, and per step the updated trainable
  weights gathered.

Parameters move in the dtype the strategy gathers them in (Lightning's FSDP and DeepSpeed: the half dtype under a
half or mixed precision; FSDP2 under ``ModelParallelStrategy``: the module's own), gradients in the dtype they are
reduced in (the half dtype where the strategy reduces in it, else the parameters').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.plan.space import Candidate, candidate_space

__all__ = [
    "CPU_STRATEGIES",
    "PLAN_STRATEGIES",
    "ParameterCounts",
    "comm_bytes",
    "optimizer_share",
    "parse_strategies",
    "rank_space",
    "world_sizes",
]

#: the strategies a plan on several devices weighs, least communication first (FSDP2, ``model_parallel``, only for a
#: module whose ``configure_model`` shards it: Lightning's ModelParallelStrategy requires one)
PLAN_STRATEGIES = ("ddp", "deepspeed_stage_2", "fsdp", "model_parallel", "deepspeed_stage_3")
#: the strategies Lightning runs on CPU processes (gloo): its FSDPStrategy refuses ``accelerator="cpu"``, and
#: DeepSpeed's ZeRO needs its CUDA build
CPU_STRATEGIES = ("ddp", "model_parallel")
#: the strategies that shard the optimizer state (each rank steps its shard)
_SHARDED_OPTIMIZER = ("deepspeed_stage_2", "fsdp", "model_parallel", "deepspeed_stage_3")


@dataclass(frozen=True)
class ParameterCounts:
    """A module's parameter elements: ``total`` (every parameter), ``trainable`` (those with ``requires_grad``)."""

    total: int
    trainable: int

    @classmethod
    def of(cls, module: nn.Module) -> ParameterCounts:
        """Count ``module``'s parameters (each shared parameter once)."""
        unique = {id(p): p for p in module.parameters()}.values()
        return cls(sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad))


def parse_strategies(
    strategy: str | Iterable[str] | None, can_model_parallel: bool, device_type: str = "cuda"
) -> tuple[str, ...]:
    """The strategies a plan weighs: ``None`` for every one of :data:`PLAN_STRATEGIES` that applies (FSDP2 only where
    the module shards itself in ``configure_model``; on CPU only :data:`CPU_STRATEGIES`), else the names given
    (``"fsdp"``, ``"ddp,fsdp"``).

    Raises:
        ValueError: a name not in :data:`PLAN_STRATEGIES`, ``model_parallel`` for a module without
            ``configure_model``, or a strategy Lightning does not run on the device.
    """
    usable = PLAN_STRATEGIES if device_type == "cuda" else CPU_STRATEGIES
    if strategy is None:
        return tuple(s for s in usable if s != "model_parallel" or can_model_parallel)
    words = [w.strip().lower() for w in (strategy.split(",") if isinstance(strategy, str) else strategy) if w.strip()]
    for word in words:
        if word not in PLAN_STRATEGIES:
            raise ValueError(f"strategy {word!r}: choose from {', '.join(PLAN_STRATEGIES)} (comma-separated)")
    if "model_parallel" in words and not can_model_parallel:
        raise ValueError(
            "strategy 'model_parallel' (FSDP2): Lightning's ModelParallelStrategy needs the module to shard itself in "
            "configure_model (fully_shard on its blocks, then on the model); this module has none: plan fsdp instead"
        )
    if not words:
        raise ValueError(f"strategy={strategy!r}: give one of {', '.join(PLAN_STRATEGIES)}")
    refused = [word for word in words if word not in usable]
    if refused:
        raise ValueError(
            f"strategy {refused[0]!r} does not run on {device_type} processes (Lightning's FSDPStrategy refuses "
            f"accelerator='cpu', DeepSpeed's ZeRO needs CUDA): on {device_type} plan {' or '.join(usable)}"
        )
    return tuple(dict.fromkeys(words))


def world_sizes(effective_batch: int, largest: int) -> list[int]:
    """The device counts a plan for the fewest GPUs tries, fewest first: 1, 2, 4, ... up to ``largest`` (``largest``
    itself included), those that divide ``effective_batch`` (each rank trains the same number of samples)."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    sizes.append(largest)
    return [n for n in dict.fromkeys(sizes) if effective_batch % n == 0]


def rank_space(
    effective_batch: int,
    world_size: int,
    strategies: tuple[str, ...],
    *,
    modes: tuple[str, ...],
    device_type: str,
    precision: str,
    can_checkpoint: bool,
    can_accumulate: bool,
) -> list[Candidate]:
    """Every candidate on ``world_size`` devices: the single-device space at the per-rank batch
    (:func:`~lightning_memkit.plan.space.candidate_space`), under each of ``strategies``; the first strategy's
    baseline (the per-rank batch as is) first. Checkpointing is every block (``auto``): a checkpointing budget
    measures a forward of the whole model, which a rank's estimate refuses."""
    per_rank = effective_batch // world_size
    base = candidate_space(
        per_rank,
        modes=modes,
        device_type=device_type,
        precision=precision,
        can_checkpoint=can_checkpoint,
        can_accumulate=can_accumulate,
    )
    per_rank_modes = [c for c in base if not isinstance(c.checkpoint, CheckpointBudget)]
    return [dataclasses.replace(c, strategy=s, world_size=world_size) for s in strategies for c in per_rank_modes]


def _sizes(strategy: str, precision: str) -> tuple[int, int]:
    """Bytes per element of the parameters a strategy moves and of the gradients it reduces, in ``precision``: all in
    fp32 under ``32-true``, all in the half dtype under a true half precision; under a mixed precision Lightning's
    FSDP (``MixedPrecision(param_dtype, reduce_dtype)`` in the half dtype) and DeepSpeed (half weights and gradients)
    move half, DDP all-reduces the fp32 gradients of the fp32 weights, and FSDP2 moves the module's fp32 tensors
    (autocast computes in the half dtype, the shards stay fp32, unless configure_model gives a MixedPrecisionPolicy)."""
    if precision == "32-true":
        return 4, 4
    if precision.endswith("-true") or strategy in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3"):
        return 2, 2
    return 4, 4


def comm_bytes(candidate: Candidate, parameters: ParameterCounts) -> int:
    """Bytes one rank sends per optimizer step under ``candidate``'s strategy (the module's docstring), 0 on one
    device."""
    n, strategy = candidate.world_size, candidate.strategy
    if strategy is None or n == 1:
        return 0
    share = (n - 1) / n
    parameter_size, gradient_size = _sizes(strategy, candidate.precision)
    gradients = share * parameters.trainable * gradient_size
    if strategy == "ddp":
        return int(2 * gradients)
    if strategy == "deepspeed_stage_2":
        return int(candidate.accumulation * gradients + share * parameters.trainable * parameter_size)
    gathered = 2 * share * parameters.total * parameter_size
    return int(candidate.accumulation * (gathered + gradients))


def optimizer_share(candidate: Candidate) -> float:
    """The part of the optimizer step one rank runs: its shard's where the strategy shards the optimizer state."""
    if candidate.strategy in _SHARDED_OPTIMIZER:
        return 1 / candidate.world_size
    return 1.0


@dataclass(frozen=True)
class Devices:
    """The devices a plan is for.

    Attributes:
        world_size: the devices (ranks) to plan for; with ``fewest``, the most tried.
        fewest: try 1, 2, 4, ... devices up to ``world_size`` and plan on the fewest where a candidate fits.
        strategies: the strategies weighed on several devices (:func:`parse_strategies`).
        interconnect: bytes per second one rank's collectives move at (a :data:`~.time_model.INTERCONNECTS` value).
        wrap: the module classes FSDP wraps as units (its repeated blocks), or ``None``.
        parameters: the module's parameter counts (what the collectives move).
    """

    world_size: int = 1
    fewest: bool = False
    strategies: tuple[str, ...] = ()
    interconnect: float | None = None
    wrap: frozenset[type] | None = None
    parameters: ParameterCounts | None = None

    @property
    def several(self) -> bool:
        """Whether the plan may put the batch on more than one device."""
        return self.world_size > 1
