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
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_memkit._torch_compat import keystr, tree_flatten, tree_flatten_with_path
from lightning_memkit.estimate.data.batches import NoBatchError, batch_size_of, preserved_rng, train_loader_and_length

__all__ = [
    "BatchSource",
    "WorstBatch",
    "find_worst_batch",
    "worst_batch_and_length",
    "seen_batch",
    "batch_shapes",
    "batch_nbytes",
    "batch_tensors",
    "MAX_SIZED_SAMPLES",
    "SCAN_SECONDS",
    "SAMPLED_COUNT",
]

#: The most samples sized one by one; a larger dataset is sized on a fixed random subset of this many.
MAX_SIZED_SAMPLES = 100_000
#: When sizing every sample would take longer than this (seconds, projected from the first samples), a fixed random
#: subset of :data:`SAMPLED_COUNT` samples is sized instead, and the answer says what it covered.
SCAN_SECONDS = 30.0
#: How many samples a sized subset has when the whole dataset would take too long.
SAMPLED_COUNT = 4096
#: How many ranking keys (the total size, then each tensor dimension that varies) may propose a worst batch.
_MAX_KEYS = 8
#: The seed every generator gets while samples are sized and collated, so random augmentations repeat.
_SEED = 0


class BatchSource(enum.Enum):
    """Where a worst batch came from, and so what the answer holds for."""

    DATASET = "every sample of the dataset sized"
    DATASET_SUBSET = "a fixed random subset of the dataset sized"
    SIZE_FIELD = "the sizes the user named"
    BATCH_LIST = "the largest of the loader's ready batches"
    GIVEN = "the batch given"
    SEEN = "the batch seen"


@dataclass
class WorstBatch:
    """The largest batch the data can produce at ``batch_size``, and how it was found.

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

    @property
    def holds_for_the_run(self) -> bool:
        """Whether the answer holds for every batch the data can produce (not only the one seen)."""
        return self.source in (BatchSource.DATASET, BatchSource.SIZE_FIELD, BatchSource.BATCH_LIST)

    def shapes(self) -> str:
        """The batch's tensor shapes, e.g. ``input_ids (16, 256), attention_mask (16, 256), labels (16,)``."""
        return batch_shapes(self.batch)

    def describe(self) -> str:
        """Its shapes and what it is, e.g. ``input_ids (16, 256), labels (16,): the worst batch of all 512 samples``."""
        return f"{self.shapes()}: {self.note}"

    def indices(self, size: int) -> list[int] | None:
        """The dataset indices of the worst batch of ``size`` samples, largest first (the largest repeated when the
        dataset has fewer), or ``None`` where the samples are not known (the batch seen or given)."""
        if self._make is None or not self._order:
            return None
        if size < 1:
            raise ValueError(f"size must be a positive integer, not {size!r}")
        order = self._order
        return [order[i % len(order)] for i in range(size)]

    def at(self, size: int) -> Any:
        """The worst batch of ``size`` samples: the ``size`` largest samples collated (a real batch), or ``None``
        where the samples are not known (the batch seen or given: rebatch that instead)."""
        indices = self.indices(size)
        return None if indices is None else self._make(indices)


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


def _seeded() -> None:
    torch.manual_seed(_SEED)
    random.seed(_SEED)
    try:
        import numpy  # optional dependency: torch runs without numpy

        numpy.random.seed(_SEED)
    except ImportError:  # pragma: no cover - numpy comes with torch
        pass


def _signature(sample: Any) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """A sample's total size and the shape of each of its tensor (or array) leaves."""
    leaves = tree_flatten(sample)[0]
    leaves = [
        inner for leaf in leaves for inner in (tree_flatten(dict(leaf))[0] if isinstance(leaf, Mapping) else [leaf])
    ]
    shapes = tuple(tuple(leaf.shape) for leaf in leaves if hasattr(leaf, "shape"))
    return sum(_leaf_size(leaf) for leaf in leaves), shapes


def _keys(signatures: dict[int, tuple[int, tuple]]) -> list[Callable[[int], int]]:
    """The rankings that may make the largest batch: the total size, then each tensor dimension that varies
    (two images, one tall and one wide, are padded to the tallest and the widest: neither is largest alone)."""
    keys: list[Callable[[int], int]] = [lambda index: signatures[index][0]]
    shapes = [shape for _, shape in signatures.values()]
    first = shapes[0]
    for leaf, shape in enumerate(first):
        for dim in range(len(shape)):
            same_layout = all(len(s) > leaf and len(s[leaf]) == len(shape) for s in shapes)
            if same_layout and len({s[leaf][dim] for s in shapes}) > 1 and len(keys) < _MAX_KEYS:
                keys.append(lambda index, leaf=leaf, dim=dim: signatures[index][1][leaf][dim])
    return keys


def _size_samples(dataset: Any, indices: Sequence[int]) -> dict[int, tuple[int, tuple]]:
    signatures: dict[int, tuple[int, tuple]] = {}
    for index in indices:
        try:
            signatures[index] = _signature(dataset[index])
        except Exception as error:
            raise NoBatchError(
                f"{type(dataset).__name__}[{index}] failed while memkit sized the samples for the worst "
                f"batch: {type(error).__name__}: {error}"
            ) from error
    return signatures


