"""What activation checkpointing costs on this CPU beyond the ops it recomputes, measured.

torch's non-reentrant checkpoint runs Python for every checkpointed call (the saved-tensor hooks' frame, the RNG
and autocast state it keeps, the recompute it starts from the backward) and for every tensor a region saves (a pack
hook in the forward, another in the recompute, an unpack in the backward). On a CPU these cost more than many of the
ops themselves: on a 2-core VM about 0.4 ms per call and tens of microseconds per op inside, so a checkpointed
small micro-batch is much slower than its recomputed FLOPs say. The fake step counts a plan's checkpointed calls
and the ops inside them (:attr:`~lightning_memkit.plan.time_model.OpCosts.checkpoint_terms`); this module measures
the price of each on a chain of tiny blocks, timed plain and checkpointed side by side, with the same fake step
counting the chain's ops as it counts a plan's.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate.batches import preserved_rng
from lightning_memkit.estimate.core import estimate_memory, observing_ops
from lightning_memkit.modes.checkpointing import apply_checkpointing
from lightning_memkit.modes.mode import Mode
from lightning_memkit.plan.time_model import OpCosts

__all__ = ["measure_checkpoint_overheads"]

#: blocks in the measured chain (each one checkpointed call)
_BLOCKS = 4
#: the two block depths measured (layers per block): their difference prices an op inside a region
_DEPTHS = (1, 8)


class _Block(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Chain(nn.Module):
    def __init__(self, depth: int, blocks: int = _BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(depth) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@functools.cache
def _counts(depth: int) -> tuple[float, float, float]:
    """For one block of ``depth`` layers, as the plan's fake step counts them: ``(ops of its plain forward and
    backward, ops the recompute adds when it is checkpointed, ops inside the checkpointed call)``. The same for every
    run of this torch (about half a second each, the first time: kept)."""
    block, sample = _Chain(depth, blocks=1), torch.zeros(2, 8)
    counted = []
    for mode in (None, Mode(checkpoint={_Block})):
        costs = OpCosts()
        with observing_ops(costs):
            estimate_memory(
                block,
                batch=sample,
                mode=mode,
                device="cpu",
                optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                loss_fn=lambda m, b: m(b).sum(),
            )
        counted.append(costs)
    plain, checkpointed = counted
    calls, inside = checkpointed.checkpoint_terms
    if calls != 1:  # the block is one checkpointed call, or the counting is not what this module assumes
        raise RuntimeError(f"a checkpointed block counted as {calls} calls")
    recompute = (checkpointed.micro.count - plain.micro.count) / checkpointed.micro_batches
    return plain.micro.count / plain.micro_batches, recompute, inside


def _seconds(chain: _Chain, sample: torch.Tensor, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        chain(sample).sum().backward()
    return (time.perf_counter() - started) / repeats


def measure_checkpoint_overheads(rounds: int = 5, repeats: int = 10) -> tuple[float, float]:
    """Seconds this CPU spends per checkpointed call and per op inside one beyond running the recomputed ops again:
    ``(per call, per op inside)``, both >= 0. The time model charges the recompute's ops as it charges every op (the
    fake step counts them) and these on top.

    A chain of :data:`_BLOCKS` tiny blocks (``Linear(8, 8)`` + ``tanh``, 1 and 8 of them per block) runs forward and
    backward plain and with every block checkpointed, in ``rounds`` rounds that alternate the order; each variant's
    fastest round counts (the machine's noise only ever adds time). The recompute's ops are taken out at the plain
    chain's own time per op. About 0.7 s (the first call in a process about a second more: the fake step counts the
    blocks' ops once); nothing it made outlives the call."""
    extra_per_call: list[tuple[float, float]] = []  # (ops inside a call, seconds per call beyond its recompute)
    with preserved_rng():
        for depth in _DEPTHS:
            plain_ops, recompute, inside = _counts(depth)
            chain = _Chain(depth)
            sample = torch.randn(2, 8)
            best = {False: float("inf"), True: float("inf")}
            for round_ in range(rounds):
                for checkpointed in (False, True) if round_ % 2 == 0 else (True, False):
                    handle = apply_checkpointing(chain, {_Block}) if checkpointed else None
                    try:
                        _seconds(chain, sample, 2)  # warm
                        best[checkpointed] = min(best[checkpointed], _seconds(chain, sample, repeats))
                    finally:
                        if handle is not None:
                            handle.remove()
            per_op = best[False] / (_BLOCKS * plain_ops)  # the plain chain's seconds per counted op
            extra = (best[True] - best[False]) / _BLOCKS - recompute * per_op
            extra_per_call.append((inside, max(extra, 0.0)))
            del chain, sample
    (ops_small, small), (ops_large, large) = extra_per_call
    per_op = max(large - small, 0.0) / (ops_large - ops_small) if ops_large > ops_small else 0.0
    return max(small - per_op * ops_small, 0.0), per_op


def describe(overheads: Any) -> str:
    """``(per call, per op inside)`` seconds in words."""
    per_call, per_op = overheads
    return f"{per_call * 1e3:.2f} ms per checkpointed call, {per_op * 1e6:.1f} us per op inside one"


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m lightning_memkit.plan.checkpoint_cost
    print(describe(measure_checkpoint_overheads()))
