"""The worst batch the data can produce: the samples that make the largest collated batch, found without the model.

A run's batches change shape (text padded per batch, bucketing, images of varying size), so an answer to "will it
fit" drawn from one random batch holds for that batch only. For a map-style dataset every sample is sized (the
bytes of its tensors, the length of its strings; no model runs), the largest samples are put together with the
loader's own ``collate_fn``, and the largest result is the batch every estimate, search and plan uses. The sizing
is deterministic (every random-number generator is seeded for it and put back after), so the same data gives the
same answer in every run. Where the data cannot be enumerated (an iterable dataset, a loader that is not a
``DataLoader``), the answer is for the batch seen, and says so.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_memkit._torch_compat import keystr, tree_flatten_with_path
from lightning_memkit.estimate.data.batches import NoBatchError, batch_size_of, preserved_rng, train_loader_and_length
from lightning_memkit.estimate.data.sample_sizes import (
    MAX_SIZED_SAMPLES,
    indices_to_size,
    named_sizes,
    ranking_keys,
    seed_everything,
    size_samples,
)
from lightning_memkit.estimate.data.sampler_batches import SamplerBatches, iterable_sampler, largest_yielded

__all__ = [
    "BatchSource",
    "WorstBatch",
    "find_worst_batch",
    "agreed_worst_batch",
    "worst_batch_and_length",
    "seen_batch",
    "batch_shapes",
    "batch_nbytes",
    "batch_tensors",
]


class BatchSource(enum.Enum):
    """Where a worst batch came from, and so what the answer holds for."""

    DATASET = "every sample of the dataset sized"
    DATASET_SUBSET = "a fixed random subset of the dataset sized"
    SIZE_FIELD = "the sizes the user named"
    SAMPLER = "the largest batch the loader's batch sampler yields at a size"
    BATCH_LIST = "the largest of the loader's ready batches"
    GIVEN = "the batch given"
    SEEN = "the batch seen"


@dataclass
class WorstBatch:
    """The largest batch the data can produce at ``batch_size``, and how it was found.

    Where a custom batch sampler makes the batches (buckets of similar lengths) it is the largest samples together, an
    upper bound for any batch of that size; where that sampler can be iterated without training,
    :meth:`at_size` gives the largest batch it really yields at a size (source ``SAMPLER``).

    Attributes:
        batch: the collated batch (real tensors), its largest samples first.
        batch_size: its samples (``None`` when it has no batch dimension).
        source: where it came from (:class:`BatchSource`).
        sized: how many samples were sized; ``total`` is the dataset's length (``None`` when unknown).
        seconds: wall time of the search, seconds.
        nbytes: the bytes of the batch's tensors.
        note: what the answer holds for, in one line (for every output that uses this batch).
    """

    batch: Any
    batch_size: int | None
    source: BatchSource
    sized: int = 0
    total: int | None = None
    seconds: float = 0.0
    nbytes: int = 0
    note: str = ""
    _order: list[int] = field(default_factory=list, repr=False)
    _make: Callable[[Sequence[int]], Any] | None = field(default=None, repr=False)
    _sampling: _Sampling | None = field(default=None, repr=False)

    @property
    def holds_for_the_run(self) -> bool:
        """Whether the answer holds for every batch the data can produce (not only the one seen)."""
        return self.source in (BatchSource.DATASET, BatchSource.SIZE_FIELD, BatchSource.SAMPLER, BatchSource.BATCH_LIST)

    @property
    def sampler_name(self) -> str | None:
        """The class of the custom batch sampler that makes the loader's batches (``None``: the loader's own
        ``batch_size`` does)."""
        return self._sampling.name if self._sampling is not None else None

    @property
    def sampler_iterable(self) -> bool:
        """Whether :meth:`at_size` gives the largest batch that sampler really yields at a size."""
        return self._sampling is not None and self._sampling.sampler is not None

    def note_at(self, size: int | None) -> str:
        """What an answer at ``size`` samples per batch, on this batch, holds for (its own size when ``None``)."""
        if self._sampling is None:
            return self.note
        return _note(self, size=size or self.batch_size)

    def at_size(self, size: int) -> WorstBatch:
        """The worst batch a run at ``size`` samples per batch meets: the largest batch the loader's batch sampler
        yields at that size where it can be iterated without training (a ``SAMPLER`` batch, found once per size),
        else this one (whose :meth:`at` and :meth:`indices` give that size)."""
        sampling = self._sampling
        if sampling is None or sampling.sampler is None or self._make is None:
            return self
        if size not in sampling.found:
            sampling.found[size] = _yielded(self, sampling, sampling.sampler, self._make, size)
        return sampling.found[size]

    def shapes(self) -> str:
        """The batch's tensor shapes, e.g. ``input_ids (16, 256), attention_mask (16, 256), labels (16,)``."""
        return batch_shapes(self.batch)

    def describe(self) -> str:
        """Its shapes and what it is, e.g. ``input_ids (16, 256), labels (16,): the worst batch of all 512 samples``."""
        return f"{self.shapes()}: {self.note}"

    def indices(self, size: int) -> list[int] | None:
        """The dataset indices of the worst batch of ``size`` samples, largest first (the largest repeated when the
        dataset has fewer), or ``None`` where the samples are not known (the batch seen or given). A ``SAMPLER``
        batch's are its own samples, the batch of the size it was found at."""
        if self._make is None or not self._order:
            return None
        if size < 1:
            raise ValueError(f"size must be a positive integer, not {size!r}")
        order = self._order
        if self.source is BatchSource.SAMPLER:
            return list(order)
        return [order[i % len(order)] for i in range(size)]

    def at(self, size: int) -> Any:
        """The worst batch of ``size`` samples: the ``size`` largest samples collated (a real batch), or ``None``
        where the samples are not known (the batch seen or given: rebatch that instead)."""
        indices = self.indices(size)
        return None if indices is None or self._make is None else self._make(indices)


