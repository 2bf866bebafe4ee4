"""Which candidates a plan tries, and which one it chooses.

**The trials** take the rows in :func:`~lightning_memkit.plan.rows.trial_order` (each mode's largest micro-batch
that fits, in the rule's order), one at a time, at most ``trials``: the first always, and trials go on until one
fits; each other one only when the time budget affords what a trial has cost so far.

**The choice** is the rule's first among the trials that fit (:func:`~lightning_memkit.plan.space.preference`),
unless another trial is measured faster by more than :data:`MIN_GAIN`. Every other trial that fits is timed again
side by side with it, in rounds of alternating order (a CPU's speed drifts by tens of percent over seconds: timings
seconds apart share the machine's state, a trial's own timing minutes later does not), until the per-round ratios
tell whether it is faster by more than :data:`MIN_GAIN` or slower (after at least :data:`MIN_ROUNDS` rounds, by
:func:`~lightning_memkit.timing.faster_by`, the package's one noise rule) or the time budget ends (at most
:data:`MAX_ROUNDS` rounds). A trial's own timing decides nothing, not even which trials the rounds time: a trial
15% faster measured slower in its own trial on a quiet 2-core CPU, and a plan that left it out chose differently
from the next. What the side-by-side rounds cannot tell apart, or have no time for, the rule decides: the same
choice in every run.
"""

from __future__ import annotations

import statistics
import time

from lightning_memkit.plan.lightning_runs import timed_step
from lightning_memkit.plan.result import PlanRow, RowStatus
from lightning_memkit.plan.rows import dominated_by, trial_order
from lightning_memkit.plan.space import preference
from lightning_memkit.plan.state import PlanState
from lightning_memkit.plan.trials import TrialSteps, run_row
from lightning_memkit.timing import faster_by

__all__ = ["MAX_ROUNDS", "MIN_GAIN", "MIN_ROUNDS", "ROUND_STEPS", "choose", "run_trials"]

#: a trial the rule ranks after the rule's first is chosen only when measured faster than it by more than this share:
#: a smaller gain does not survive a change of machine load, and the rule's first then keeps the choice stable
MIN_GAIN = 0.05
#: side-by-side rounds timed before their per-round ratios can tell two trials apart (a middle half of fewer says
#: nothing of the machine's noise; five, with three members, ran out of the default time budget before a verdict in
#: three of four held-out ConvMixer plans, benchmarks/README.md)
MIN_ROUNDS = 3
#: the most side-by-side rounds (a budget of ``inf`` seconds would otherwise time two equal configurations forever)
MAX_ROUNDS = 10
#: optimizer steps each configuration times per round, at least (and half the trial's seconds on CPU)
ROUND_STEPS = 2


def run_trials(state: PlanState) -> None:
    """Run trials in :func:`~lightning_memkit.plan.rows.trial_order` until ``trials`` ran or none is left; a trial
    after the first that fit runs only when the budget affords the mean wall time of the trials so far. The rows
    left without a trial say why."""
    settings, clock = state.settings, state.clock
    steps = TrialSteps(settings.warmup_steps, settings.timed_steps, settings.timed_seconds)
    while state.inputs.can_run and state.trials_run < settings.trials:
        queue = trial_order(state.rows)
        if not queue:
            break
        row = queue[0]
        if any(r.ran for r in state.rows):
            cost = statistics.fmean(state.trial_seconds.values())
            if not clock.affords(cost):
                clock.skip(
                    "trial", f"about {cost:.0f} s, and {max(clock.left(), 0):.0f} s are left", row.candidate.describe()
                )
                break
        took = run_row(state.inputs, row, steps, state.say)
        state.trial_seconds[id(row)] = took
        clock.ran("trial", took, row.candidate.describe())
        if clock.step_s is None and row.measured_samples_per_s is not None:  # it ran
            clock.step_s = row.candidate.effective_batch / row.measured_samples_per_s
    _mark_not_run(state.rows)


def _mark_not_run(rows: list[PlanRow]) -> None:
    for row in rows:
        if row.fits and row.status is RowStatus.ESTIMATED:
            other = dominated_by(row, rows)
            row.status = RowStatus.NOT_RUN
            row.note = (
                f"not run: no faster than {other.candidate.describe()} (the same micro-batch, less recompute or no "
                "offload)"
                if other is not None
                else "not run: the trials took the rule's earlier candidates"
            )


