"""How big each sample is, found without the model, and which samples are sized: every one, a fixed random subset of a
dataset too large (:data:`MAX_SIZED_SAMPLES`) or too slow to load (:data:`SCAN_SECONDS`), or the sizes the user named.
The worst-batch search (estimate/worst_batch.py) ranks samples by these sizes.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.estimate.data.batches import NoBatchError

__all__ = [
    "MAX_SIZED_SAMPLES",
    "PROBED_SAMPLES",
    "SAMPLED_COUNT",
    "SCAN_SECONDS",
    "SIZING_SEED",
    "fixed_subset",
    "indices_to_size",
    "named_sizes",
    "ranking_keys",
    "seed_everything",
    "signature",
    "size_samples",
    "sized_indices",
]

#: The most samples sized one by one; a larger dataset is sized on a fixed random subset of this many.
MAX_SIZED_SAMPLES = 100_000
#: When sizing every sample would take longer than this (seconds, projected from the first samples), a fixed random
#: subset of :data:`SAMPLED_COUNT` samples is sized instead, and the answer says what it covered.
SCAN_SECONDS = 30.0
#: How many samples a sized subset has when the whole dataset would take too long.
SAMPLED_COUNT = 4096
#: How many samples are loaded to project the time of sizing them all.
PROBED_SAMPLES = 32
#: How many ranking keys (the total size, then each tensor dimension that varies) may propose a worst batch.
_MAX_KEYS = 8
#: The seed every generator gets while samples are sized and collated, so random augmentations repeat.
SIZING_SEED = 0


def seed_everything(seed: int = SIZING_SEED) -> None:
    """Seed torch's, ``random``'s and numpy's generators (call inside ``preserved_rng()``)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy  # optional dependency: torch runs without numpy

        numpy.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy comes with torch
        pass


def _leaf_size(leaf: Any) -> int:
    """What one leaf of a sample adds to a batch: a tensor's (or array's) bytes, a string's or a list's length."""
    if isinstance(leaf, torch.Tensor):
        return leaf.numel() * leaf.element_size()
    nbytes = getattr(leaf, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(leaf, (str, bytes)):
        return len(leaf)
    return 0


def signature(sample: Any) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """A sample's total size and the shape of each of its tensor (or array) leaves."""
    leaves = tree_flatten(sample)[0]
    leaves = [
        inner for leaf in leaves for inner in (tree_flatten(dict(leaf))[0] if isinstance(leaf, Mapping) else [leaf])
    ]
    shapes = tuple(tuple(leaf.shape) for leaf in leaves if hasattr(leaf, "shape"))
    return sum(_leaf_size(leaf) for leaf in leaves), shapes


def _dimension(signatures: dict[int, tuple[int, tuple]], leaf: int, dim: int, index: int) -> int:
    """Dimension ``dim`` of tensor leaf ``leaf`` of sample ``index``."""
    return signatures[index][1][leaf][dim]


def ranking_keys(signatures: dict[int, tuple[int, tuple]]) -> list[Callable[[int], float]]:
    """The rankings that may make the largest batch: the total size, then each tensor dimension that varies
    (two images, one tall and one wide, are padded to the tallest and the widest: neither is largest alone)."""
    keys: list[Callable[[int], float]] = [lambda index: signatures[index][0]]
    shapes = [shape for _, shape in signatures.values()]
    first = shapes[0]
    for leaf, shape in enumerate(first):
        for dim in range(len(shape)):
            same_layout = all(len(s) > leaf and len(s[leaf]) == len(shape) for s in shapes)
            if same_layout and len({s[leaf][dim] for s in shapes}) > 1 and len(keys) < _MAX_KEYS:
                keys.append(functools.partial(_dimension, signatures, leaf, dim))
    return keys


def size_samples(dataset: Any, indices: Sequence[int]) -> dict[int, tuple[int, tuple]]:
    signatures: dict[int, tuple[int, tuple]] = {}
    for index in indices:
        try:
            signatures[index] = signature(dataset[index])
        except Exception as error:  # the user's dataset may raise anything: a NoBatchError names the sample
            raise NoBatchError(
                f"{type(dataset).__name__}[{index}] failed while memkit sized the samples for the worst "
                f"batch: {type(error).__name__}: {error}"
            ) from error
    return signatures


def fixed_subset(total: int, count: int) -> list[int]:
    """``count`` of ``total`` dataset indices, sorted: the same random subset in every run and on every rank."""
    generator = torch.Generator().manual_seed(SIZING_SEED)
    return sorted(torch.randperm(total, generator=generator)[:count].tolist())


def indices_to_size(
    dataset: Any, total: int, max_samples: int, agree_seconds: Callable[[float], float] | None
) -> tuple[list[int], bool]:
    """Which samples to size: all of them, a fixed random subset of ``max_samples`` when there are more, or one of
    :data:`SAMPLED_COUNT` when sizing those would take longer than :data:`SCAN_SECONDS` (projected from the first
    :data:`PROBED_SAMPLES` of them; ``agree_seconds`` turns this process's projection into the one every process
    agrees on). Returns ``(indices, complete)``."""
    pool = list(range(total)) if total <= max_samples else fixed_subset(total, max_samples)
    probe = pool[:PROBED_SAMPLES]
    started = time.perf_counter()
    for index in probe:
        dataset[index]
    projected = (time.perf_counter() - started) / max(len(probe), 1) * len(pool)
    if agree_seconds is not None:
        projected = float(agree_seconds(projected))
    return sized_indices(total, pool, projected)


def sized_indices(total: int, pool: list[int], projected_seconds: float) -> tuple[list[int], bool]:
    """The samples sized of a dataset of ``total``: the ``pool`` (every index, or a fixed subset of a dataset over
    ``max_samples``), or a fixed random subset of :data:`SAMPLED_COUNT` when sizing the pool is projected to take
    more than :data:`SCAN_SECONDS` (``projected_seconds``). A function of its arguments alone: processes that agree on
    the projection size the same samples. Returns ``(indices, complete)``."""
    if projected_seconds > SCAN_SECONDS and len(pool) > SAMPLED_COUNT:
        return fixed_subset(total, SAMPLED_COUNT), False
    return pool, len(pool) == total


def named_sizes(dataset: Any, size_of: Any, total: int) -> Sequence[float]:
    """Per-sample sizes from ``size_of``: a callable ``index -> size`` or the name of a dataset attribute that is a
    sequence of sizes (e.g. ``"lengths"``) or such a callable."""
    source = getattr(dataset, size_of, None) if isinstance(size_of, str) else size_of
    if source is None:
        raise ValueError(
            f"size_of={size_of!r}: {type(dataset).__name__} has no attribute {size_of!r}; name a dataset "
            "attribute holding each sample's size (e.g. 'lengths'), or give a callable index -> size"
        )
    sizes = [source(index) for index in range(total)] if callable(source) else list(source)
    if len(sizes) != total:
        raise ValueError(
            f"size_of={size_of!r} gives {len(sizes)} sizes for a dataset of {total} samples: give one size per sample"
        )
    return sizes
