"""Which trial a plan chooses: when several ran on a CPU, each is timed again in interleaved rounds and compared round
by round (:func:`interleaved_rounds`); the fastest wins, unless trials within the machine's measured noise of it
(:func:`ties`) have a lower peak: a tie is settled by the lower peak, with no more rounds (:func:`settle`)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from lightning_memkit.plan import timing
from lightning_memkit.plan.result import PlanRow
from lightning_memkit.plan.rows import observation
from lightning_memkit.plan.time_budget import MIN_ROUNDS
from lightning_memkit.units import format_bytes

__all__ = ["RETIMING_ROUNDS", "TIE_ERRORS", "interleaved_rounds", "round_ratios", "settle", "step_spread", "ties"]

#: CPU: when several trials ran, each is timed this many times more (each timing half the plan's ``timed_seconds``,
#: :data:`~lightning_memkit.plan.timing.TIMED_SECONDS` by default), in rounds of alternating order, and they are
#: compared round by round
RETIMING_ROUNDS = 3
#: a trial is a tie with the fastest when their difference (the mean of the per-round log ratios after interleaved
#: rounds, else the log ratio of the trials' medians) is within this many standard errors of the machine's measured
#: noise (the spread of the per-round ratios, pooled over the trials; without rounds the spread of the trials' own
#: timed steps): a tie is settled by the lower measured peak, with no more rounds (a 0.5 s timing moves by about 15%
#: from one round to the next on a 2-core VM: more rounds cannot settle a few percent in a plan's time)
TIE_ERRORS = 2.0


def interleaved_rounds(
    module: Any,
    ran: list[PlanRow],
    batch: Any,
    device_type: str,
    warmup: int,
    timed: int,
    seconds: float,
    say: Any,
    rounds: int = RETIMING_ROUNDS,
    keep_going: Any = None,
) -> dict[int, list[float]]:
    """Time every trial that ran ``rounds`` more times, in rounds that alternate the order (C B A, A B C, ...), each
    time for ``seconds / 2``, and compare them round by round: the timings of one round are seconds apart, while a
    machine's phases of speed (tens of percent, seconds long on a shared CPU) put timings minutes apart on different
    footings. The row with the lowest median is the anchor; every row's step is the anchor's median times the median
    of its per-round ratios to the anchor. No more rounds follow: a difference the rounds leave within the machine's
    noise is a tie (:func:`settle`). The configurations fit already (the trial measured their peak): no budget here.
    ``rounds=0``: each row keeps its trial's own timing, nothing compared. ``keep_going(seconds per round so far)``,
    when given, is asked after each round from the :data:`MIN_ROUNDS`-th on whether to run the next (the time
    budget's check). Returns each row's timings (``id(row)`` -> seconds per step: its trial's median, then one per
    round)."""
    timings = {id(row): [observation(row)[2]] for row in ran}  # the trial's own first: in no round with the others
    started = time.perf_counter()
    for round_ in range(rounds):
        if round_ >= MIN_ROUNDS and keep_going is not None and not keep_going((time.perf_counter() - started) / round_):
            rounds = round_
            break
        for row in ran[::-1] if round_ % 2 == 0 else ran:
            again = statistics.median(
                timing.timed_step(module, row.candidate, batch, device_type, warmup, timed, seconds / 2)
            )
            timings[id(row)].append(again)
    steps = {id(row): statistics.median(timings[id(row)]) for row in ran}
    how: dict[int, str] = {}  # how a row was priced: none for a row at the median of its own timings
    if rounds > 0 and len(ran) > 1:
        anchor = min(ran, key=lambda row: steps[id(row)])
        for row in ran:
            if row is not anchor:
                ratio = statistics.median(round_ratios(timings, row, anchor))
                steps[id(row)] = steps[id(anchor)] * ratio
                how[id(row)] = (
                    f"{len(timings[id(row)])} interleaved timings, priced from {anchor.candidate.describe()}'s "
                    f"median x {ratio:.3f}, the median of their {rounds} per-round ratios"
                )
    for row in ran:
        row.measured_samples_per_s = row.candidate.effective_batch / steps[id(row)]
        priced = how.get(id(row), f"median of {len(timings[id(row)])} interleaved timings")
        row.note = (
            f"ran: step {steps[id(row)] * 1e3:.1f} ms ({priced}: "
            f"{', '.join(f'{t * 1e3:.1f}' for t in timings[id(row)])} ms)"
        )
        say(
            f"memkit plan: timed in {len(timings[id(row)])} rounds: {row.candidate.describe()} -> "
            f"{steps[id(row)] * 1e3:.1f} ms"
        )
    return timings


def round_ratios(timings: dict[int, list[float]], row: PlanRow, to: PlanRow) -> list[float]:
    """``row``'s step over ``to``'s in each round both were timed in (the trials' own timings left out)."""
    return [b / a for a, b in zip(timings[id(to)][1:], timings[id(row)][1:])]


def _pooled_variance(groups: list[list[float]]) -> float | None:
    """The variance of values about their own group's mean, pooled over the groups (``None`` with no group of two)."""
    squares, freedom = 0.0, 0
    for values in groups:
        if len(values) >= 2:
            mean = statistics.fmean(values)
            squares += sum((value - mean) ** 2 for value in values)
            freedom += len(values) - 1
    return squares / freedom if freedom else None


def ties(ran: list[PlanRow], timings: dict[int, list[float]] | None = None) -> tuple[PlanRow | None, list[tuple]]:
    """The fastest trial, and each other trial against it: ``(row, apart, noise)``, both log ratios of steps:
    ``apart`` how much slower the row is, ``noise`` :data:`TIE_ERRORS` standard errors of that difference as the
    machine's measured noise gives it (``None`` where it was not measured: CUDA trials keep no steps). The row is a
    tie with the fastest when ``apart <= noise``.

    After at least :data:`MIN_ROUNDS` interleaved rounds (``timings`` from :func:`interleaved_rounds`) the noise is
    the spread of the per-round log ratios to the fastest, pooled over the trials, over the square root of the rounds;
    without them, the spread of the log steps within each trial's timing (:func:`step_spread`) makes the standard
    error of the two trials' medians (1.25 x that of a mean)."""
    if not ran:
        return None, []
    fastest = max(ran, key=lambda row: row.measured_samples_per_s)
    step = {id(row): row.candidate.effective_batch / row.measured_samples_per_s for row in ran}
    others = [row for row in ran if row is not fastest]
    rounds = min((len(timings[id(row)]) - 1 for row in ran), default=0) if timings else 0
    compared = []
    if rounds >= MIN_ROUNDS:
        logs = {id(row): [math.log(r) for r in round_ratios(timings, row, fastest)] for row in others}
        variance = _pooled_variance(list(logs.values()))
        for row in others:
            noise = None if variance is None else TIE_ERRORS * math.sqrt(variance / len(logs[id(row)]))
            compared.append((row, math.log(step[id(row)] / step[id(fastest)]), noise))
        return fastest, compared
    spread = step_spread(ran)
    for row in others:
        counts = (len(row.step_seconds), len(fastest.step_seconds))
        noise = None
        if spread is not None and min(counts) > 0:
            noise = TIE_ERRORS * math.sqrt(math.pi / 2) * spread * math.sqrt(1 / counts[0] + 1 / counts[1])
        compared.append((row, math.log(step[id(row)] / step[id(fastest)]), noise))
    return fastest, compared


def step_spread(ran: list[PlanRow]) -> float | None:
    """The standard deviation of one timed step's log seconds, robustly (1.4826 x the median absolute deviation from
    each trial's own median, pooled over the trials; a step the machine stalled in moves it no more than any other
    step, as it moves no trial's median): ``None`` without a trial of two steps."""
    deviations: list[float] = []
    for row in ran:
        logs = sorted(math.log(t) for t in row.step_seconds if t > 0)
        if len(logs) >= 2:
            centre = statistics.median(logs)
            if len(logs) % 2:  # the median step itself says nothing of the spread
                del logs[len(logs) // 2]
            deviations += [abs(value - centre) for value in logs]
    return 1.4826 * statistics.median(deviations) if deviations else None


def settle(ran: list[PlanRow], timings: dict[int, list[float]] | None, say: Any) -> tuple[PlanRow | None, str | None]:
    """The best of the trials that ran: the fastest, unless trials within the machine's measured noise of it
    (:func:`ties`) have a lower measured peak: a tie is settled by the lower peak (the same speed as far as the
    plan can tell, more memory left), with no more rounds. Returns ``(best, the tie's note or None)``."""
    fastest, compared = ties(ran, timings)
    tied = [(row, apart, noise) for row, apart, noise in compared if noise is not None and apart <= noise]
    if fastest is None or not tied:
        return fastest, None
    group = [fastest] + [row for row, _, _ in tied]
    best = min(
        group,
        key=lambda row: (
            row.measured_peak_bytes if row.measured_peak_bytes is not None else math.inf,
            -row.measured_samples_per_s,
        ),
    )
    parts = [
        f"{row.candidate.describe()} {math.exp(apart) - 1:.1%} slower (noise +-{math.exp(noise) - 1:.1%})"
        for row, apart, noise in tied
    ]
    note = (
        f"a tie within the measured noise: {'; '.join(parts)} than the fastest, {fastest.candidate.describe()}; "
        f"the lower peak settles it: {best.candidate.describe()} "
        f"({format_bytes(best.measured_peak_bytes) if best.measured_peak_bytes is not None else '-'} measured)"
    )
    say(f"memkit plan: {note}")
    for row in group:
        row.note += (
            "; chosen: a tie with the fastest, and the lower peak"
            if row is best and row is not fastest
            else "; a tie within the noise, the lower peak chose another"
            if row is not best
            else "; a tie within the noise: the lowest peak of the tie"
        )
    return best, note
