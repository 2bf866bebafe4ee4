"""Will it fit? A training step's memory predicted on fake tensors, the CUDA caching-allocator model,
and the largest batch size predicted from a few estimates."""

from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.estimate.api import estimate_memory, measure_training_step
from lightning_memkit.estimate.cuda.caching_allocator import AllocatorView, CudaAllocatorModel
from lightning_memkit.estimate.data.batches import NoBatchError
from lightning_memkit.estimate.step.memory_estimate import EstimateError, MemoryEstimate
from lightning_memkit.estimate.step.settings import reusing_fake_copies

__all__ = [
    "AllocatorView",
    "CudaAllocatorModel",
    "CATEGORIES",
    "EstimateError",
    "MemoryEstimate",
    "NoBatchError",
    "estimate_memory",
    "measure_training_step",
    "reusing_fake_copies",
]
from lightning_memkit.estimate.largest_batch import (  # noqa: E402
    AffineGrowth,
    BatchSizePrediction,
    DoesNotFitError,
    device_capacity_bytes,
    predict_max_batch_size,
)

__all__ += ["AffineGrowth", "BatchSizePrediction", "DoesNotFitError", "device_capacity_bytes", "predict_max_batch_size"]
from lightning_memkit.estimate.batch_split import BatchSplit, estimate_batch_split  # noqa: E402
from lightning_memkit.estimate.mode_needs import ALTERNATIVE_MODES, ModeNeed, mode_needs  # noqa: E402

__all__ += ["ALTERNATIVE_MODES", "BatchSplit", "ModeNeed", "estimate_batch_split", "mode_needs"]
from lightning_memkit.estimate.distributed.per_rank import DistributedEstimate, estimate_distributed_memory  # noqa: E402
from lightning_memkit.estimate.distributed.sharding import (  # noqa: E402
    STRATEGIES,
    ModelStates,
    Sharding,
    model_state_bytes,
    optimizer_state_bytes_per_parameter,
    sharding_of,
)

__all__ += [
    "STRATEGIES",
    "DistributedEstimate",
    "ModelStates",
    "Sharding",
    "estimate_distributed_memory",
    "model_state_bytes",
    "optimizer_state_bytes_per_parameter",
    "sharding_of",
]