def _indices_to_size(dataset: Any, total: int, max_samples: int) -> tuple[list[int], bool]:
    """Which samples to size: all of them, or a fixed random subset when there are too many or they are slow.

    Returns ``(indices, complete)``."""
    if total > max_samples:
        generator = torch.Generator().manual_seed(_SEED)
        return sorted(torch.randperm(total, generator=generator)[:max_samples].tolist()), False
    probe = min(total, 32)
    started = time.perf_counter()
    for index in range(probe):
        dataset[index]
    projected = (time.perf_counter() - started) / max(probe, 1) * total
    if projected > SCAN_SECONDS and total > SAMPLED_COUNT:
        generator = torch.Generator().manual_seed(_SEED)
        return sorted(torch.randperm(total, generator=generator)[:SAMPLED_COUNT].tolist()), False
    return list(range(total)), True


def _loader_batch_size(loader: DataLoader) -> tuple[int, str]:
    """The loader's samples per batch, and a note when a custom batch sampler decides it."""
    if loader.batch_size is not None:
        return int(loader.batch_size), ""
    sampler = loader.batch_sampler
    size = getattr(sampler, "batch_size", None)
    if not isinstance(size, int):
        with preserved_rng():
            size = max((len(indices) for indices in sampler), default=1)
    kind = (
        ""
        if isinstance(sampler, BatchSampler)
        else (
            f"; custom batch sampler {type(sampler).__name__}: the {size} largest samples together, an upper bound for "
            f"any batch of {size}"
        )
    )
    return int(size), kind


def _collated(loader: DataLoader, dataset: Any) -> Callable[[Sequence[int]], Any]:
    collate = loader.collate_fn

    def make(indices: Sequence[int]) -> Any:
        with preserved_rng():
            _seeded()
            return collate([dataset[index] for index in indices])

    return make


def _from_dataset(loader: DataLoader, batch_size: int, size_of: Any, max_samples: int) -> WorstBatch:
    started = time.perf_counter()
    dataset = loader.dataset
    total = len(dataset)
    if total == 0:
        raise NoBatchError(f"the train dataset {type(dataset).__name__} is empty; pass an example batch (batch=...)")
    make = _collated(loader, dataset)
    with preserved_rng():
        _seeded()
        if size_of is not None:
            sizes = _named_sizes(dataset, size_of, total)
            keys, source, sized = [lambda index: sizes[index]], BatchSource.SIZE_FIELD, total
            candidates = range(total)
        else:
            indices, complete = _indices_to_size(dataset, total, max_samples)
            signatures = _size_samples(dataset, indices)
            keys, candidates = _keys(signatures), indices
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
    return WorstBatch(
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


def _round_robin(orders: list[list[int]]) -> list[int]:
    """The largest by each ranking in turn: one batch then holds the tallest and the widest image at once, which a
    collate that pads to both makes larger than any ranking alone."""
    merged: dict[int, None] = {}
    for rank in range(len(orders[0])):
        for order in orders:
            merged.setdefault(order[rank], None)
    return list(merged)


def _named_sizes(dataset: Any, size_of: Any, total: int) -> Sequence[float]:
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


def find_worst_batch(
    loader: Any, batch_size: int | None = None, *, size_of: Any = None, max_samples: int = MAX_SIZED_SAMPLES
) -> WorstBatch:
    """The largest batch ``loader`` can produce at ``batch_size`` samples (default: the loader's own).

    For a ``DataLoader`` over a map-style dataset every sample is sized (tensor bytes, string lengths; the model
    does not run), and the largest samples are collated with the loader's ``collate_fn``: by total size, and by
    each tensor dimension that varies (the tallest and the widest images). The collated batch with the most bytes
    wins. A dataset over ``max_samples``, or one whose samples are slow to load (sizing all would take over
    :data:`SCAN_SECONDS`), is sized on a fixed random subset, and the note says how much it covered.

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
    started = time.perf_counter()
    if (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and hasattr(loader.dataset, "__len__")
        and hasattr(loader.dataset, "__getitem__")
    ):
        size, sampler_note = _loader_batch_size(loader)
        found = _from_dataset(loader, batch_size or size, size_of, max_samples)
        found.note = _note(found) + sampler_note
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


def _note(found: WorstBatch, why: str = "") -> str:
    """Which batch ``found`` is and what an answer on it holds for (its shapes are said apart: :meth:`describe`)."""
    if found.source is BatchSource.DATASET:
        return f"the worst batch of all {found.total:,} samples"
    if found.source is BatchSource.DATASET_SUBSET:
        return (
            f"the worst batch of {found.sized:,} of {found.total:,} samples ({found.sized / found.total:.0%}, a "
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
    except Exception as error:
        raise NoBatchError(
            f"the train dataloader failed while memkit looked for its worst batch: {type(error).__name__}: {error}"
        ) from error
