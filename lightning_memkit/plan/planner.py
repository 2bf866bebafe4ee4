"""``plan_fit``: the fastest way to train the user's effective batch within a memory budget, proved by real trials.

1. The baseline (the user's batch as is) is estimated on fake tensors; when it fits, one real trial confirms it and
   the plan changes nothing.
2. Otherwise the candidates of the space (:mod:`~lightning_memkit.plan.space`) are estimated, one fake step each
   (:mod:`~.rows`; on CUDA the same fake step's ops also predict the step time on the GPU's roofline).
3. Those predicted to fit (on CUDA with :data:`~.rows.CUDA_MARGIN` of the memory kept free for the allocator) are
   ordered by the plan's rule (:func:`~lightning_memkit.plan.space.preference`: no recompute first, a lower precision
   where allowed (true half, then mixed, then full), no offload, fewer and larger micro-batches), and at most
   ``trials`` of them run as real trials (:mod:`~.trials`): a real Lightning ``Trainer`` on a deep copy of the module,
   its peak measured within the budget and its steps timed.
4. The choice (:mod:`~.choice`) is the rule's first among the trials that fit, unless another is measured faster by
   more than :data:`~.choice.MIN_GAIN`, side by side: never a configuration that did not run.

The plan keeps to a wall-time budget (:mod:`~.time_budget`: ``max_seconds``, by default the estimate plus 20 steps of
the effective batch, at least 30 s more).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from lightning_memkit.estimate.data.batches import preserved_rng
from lightning_memkit.estimate.data.worst_batch import batch_shapes
from lightning_memkit.estimate.step.settings import reusing_fake_copies
from lightning_memkit.plan.choice import choose, run_trials
from lightning_memkit.plan.inputs import MAX_TRIALS, plan_device, plan_inputs, trial_settings
from lightning_memkit.plan.lightning_runs import TIMED_SECONDS, TIMED_STEPS, WARMUP_STEPS
from lightning_memkit.plan.result import Plan, PlanRow
from lightning_memkit.plan.rows import estimate_families, estimate_row, ranked
from lightning_memkit.plan.several_devices import plan_devices
from lightning_memkit.plan.state import PlanState
from lightning_memkit.plan.time_budget import TimeBudget, budget_text
from lightning_memkit.plan.time_model import TimeModel, roofline_for
from lightning_memkit.plan.trials import TrialSteps, proved_batch, run_row
from lightning_memkit.units import format_bytes

if TYPE_CHECKING:
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_memkit.estimate.cuda.gpu_target import GpuLike

__all__ = ["plan_fit", "no_best_note"]


def plan_fit(
    module: LightningModule,
    *,
    batch_size: int | None = None,
    device_memory: int | str | None = None,
    gpu: GpuLike = None,
    device: str | torch.device | None = None,
    modes: str | Iterable[str] | None = None,
    datamodule: LightningDataModule | None = None,
    trials: int = MAX_TRIALS,
    world_size: int = 1,
    strategy: str | None = None,
    max_world_size: int | None = None,
    interconnect: str | float | None = None,
    verbose: bool = True,
    warmup_steps: int = WARMUP_STEPS,
    timed_steps: int = TIMED_STEPS,
    timed_seconds: float = TIMED_SECONDS,
    max_seconds: float | None = None,
) -> Plan:
    """The fastest way to train ``module`` at its effective batch within a memory budget, proved by real trials.

    Args:
        module: a LightningModule (trials train a deep copy of it with a real ``Trainer``; it is left untouched).
        batch_size: the effective batch (samples per optimizer step, over every device) to keep; default: the train
            dataloader's batch (per device, as under Lightning's DDP) times ``world_size``.
        device_memory: the budget, bytes or a size (``"4GiB"``); default: the GPU's memory (``gpu=`` or this
            machine's, less what other processes hold), on CPU half the host memory available now.
        gpu: the GPU to plan for (``"h100"``, ``"sm80"``...): its kernels, roofline and memory; implies CUDA.
        device: ``"cpu"``, ``"cuda"`` or a CUDA device by index (``"cuda:1"``, ``torch.device("cuda", 1)``: the
            budget, the trials and their peaks are that device's; default: CUDA when available or ``gpu`` is given,
            the current device, else CPU).
        modes: what may change: ``"micro_batch,checkpoint"`` (the default: memory-only changes), plus ``bf16`` /
            ``fp16`` / ``amp`` (a change to mixed precision), ``bf16-true`` / ``fp16-true`` (a change to true half
            precision: the weights, gradients and optimizer state in 16 bits, no fp32 master weights) and
            ``offload`` (CUDA only); see :data:`~lightning_memkit.plan.space.PLAN_MODE_WORDS`.
        datamodule: a LightningDataModule to take the batch from.
        trials: the most real trials (1 to :data:`MAX_TRIALS`).
        world_size: devices to plan for (each trains ``batch_size / world_size`` samples per optimizer step); on
            several, every candidate is one rank's estimate under a strategy
            (:mod:`~lightning_memkit.plan.several_devices`), ranked by its predicted step (a CUDA plan) or by the rule
            (CPU), and nothing is trialled.
        strategy: on several devices, the strategies weighed (``"fsdp"``, ``"ddp,deepspeed_stage_3"``; default:
            every one of :data:`~lightning_memkit.plan.rank_space.PLAN_STRATEGIES` that applies).
        max_world_size: plan on the fewest devices, up to this many, where a candidate fits (1, 2, 4, ...).
        interconnect: what one rank's collectives move at: ``"nvlink"`` (default), ``"infiniband"``, ``"pcie"``
            (:data:`~lightning_memkit.plan.time_model.INTERCONNECTS`), or bytes per second.
        verbose: print a progress line per phase.
        warmup_steps, timed_steps: optimizer steps per trial before timing, and timed at least (their median counts).
        timed_seconds: CPU: each trial times steps until they add up to this many seconds (at most
            :data:`~lightning_memkit.plan.lightning_runs.MAX_TIMED_STEPS`); a side-by-side round times each
            configuration for half as long. 0 times ``timed_steps`` steps once.
        max_seconds: the wall-time budget of the plan, seconds; default: the estimate's time plus 20 steps of the
            effective batch (at least 30 s more; :mod:`~lightning_memkit.plan.time_budget`). The estimate and trials
            until one fits always run, a further trial or a side-by-side round only where its predicted cost fits
            what is left (``plan.phases`` says what ran and what was left out, and why).

    Returns:
        a :class:`~lightning_memkit.plan.result.Plan`; ``plan.best`` is ``None`` when nothing fit in a real trial,
        or no trial could run here (a CUDA plan on a machine without a GPU: predictions only).

    Raises:
        PlanError: bad input (the message says what to do): not a LightningModule, a budget below the model's
            parameters, a batch size that is not a positive integer, ``trials`` outside 1..3, several devices,
            ``max_seconds`` that is not a positive number.
    """
    # the trials' random numbers leave the caller's RNG streams as they were; a CUDA plan runs on the device it names
    # (the current device is set back after)
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
            max_world_size=max_world_size,
            interconnect=interconnect,
        )
        state = PlanState(inputs, settings, TimeBudget(settings.max_seconds, started, say), say, notes=inputs.notes)
        if inputs.devices.several:
            plan_devices(state, _one_device)
        else:
            _one_device(state)
        return _plan(state)


def _one_device(state: PlanState) -> None:
    """The plan on one device: estimate, then (unless the batch fits as is) the trials and the choice."""
    inputs = state.inputs
    _estimate(state)
    if state.fits_as_is:
        return
    if inputs.can_run:
        run_trials(state)
        choose(state)
    elif any(p.is_meta for p in inputs.module.parameters()):
        state.notes.append(
            "the module is on the meta device (no weights to train): the table is the prediction only and nothing "
            "ran; build it with weights on the GPU for real trials and a best configuration"
        )
    else:
        state.notes.append(
            "no GPU here: the table is the prediction only and nothing ran; run memkit plan on the GPU "
            "for real trials and a best configuration"
        )


def _estimate(state: PlanState) -> None:
    """Estimate the baseline (one trial confirms it when it fits), then, when it does not, the other candidates."""
    inputs, clock = state.inputs, state.clock
    model = None if inputs.cpu else TimeModel(roofline_for(inputs.gpu))
    estimating = time.perf_counter()
    with reusing_fake_copies():
        baseline = estimate_row(inputs, inputs.space[0], model)
        state.rows.append(baseline)
        peak = baseline.predicted_peak_bytes
        state.say(
            f"memkit plan: baseline {baseline.candidate.describe()}: predicted peak "
            f"{format_bytes(peak) if peak is not None else '-'} of {format_bytes(inputs.budget)}"
        )
        if baseline.fits and inputs.can_run:
            clock.ran("estimate", time.perf_counter() - estimating, "1 candidate")
            steps = TrialSteps(state.settings.warmup_steps, state.settings.timed_steps)
            state.trial_seconds[id(baseline)] = took = run_row(inputs, baseline, steps, state.say)
            clock.ran("trial", took, baseline.candidate.describe())
            if baseline.ran:
                state.fits_as_is, state.best = True, baseline
                state.reason = "the batch fits as it is: nothing to change"
                baseline.note = "fits as is: nothing to change; " + baseline.note
                return
            estimating = time.perf_counter()
        skipped = estimate_families(inputs, state.rows, model)
    took = time.perf_counter() - estimating
    clock.ran("estimate", took, f"{len(state.rows)} candidates")
    fitting = sum(row.fits for row in state.rows)
    state.say(f"memkit plan: {len(state.rows)} candidates estimated, {fitting} predicted to fit ({took:.1f} s)")
    if skipped:
        state.notes.append(
            f"{skipped} smaller micro-batches not estimated: below two that fit in the same mode they fit too "
            "(memory grows with the micro-batch), and the rule ranks them after"
        )


def _plan(state: PlanState) -> Plan:
    """The :class:`~lightning_memkit.plan.result.Plan`, its notes completed, and the closing line said."""
    inputs, clock, best = state.inputs, state.clock, state.best
    worst = inputs.worst
    found = worst.describe() if worst is not None else "the batch given"
    state.notes.insert(0, f"batch: {found}; micro-batches are its largest samples")
    seconds = time.perf_counter() - clock.started
    state.notes.append(
        f"planned in {seconds:.1f} s of a {budget_text(clock.total)} s time budget "
        f"({'max_seconds' if clock.given is not None else 'the default'}): {clock.summary()}"
    )
    if best is None and inputs.can_run:
        state.notes.append(no_best_note(state.rows))
    chosen = best.candidate if best is not None else None
    plan = Plan(
        ranked(state.rows, by_time=state.world_size > 1 and not inputs.cpu),
        chosen,
        state.fits_as_is,
        inputs.budget,
        inputs.effective,
        state.trials_run,
        inputs.device_type,
        state.notes,
        seconds,
        batch_shapes=worst.shapes() if worst is not None else batch_shapes(inputs.batch),
        proved_micro_batch=proved_batch(inputs.batch, chosen),
        max_seconds=clock.total,
        phases=list(clock.phases),
        reason=state.reason,
        world_size=state.world_size,
        wrap=inputs.devices.wrap if chosen is not None and chosen.strategy == "fsdp" else None,
    )
    if best is not None:
        state.say(f"memkit plan: best {best.candidate.describe()}: {state.reason} ({seconds:.1f} s)")
    return plan


def no_best_note(rows: list[PlanRow]) -> str:
    """Why no candidate was chosen: every estimate failed (and why; then no trial ran), none was predicted to fit, or
    none fit in a real trial."""
    failed = [row for row in rows if row.note.startswith("not estimated: ")]
    if failed and len(failed) == len(rows):  # nothing was predicted, so nothing was tried: memory is not the answer
        reason = failed[0].note.removeprefix("not estimated: ")
        if not reason.endswith(".") and ". " in reason:  # a note cut short: up to its last whole sentence
            reason = reason[: reason.rindex(". ") + 1]
        reason = reason if reason.endswith(".") else reason + "."
        return (
            f"the estimate failed for every candidate, so no trial ran (more memory would not help): {reason} "
            "memkit estimate shows the whole error"
        )
    if not any(row.fits for row in rows):
        return "no candidate is predicted to fit: give more memory, or allow more modes (bf16, checkpoint)"
    return "no candidate fit in a real trial: give more memory, or allow more modes (bf16, checkpoint)"
