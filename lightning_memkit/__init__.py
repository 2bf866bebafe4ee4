"""lightning-memkit: training memory for PyTorch Lightning, measured, explained and fixed.

The public API is what this module exports; everything else may change. Each name is imported from its home when it
is first used (PEP 562), so ``memkit estimate`` loads the estimate and not the callbacks, the planner or the doctor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# first: below the supported torch range, importing fails here with one line naming the range
from lightning_memkit import _torch_range  # noqa: F401

# lightning_memkit.__version__, public but outside __all__: one definition, read by the report too
from lightning_memkit._version import __version__  # noqa: F401

if TYPE_CHECKING:  # what type checkers and editors read; _HOMES is the same table for the import on first use
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

#: home module -> the public names it defines (tests/project/test_public_names.py holds it against the imports above)
_HOMES: dict[str, tuple[str, ...]] = {
    "lightning_memkit.accounting.accountant": ("TensorAccountant",),
    "lightning_memkit.callbacks.activation_checkpointing": ("ActivationCheckpointing",),
    "lightning_memkit.callbacks.activation_offload": ("ActivationOffload",),
    "lightning_memkit.callbacks.auto_fit": ("AutoFit",),
    "lightning_memkit.callbacks.layer_trace": ("LayerTrace",),
    "lightning_memkit.callbacks.max_batch_size": ("MaxBatchSize", "find_max_batch_size"),
    "lightning_memkit.callbacks.memory_doctor": ("MemoryDoctor",),
    "lightning_memkit.callbacks.memory_tracker": ("MemoryTracker",),
    "lightning_memkit.doctor.leaks": ("LeakWatcher",),
    "lightning_memkit.doctor.recorder": ("CreationRecorder",),
    "lightning_memkit.doctor.verdict": ("DoctorReport", "DoctorSession"),
    "lightning_memkit.errors": ("MemkitError",),
    "lightning_memkit.estimate.api": ("estimate_memory", "measure_training_step"),
    "lightning_memkit.estimate.data.worst_batch": ("WorstBatch", "find_worst_batch"),
    "lightning_memkit.estimate.distributed.per_rank": ("DistributedEstimate", "estimate_distributed_memory"),
    "lightning_memkit.estimate.distributed.sharding": ("model_state_bytes",),
    "lightning_memkit.estimate.largest_batch": ("predict_max_batch_size",),
    "lightning_memkit.estimate.step.memory_estimate": ("MemoryEstimate",),
    "lightning_memkit.meter": ("MemoryMeter", "training_state_tensors"),
    "lightning_memkit.modes.checkpoint_policy": ("CheckpointBudget",),
    "lightning_memkit.modes.checkpointing": ("apply_checkpointing",),
    "lightning_memkit.modes.comparison": ("compare_modes",),
    "lightning_memkit.modes.mode": ("Mode", "parse_mode"),
    "lightning_memkit.oom": ("is_out_of_memory",),
    "lightning_memkit.plan.planner": ("plan_fit",),
    "lightning_memkit.plan.result": ("Plan", "PlanError", "PlanRow"),
    "lightning_memkit.plan.space": ("Candidate",),
    "lightning_memkit.records": ("RunSummary", "StepReading"),
    "lightning_memkit.search.budget": ("BudgetExceededError", "MemoryBudget"),
    "lightning_memkit.trace.trace_records": ("LayerTraceResult", "TraceEvent"),
    "lightning_memkit.trace.tracer": ("LayerTracer", "trace_step"),
    "lightning_memkit.units": ("format_bytes", "parse_bytes"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_memkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next read finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
