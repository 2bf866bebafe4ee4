"""``plan_fit``: the fastest way to train the user's effective batch within a memory budget, proved by real trials.

1. The baseline (the user's batch as is) is estimated on fake tensors; when it fits, one real trial confirms it and
   the plan changes nothing.
2. Otherwise every candidate of the space (:mod:`~lightning_memkit.plan.space`) is estimated in one fake step each,
   which gives both its peak (:func:`~lightning_memkit.estimate.estimate_memory`) and its ops' FLOPs and bytes
   (:class:`~lightning_memkit.plan.time_model.OpCosts`), hence its predicted step time (:mod:`~.rows`).
3. The candidates predicted to fit (on CUDA with :data:`~.rows.CUDA_MARGIN` of the memory kept free for the
   allocator; on CPU the estimate counts the same bytes as the budget) are ranked by predicted samples/s, and the top
   ones run as real trials (at most ``trials``, :data:`~.inputs.MAX_TRIALS`; :mod:`~.trials`): a real Lightning
   ``Trainer`` on a deep copy of the module (the module, its optimizer state and the RNG states are untouched),
   warm-up steps then timed ones (:mod:`~.timing`), the peak measured (the accountant under a
   :class:`~lightning_memkit.search.budget.MemoryBudget` on CPU, so an over-budget trial fails cleanly; on CUDA the
   device's own peaks, the allocator capped at the budget and the module under plan off the device:
   :mod:`~.cuda_trial`). On CPU the time model is first calibrated (:mod:`~.calibration`) where that can change the
   choice, every trial refits it, and when several trials ran they are timed again in interleaved rounds.
4. The best is the fastest trial that fit: never a configuration that did not run. A trial whose difference from the
   fastest is within the machine's measured noise is a tie, settled by the lower peak (:mod:`~.settle`).

The plan keeps to a wall-time budget (:mod:`~.time_budget`: ``max_seconds``, by default the estimate plus 20 baseline
steps), stated at the start: the estimate and trials until one fits always run, every other phase only where its
predicted cost fits what is left, and each phase's cost is said as it ends.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from lightning_memkit.estimate.batches import preserved_rng
from lightning_memkit.estimate.settings import reusing_fake_copies
from lightning_memkit.plan.calibration import (
    CALIBRATION_ACCUMULATION,
    CALIBRATION_ROUNDS,
    CALIBRATION_SIZES,
    PLAUSIBLE_OP_OVERHEADS,
    PLAUSIBLE_SCALES,
    PLAUSIBLE_SIZE_EXPONENTS,
    CalibrationLimits,
    calibrate,
)
from lightning_memkit.plan.checkpoint_cost import measure_checkpoint_overheads
from lightning_memkit.plan.inputs import MAX_TRIALS, plan_device, plan_inputs, trial_settings
from lightning_memkit.plan.result import Plan, PlanError, PlanRow
from lightning_memkit.plan.rows import CUDA_MARGIN, contenders, estimate_families, estimate_row, ranked, repredict
from lightning_memkit.plan.schedule import run_trials, time_again
from lightning_memkit.plan.settle import RETIMING_ROUNDS, TIE_ERRORS, settle
from lightning_memkit.plan.state import PlanState
from lightning_memkit.plan.time_budget import MIN_ROUNDS, TimeBudget, budget_text
from lightning_memkit.plan.time_model import TimeModel, calibrate_cpu, roofline_for
from lightning_memkit.plan.timing import (
    GIVE_UP_FACTOR,
    MAX_TIMED_STEPS,
    TIMED_SECONDS,
    TIMED_STEPS,
    WARMUP_STEPS,
    loop_overheads,
)
from lightning_memkit.plan.trials import proved_batch, run_row
from lightning_memkit.units import format_bytes

# the settings' constants are named here too, beside plan_fit whose defaults they are
__all__ = [
    "Plan",
    "PlanRow",
    "PlanError",
    "plan_fit",
    "no_best_note",
    "CUDA_MARGIN",
    "WARMUP_STEPS",
    "TIMED_STEPS",
    "TIMED_SECONDS",
    "MAX_TIMED_STEPS",
    "RETIMING_ROUNDS",
    "MIN_ROUNDS",
    "MAX_TRIALS",
    "TIE_ERRORS",
    "GIVE_UP_FACTOR",
    "CALIBRATION_ACCUMULATION",
    "CALIBRATION_ROUNDS",
    "CALIBRATION_SIZES",
    "PLAUSIBLE_SCALES",
    "PLAUSIBLE_OP_OVERHEADS",
    "PLAUSIBLE_SIZE_EXPONENTS",
]


def plan_fit(
    module: Any,
    *,
    batch_size: int | None = None,
    device_memory: int | str | None = None,
    gpu: Any = None,
    device: Any = None,
    modes: Any = None,
    datamodule: Any = None,
    trials: int = MAX_TRIALS,
    world_size: int = 1,
    strategy: Any = None,
    verbose: bool = True,
    warmup_steps: int = WARMUP_STEPS,
    timed_steps: int = TIMED_STEPS,
    timed_seconds: float = TIMED_SECONDS,
    max_seconds: float | None = None,
) -> Plan:
    """The fastest way to train ``module`` at its effective batch within a memory budget, proved by real trials.

    Args:
        module: a LightningModule (trials train a deep copy of it with a real ``Trainer``; it is left untouched).
        batch_size: the effective batch (samples per optimizer step) to keep; default: the train dataloader's batch.
        device_memory: the budget, bytes or a size (``"4GiB"``); default: the GPU's memory (``gpu=`` or this
            machine's, less what other processes hold), on CPU half the host memory available now.
        gpu: the GPU to plan for (``"h100"``, ``"sm80"``...): its kernels, roofline and memory; implies CUDA.
        device: ``"cpu"``, ``"cuda"`` or a CUDA device by index (``"cuda:1"``, ``torch.device("cuda", 1)``: the
            budget, the trials and their peaks are that device's; default: CUDA when available or ``gpu`` is given,
            the current device, else CPU).
        modes: what may change: ``"micro_batch,checkpoint"`` (the default: memory-only changes), plus ``bf16`` /
            ``fp16`` / ``amp`` (a precision change) and ``offload`` (CUDA only); see
            :data:`~lightning_memkit.plan.space.PLAN_MODE_WORDS`.
        datamodule: a LightningDataModule to take the sample batch from.
        trials: the most real trials (1 to :data:`MAX_TRIALS`).
        world_size, strategy: one device only for now (1 and ``None``).
        verbose: print progress lines.
        warmup_steps, timed_steps: optimizer steps per trial before timing, and timed at least (their median counts).
        timed_seconds: CPU: each trial times steps until they add up to this many seconds (at most
            :data:`MAX_TIMED_STEPS`), and when several trials ran each is timed :data:`RETIMING_ROUNDS` times more
            for half as long, in rounds of alternating order, compared round by round (a CPU's speed drifts by tens
            of percent within seconds); the time model's calibration takes :data:`CALIBRATION_ROUNDS` times
            half this per size it times (two timings at the smallest micro-batch, one at each of up to
            :data:`CALIBRATION_SIZES` larger ones). 0 times ``timed_steps`` steps once.
        max_seconds: the wall-time budget of the plan, seconds; default: the estimate's time plus 20 steps of the
            baseline (at least 30 s more; :mod:`~lightning_memkit.plan.time_budget`). Stated at the start; the
            estimate and trials until one fits always run, the calibration, the other trials (a trial may time
            fewer steps) and the rounds only where their predicted cost fits what is left (``plan.phases`` says what
            ran and what was left out, and why).

    Returns:
        a :class:`~lightning_memkit.plan.result.Plan`; ``plan.best`` is ``None`` when nothing fit in a real trial,
        or no trial could run here (a CUDA plan on a machine without a GPU: predictions only).

    Raises:
        PlanError: bad input (the message says what to do): not a LightningModule, a budget below the model's
            parameters, a batch size that is not a positive integer, ``trials`` outside 1..3, several devices,
            ``max_seconds`` that is not a positive number.
    """
    # the CPU calibration's and the trials' random numbers leave the caller's RNG streams as they were; a CUDA plan
    # runs on the device it names (the current device is set back after)
    started = time.perf_counter()
    say = (lambda text: print(text, flush=True)) if verbose else (lambda text: None)
    with preserved_rng(), plan_device(device):
        settings = trial_settings(trials, warmup_steps, timed_steps, timed_seconds, max_seconds)
        inputs = plan_inputs(
            module,
            batch_size=batch_size,
            device_memory=device_memory,
            gpu=gpu,
            device=device,
            modes=modes,
            datamodule=datamodule,
            world_size=world_size,
            strategy=strategy,
        )
        clock = TimeBudget(settings.max_seconds, started, say)
        model = TimeModel(calibrate_cpu() if inputs.cpu else roofline_for(inputs.gpu))
        return _plan_run(PlanState(inputs, settings, clock, say, model, notes=list(inputs.notes)))


def _plan_run(state: PlanState) -> Plan:
    """Estimate, then (unless the baseline fits as is) calibrate, run the trials and settle the best."""
    with reusing_fake_copies():
        _baseline(state)
        if not state.fits_as_is:
            _estimate_the_rest(state)
    if not state.fits_as_is:
        _choose(state)
    return _plan(state)


# -------------------------------------------------------------------------------------- estimates
def _baseline(state: PlanState) -> None:
    """Estimate the baseline; when it is predicted to fit, one trial confirms it."""
    inputs, clock = state.inputs, state.clock
    baseline = estimate_row(inputs, inputs.space[0], state.model)
    state.rows.append(baseline)
    peak = baseline.predicted_peak_bytes
    state.say(
        f"memkit plan: baseline {baseline.candidate.describe()}: predicted peak "
        f"{format_bytes(peak) if peak is not None else '-'} of {format_bytes(inputs.budget)}"
    )
    clock.state(baseline.predicted_step_s, baseline.candidate.micro_batch)
    if baseline.fits and inputs.can_run:
        clock.estimated(1, 1)
        state.trials_run += 1
        steps = (state.settings.warmup_steps, state.settings.timed_steps, 0.0)
        run_row(inputs, baseline, steps, state.say, clock=clock)
        if baseline.ran:
            state.fits_as_is, state.best = True, baseline
            baseline.note = "fits as is: nothing to change; " + baseline.note


def _estimate_the_rest(state: PlanState) -> None:
    """Estimate the other candidates (per mode, down to two micro-batches below the first that fits)."""
    estimating = time.perf_counter()
    skipped = estimate_families(state.inputs, state.rows, state.model)
    state.clock.estimated(
        len(state.rows),
        sum(row.fits for row in state.rows),
        time.perf_counter() - estimating if state.clock.estimate_s is not None else None,
    )
    if skipped:
        state.notes.append(
            f"{skipped} smaller micro-batches not estimated: below two that fit in the same mode they fit too "
            "(memory grows with the micro-batch) and are slower (the same FLOPs in more, smaller steps)"
        )


# -------------------------------------------------------------------------------------- the choice
def _choose(state: PlanState) -> None:
    """Measure the loop's overheads and calibrate (CPU), run the trials, time them again, settle the best."""
    inputs, clock = state.inputs, state.clock
    live = inputs.cpu and inputs.can_run
    if not inputs.can_run:
        state.notes.append(
            "no GPU here: the table is the prediction only and nothing ran; run memkit plan on the GPU "
            "for real trials and a best configuration"
        )
    if live:
        _measure_overheads(state)
    repredict(state.rows, state.model)
    state.reference = state.model
    baseline = state.rows[0]
    if baseline.costs is not None:
        clock.baseline_step_s = state.reference.step_seconds(baseline.costs, 1)
        clock.rebase()
    if live:
        _calibrate(state)
    repredict(state.rows, state.model)
    for row in state.rows:  # what the model alone says, kept beside the ranking the trials will refine
        row.model_step_s = row.predicted_step_s
    run_trials(state)
    ran = [r for r in state.rows if r.ran]
    if inputs.cpu and state.settings.timed_seconds > 0 and len(ran) > 1:
        time_again(state, ran)
    if inputs.cpu and state.observations:
        state.notes.append(_model_note(state.model, inputs.precision))
    state.best, tie = settle(ran, state.timings, state.say)
    if tie is not None:
        state.notes.append(tie)
    state.rows = ranked(state.rows)
    if state.best is None and inputs.can_run:
        state.notes.append(no_best_note(state.rows))


