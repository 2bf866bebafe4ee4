"""The CPU calibration of a plan's time model: real steps timed at the smallest micro-batch (with accumulation 1 and
:data:`CALIBRATION_ACCUMULATION`: a micro-batch's time and the once-per-step part) and at larger ones predicted to fit
(each size's correction), run only where it can change which candidates get trials (:func:`calibration_needless`:
not when every candidate that is the fastest under some plausible time model gets one) and where the time budget
pays for it."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lightning_memkit.plan import timing
from lightning_memkit.plan.inputs import PlanInputs
from lightning_memkit.plan.result import PlanRow, RowStatus
from lightning_memkit.plan.rows import contenders
from lightning_memkit.plan.space import Candidate
from lightning_memkit.plan.time_budget import MIN_ROUNDS, TimeBudget, describe_seconds
from lightning_memkit.plan.time_model import TimeModel
from lightning_memkit.plan.timing import MAX_TIMED_STEPS

__all__ = [
    "CALIBRATION_ACCUMULATION",
    "CALIBRATION_ROUNDS",
    "CALIBRATION_SIZES",
    "PLAUSIBLE_OP_OVERHEADS",
    "PLAUSIBLE_SCALES",
    "PLAUSIBLE_SIZE_EXPONENTS",
    "CalibrationLimits",
    "calibrate",
    "calibration_needless",
    "calibration_rows",
    "calibration_steps",
    "plausible_models",
    "plausible_winners",
    "split_calibration",
]

#: CPU: the calibration times the smallest micro-batch with accumulation 1 and this (their difference: one
#: micro-batch; the rest: the once-per-step part), and larger sizes predicted to fit (:data:`CALIBRATION_SIZES`)
#: with accumulation 1
CALIBRATION_ACCUMULATION = 4
#: CPU: the most larger micro-batch sizes the calibration times (the largest that fit; the sizes between are
#: interpolated): each adds a timing per round, and one step of a large micro-batch can outlast its half-second
CALIBRATION_SIZES = 4
#: CPU: ...in this many rounds of alternating order (each of its timings, two at the smallest micro-batch and one at
#: each larger size predicted to fit, half the plan's ``timed_seconds``: a batch of 16 whose sizes 1 to 8 fit takes
#: 2.5 times this many ``timed_seconds``, longer where one step takes longer than that): the once-per-step part is a
#: difference of two timings, and two rounds left it several milliseconds off when one fell in a slow phase
CALIBRATION_ROUNDS = 4
#: CPU: the calibration is left out when every candidate that is the fastest under some time model of this grid
#: gets a trial (the kernels' scale times each of these, the per-op overhead times each of
#: :data:`PLAUSIBLE_OP_OVERHEADS`, and a micro-batch's ops corrected by each of :data:`PLAUSIBLE_SIZE_EXPONENTS`): a
#: CPU's fitted scale and per-op cost have ranged over about these (a transformer's ops cost 10 to 50 us each in a
#: training step, where one tiny ``add`` costs a few us)
PLAUSIBLE_SCALES = (0.5, 1.0, 2.0, 4.0)
#: ...the per-op overheads' factors...
PLAUSIBLE_OP_OVERHEADS = (1.0, 4.0, 20.0)
#: ...and the exponents ``e`` of a micro-batch's correction ``(largest / micro-batch) ** e`` (the largest candidate
#: micro-batch's ops as modelled): a CPU's kernels run a small micro-batch less efficiently than a large one (the
#: calibration measures this per size; a DemoResNet step at micro-batch 2 costs about what it costs at 4)
PLAUSIBLE_SIZE_EXPONENTS = (0.0, 0.25, 0.5)


def split_calibration(
    ones: list[float], manys: list[float], per_batch: float, per_step: float
) -> tuple[float, float | None]:
    """Seconds of one step at accumulation 1 and at :data:`CALIBRATION_ACCUMULATION`, round by round -> ``(one
    micro-batch, the once-per-step part)``: in each round their difference is the added micro-batches, the rest of the
    first step the part paid once (at least Lightning's measured ``per_step``); the median over the rounds counts, so
    that a round in a slow phase of the machine moves neither. ``None`` for the second when the timings cannot be told
    apart (a micro-batch no dearer than the loop's own ``per_batch``: the machine's noise)."""
    added = CALIBRATION_ACCUMULATION - 1
    per_micro = statistics.median((many - one) / added for one, many in zip(ones, manys))
    if per_micro <= per_batch:
        return max(per_micro, 0.0), None
    once = statistics.median(one - (many - one) / added for one, many in zip(ones, manys))
    return per_micro, max(once, per_step)


def calibration_steps(
    module: Any,
    probes: list[Candidate],
    batch: Any,
    device_type: str,
    seconds: float,
    rounds: int = CALIBRATION_ROUNDS,
    keep_going: Any = None,
) -> list[list[float]]:
    """For each of ``probes`` (in order), the median seconds per optimizer step of each round: ``rounds`` rounds of
    alternating order (each timing ``seconds / 2``), the timings of a round back to back, so that the machine's phases
    fall on all of them alike. ``keep_going(rounds done, their timings, seconds per round)``, when given, is asked
    after each round but the last whether to run the next (the time budget's check)."""
    each: list[list[float]] = [[] for _ in probes]
    started = time.perf_counter()
    for round_ in range(rounds):
        order = list(range(len(probes)))
        for index in order if round_ % 2 == 0 else order[::-1]:
            each[index].append(
                statistics.median(timing.timed_step(module, probes[index], batch, device_type, 1, 2, seconds / 2))
            )
        done = round_ + 1
        if done < rounds and keep_going is not None:
            if not keep_going(done, each, (time.perf_counter() - started) / done):
                break
    return each


def calibration_rows(rows: list[PlanRow], small: PlanRow, precision: str) -> list[PlanRow]:
    """The rows the CPU calibration times beside ``small`` (the smallest plain micro-batch): at each larger
    micro-batch predicted to fit (in the user's precision, no offload, no failed trial), the one of fewest ops (plain
    where plain fits, else the least checkpointing), as that row runs it: within the budget; the largest
    :data:`CALIBRATION_SIZES` sizes."""
    chosen: dict[int, PlanRow] = {}
    for r in rows:
        size = r.candidate.micro_batch
        if (
            r.costs is not None
            and r.fits
            and r.status is RowStatus.ESTIMATED
            and not r.candidate.offload
            and r.candidate.precision == precision
            and size > small.candidate.micro_batch
            and (size not in chosen or r.costs.micro.count < chosen[size].costs.micro.count)
        ):
            chosen[size] = r
    return [chosen[size] for size in sorted(chosen)[-CALIBRATION_SIZES:]]


def plausible_models(model: TimeModel, choosable: list[PlanRow]) -> Iterator[TimeModel]:
    """``model`` varied over the plausible grid: its kernel scale times each of :data:`PLAUSIBLE_SCALES`, its per-op
    overhead times each of :data:`PLAUSIBLE_OP_OVERHEADS`, each contender's micro-batch ops times ``(largest /
    micro-batch) ** e`` for each ``e`` of :data:`PLAUSIBLE_SIZE_EXPONENTS` (``largest``: the largest contender's)."""
    largest = max(r.candidate.micro_batch for r in choosable)
    for scale in PLAUSIBLE_SCALES:
        for factor in PLAUSIBLE_OP_OVERHEADS:
            for exponent in PLAUSIBLE_SIZE_EXPONENTS:
                yield dataclasses.replace(
                    model,
                    scale=model.scale * scale,
                    roofline=dataclasses.replace(model.roofline, op_overhead_s=model.roofline.op_overhead_s * factor),
                    micro_factors={
                        (r.candidate.precision, r.candidate.micro_batch): (largest / r.candidate.micro_batch)
                        ** exponent
                        for r in choosable
                    },
                )


def plausible_winners(choosable: list[PlanRow], model: TimeModel) -> list[PlanRow]:
    """The rows of ``choosable`` that are the fastest under some plausible time model (:func:`plausible_models`),
    those that win under more of them first (then in ``choosable``'s order): the trials to run when the model is not
    calibrated, so that the fastest under whichever of them is right gets a trial."""
    if not choosable:
        return []
    wins = {id(row): 0 for row in choosable}
    for variant in plausible_models(model, choosable):
        fastest = min(
            choosable,
            key=lambda r: variant.step_seconds(
                r.costs, r.candidate.accumulation, r.offload_bytes, r.candidate.micro_batch, r.candidate.precision
            ),
        )
        wins[id(fastest)] += 1
    order = {id(row): index for index, row in enumerate(choosable)}
    return sorted((row for row in choosable if wins[id(row)]), key=lambda r: (-wins[id(r)], order[id(r)]))


def calibration_needless(rows: list[PlanRow], trials: int, model: TimeModel) -> str | None:
    """Why the CPU calibration cannot change the choice, or ``None`` when it can. The calibration only picks which
    candidates run trials; the trials choose. It cannot change the choice when the candidates a trial could choose
    (:func:`contenders`) are no more than the trials (every one of them runs), nor when every candidate that is the
    fastest under some plausible time model (:func:`plausible_winners`) gets a trial: whichever model is right, its
    fastest runs."""
    choosable = contenders(rows)
    if len(choosable) <= trials:
        return (
            f"{len(choosable)} candidate{'s' if len(choosable) != 1 else ''} predicted to fit could be chosen "
            f"and up to {trials} trials run {'them all' if len(choosable) != 1 else 'it'}: the trials decide"
        )
    winners = plausible_winners(choosable, model)
    if len(winners) > trials:
        return None
    return (
        f"of the {len(choosable)} candidates that could be chosen, {len(winners)} "
        f"{'is' if len(winners) == 1 else 'are'} the fastest under some plausible time model (kernels "
        f"{min(PLAUSIBLE_SCALES):g} to {max(PLAUSIBLE_SCALES):g} x, per-op cost {min(PLAUSIBLE_OP_OVERHEADS):g} to "
        f"{max(PLAUSIBLE_OP_OVERHEADS):g} x the measured, a micro-batch k times smaller up to k ** "
        f"{max(PLAUSIBLE_SIZE_EXPONENTS):g} times slower per sample): "
        + "; ".join(row.candidate.describe() for row in winners)
        + f"; {'it gets a trial' if len(winners) == 1 else 'each gets a trial'}: the trials decide"
    )


def calibrate(
    inputs: PlanInputs,
    rows: list[PlanRow],
    model: TimeModel,
    limits: CalibrationLimits,
) -> tuple[TimeModel, list[tuple], str] | None:
    """The CPU calibration of ``model`` where it can change the choice and its cost fits the time budget (left out
    otherwise, and why is recorded in ``limits.clock``): ``(the model with the once-per-step part measured, the
    calibration's observations, its note)``, or ``None``.

    Timed real steps at the smallest micro-batch estimated (where the per-op overhead weighs most), with
    accumulation 1 and :data:`CALIBRATION_ACCUMULATION`, and at each larger micro-batch predicted to fit
    (:func:`calibration_rows`: as one of its rows runs it, checkpointing too, so within the budget), with
    accumulation 1: a calibration of the time model, not a trial (no budget, no candidate chosen by it), said in the
    notes. The first two's difference is a micro-batch's time, the rest the once-per-step part (the optimizer,
    zero_grad, the loop), the same for every candidate: measured, it keeps the optimizer's many cheap ops out of the
    per-op overhead fitted to the model's. The larger ones part the kernels' time from the per-op overhead (at one
    micro-batch they are in one ratio): a CPU's small micro-batches pay per op (autograd, the modules' Python,
    kernels too small for the cores) several times what a tiny op alone costs, so a model fitted at one micro-batch
    misranks larger ones. Each size gets its own correction (``TimeModel.micro_factors``): a CPU's kernels do not
    scale smoothly with the batch.

    It runs in up to :data:`CALIBRATION_ROUNDS` rounds where the time budget left, less ``limits.reserve()`` seconds
    kept for the trials (priced at the machine's speed as measured so far), pays for them: it is left out when
    :data:`~lightning_memkit.plan.time_budget.MIN_ROUNDS` rounds are predicted not to fit, and stops after a round
    when the next, priced as the rounds so far took, does not fit."""
    clock = limits.clock
    small = _smallest_plain(rows, inputs.precision)
    if small is None or small.candidate.micro_batch >= inputs.effective:
        clock.skip("calibration", "no micro-batch smaller than the batch was estimated")
        return None
    needless = calibration_needless(rows, limits.trials, model)
    if needless is not None:
        clock.skip("calibration", needless)
        return None
    larger = calibration_rows(rows, small, inputs.precision)
    probes = [
        Candidate(small.candidate.micro_batch, accumulation, inputs.precision)
        for accumulation in (1, CALIBRATION_ACCUMULATION)
    ]
    probes += [dataclasses.replace(r.candidate, accumulation=1) for r in larger]
    predicted = [
        model.step_seconds(r.costs, p.accumulation, 0, p.micro_batch, p.precision)
        for r, p in zip([small, small] + larger, probes)
    ]
    rounds = _affordable_rounds(probes, predicted, limits)
    if not rounds:
        return None

    def keep_going(done: int, timings: list[list[float]], seconds: float) -> bool:
        # the machine's speed as the rounds so far measured it prices the trials kept for; the next round as these
        _observe(clock, predicted, timings, probes)
        return seconds + limits.reserve() <= clock.left()

    calibrating = time.perf_counter()
    timings = calibration_steps(
        inputs.module, probes, inputs.batch, "cpu", limits.timed_seconds, rounds, keep_going=keep_going
    )
    calibrating = time.perf_counter() - calibrating
    _observe(clock, predicted, timings, probes)
    clock.ran(
        "calibration",
        calibrating,
        detail=f"{len(timings[0])} rounds",
        say=f"calibration: {len(timings[0])} rounds of {len(probes)} timings (micro-batch "
        f"{', '.join(str(p.micro_batch) for p in [probes[0]] + probes[2:])})",
    )
    per_micro, once = split_calibration(timings[0], timings[1], *limits.overheads)
    observations = [
        (r.costs, p.accumulation, statistics.median(t), p.micro_batch, inputs.precision)
        for r, p, t in zip([small, small] + larger, probes, timings)
    ]
    note = _calibration_note(small, probes, (per_micro, once), calibrating, len(timings[0]))
    return dataclasses.replace(model, step_s=once), observations, note


@dataclass
class CalibrationLimits:
    """What bounds a plan's CPU calibration.

    Attributes:
        clock: the plan's time budget (the calibration is recorded there as a phase, or as left out and why).
        trials: the most real trials the plan runs.
        overheads: Lightning's loop measured apart, seconds: ``(per micro-batch, per optimizer step)``.
        timed_seconds: the plan's ``timed_seconds`` (each timing takes half of it).
        reserve: seconds of the time budget kept for the trials, asked as the calibration goes.
    """

    clock: TimeBudget
    trials: int
    overheads: tuple[float, float]
    timed_seconds: float
    reserve: Callable[[], float]


def _smallest_plain(rows: list[PlanRow], precision: str) -> PlanRow | None:
    """The estimated row of the smallest micro-batch without checkpointing or offload, in the user's precision."""
    return min(
        (
            r
            for r in rows
            if r.costs is not None
            and r.candidate.checkpoint is None
            and not r.candidate.offload
            and r.candidate.precision == precision
        ),
        key=lambda r: r.candidate.micro_batch,
        default=None,
    )


def _affordable_rounds(probes: list[Candidate], predicted: list[float], limits: CalibrationLimits) -> int:
    """How many rounds of the probes' timings the time budget pays for, the trials' reserve kept (0: recorded as left
    out, and why)."""
    clock = limits.clock
    per_round = sum(
        clock.timing_cost(clock.expected(step, probe.micro_batch), 1, 2, limits.timed_seconds / 2, MAX_TIMED_STEPS)
        for step, probe in zip(predicted, probes)
    )
    rounds = max(
        (n for n in range(MIN_ROUNDS, CALIBRATION_ROUNDS + 1) if n * per_round + limits.reserve() <= clock.left()),
        default=0,
    )
    if not rounds:
        clock.skip(
            "calibration",
            f"{MIN_ROUNDS} rounds of its {len(probes)} timings would take "
            f"{describe_seconds(MIN_ROUNDS * per_round)}, and {max(clock.left(), 0):.0f} s of "
            f"the time budget are left, {describe_seconds(limits.reserve())} of them kept for the "
            "trials (the time model ranks the candidates from its roofline and measured "
            "overheads)",
        )
    return rounds


def _observe(clock: TimeBudget, predicted: list[float], timings: list[list[float]], probes: list[Candidate]) -> None:
    """Tell the time budget the machine's speed: each probe's median timing against its predicted step."""
    for index, (step, measured) in enumerate(zip(predicted, timings)):
        clock.observe(step, statistics.median(measured), ("calibration", index), probes[index].micro_batch)


def _calibration_note(
    small: PlanRow, probes: list[Candidate], parts: tuple[float, float | None], seconds: float, rounds: int
) -> str:
    """What the calibration measured, for the plan's notes (``parts``: a micro-batch's and the once-per-step
    seconds)."""
    per_micro, once = parts
    return (
        f"CPU time model: real steps at micro-batch {small.candidate.micro_batch} with accumulation "
        f"1 and {CALIBRATION_ACCUMULATION}"
        + "".join(f", {p.describe()}" for p in probes[2:])
        + f" calibrate it (not trials; {seconds:.1f} s, {rounds} rounds): "
        + (
            f"{per_micro * 1e3:.2f} ms per micro-batch, {once * 1e3:.2f} ms once per step (the optimizer, the loop)"
            if once is not None
            else "too noisy to part a micro-batch from the once-per-step part (the optimizer priced from its ops)"
        )
        + "; each size timed gets its own correction of its ops; each trial refits it"
    )
