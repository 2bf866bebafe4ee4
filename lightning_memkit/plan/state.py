"""A plan's state as it runs (:class:`PlanState`): its inputs and settings, its rows, the time model as calibration
and trials refine it, its time budget and notes; and what a trial costs at the machine's speed as measured so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_memkit.plan.inputs import PlanInputs, TrialSettings
from lightning_memkit.plan.result import PlanRow
from lightning_memkit.plan.time_budget import TimeBudget
from lightning_memkit.plan.time_model import TimeModel
from lightning_memkit.plan.timing import MAX_TIMED_STEPS

__all__ = ["PlanState"]


@dataclass
class PlanState:
    """One plan as it runs.

    Attributes:
        inputs: what it plans for.
        settings: how its trials run.
        clock: its time budget (the phases' seconds, or why each was left out).
        say: prints a progress line (or nothing).
        model: the time model, refitted as calibration and trials run.
        rows: the candidates' rows.
        notes: what the reader should know.
        trials_run: how many real trials ran.
        fits_as_is: the baseline fit as is.
        best: the row chosen.
        base_model: the model refits start from (the measured overheads in it, the calibrated once-per-step part).
        reference: the model the time budget prices every real run with (before the calibration, as the baseline's
            step was predicted; the measured / predicted ratio of the steps that ran scales it).
        observations: the real steps the model is fitted to (calibration's, then the trials').
        calibrations: the calibration's own observations.
        overheads: Lightning's loop measured apart, seconds: ``(per micro-batch, per optimizer step)``.
        timings: the interleaved rounds' timings (``id(row)`` -> seconds per step), when they ran.
    """

    inputs: PlanInputs
    settings: TrialSettings
    clock: TimeBudget
    say: Callable[[str], None]
    model: TimeModel
    rows: list[PlanRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trials_run: int = 0
    fits_as_is: bool = False
    best: PlanRow | None = None
    base_model: TimeModel | None = None
    reference: TimeModel | None = None
    observations: list[tuple] = field(default_factory=list)
    calibrations: list[tuple] = field(default_factory=list)
    overheads: tuple[float, float] = (0.0, 0.0)
    timings: dict[int, list[float]] | None = None

    def __post_init__(self) -> None:
        self.base_model = self.base_model or self.model
        self.reference = self.reference or self.model

    def expected_step(self, row: PlanRow) -> float:
        """Seconds one optimizer step of ``row`` takes here: measured when it ran, else the reference model's
        prediction at the machine's speed as measured so far."""
        if row.ran:
            return row.candidate.effective_batch / row.measured_samples_per_s
        c = row.candidate
        predicted = self.reference.step_seconds(
            row.costs, c.accumulation, row.offload_bytes, c.micro_batch, c.precision
        )
        return self.clock.expected(predicted, c.micro_batch)

    def trial_cost(self, row: PlanRow, timed: int | None = None, seconds: float | None = None) -> float:
        """Seconds a trial of ``row`` costs, timing ``timed`` steps for ``seconds`` (the settings' by default)."""
        settings = self.settings
        return self.clock.trial_cost(
            self.expected_step(row),
            row.candidate.accumulation,
            settings.warmup_steps,
            settings.timed_steps if timed is None else timed,
            settings.timed_seconds if seconds is None else seconds,
            MAX_TIMED_STEPS,
            self.inputs.cpu,
        )
