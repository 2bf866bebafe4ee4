"""The batch-size search: an estimate-guided core (no Lightning), a CPU memory budget that fails like an
out-of-memory error, and the Lightning trial runner behind MaxBatchSize / find_max_batch_size."""

from lightning_memkit.search.budget import BudgetExceededError, MemoryBudget
from lightning_memkit.search.core import BatchSizeSearch, SearchError, SearchResult, Trial

__all__ = ["BatchSizeSearch", "BudgetExceededError", "MemoryBudget", "SearchError", "SearchResult", "Trial", "find_max_batch_size"]


def find_max_batch_size(trainer, module, datamodule=None, **options):  # noqa: ANN001 - see the wrapped function
    """See :func:`lightning_memkit.search.lightning.find_max_batch_size` (imported lazily: it needs Lightning)."""
    from lightning_memkit.search.lightning import find_max_batch_size as find

    return find(trainer, module, datamodule, **options)
