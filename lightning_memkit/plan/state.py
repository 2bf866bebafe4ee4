"""A plan's state as it runs (:class:`PlanState`): its inputs and settings, its rows, its time budget and notes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_memkit.plan.inputs import PlanInputs, TrialSettings
from lightning_memkit.plan.result import PlanRow
from lightning_memkit.plan.time_budget import TimeBudget

__all__ = ["PlanState"]


@dataclass
class PlanState:
    """One plan as it runs.

    Attributes:
        inputs: what it plans for.
        settings: how its trials run.
        clock: its time budget (the phases' seconds, or why each was left out).
        say: prints a progress line (or nothing).
        rows: the candidates' rows.
        notes: what the reader should know.
        trial_seconds: each trial's wall time, seconds (``id(row)`` -> seconds): what the budget prices the next
            run at.
        fits_as_is: the baseline fit as is.
        best: the row chosen.
        reason: one line on why it was chosen.
        world_size: the devices the rows are for (the fewest that fit, when the plan looks for them).
    """

    inputs: PlanInputs
    settings: TrialSettings
    clock: TimeBudget
    say: Callable[[str], None]
    rows: list[PlanRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trial_seconds: dict[int, float] = field(default_factory=dict)
    fits_as_is: bool = False
    best: PlanRow | None = None
    reason: str = ""
    world_size: int = 1

    @property
    def trials_run(self) -> int:
        """How many real trials ran."""
        return len(self.trial_seconds)