def _measure_overheads(state: PlanState) -> None:
    """CPU: Lightning's own cost per micro-batch and per step, and checkpointing's Python per call and per op
    inside one, measured here: what no op of the fake step shows (on a CPU they outweigh the recomputed FLOPs of
    a small micro-batch)."""
    measuring = time.perf_counter()
    per_batch, per_step, state.clock.fit_overhead_s = loop_overheads()
    per_call, per_inside = 0.0, 0.0
    if any(r.costs is not None and r.costs.regions for r in state.rows):
        per_call, per_inside = measure_checkpoint_overheads()
    state.overheads = (per_batch, per_step)
    state.base_model = state.model = TimeModel(
        dataclasses.replace(
            state.model.roofline,
            batch_overhead_s=per_batch,
            step_overhead_s=per_step,
            checkpoint_call_s=per_call,
            checkpoint_op_s=per_inside,
        )
    )
    state.clock.ran(
        "overheads",
        time.perf_counter() - measuring,
        say="Lightning's loop" + (" and checkpointing's Python" if per_call or per_inside else "") + " measured apart",
    )


def _calibrate(state: PlanState) -> None:
    """CPU: the time model's calibration, where it can change the choice and the time budget pays for it."""
    settings = state.settings
    limits = CalibrationLimits(
        state.clock,
        settings.trials,
        state.overheads,
        settings.timed_seconds,
        lambda: sum(state.trial_cost(row) for row in contenders(state.rows)[: settings.trials]),
    )
    calibration = calibrate(state.inputs, state.rows, state.model, limits)
    if calibration is not None:
        state.base_model, state.calibrations, note = calibration
        state.observations += state.calibrations
        state.model = state.base_model.fit(state.observations)
        state.notes.append(note)
        state.clock.rebase()


