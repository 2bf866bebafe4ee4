"""The batches a loader's own batch sampler yields (buckets of similar lengths), where memkit can iterate it without
training: at each batch size, the largest of them is the worst batch a run of that size meets, which the largest
samples put together (what any batch of that size could hold) may exceed many times over.

A sampler can be iterated so when a copy of it can be set to another size (an ``int`` attribute ``batch_size``) and
yields the same batches whatever the random state and the epoch (seeded or deterministic): iterating a copy then
shows the batches training will see. Otherwise :func:`iterable_sampler` says why not, and the worst batch stays the
largest samples together, an upper bound.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_memkit.estimate.data.batches import preserved_rng
from lightning_memkit.estimate.data.sample_sizes import seed_everything

__all__ = ["SamplerBatches", "iterable_sampler", "largest_yielded"]

#: the random state each look at a sampler's batches starts from: two different ones must give the same batches
_SEEDS = (0, 1)


@dataclass
class SamplerBatches:
    """A loader's batch sampler, iterated on copies (the loader's own is never advanced).

    Attributes:
        sampler: the loader's batch sampler.
        name: its class name, for notes.
        keep: objects a copy shares with the sampler instead of copying them (the dataset).
    """

    sampler: Any
    name: str
    keep: tuple[Any, ...] = ()

    def batches(self, size: int | None = None, seed: int = _SEEDS[0], epochs: int = 1) -> list[list[int]]:
        """The batches a copy of the sampler yields over ``epochs`` epochs at ``size`` samples per batch (its own
        size when ``None``), from a seeded random state; every random state is put back after."""
        copied = copy.deepcopy(self.sampler, {id(each): each for each in self.keep})
        if size is not None:
            copied.batch_size = size
        with preserved_rng():
            seed_everything(seed)
            return [[int(index) for index in batch] for _ in range(epochs) for batch in copied]


def _same(first: list[list[int]], second: list[list[int]]) -> bool:
    """Whether two lists of batches hold the same batches (in any order, each batch's samples in any order)."""
    return sorted(sorted(batch) for batch in first) == sorted(sorted(batch) for batch in second)


def iterable_sampler(sampler: Any, keep: tuple[Any, ...] = ()) -> tuple[SamplerBatches | None, str]:
    """``(its batches, "")`` where the batch sampler can be iterated without training, else ``(None, why not)``: it
    needs an ``int`` attribute ``batch_size`` (set on a copy for another size), and the same batches in two epochs
    and from two random states."""
    name = type(sampler).__name__
    size = getattr(sampler, "batch_size", None)
    if not isinstance(size, int) or isinstance(size, bool):
        return None, f"{name} has no batch_size attribute memkit can set on a copy"
    found = SamplerBatches(sampler, name, keep)
    try:
        first = found.batches(epochs=2)
        other = found.batches(seed=_SEEDS[1])
    except Exception as error:  # noqa: BLE001 - a sampler that cannot be copied or iterated: the upper bound
        return None, f"iterating a copy of {name} failed ({type(error).__name__}: {error})"
    half = len(first) // 2
    if not (_same(first[:half], first[half:]) and _same(first[:half], other)):
        return None, f"{name}'s batches change with the random state or the epoch"
    return found, ""


def _padded_size(key: Callable[[int], float], batch: list[int]) -> float:
    """The batch's samples times their largest ``key``: what padding to the longest makes."""
    return len(batch) * max(key(index) for index in batch)


def largest_yielded(
    batches: Sequence[list[int]], keys: list[Callable[[int], float]], make: Callable[[Sequence[int]], Any], nbytes: Any
) -> tuple[list[int], Any, int]:
    """The batch of ``batches`` whose collated form (``make``) has the most bytes (``nbytes``): ``(its indices, the
    collated batch, its bytes)``. Only the batches that lead a ranking are collated: the sum of each sample's total
    size (``keys[0]``; what stacking makes) and, for each key, the batch's samples times its largest value (what
    padding to the longest makes)."""
    nonempty = [batch for batch in batches if batch]
    rankings: list[Callable[[list[int]], float]] = [lambda batch: sum(keys[0](index) for index in batch)]
    rankings += [functools.partial(_padded_size, key) for key in keys]
    leaders: set[tuple[int, ...]] = set()
    for ranking in rankings:
        leading: list[int] = max(nonempty, key=ranking)
        leaders.add(tuple(leading))
    best: tuple[list[int], Any, int] = ([], None, -1)
    for leader in sorted(leaders):
        batch = make(leader)
        size = nbytes(batch)
        if size > best[2]:
            best = (list(leader), batch, size)
    return best