def batch_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``batch`` with their place in it (``input_ids``, ``batch[0]``), walked with torch's pytree
    (lists, tuples, dicts, namedtuples, registered classes) and into any other mapping it leaves whole (Hugging
    Face's ``BatchEncoding`` is a ``UserDict``)."""
    found: list[tuple[str, torch.Tensor]] = []
    for path, leaf in tree_flatten_with_path(batch)[0]:
        name = keystr(path).replace("['", ".").replace("']", "").lstrip(".")
        name = ("batch" + name) if name.startswith("[") else name
        if isinstance(leaf, torch.Tensor):
            found.append((name or "batch", leaf))
        elif isinstance(leaf, Mapping):
            found += [(f"{name}.{inner}" if name else inner, tensor) for inner, tensor in batch_tensors(dict(leaf))]
    return found


def _nbytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.nbytes)
    except (RuntimeError, NotImplementedError, TypeError):  # a nested tensor has none: it counts 0
        return 0


def batch_nbytes(batch: Any) -> int:
    """Bytes of every tensor in ``batch`` (``numel * element_size``; see :func:`batch_tensors` for the walk)."""
    return sum(_nbytes(tensor) for _, tensor in batch_tensors(batch))


def batch_shapes(batch: Any) -> str:
    """The tensors of ``batch`` named by their place in it and their shape: ``input_ids (16, 256), labels (16,)``."""
    return ", ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in batch_tensors(batch)) or "no tensors"


def _loader_batch_size(loader: DataLoader) -> tuple[int, Any]:
    """The loader's samples per batch, and its batch sampler where a custom one (not torch's ``BatchSampler``)
    decides them (else ``None``)."""
    if loader.batch_size is not None:
        return int(loader.batch_size), None
    sampler: Any = loader.batch_sampler  # torch's BatchSampler or the user's own: any iterable of index lists
    size = getattr(sampler, "batch_size", None)
    if not isinstance(size, int):
        with preserved_rng():
            size = max((len(indices) for indices in sampler), default=1)
    return int(size), None if isinstance(sampler, BatchSampler) else sampler