# -------------------------------------------------------------------------------------- the plan
def _plan(state: PlanState) -> Plan:
    """The :class:`~lightning_memkit.plan.result.Plan`, its notes completed, and the closing line said."""
    inputs, clock, best = state.inputs, state.clock, state.best
    state.notes.insert(0, f"batch: {inputs.worst.describe()}; micro-batches are its largest samples")
    seconds = time.perf_counter() - clock.started
    state.notes.append(
        f"time budget {budget_text(clock.total)} s "
        f"({'max_seconds' if clock.given is not None else 'the default'}); "
        f"planned in {seconds:.1f} s: {clock.summary()}"
    )
    state.notes += [
        f"{phase.name}{f' of {phase.detail}' if phase.detail else ''} left out: {phase.skipped}"
        for phase in clock.phases
        if phase.skipped
    ]
    chosen = best.candidate if best is not None else None
    plan = Plan(
        state.rows,
        chosen,
        state.fits_as_is,
        inputs.budget,
        inputs.effective,
        state.trials_run,
        inputs.device_type,
        state.notes,
        seconds,
        batch_shapes=inputs.worst.shapes(),
        proved_micro_batch=proved_batch(inputs.batch, chosen),
        max_seconds=clock.total,
        phases=list(clock.phases),
    )
    if state.fits_as_is:
        state.say(
            f"memkit plan: the baseline fits in {format_bytes(inputs.budget)} as is; nothing to change "
            f"({seconds:.1f} s: {clock.summary()})"
        )
    elif best is not None:
        state.say(
            f"memkit plan: best {best.candidate.describe()} ({best.measured_samples_per_s:.1f} samples/s "
            f"measured, {state.trials_run} trials) in {seconds:.1f} s of a {budget_text(clock.total)} s time "
            f"budget: {clock.summary()}"
        )
    return plan


