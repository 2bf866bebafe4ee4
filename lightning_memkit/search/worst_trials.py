"""Trials on the worst batch: a batch-size search's real trials train on the largest batch the data can produce at
each size, and record the largest batch each trial ran, so what fits holds for the run, not for a random draw."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Sampler

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.estimate.data.worst_batch import WorstBatch, batch_nbytes, batch_shapes, find_worst_batch

__all__ = ["worst_of_fit", "worst_loader", "BatchRecorder"]


def worst_of_fit(trainer: Any) -> WorstBatch | None:
    """The worst batch of the fit's train dataloader (after ``reload_train_dataloader``), or ``None`` when there is
    none to read (no loader set up)."""
    loader = compat.train_loader(trainer)
    if loader is None:
        return None
    return find_worst_batch(loader)


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


def worst_loader(worst: WorstBatch, size: int, loader: Any, count: int) -> DataLoader | None:
    """A loader whose every batch is the worst batch of ``size`` samples, collated afresh each step by ``loader``'s own
    ``collate_fn`` (as the real loader would), ``count`` batches; ``None`` when ``worst`` has no samples to take
    (the batch seen: the trial then trains on the loader's own batches)."""
    indices = worst.indices(size)
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