@dataclass
class _Sampling:
    """A custom batch sampler's part in a worst batch: its name, its batches where it can be iterated without training
    (``None``: ``why_not`` says why), the samples' rankings, and the largest batch it yields at each size asked."""

    name: str
    sampler: SamplerBatches | None
    why_not: str = ""
    keys: list[Callable[[int], float]] = field(default_factory=list)
    found: dict[int, WorstBatch] = field(default_factory=dict)


def _sampling_of(sampler: Any, loader: DataLoader, found: WorstBatch, keys: list[Callable[[int], float]]) -> _Sampling:
    name = type(sampler).__name__
    if found.source not in (BatchSource.DATASET, BatchSource.SIZE_FIELD):
        return _Sampling(name, None, "not every sample was sized, so its batches cannot be ranked")
    batches, why_not = iterable_sampler(sampler, keep=(loader.dataset,))
    return _Sampling(name, batches, why_not, keys)


def _yielded(
    worst: WorstBatch,
    sampling: _Sampling,
    sampler: SamplerBatches,
    make: Callable[[Sequence[int]], Any],
    size: int,
) -> WorstBatch:
    """The largest batch (by collated bytes) ``sampler`` (``sampling``'s) yields at ``size`` samples per batch,
    collated by ``make``."""
    started = time.perf_counter()
    batches = sampler.batches(size)
    indices, batch, nbytes = largest_yielded(batches, sampling.keys, make, batch_nbytes)
    found = WorstBatch(
        batch,
        len(indices),
        BatchSource.SAMPLER,
        worst.sized,
        worst.total,
        time.perf_counter() - started,
        nbytes,
        _order=indices,
        _make=worst._make,
    )
    sized = "every sample sized" if worst.source is BatchSource.DATASET else "by the sizes named"
    found.note = (
        f"the largest batch {sampling.name} yields at batch size {size} (of its {len(batches):,} batches of "
        f"{worst.total:,} samples, {sized})"
    )
    return found


def _collated(loader: DataLoader, dataset: Any) -> Callable[[Sequence[int]], Any]:
    collate = loader.collate_fn

    def make(indices: Sequence[int]) -> Any:
        with preserved_rng():
            seed_everything()
            return collate([dataset[index] for index in indices])

    return make


def _from_dataset(
    loader: DataLoader, batch_size: int, size_of: Any, max_samples: int, agree_seconds: Callable[[float], float] | None
) -> tuple[WorstBatch, list[Callable[[int], float]]]:
    """The largest samples collated at ``batch_size``, and the rankings of the samples it tried."""
    started = time.perf_counter()
    dataset = loader.dataset
    total = len(dataset)  # type: ignore[arg-type]  # a map-style dataset's __len__, which Dataset does not declare
    if total == 0:
        raise NoBatchError(f"the train dataset {type(dataset).__name__} is empty; pass an example batch (batch=...)")
    make = _collated(loader, dataset)
    keys: list[Callable[[int], float]]
    candidates: Sequence[int]
    with preserved_rng():
        seed_everything()
        if size_of is not None:
            sizes = named_sizes(dataset, size_of, total)
            keys, source, sized = [lambda index: sizes[index]], BatchSource.SIZE_FIELD, total
            candidates = range(total)
        else:
            indices, complete = indices_to_size(dataset, total, max_samples, agree_seconds)
            signatures = size_samples(dataset, indices)
            keys, candidates = ranking_keys(signatures), indices
            source, sized = (BatchSource.DATASET if complete else BatchSource.DATASET_SUBSET), len(indices)
    best_order: list[int] = []
    best_batch, best_bytes = None, -1
    tried: set[tuple[int, ...]] = set()
    orders = [sorted(candidates, key=lambda index: (-key(index), index)) for key in keys]
    if len(orders) > 2:  # two or more dimensions vary: the largest of each together, with and without the total's
        orders += [_round_robin(orders[1:]), _round_robin(orders)]
    for order in orders:
        top = tuple(order[:batch_size])
        if top in tried:
            continue
        tried.add(top)
        batch = make(top)
        nbytes = batch_nbytes(batch)
        if nbytes > best_bytes:
            best_order, best_batch, best_bytes = order, batch, nbytes
    found = WorstBatch(
        best_batch,
        min(batch_size, total),
        source,
        sized,
        total,
        time.perf_counter() - started,
        best_bytes,
        _order=best_order,
        _make=make,
    )
    return found, keys