def _model_note(model: TimeModel, precision: str) -> str:
    """The CPU time model as fitted, for the plan's notes."""
    roofline = model.roofline
    return (
        f"CPU time model fitted: kernels {model.scale:.2f} x the measured roofline, "
        f"{roofline.op_overhead_s * 1e6:.1f} us per op; Lightning's loop measured apart: "
        f"{roofline.batch_overhead_s * 1e3:.2f} ms per micro-batch, "
        + (
            f"{roofline.step_overhead_s * 1e3:.2f} ms per step"
            if model.step_s is None
            else f"{model.step_s * 1e3:.2f} ms once per step with the optimizer (calibrated)"
        )
        + (
            "; each micro-batch size's correction of its ops (measured / modelled): "
            + ", ".join(
                f"{size}{'' if each == precision else f' ({each})'}: {factor:.2f}"
                for (each, size), factor in sorted(model.micro_factors.items())
            )
            if model.micro_factors
            else ""
        )
        + (
            f"; checkpointing measured apart: {roofline.checkpoint_call_s * 1e3:.2f} ms per "
            f"checkpointed call, {roofline.checkpoint_op_s * 1e6:.1f} us per op inside one"
            if roofline.checkpoint_call_s or roofline.checkpoint_op_s
            else ""
        )
    )


def no_best_note(rows: list[PlanRow]) -> str:
    """Why no candidate was chosen: every estimate failed (and why; then no trial ran), or none fit in a real trial."""
    failed = [row for row in rows if row.predicted_peak_bytes is None]
    if failed and len(failed) == len(rows):  # nothing was predicted, so nothing was tried: memory is not the answer
        reason = failed[0].note.removeprefix("not estimated: ")
        if not reason.endswith(".") and ". " in reason:  # a note cut short: up to its last whole sentence
            reason = reason[: reason.rindex(". ") + 1]
        reason = reason if reason.endswith(".") else reason + "."
        return (
            f"the estimate failed for every candidate, so no trial ran (more memory would not help): {reason} "
            "memkit estimate shows the whole error"
        )
    return "no candidate fit in a real trial: give more memory, or allow more modes (bf16, checkpoint)"
