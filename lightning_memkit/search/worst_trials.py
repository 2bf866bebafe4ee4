"""Trials on the worst batch: a batch-size search's real trials train on the largest batch the data can produce at
each size, and record the largest batch each trial ran, so what fits holds for the run, not for a random draw."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Sampler

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.estimate.data.worst_batch import (
    WorstBatch,
    agreed_worst_batch,
    batch_nbytes,
    batch_shapes,
    find_worst_batch,
)

__all__ = ["worst_of_fit", "worst_loader", "trained_on", "BatchRecorder"]


def worst_of_fit(trainer: Any, agree_seconds: Callable[[float], float] | None = None) -> WorstBatch | None:
    """The worst batch of the fit's train dataloader (after ``reload_train_dataloader``), or ``None`` when there is
    none to read (no loader set up). ``agree_seconds``: every rank's projection of the sizing time made one (see
    :func:`~lightning_memkit.estimate.data.worst_batch.agreed_worst_batch`), so every rank sizes the same samples."""
    loader = compat.train_loader(trainer)
    if loader is None:
        return None
    return find_worst_batch(loader) if agree_seconds is None else agreed_worst_batch(loader, agree_seconds)


class _SameIndices(Sampler[list[int]]):
    """The same batch of dataset indices, ``count`` times."""

    def __init__(self, indices: list[int], count: int) -> None:
        self.indices = indices
        self.count = count

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.count):
            yield list(self.indices)

    def __len__(self) -> int:
        return self.count


def trained_on(worst: WorstBatch) -> str:
    """What a trial at any size trains on, in words: the largest batch the loader's batch sampler yields at that size
    where it can be iterated, else the worst batch's note."""
    if worst.sampler_iterable:
        return f"the largest batch {worst.sampler_name} yields at that size ({worst.total:,} samples sized)"
    return worst.note


def worst_loader(worst: WorstBatch, size: int, loader: Any, count: int) -> DataLoader | None:
    """A loader whose every batch is the worst batch at ``size`` samples per batch (:meth:`WorstBatch.at_size`: a batch
    sampler's largest there where it can be iterated), collated afresh each step by ``loader``'s own ``collate_fn``
    (as the real loader would), ``count`` batches; ``None`` when ``worst`` has no samples to take (the batch seen: the
    trial then trains on the loader's own batches)."""
    indices = worst.at_size(size).indices(size)
    if indices is None or not isinstance(loader, DataLoader):
        return None
    return DataLoader(
        loader.dataset,
        batch_sampler=_SameIndices(indices, count),
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
    )


class BatchRecorder(Callback):
    """Records the largest batch (in bytes) a trial trained on, and its shapes."""

    def __init__(self) -> None:
        self.nbytes: int | None = None
        self.shapes = ""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        nbytes = batch_nbytes(batch)
        if self.nbytes is None or nbytes > self.nbytes:
            self.nbytes, self.shapes = nbytes, batch_shapes(batch)