def choose(state: PlanState) -> None:
    """Choose among the trials that fit (see the module's docstring): ``state.best`` and ``state.reason``."""
    ran = [row for row in state.rows if row.ran]
    if not ran:
        return
    first = min(ran, key=lambda row: preference(row.candidate))
    challengers = [row for row in ran if row is not first]
    state.best = first
    state.reason = "the plan's rule ranks it first among the trials that fit" + (
        "" if challengers else ", the only trial that fit"
    )
    if not challengers:
        return
    rounds = _side_by_side(state, first, challengers)
    verdicts = {id(row): _verdict(row, first, rounds) for row in challengers}
    winners = [row for row in challengers if verdicts[id(row)][0] is True]
    if winners:
        state.best = min(winners, key=lambda row: verdicts[id(row)][1])
        gain = 1 / verdicts[id(state.best)][1] - 1
        state.reason = (
            f"measured {gain:.0%} faster than the rule's first, {first.candidate.describe()}, "
            f"{_how(state.best, rounds)}"
        )
        return
    state.reason += (
        f"; {', '.join(r.candidate.describe() for r in challengers)} not shown faster by more than "
        f"{MIN_GAIN:.0%} {_how(_most_timed(challengers, rounds), rounds)}, so the rule keeps the choice"
    )


def _median(row: PlanRow) -> float:
    return statistics.median(row.step_seconds)


def _side_by_side(state: PlanState, first: PlanRow, challengers: list[PlanRow]) -> list[dict[int, float]]:
    """Time ``first`` and the undecided ``challengers`` again in rounds of alternating order while the budget affords
    a round and one is undecided (at most :data:`MAX_ROUNDS`); returns each round's median step per row
    (``id(row)`` -> seconds)."""
    inputs, settings, clock = state.inputs, state.settings, state.clock
    steps = TrialSteps(settings.warmup_steps, min(ROUND_STEPS, settings.timed_steps), settings.timed_seconds / 2)
    rounds: list[dict[int, float]] = []
    started = time.perf_counter()
    undecided = list(challengers)
    while undecided and len(rounds) < MAX_ROUNDS:
        members = [first, *undecided]
        # the first round is priced at half the members' trials: a round times each once for half a trial's
        # seconds, without the trial's accountant steps; later rounds at the mean of those that ran
        first_round = sum(state.trial_seconds[id(r)] for r in members) / 2
        cost = (time.perf_counter() - started) / len(rounds) if rounds else first_round
        if not clock.affords(cost):
            if not rounds:
                clock.skip("rounds", f"a round takes about {cost:.0f} s, and {max(clock.left(), 0):.0f} s are left")
            break
        timings: dict[int, float] = {}
        for row in members if len(rounds) % 2 else members[::-1]:
            seconds = timed_step(
                inputs.module, row.candidate, inputs.batch, inputs.device_type, steps.warmup, steps.timed, steps.seconds
            )
            timings[id(row)] = statistics.median(seconds)
            row.round_seconds.append(timings[id(row)])
        rounds.append(timings)
        undecided = [row for row in undecided if _verdict(row, first, rounds)[0] is None or len(rounds) < MIN_ROUNDS]
    if rounds:
        clock.ran("rounds", time.perf_counter() - started, f"{len(rounds)} rounds")
        state.say(f"memkit plan: {len(rounds)} side-by-side rounds ({time.perf_counter() - started:.1f} s)")
    return rounds


def _ratios(row: PlanRow, first: PlanRow, rounds: list[dict[int, float]]) -> list[float]:
    return [each[id(row)] / each[id(first)] for each in rounds if id(row) in each]


def _verdict(row: PlanRow, first: PlanRow, rounds: list[dict[int, float]]) -> tuple[bool | None, float]:
    """Whether ``row`` is faster than ``first`` by more than :data:`MIN_GAIN`: ``True`` once the rounds show it,
    ``False`` once they show it slower than ``first``, else ``None`` (fewer than :data:`MIN_ROUNDS` rounds, or not
    told apart yet: the rounds go on while the budget pays); and the median of its per-round step over ``first``'s.
    "Not 5% faster" alone ends nothing: three noisy rounds said so of a configuration 8-18% faster (held-out
    ConvMixer), and the choice flipped between plans."""
    ratios = _ratios(row, first, rounds)
    if len(ratios) < MIN_ROUNDS:
        return None, statistics.median(ratios) if ratios else _median(row) / _median(first)
    if faster_by(ratios, [1.0], MIN_GAIN):
        return True, statistics.median(ratios)
    return (False if faster_by([1.0], ratios) else None), statistics.median(ratios)


def _most_timed(rows: list[PlanRow], rounds: list[dict[int, float]]) -> PlanRow:
    """The row timed in the most side-by-side rounds (a clearly slower one leaves the rounds early)."""
    return max(rows, key=lambda row: sum(id(row) in each for each in rounds))


def _how(row: PlanRow, rounds: list[dict[int, float]]) -> str:
    count = sum(id(row) in each for each in rounds)
    if not count:
        return "(no time was left to time it side by side)"
    return f"over {count} side-by-side round{'s' if count != 1 else ''}"