def _round_robin(orders: list[list[int]]) -> list[int]:
    """The largest by each ranking in turn: one batch then holds the tallest and the widest image at once, which a
    collate that pads to both makes larger than any ranking alone."""
    merged: dict[int, None] = {}
    for rank in range(len(orders[0])):
        for order in orders:
            merged.setdefault(order[rank], None)
    return list(merged)


def find_worst_batch(
    loader: Iterable[Any],
    batch_size: int | None = None,
    *,
    size_of: str | Callable[[int], float] | None = None,
    max_samples: int = MAX_SIZED_SAMPLES,
) -> WorstBatch:
    """The largest batch ``loader`` can produce at ``batch_size`` samples (default: the loader's own).

    For a ``DataLoader`` over a map-style dataset every sample is sized (tensor bytes, string lengths; the model
    does not run), and the largest samples are collated with the loader's ``collate_fn``: by total size, and by
    each tensor dimension that varies (the tallest and the widest images). The collated batch with the most bytes
    wins. A dataset over ``max_samples`` is sized on a fixed random subset of that many, and one whose samples are
    slow to load (sizing them would take over ``SCAN_SECONDS``, projected from the first 32) on a fixed random subset
    of ``SAMPLED_COUNT`` (estimate/data/sample_sizes.py); the note says how much it covered. Where a custom batch
    sampler makes the batches, the largest samples together are an upper bound for any batch of that size, and the
    note says so; where that sampler can be iterated without training (seeded or deterministic, with a
    ``batch_size`` to set), :meth:`WorstBatch.at_size` gives the largest batch it really yields at a size.

    Args:
        loader: a ``DataLoader``, a list of ready batches, or any iterable of batches.
        batch_size: samples per batch (default: the loader's ``batch_size`` or its batch sampler's).
        size_of: each sample's size without loading it: the name of a dataset attribute (a sequence of sizes,
            e.g. ``"lengths"``) or a callable ``index -> size``. Only the largest samples are then loaded.
        max_samples: the most samples sized one by one.

    Returns:
        a :class:`WorstBatch`; for an iterable dataset or another iterable, the first batch, marked as the batch seen.

    Raises:
        NoBatchError: the loader is empty or a sample fails to load (the message names it).
    """
    return _find(loader, batch_size, size_of, max_samples, None)


def agreed_worst_batch(loader: Any, agree_seconds: Callable[[float], float]) -> WorstBatch:
    """:func:`find_worst_batch` at the loader's own size where several processes look for the same worst batch (the
    ranks of a DDP search): ``agree_seconds`` turns this process's projected seconds of sizing the samples into the
    projection all agree on (the largest), so that every process sizes the same samples."""
    return _find(loader, None, None, MAX_SIZED_SAMPLES, agree_seconds)


