"""A plan's trials in order (:func:`run_trials`): the candidate ranked first each time (the plausible winners first
when the time model is not calibrated), each within its share of the time budget, each refitting the time model; then
on CPU the trials timed again in interleaved rounds (:func:`time_again`)."""

from __future__ import annotations

import time

from lightning_memkit.plan.calibration import plausible_winners
from lightning_memkit.plan.result import PlanRow, RowStatus
from lightning_memkit.plan.rows import contenders, needless_trial, observation, ranked, repredict
from lightning_memkit.plan.settle import RETIMING_ROUNDS, interleaved_rounds
from lightning_memkit.plan.state import PlanState
from lightning_memkit.plan.time_budget import MIN_ROUNDS, MIN_TIMED_STEPS, describe_seconds
from lightning_memkit.plan.timing import GIVE_UP_FACTOR, MAX_TIMED_STEPS
from lightning_memkit.plan.trials import run_row

__all__ = ["run_trials", "time_again"]


def run_trials(state: PlanState) -> None:
    """Run trials, the candidate ranked first each time, until ``trials`` ran or none is left: without a
    calibration the model's ranking is a guess, so the candidates that are the fastest under some plausible time
    model (the most plausible first) run first."""
    inputs = state.inputs
    cover = (
        []
        if state.calibrations or not (inputs.cpu and inputs.can_run)
        else plausible_winners(contenders(state.rows), state.model)
    )
    if len(cover) > 1:
        state.notes.append(
            "the time model was not calibrated: the trials ran first the candidates that are the fastest "
            "under some plausible time model: " + "; ".join(r.candidate.describe() for r in cover)
        )
    while inputs.can_run and state.trials_run < state.settings.trials:
        queue = [r for r in ranked(state.rows) if r.fits and r.status is RowStatus.ESTIMATED]
        if not queue:
            break
        waiting_cover = [r for r in cover if any(r is q for q in queue)]
        queue = waiting_cover + [r for r in queue if not any(r is c for c in waiting_cover)]
        row = queue[0]
        skipped = needless_trial(row, state.rows)
        if skipped is not None:
            row.note, row.status = skipped, RowStatus.NOT_RUN
            continue
        timing = _trial_timing(state, row, queue)
        if timing is None:
            break
        _run_trial(state, row, timing)


def _trial_timing(state: PlanState, row: PlanRow, queue: list[PlanRow]) -> tuple[int, float] | None:
    """``(timed steps, seconds)`` for ``row``'s trial within its share of what is left of the time budget (a
    trial times fewer steps to keep to it), or ``None`` when even its fewest do not fit and a trial has fit
    already (recorded as left out): until one has fit, a trial runs whatever the budget says, as the plan's
    choice must have run."""
    settings, clock = state.settings, state.clock
    waiting = min(settings.trials - state.trials_run, sum(needless_trial(r, state.rows) is None for r in queue))
    timing = clock.fitting_steps(
        state.expected_step(row),
        row.candidate.accumulation,
        settings.warmup_steps,
        settings.timed_steps,
        settings.timed_seconds,
        MAX_TIMED_STEPS,
        state.inputs.cpu,
        clock.left() / max(waiting, 1),
    )
    shortest = min(settings.timed_steps, MIN_TIMED_STEPS)
    if timing is None and state.trial_cost(row, shortest, 0.0) <= clock.left():
        timing = (shortest, 0.0)  # more than its share, its fewest steps: the trials after it may not run
    if timing is None:
        if any(r.ran for r in state.rows):
            clock.skip(
                "trial",
                f"{describe_seconds(state.trial_cost(row, shortest, 0.0))} with {shortest} timed steps, and "
                f"{max(clock.left(), 0):.0f} s of the time budget are left",
                detail=row.candidate.describe(),
            )
            return None
        timing = (shortest, 0.0)
    if timing != (settings.timed_steps, settings.timed_seconds):
        state.say(
            f"memkit plan: trial of {row.candidate.describe()}: {timing[0]} timed steps, to keep to the time "
            f"budget ({describe_seconds(state.trial_cost(row, *timing))}, {max(clock.left(), 0):.0f} s left)"
        )
    return timing


def _run_trial(state: PlanState, row: PlanRow, timing: tuple[int, float]) -> None:
    """Run ``row``'s trial; what it measured rescales the time budget's prices and (CPU) refits the time model."""
    cpu, clock = state.inputs.cpu, state.clock
    state.trials_run += 1
    fastest = min((r.candidate.effective_batch / r.measured_samples_per_s for r in state.rows if r.ran), default=0.0)
    timed, seconds = timing
    run_row(
        state.inputs,
        row,
        (state.settings.warmup_steps, timed, seconds),
        state.say,
        clock,
        give_up=GIVE_UP_FACTOR * fastest if cpu else 0.0,
    )
    if not row.ran or row.costs is None:
        return
    clock.observe(
        state.reference.step_seconds(row.costs, row.candidate.accumulation, row.offload_bytes),
        row.candidate.effective_batch / row.measured_samples_per_s,
        micro_batch=row.candidate.micro_batch,
    )
    clock.rebase()
    if cpu:  # every trial that ran refits the time model, and the candidates not run yet are ranked again
        state.observations.append(observation(row))
        state.model = state.base_model.fit(state.observations)
        repredict(state.rows, state.model, measured_errors=True)


def time_again(state: PlanState, ran: list[PlanRow]) -> None:
    """CPU: time the trials that ran again in interleaved rounds, as many as the time budget pays for (at least
    MIN_ROUNDS, else left out: the trials' own timings decide)."""
    settings, clock = state.settings, state.clock
    per_round = sum(
        clock.timing_cost(
            state.expected_step(row),
            settings.warmup_steps,
            settings.timed_steps,
            settings.timed_seconds / 2,
            MAX_TIMED_STEPS,
        )
        for row in ran
    )
    rounds = max((n for n in range(MIN_ROUNDS, RETIMING_ROUNDS + 1) if n * per_round <= clock.left()), default=0)
    if not rounds:
        clock.skip(
            "rounds",
            f"{MIN_ROUNDS} rounds of the {len(ran)} trials would take "
            f"{describe_seconds(MIN_ROUNDS * per_round)}, and {max(clock.left(), 0):.0f} s of "
            "the time budget are left: the trials' own timings decide, a difference within "
            "their steps' noise is a tie",
        )
        return
    started = time.perf_counter()
    inputs = state.inputs
    state.timings = interleaved_rounds(
        inputs.module,
        ran,
        inputs.batch,
        inputs.device_type,
        settings.warmup_steps,
        settings.timed_steps,
        settings.timed_seconds,
        state.say,
        rounds,
        keep_going=lambda seconds: seconds <= clock.left(),
    )
    rounds = min(len(state.timings[id(row)]) - 1 for row in ran)
    clock.ran(
        "rounds",
        time.perf_counter() - started,
        detail=f"{rounds} rounds",
        say=f"rounds: the {len(ran)} trials timed {rounds} more times each, in rounds of alternating order",
    )
    state.observations = state.calibrations + [observation(r) for r in ran if r.costs is not None]
    state.model = state.base_model.fit(state.observations)
    repredict(state.rows, state.model, measured_errors=True)
    state.notes.append(
        f"each trial was timed {1 + rounds} times in rounds of alternating order and priced "
        "round by round against the one with the lowest median: a CPU's speed drifts by tens of "
        "percent while a plan runs"
    )
