"""The batch-size search: an estimate-guided core (no Lightning), a CPU memory budget that fails like an
out-of-memory error, and the Lightning trial runner behind MaxBatchSize / find_max_batch_size."""

from lightning_memkit.search.budget import BudgetExceededError, MemoryBudget
from lightning_memkit.search.core import BatchSizeSearch, SearchError, SearchResult, Trial

__all__ = ["BatchSizeSearch", "BudgetExceededError", "MemoryBudget", "SearchError", "SearchResult", "Trial", "find_max_batch_size"]


def find_max_batch_size(trainer, module, datamodule=None, **options):  # noqa: ANN001 - see the wrapped function
    """Find the largest batch size that trains, in a short ``fit`` that stops after the search.

    ``options`` are :class:`~lightning_memkit.callbacks.max_batch_size.MaxBatchSize`'s arguments
    (``margin`` a fraction, ``budget`` bytes, ``max_val`` samples, ...). The size found (samples per
    batch, always one whose trial ran) is set on the module, its hparams or the datamodule, so a
    following ``trainer.fit(module, datamodule)`` trains with it. Returns the ``SearchResult``:
    ``batch_size`` (samples), ``trials`` (each with its ``peak_bytes`` in bytes), ``reason`` and
    ``seconds`` (wall time). Implemented in :func:`lightning_memkit.search.lightning.find_max_batch_size`
    (imported lazily: it needs Lightning).
    """
    from lightning_memkit.search.lightning import find_max_batch_size as find

    return find(trainer, module, datamodule, **options)