def _find(
    loader: Any,
    batch_size: int | None,
    size_of: Any,
    max_samples: int,
    agree_seconds: Callable[[float], float] | None,
) -> WorstBatch:
    started = time.perf_counter()
    if (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and hasattr(loader.dataset, "__len__")
        and hasattr(loader.dataset, "__getitem__")
    ):
        size, sampler = _loader_batch_size(loader)
        found, keys = _from_dataset(loader, batch_size or size, size_of, max_samples, agree_seconds)
        if sampler is not None:
            found._sampling = _sampling_of(sampler, loader, found, keys)
        found.note = _note(found)
        return found
    if isinstance(loader, (list, tuple)) and loader:
        batch = max(loader, key=batch_nbytes)
        found = WorstBatch(
            batch,
            batch_size_of(batch),
            BatchSource.BATCH_LIST,
            len(loader),
            len(loader),
            time.perf_counter() - started,
            batch_nbytes(batch),
        )
        found.note = _note(found)
        return found
    with preserved_rng():
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise NoBatchError("the train dataloader is empty; pass an example batch (batch=...)") from None
    return seen_batch(batch, why=f"{type(getattr(loader, 'dataset', loader)).__name__} cannot be enumerated")


def seen_batch(batch: Any, why: str = "", given: bool = False) -> WorstBatch:
    """A :class:`WorstBatch` for a batch that was given or seen, whose note says what the answer then holds for."""
    found = WorstBatch(
        batch, batch_size_of(batch), BatchSource.GIVEN if given else BatchSource.SEEN, nbytes=batch_nbytes(batch)
    )
    found.note = _note(found, why)
    return found


def _note(found: WorstBatch, why: str = "", size: int | None = None) -> str:
    """Which batch ``found`` is and what an answer on it holds for (its shapes are said apart: :meth:`describe`); where
    a custom batch sampler makes the batches, at ``size`` samples per batch (its own size when ``None``)."""
    sampling = found._sampling
    if sampling is None or found.source is BatchSource.SAMPLER:
        return _source_note(found, why)
    size = size or found.batch_size
    bound = (
        f"{_source_note(found, why)}; custom batch sampler {sampling.name}: the {size} largest samples together, an "
        f"upper bound for any batch of {size}"
    )
    return bound + (f" ({sampling.why_not})" if sampling.why_not else "")


def _source_note(found: WorstBatch, why: str = "") -> str:
    if found.source is BatchSource.DATASET:
        return f"the worst batch of all {found.total:,} samples"
    if found.source is BatchSource.DATASET_SUBSET:
        return (
            f"the worst batch of {found.sized:,} of {found.total:,} samples ({found.sized / (found.total or 1):.0%}, a "
            f"fixed random subset): a larger batch may exist; name each sample's "
            "size (size_of=) to cover every sample"
        )
    if found.source is BatchSource.SIZE_FIELD:
        return f"the worst batch of {found.total:,} samples by the sizes named"
    if found.source is BatchSource.BATCH_LIST:
        return f"the largest of the loader's {found.total} batches"
    if found.source is BatchSource.GIVEN:
        return "the batch given: the answer holds for batches no larger than it"
    reason = f" ({why})" if why else ""
    return (
        f"the batch seen{reason}: the answer holds for this batch only; pass the worst batch (batch=...) for an "
        "answer that holds for the run"
    )


def worst_batch_and_length(
    module: Any, datamodule: Any = None, *, size_of: Any = None
) -> tuple[WorstBatch, int | None]:
    """The worst batch of the train dataloader of ``datamodule`` or ``module`` (see :func:`find_worst_batch`), and
    the loader's length in batches (``None`` when it has none). RNG states are untouched.

    Raises:
        NoBatchError: as :func:`~lightning_memkit.estimate.data.batches.sample_batch_and_length`.
    """
    with preserved_rng():
        loader, batches = train_loader_and_length(module, datamodule)
    try:
        return find_worst_batch(loader, size_of=size_of), batches
    except NoBatchError:
        raise
    except ValueError:
        raise
    except Exception as error:  # the user's loader may raise anything: a NoBatchError says where
        raise NoBatchError(
            f"the train dataloader failed while memkit looked for its worst batch: {type(error).__name__}: {error}"
        ) from error
