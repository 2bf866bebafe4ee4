"""lightning-memkit: training memory for PyTorch Lightning, measured, explained and fixed.

The public API is what this module exports; everything else may change.
"""

# first: below the supported torch range, importing fails here with one line naming the range
from lightning_memkit import _torch_range  # noqa: F401

# lightning_memkit.__version__, public but outside __all__: one definition, read by the report too
from lightning_memkit._version import __version__  # noqa: E402, F401
from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.activation_offload import ActivationOffload
from lightning_memkit.callbacks.auto_fit import AutoFit
from lightning_memkit.callbacks.layer_trace import LayerTrace
from lightning_memkit.callbacks.max_batch_size import MaxBatchSize, find_max_batch_size
from lightning_memkit.callbacks.memory_doctor import MemoryDoctor
from lightning_memkit.callbacks.memory_tracker import MemoryTracker
from lightning_memkit.doctor.leaks import LeakWatcher
from lightning_memkit.doctor.recorder import CreationRecorder
from lightning_memkit.doctor.verdict import DoctorReport, DoctorSession
from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.api import estimate_memory, measure_training_step
from lightning_memkit.estimate.data.worst_batch import WorstBatch, find_worst_batch
from lightning_memkit.estimate.distributed.per_rank import DistributedEstimate, estimate_distributed_memory
from lightning_memkit.estimate.distributed.sharding import model_state_bytes
from lightning_memkit.estimate.largest_batch import predict_max_batch_size
from lightning_memkit.estimate.step.memory_estimate import MemoryEstimate
from lightning_memkit.meter import MemoryMeter, training_state_tensors
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.modes.checkpointing import apply_checkpointing
from lightning_memkit.modes.comparison import compare_modes
from lightning_memkit.modes.mode import Mode, parse_mode
from lightning_memkit.oom import is_out_of_memory
from lightning_memkit.plan.planner import plan_fit
from lightning_memkit.plan.result import Plan, PlanError, PlanRow
from lightning_memkit.plan.space import Candidate
from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.search.budget import BudgetExceededError, MemoryBudget
from lightning_memkit.trace.trace_records import LayerTraceResult, TraceEvent
from lightning_memkit.trace.tracer import LayerTracer, trace_step
from lightning_memkit.units import format_bytes, parse_bytes

__all__ = [
    "Mode",
    "parse_mode",
    "apply_checkpointing",
    "compare_modes",
    "CheckpointBudget",
    "ActivationCheckpointing",
    "ActivationOffload",
    "AutoFit",
    "plan_fit",
    "Plan",
    "PlanRow",
    "PlanError",
    "Candidate",
    "MemoryTracker",
    "MemoryDoctor",
    "DoctorSession",
    "DoctorReport",
    "LeakWatcher",
    "CreationRecorder",
    "LayerTrace",
    "LayerTracer",
    "trace_step",
    "TraceEvent",
    "LayerTraceResult",
    "MemoryMeter",
    "TensorAccountant",
    "StepReading",
    "RunSummary",
    "training_state_tensors",
    "is_out_of_memory",
    "format_bytes",
    "parse_bytes",
    "estimate_memory",
    "measure_training_step",
    "predict_max_batch_size",
    "find_worst_batch",
    "WorstBatch",
    "estimate_distributed_memory",
    "model_state_bytes",
    "DistributedEstimate",
    "MemoryEstimate",
    "MaxBatchSize",
    "find_max_batch_size",
    "MemoryBudget",
    "BudgetExceededError",
    "MemkitError",
]
