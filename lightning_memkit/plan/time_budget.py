"""The plan's time budget: how long planning may take, what each phase cost, and which phases it left out.

A plan states its budget at the start: ``max_seconds`` when given, else the time of the estimate (every candidate's
fake step) plus :data:`BUDGET_STEPS` steps of the baseline (the user's batch as is, predicted by the time model:
it does not fit, so it is not run), at least :data:`MIN_BUDGET_SECONDS`. Once real steps have run, the default is
taken again from them (the baseline's predicted step times the measured / predicted ratio of the steps that ran):
a loaded machine's steps are slower than the roofline measured at the plan's start says.

The estimate, and real trials until one fits, always run (the plan's choice must have run in a real trial within the
memory budget). Every other phase
(the CPU calibration, the second and third trials, the interleaved rounds) runs only when its cost, predicted from
the steps it will time, fits in what is left of the budget; a trial may time fewer steps to fit (at least
:data:`MIN_TIMED_STEPS`). Each phase is recorded (:class:`Phase`: its seconds, or why it was left out) and said as
it ends.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Phase",
    "TimeBudget",
    "budget_text",
    "describe_seconds",
    "BUDGET_STEPS",
    "MIN_BUDGET_SECONDS",
    "FIT_OVERHEAD_S",
    "ACCOUNTANT_FACTOR",
    "MIN_TIMED_STEPS",
    "MIN_ROUNDS",
]

#: the default budget: the estimate's time plus this many steps of the baseline
BUDGET_STEPS = 20
#: ...and at least this many seconds beyond the estimate: a CPU's speed drifts by tens of percent within a second,
#: so a configuration whose step takes milliseconds needs about a second of timing to be told from another, and each
#: real run builds a Trainer (tenths of a second)
MIN_BUDGET_SECONDS = 30.0
#: seconds one real run costs beyond its steps (a deep copy, a Trainer built, set up and torn down), until the plan
#: measures it (CPU: with Lightning's loop)
FIT_OVERHEAD_S = 0.5
#: CPU: a trial's two steps under the budget's accountant (at most two micro-batches each) cost about this many
#: times the same micro-batches without it (the accountant's bookkeeping per op)
ACCOUNTANT_FACTOR = 2.0
#: the fewest timed steps a trial shortened to fit the budget times (a median and a spread need two)
MIN_TIMED_STEPS = 2
#: CPU: the fewest rounds the interleaved timing or the calibration runs when the time budget cannot pay for all of
#: them (one round says nothing of the machine's noise); fewer, and the phase is left out
MIN_ROUNDS = 2


@dataclass
class Phase:
    """One phase of a plan.

    Attributes:
        name: ``"estimate"``, ``"overheads"``, ``"calibration"``, ``"trial"``, ``"rounds"``.
        seconds: its wall time, seconds (0 when left out).
        skipped: why it was left out; ``""`` when it ran.
        detail: what it did (a trial's configuration, the rounds' count).
    """

    name: str
    seconds: float = 0.0
    skipped: str = ""
    detail: str = ""

    def describe(self) -> str:
        """``calibration 12.3 s`` or ``calibration left out``."""
        return f"{self.name} left out" if self.skipped else f"{self.name} {self.seconds:.1f} s"


class TimeBudget:
    """A plan's wall-time budget from ``started`` (``time.perf_counter()``): ``max_seconds``, or the default (see the
    module's docstring) once :meth:`estimated` sets it.

    ``say`` prints a progress line. :meth:`expected` turns a predicted step into the expected one (scaled by the
    measured / predicted ratio of the steps that ran, :meth:`observe`); :meth:`timing_cost` and :meth:`trial_cost`
    price a phase's real runs from their expected steps.
    """

    def __init__(self, max_seconds: float | None, started: float, say: Callable[[str], None]) -> None:
        self.given = max_seconds
        self.started = started
        self.total: float | None = float(max_seconds) if max_seconds is not None else None
        self.say = say
        self.phases: list[Phase] = []
        self.fit_overhead_s = FIT_OVERHEAD_S
        self.baseline_step_s: float | None = None  # the baseline's predicted step (the default's unit)
        self.estimate_s: float | None = None
        self._base = 0.0  # the default budget's start: the estimate's end (the baseline steps are counted from it)
        self._ratios: dict[Any, tuple[float, int | None]] = {}  # (measured / predicted step, micro-batch) per run
        self.baseline_micro_batch: int | None = None

    # ------------------------------------------------------------------ the budget
    def elapsed(self) -> float:
        """Seconds since the plan started."""
        return time.perf_counter() - self.started

    def left(self) -> float:
        """Seconds left of the budget (infinite before the default is set)."""
        return math.inf if self.total is None else self.total - self.elapsed()

    def state(self, baseline_step_s: float | None, micro_batch: int | None = None) -> None:
        """Say the budget at the start: the one given, or the default's parts with the baseline's predicted step
        (``micro_batch``: the baseline's, the size its later expected step is taken at)."""
        self.baseline_step_s = baseline_step_s if baseline_step_s and baseline_step_s > 0 else None
        self.baseline_micro_batch = micro_batch
        if self.given is not None:
            self.say(
                f"memkit plan: time budget {budget_text(self.given)} s (max_seconds): the estimate and trials until "
                "one fits always run; the other phases only where their predicted cost fits what is left"
            )
            return
        self.say(
            f"memkit plan: time budget: the estimate, then {self._default_text()} (set max_seconds, "
            "--max-seconds, to change it); phases whose predicted cost does not fit are left out"
        )

    def _default_after_estimate(self) -> float:
        steps = (
            BUDGET_STEPS * self.expected(self.baseline_step_s, self.baseline_micro_batch)
            if self.baseline_step_s
            else 0.0
        )
        return max(steps, MIN_BUDGET_SECONDS)

    def _default_text(self) -> str:
        if not self.baseline_step_s:
            return f"{MIN_BUDGET_SECONDS:.0f} s"
        step = self.expected(self.baseline_step_s, self.baseline_micro_batch)
        text = f"{BUDGET_STEPS} baseline steps of about {step:.2f} s ({BUDGET_STEPS * step:.1f} s"
        return text + (f"; at least {MIN_BUDGET_SECONDS:.0f} s)" if BUDGET_STEPS * step < MIN_BUDGET_SECONDS else ")")

    def estimated(self, candidates: int, fitting: int, seconds: float | None = None) -> None:
        """The estimate ended (``seconds``: its time; default: everything since the plan started, which is the
        estimate when it is the first phase): record it, set the default budget, say both. The default's baseline
        steps count from the estimate's end (from the second's when the baseline's trial did not fit and the other
        candidates were estimated after it)."""
        seconds = self.elapsed() if seconds is None else seconds
        self.phases.append(Phase("estimate", seconds, detail=f"{candidates} candidates"))
        self.estimate_s = (self.estimate_s or 0.0) + seconds
        if self.given is None:
            self._base = self.elapsed()
            self.total = self._base + self._default_after_estimate()
        self.say(
            f"memkit plan: estimate: {candidates} candidate{'s' if candidates != 1 else ''} in "
            f"{seconds:.1f} s, {fitting} predicted to fit; time budget {budget_text(self.total)} s in all, "
            f"{max(self.left(), 0.0):.0f} s left"
        )

    def rebase(self) -> None:
        """The default budget taken again from the steps measured so far (a slower or faster machine than the
        roofline measured at the start said); said when it moves by more than 10%."""
        if self.given is not None or self.estimate_s is None or not self._ratios or not self.baseline_step_s:
            return
        total = self._base + self._default_after_estimate()
        if self.total is not None and abs(total / self.total - 1) > 0.10:
            self.say(
                f"memkit plan: time budget now {total:.0f} s: the steps that ran nearest the baseline's micro-batch "
                f"took {self.speed(self.baseline_micro_batch):.2f} x the time model's prediction, so "
                f"{self._default_text()}"
            )
        self.total = total

    # ------------------------------------------------------------------ phases
    def ran(self, name: str, seconds: float, detail: str = "", say: str | None = None) -> Phase:
        """Record a phase that ran (``say``: its progress line, without the seconds, which are added)."""
        phase = Phase(name, seconds, detail=detail)
        self.phases.append(phase)
        if say is not None:
            self.say(f"memkit plan: {say} ({seconds:.1f} s)")
        return phase

    def skip(self, name: str, why: str, detail: str = "") -> Phase:
        """Record (and say) a phase left out, and why."""
        phase = Phase(name, skipped=why, detail=detail)
        self.phases.append(phase)
        self.say(f"memkit plan: {name}{f' of {detail}' if detail else ''} left out: {why}")
        return phase

    def seconds(self, name: str) -> float:
        """The seconds of every phase of that name together."""
        return sum(phase.seconds for phase in self.phases if phase.name == name)

    def summary(self) -> str:
        """``estimate 17.3 s, overheads 1.2 s, calibration left out, 3 trials 45.0 s, rounds left out``."""
        parts: list[str] = []
        for name in dict.fromkeys(phase.name for phase in self.phases):
            phases = [phase for phase in self.phases if phase.name == name]
            ran = [phase for phase in phases if not phase.skipped]
            if name == "trial":
                text = f"{len(ran)} trial{'s' if len(ran) != 1 else ''} {sum(p.seconds for p in ran):.1f} s"
                left = len(phases) - len(ran)
                parts.append(text + (f" ({left} left out)" if left else ""))
            elif ran:
                parts.append(f"{name} {sum(p.seconds for p in ran):.1f} s")
            else:
                parts.append(f"{name} left out")
        return ", ".join(parts)

    # ------------------------------------------------------------------ costs
    def observe(
        self,
        predicted_step_s: float | None,
        measured_step_s: float | None,
        key: Any = None,
        micro_batch: int | None = None,
    ) -> None:
        """A real run's step against the time model's prediction for it (the model the budget's predictions use), at
        its ``micro_batch``; a ``key`` observed again replaces its ratio (a configuration timed again as a phase goes
        on)."""
        if predicted_step_s and measured_step_s and predicted_step_s > 0 and measured_step_s > 0:
            self._ratios[len(self._ratios) if key is None else key] = (measured_step_s / predicted_step_s, micro_batch)

    def speed(self, micro_batch: int | None = None) -> float:
        """Measured / predicted seconds per step (1 before any real run): the median over the real runs at the
        micro-batch nearest ``micro_batch`` (on log scales) when given, else over them all. A CPU's kernels are not
        linear in the micro-batch, so the runs nearest in size price a run best."""
        if not self._ratios:
            return 1.0
        ratios = list(self._ratios.values())
        sized = [(ratio, size) for ratio, size in ratios if size]
        if micro_batch and sized:
            nearest = min({size for _, size in sized}, key=lambda size: abs(math.log(size / micro_batch)))
            ratios = [(ratio, size) for ratio, size in sized if size == nearest]
        return statistics.median(ratio for ratio, _ in ratios)

    def expected(self, predicted_step_s: float | None, micro_batch: int | None = None) -> float:
        """The step the machine is expected to take where the time model predicts ``predicted_step_s`` (at
        ``micro_batch``: :meth:`speed`)."""
        return (predicted_step_s or 0.0) * self.speed(micro_batch)

    def timing_cost(self, step_s: float, warmup: int, timed: int, seconds: float, max_steps: int) -> float:
        """Seconds of one timing run (a deep copy and a Trainer): ``warmup`` steps, then at least ``timed`` until
        they add up to ``seconds`` (at most ``max_steps``), each ``step_s``."""
        steps = timed
        if step_s > 0 and seconds > 0:
            steps = min(max(timed, math.ceil(seconds / step_s)), max(timed, max_steps))
        return self.fit_overhead_s + (warmup + steps) * step_s

    def trial_cost(
        self, step_s: float, accumulation: int, warmup: int, timed: int, seconds: float, max_steps: int, cpu: bool
    ) -> float:
        """Seconds of one real trial of a configuration whose step takes ``step_s``: on CPU two steps under the
        accountant (at most two micro-batches each, :data:`ACCOUNTANT_FACTOR` times as slow) in a run of their own,
        then the timing run; on CUDA one run does both."""
        timing = self.timing_cost(step_s, warmup, timed, seconds if cpu else 0.0, max_steps)
        if not cpu:
            return timing
        micro = step_s / max(accumulation, 1)
        return timing + self.fit_overhead_s + ACCOUNTANT_FACTOR * 2 * min(accumulation, 2) * micro

    def fitting_steps(
        self,
        step_s: float,
        accumulation: int,
        warmup: int,
        timed: int,
        seconds: float,
        max_steps: int,
        cpu: bool,
        share: float,
    ) -> tuple[int, float] | None:
        """The ``(timed steps, seconds)`` a trial times to cost at most ``share`` seconds: as asked when it fits,
        else fewer steps (down to :data:`MIN_TIMED_STEPS`, no seconds rule); ``None`` when even that does not fit."""
        if self.trial_cost(step_s, accumulation, warmup, timed, seconds, max_steps, cpu) <= share:
            return timed, seconds
        # the steps asked for without the seconds rule, then fewer
        for fewer in range(timed if seconds > 0 else timed - 1, min(MIN_TIMED_STEPS, timed) - 1, -1):
            if self.trial_cost(step_s, accumulation, warmup, fewer, 0.0, max_steps, cpu) <= share:
                return fewer, 0.0
        return None


def describe_seconds(seconds: float) -> str:
    """``about 12 s`` (one decimal below 10 s)."""
    return f"about {seconds:.1f} s" if seconds < 10 else f"about {seconds:.0f} s"


def budget_text(seconds: float | None) -> str:
    """A budget in seconds as said: whole seconds from 10 s, three figures below (``0.001``), ``none`` for none."""
    if seconds is None or math.isinf(seconds):
        return "none"
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.3g}"
