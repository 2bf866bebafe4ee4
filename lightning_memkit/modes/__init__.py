"""Memory modes: precision and activation checkpointing as one value, and the comparison of modes.

Core code (no Lightning import except in compare.py, which runs Trainers). Checkpointing is split by
concept: checkpoint_policy (policies, choice of regions), checkpoint_plan (records), checkpoint_wrap
(wrapping), checkpoint_measure (measuring); checkpointing applies them.
"""

from lightning_memkit.modes.checkpoint_measure import MeasureError, measure_activation_bytes
from lightning_memkit.modes.checkpoint_plan import CheckpointPlan, CheckpointSegment
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget, find_repeated_blocks, parse_budget
from lightning_memkit.modes.checkpoint_wrap import CheckpointHandle
from lightning_memkit.modes.checkpointing import apply_checkpointing, plan_checkpointing
from lightning_memkit.modes.compare_result import CompareResult, ModeResult, read_compare
from lightning_memkit.modes.comparison import compare_modes
from lightning_memkit.modes.mode import Mode, parse_mode, parse_modes, resolve_precision

__all__ = [
    "Mode",
    "parse_mode",
    "parse_modes",
    "resolve_precision",
    "CheckpointBudget",
    "CheckpointHandle",
    "CheckpointPlan",
    "CheckpointSegment",
    "apply_checkpointing",
    "plan_checkpointing",
    "find_repeated_blocks",
    "measure_activation_bytes",
    "parse_budget",
    "MeasureError",
    "compare_modes",
    "CompareResult",
    "ModeResult",
    "read_compare",
]
