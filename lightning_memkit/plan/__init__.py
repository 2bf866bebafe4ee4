"""The planner: the fastest way to train the user's effective batch within a memory budget (``plan_fit``), its
candidate space and its time model. Core code: the trials run a Lightning Trainer on a copy of the module."""

from lightning_memkit.plan.planner import plan_fit
from lightning_memkit.plan.result import Plan, PlanError, PlanRow, RowStatus
from lightning_memkit.plan.space import Candidate, candidate_space
from lightning_memkit.plan.time_model import ROOFLINES, Roofline, TimeModel

__all__ = [
    "Plan",
    "PlanError",
    "PlanRow",
    "RowStatus",
    "plan_fit",
    "Candidate",
    "candidate_space",
    "ROOFLINES",
    "Roofline",
    "TimeModel",
]
