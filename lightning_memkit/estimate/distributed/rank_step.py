"""One rank's fake step (:func:`run_rank_step`): the step's fake copy set up as the strategy sets up a rank (its
``configure_model``, its sharding, its buffers and hooks: a :class:`RankSetup`), then stepped as Lightning steps it.
Everything a rank reports comes from that step's own events: its tensor peak, its categories, its strategy buffers,
and on a CUDA target its caching allocator, replayed from its own allocations, resizes and frees.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memkit.accounting.accountant import StorageRecord
from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.step.memory_estimate import MemoryEstimate
from lightning_memkit.estimate.step.settings import preparing_copies
from lightning_memkit.estimate.step.step_accountant import StepAccountant

__all__ = [
    "RankSetup",
    "RankStep",
    "run_rank_step",
    "route_through",
    "padded_shard_numel",
    "trainable_parameters",
    "STRATEGY_BUFFERS",
]

#: the category of the strategy's own buffers in a rank's breakdown (DDP's buckets, FSDP's gathered parameters)
STRATEGY_BUFFERS = "strategy_buffers"


class RankSetup:
    """What a strategy does to a rank's copy of the module before its first step, and which of the rank's storages
    are the strategy's buffers. Subclasses implement :meth:`wrap` (and :meth:`build`); the base class names the
    buffers.

    Attributes:
        gathered: the buffer name of the storages the strategy resizes in place (FSDP's gathered parameters: freed
            with ``resize_(0)`` after use, grown back before the next), or ``None``.
        notes: caveats the setup adds to the estimate.
    """

    gathered: str | None = None

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._claimed: dict[int, tuple[str, StorageRecord]] = {}  # id(record) -> (buffer name, the record kept)

    def claim(self, acc: StepAccountant, name: str, tensors: list[torch.Tensor]) -> None:
        """``tensors`` (just allocated by the set-up or its hooks) are the strategy's buffer ``name``."""
        for tensor in tensors:
            for record in acc.records_of(tensor):
                self._claimed[id(record)] = (name, record)

    def build(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """Build ``module_copy`` (fake, in the step's fake world, under ``acc``) as the strategy does before the
        mode's checkpointing: its ``configure_model``, its precision's conversion. Nothing by default."""

    def wrap(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """Wrap or shard the (checkpointed) ``module_copy`` as the strategy sets up a rank before the first step."""
        raise NotImplementedError

    def buffer_name(self, record: StorageRecord, acc: StepAccountant) -> str | None:
        """The strategy buffer ``record`` belongs to, or ``None`` when it is none of the strategy's."""
        claimed = self._claimed.get(id(record))
        if claimed is not None:
            return claimed[0]
        if self.gathered is not None and id(record) in acc.resized:
            return self.gathered
        return None

    def host_bytes(self) -> int:
        """Bytes the strategy keeps in host memory beside the device (an optimizer offloaded to CPU); 0 by default."""
        return 0


@dataclass
class RankStep:
    """One rank's step as the strategy makes it (all sizes in bytes).

    Attributes:
        single: the :class:`~lightning_memkit.estimate.MemoryEstimate` of the rank's own fake step: its peak, its
            categories and, on a CUDA target, its caching-allocator view replayed from the rank's own events.
        categories: ``peak_bytes`` by category: the accountant's categories, the strategy's buffers apart
            (``strategy_buffers``).
        buffers: the strategy's buffers at the peak, by name.
        peak_bytes: the rank's tensor peak.
        notes: caveats.
        host_bytes: what the strategy keeps in host memory (an optimizer offloaded to CPU), not in ``peak_bytes``.
    """

    single: MemoryEstimate
    categories: dict[str, int]
    buffers: dict[str, int]
    peak_bytes: int
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0


@dataclass
class _SetupSeen:
    """The accountant of the rank's step, kept by the set-up callback to read the step's peak after it."""

    acc: StepAccountant | None = None


def run_rank_step(
    module: nn.Module, batch_size: int | None, setup: RankSetup, estimate_kwargs: dict[str, Any]
) -> RankStep:
    """``module``'s fake step with its copy set up by ``setup`` before the step (as a strategy sets up a rank before
    ``configure_optimizers``). The set-up is not the step: the peak starts after it, and the rank's allocator starts
    from what the set-up left alive (a rank materialises its shards; it never holds the whole model first)."""
    seen = _SetupSeen()

    def build(module_copy: nn.Module, acc: StepAccountant) -> None:
        with acc.labelled("setup"):
            setup.build(module_copy, acc)

    def wrap(module_copy: nn.Module, acc: StepAccountant) -> None:
        with acc.labelled("setup"):
            setup.wrap(module_copy, acc)
        acc.attributor.assign_module(module_copy)  # the rank's parameters now (shards, where sharded)
        acc.reset_peak()
        _allocator_starts_after_setup(acc)
        seen.acc = acc

    with preparing_copies(build, wrap):
        single = estimate_memory(module, batch_size, **estimate_kwargs)
    categories, buffers = _rank_breakdown(seen.acc, setup) if seen.acc is not None else (dict(single.by_category), {})
    categories[STRATEGY_BUFFERS] = sum(buffers.values())
    notes = list(single.notes) + setup.notes
    return RankStep(single, categories, buffers, single.peak_bytes, notes, setup.host_bytes())


def _allocator_starts_after_setup(acc: StepAccountant) -> None:
    """The events the allocator model replays start with what the set-up left alive, allocated in their order."""
    if acc.events is None:
        return
    live = sorted((r for r in acc.live_records() if r.nbytes > 0), key=lambda record: record.sequence)
    acc.events[:] = [("alloc", record.sequence, record.nbytes) for record in live]


def _rank_breakdown(acc: StepAccountant, setup: RankSetup) -> tuple[dict[str, int], dict[str, int]]:
    """The peak's bytes by category, the strategy's buffers apart and by name; each storage at its size at the peak."""
    categories = dict.fromkeys(CATEGORIES, 0)
    buffers: dict[str, int] = {}
    for record in acc.peak_records:
        nbytes = acc.size_at_peak(record)
        name = setup.buffer_name(record, acc)
        if name is not None:
            buffers[name] = buffers.get(name, 0) + nbytes
        else:
            categories[acc.attributor.category_of(record, acc.peak_tick)] += nbytes
    return categories, buffers


def route_through(wrapper: Callable[..., Any], module: nn.Module, method: str) -> None:
    """Make ``module.<method>(...)`` run through ``wrapper(...)``'s forward, as Lightning's forward redirection does
    for a strategy that wraps the LightningModule (DDP, FSDP): the wrapper's forward hooks run (FSDP gathers the
    root's parameters), then ``module.<method>`` runs where the wrapper calls ``module.forward``."""
    original = getattr(module, method)

    def routed(*args: Any, **kwargs: Any) -> Any:
        had_forward = "forward" in module.__dict__
        forward = module.__dict__.get("forward")

        def inner(*inner_args: Any, **inner_kwargs: Any) -> Any:
            _restore_forward(module, had_forward, forward)
            return original(*inner_args, **inner_kwargs)

        module.forward = inner
        try:
            return wrapper(*args, **kwargs)
        finally:
            _restore_forward(module, had_forward, forward)

    setattr(module, method, routed)


def _restore_forward(module: nn.Module, had_forward: bool, forward: Any) -> None:
    if had_forward:
        module.forward = forward
    else:
        module.__dict__.pop("forward", None)


def padded_shard_numel(numel: int, shard_size: int) -> int:
    """Elements of one rank's shard of a flat ``numel``-element tensor split over ``shard_size`` ranks, padded to
    the same size on every rank (FSDP1's flat parameter, DeepSpeed's partitions)."""
    return int(math.ceil(numel / shard_size))


def trainable_parameters(module: nn.Module) -> list[torch.nn.Parameter]:
    """``module``'s trainable parameters, each once, in registration order (DDP's and DeepSpeed's order)."""
    seen: set[int] = set()
    found = []
    for parameter in module.parameters():
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            found.append(parameter)
    return found
