"""The plan's time budget: how long planning may take, what each phase cost, and which phases it left out.

A plan's budget is ``max_seconds`` when given, else the time of the estimate (every candidate's fake step) plus
:data:`BUDGET_STEPS` steps of the user's effective batch, at least :data:`MIN_BUDGET_SECONDS` more. A step of the
effective batch is what the first trial measured (the rule's first candidate: every candidate trains the effective
batch per optimizer step); until it ran, the budget is the estimate plus :data:`MIN_BUDGET_SECONDS`.

The estimate, and trials until one fits, always run (the plan's choice must have run in a real trial within the
memory budget). Every other phase (a further trial, a round of side-by-side timing) runs only when its cost,
predicted from the runs before it, fits what is left. Each phase is recorded (:class:`Phase`: its seconds, or why it
was left out).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BUDGET_STEPS", "MIN_BUDGET_SECONDS", "Phase", "TimeBudget", "budget_text"]

#: the default budget: the estimate's time plus this many steps of the effective batch
BUDGET_STEPS = 20
#: ...and at least this many seconds beyond the estimate: each real run builds a Trainer (tenths of a second) and a
#: CPU's speed drifts by tens of percent within a second, so even a millisecond step needs seconds of timing
MIN_BUDGET_SECONDS = 30.0


@dataclass
class Phase:
    """One phase of a plan.

    Attributes:
        name: ``"estimate"``, ``"trial"`` or ``"rounds"``.
        seconds: its wall time, seconds (0 when left out).
        skipped: why it was left out; ``""`` when it ran.
        detail: what it did (a trial's configuration, the rounds' count).
    """

    name: str
    seconds: float = 0.0
    skipped: str = ""
    detail: str = ""

    def describe(self) -> str:
        """``trial 12.3 s`` or ``rounds left out``."""
        return f"{self.name} left out" if self.skipped else f"{self.name} {self.seconds:.1f} s"


class TimeBudget:
    """A plan's wall-time budget from ``started`` (``time.perf_counter()``): ``max_seconds`` when given, else the
    default (the module's docstring), which :meth:`ran` completes as the estimate and the first trial end.

    Attributes:
        given: ``max_seconds`` as given, or ``None``.
        phases: what ran and what was left out, in order.
        step_s: seconds of one optimizer step of the effective batch, as the first trial measured it (``None``
            before it).
    """

    def __init__(self, max_seconds: float | None, started: float, say: Callable[[str], None]) -> None:
        self.given, self.started, self.say = max_seconds, started, say
        self.phases: list[Phase] = []
        self.step_s: float | None = None

    @property
    def total(self) -> float:
        """The budget in all, seconds (``inf``: none)."""
        if self.given is not None:
            return float(self.given)
        steps = BUDGET_STEPS * self.step_s if self.step_s is not None else 0.0
        return self.seconds("estimate") + max(MIN_BUDGET_SECONDS, steps)

    def left(self) -> float:
        """Seconds left of the budget (negative once past it)."""
        return self.total - (time.perf_counter() - self.started)

    def affords(self, seconds: float) -> bool:
        """Whether a phase predicted to take ``seconds`` fits what is left."""
        return seconds <= self.left()

    def ran(self, name: str, seconds: float, detail: str = "") -> None:
        """Record a phase that ran."""
        self.phases.append(Phase(name, seconds, detail=detail))

    def skip(self, name: str, why: str, detail: str = "") -> None:
        """Record a phase left out, and say why."""
        self.phases.append(Phase(name, skipped=why, detail=detail))
        self.say(f"memkit plan: {name}{f' of {detail}' if detail else ''} left out: {why}")

    def seconds(self, name: str) -> float:
        """Seconds the phases called ``name`` took, together."""
        return sum(phase.seconds for phase in self.phases if phase.name == name)

    def summary(self) -> str:
        """``estimate 9.1 s, 3 trials 40.2 s, rounds left out``."""
        parts = []
        for name in dict.fromkeys(phase.name for phase in self.phases):
            ran = [p for p in self.phases if p.name == name and not p.skipped]
            if ran:
                count = f"{len(ran)} {name}s" if len(ran) > 1 else name
                parts.append(f"{count} {sum(p.seconds for p in ran):.1f} s")
            if any(p.name == name and p.skipped for p in self.phases):
                parts.append(f"{name} left out")
        return ", ".join(parts)


def budget_text(seconds: float | None) -> str:
    """A budget in seconds as text (``"73"``, ``"inf"``)."""
    if seconds is None or math.isinf(seconds):
        return "inf"
    return f"{seconds:.0f}"
