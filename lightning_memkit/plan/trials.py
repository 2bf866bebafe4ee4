"""A plan's real trials: a candidate trained with a real Lightning ``Trainer`` on a deep copy of the module, its peak
measured within the memory budget and its steps timed (:func:`trial`), and its outcome kept on its row
(:func:`run_row`)."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from lightning_memkit.compiled import compiled_parts
from lightning_memkit.compiled._torch_compat import reset_compiled
from lightning_memkit.estimate.batches import preserved_rng, rebatch
from lightning_memkit.oom import is_out_of_memory
from lightning_memkit.plan import cuda_trial
from lightning_memkit.plan.cuda_trial import cuda_device, release
from lightning_memkit.plan.inputs import PlanInputs
from lightning_memkit.plan.real_steps import real_step_seconds
from lightning_memkit.plan.result import PlanRow, RowStatus
from lightning_memkit.plan.space import Candidate
from lightning_memkit.plan.time_budget import Phase, TimeBudget
from lightning_memkit.plan.timing import (
    GIVE_UP_FACTOR,
    StepClock,
    copy_of,
    fit_steps,
    quiet_lightning,
    recording_steps,
    timing_fit,
)
from lightning_memkit.search.batch_guard import ProvedBatch
from lightning_memkit.search.budget import MemoryBudget
from lightning_memkit.units import format_bytes

__all__ = ["proved_batch", "run_row", "trial"]


def proved_batch(batch: Any, best: Candidate | None) -> ProvedBatch | None:
    """The micro-batch ``best``'s trial ran: ``batch`` cut to its micro-batch size."""
    if best is None:
        return None
    return ProvedBatch.of(rebatch(batch, best.micro_batch), f"the plan's trial of {best.describe()}")


def trial(
    module: Any,
    candidate: Candidate,
    batch: Any,
    budget: int,
    device_type: str,
    warmup: int,
    timed: int,
    seconds: float = 0.0,
    row: PlanRow | None = None,
) -> tuple[bool, int | None, float | None, str]:
    """One real trial on a deep copy of ``module``: ``(fits, peak bytes, median samples/s, note)``.

    On CPU the memory and the time are measured in two fits of the same copy: first two optimizer steps under a
    :class:`~lightning_memkit.search.budget.MemoryBudget` (the accountant counts every tensor against the budget and
    stops an over-budget step cleanly; the second step is the steady state; an accumulation of 2 has the peak of any
    larger one), then, when it fit, ``warmup`` steps and at least ``timed`` timed ones without the accountant (its
    per-op bookkeeping would be in the time), until they add up to ``seconds``. On CUDA one fit does both
    (``max_memory_allocated`` costs nothing), on the plan's device (:func:`cuda_device`) and as a card of the
    budget's size would run it (:mod:`~lightning_memkit.plan.cuda_trial`): the module under plan waits in host memory
    while its copy trains (one model on the device, as in the real fit, not two), the caching allocator is capped at
    the budget less the CUDA context (the trial runs out of memory where such a card would), and it fits when its
    peak reserved bytes plus the context are within the budget. Its peaks (allocated and reserved, also when it
    failed: how far it got) go on ``row`` and in the note. An offload trial whose predicted pinned host bytes
    (``row.offload_bytes``) the host cannot spare is refused before it runs. A ``16-mixed`` trial runs until
    ``warmup + timed`` optimizer steps were real (:class:`~lightning_memkit.plan.real_steps.RealSteps`: the steps the
    GradScaler skipped allocate no optimizer state and are not timed). A compiled module's caches are reset before and
    after the trial (it compiles at its own micro-batch, as the real fit will; CUDA-graph pools are freed), also when
    it fails; an error other than running out of memory propagates with its frames cleared: it holds none of the
    trial's tensors."""
    cuda = device_type == "cuda"
    host_bytes = row.offload_bytes if row is not None and candidate.offload else 0
    if cuda and host_bytes:
        refusal = cuda_trial.host_refusal(host_bytes, psutil.virtual_memory().available)
        if refusal is not None:
            return False, None, None, refusal
    device = cuda_device() if cuda else None
    compiled = bool(compiled_parts(module))
    if compiled:
        reset_compiled()
    run = _TrialRun()
    # on CUDA the module under plan is in host memory until the copy is gone (off_device)
    with (
        preserved_rng(),
        quiet_lightning(),
        cuda_trial.off_device(module, device) if cuda else contextlib.nullcontext(),
    ):
        copied = micro = None
        try:
            copied = copy_of(module)
            micro = rebatch(batch, candidate.micro_batch)
            if cuda:
                _cuda_fit(copied, candidate, micro, budget, (warmup, timed), device, run, row)
            else:
                _cpu_fit(copied, candidate, micro, budget, (warmup, timed, seconds), run)
        except BaseException as error:
            traceback.clear_frames(error.__traceback__)  # the error keeps its lines, not the trial's tensors
            raise
        finally:
            del copied, micro
            if compiled:
                reset_compiled()  # CUDA-graph pools go with the trees, before the cache is emptied
            release(cuda)
    if compiled:
        run.said.append("compiled: dynamo's caches reset before and after the trial")
    return _outcome(candidate, run)


@dataclass
class _TrialRun:
    """What a trial's fit left: its peak (bytes), its timed steps (seconds), why it failed, what its note adds."""

    peak: int | None = None
    timed_seconds: list[float] = field(default_factory=list)
    error: str | None = None
    said: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _out_of_memory_is_an_outcome(run: _TrialRun) -> Iterator[None]:
    """Running out of memory ends the block as the trial's outcome (``run.error``); any other error propagates. The
    error's frames are cleared: they hold the trial's tensors."""
    try:
        yield
    except BaseException as error:  # noqa: BLE001 - only out-of-memory is a trial's outcome
        if not is_out_of_memory(error):
            raise
        run.error = "out of memory: " + str(error).splitlines()[0][:200]
        traceback.clear_frames(error.__traceback__)
        del error


def _cpu_fit(
    copied: Any, candidate: Candidate, micro: Any, budget: int, steps: tuple[int, int, float], run: _TrialRun
) -> None:
    """CPU: two optimizer steps under a MemoryBudget (its accountant's peak; an accumulation of 2 has the peak of any
    larger one), then, when they fit, the timing (``steps``: warm-up, timed, seconds) without the accountant."""
    warmup, timed, seconds = steps
    with _out_of_memory_is_an_outcome(run):
        guard = MemoryBudget(budget)
        fit_steps(copied, candidate, micro, "cpu", 2, min(candidate.accumulation, 2), None, guard)
        run.peak = guard.accountant.peak_bytes
        del guard
        run.timed_seconds = timing_fit(copied, candidate, micro, "cpu", warmup, timed, seconds)


def _cuda_fit(
    copied: Any,
    candidate: Candidate,
    micro: Any,
    budget: int,
    steps: tuple[int, int],
    device: torch.device,
    run: _TrialRun,
    row: PlanRow | None,
) -> None:
    """CUDA: one fit of ``steps`` (warm-up, timed) under the allocator capped at the budget, timed by CUDA events; the
    device's own peaks, also after running out of memory (how far it got), go on ``row`` and in the note."""
    warmup, timed = steps
    clock = StepClock(candidate.accumulation, True)
    skipped: list[bool] = []
    with _out_of_memory_is_an_outcome(run):
        release(True)
        torch.cuda.reset_peak_memory_stats(device)
        with cuda_trial.capped_allocator(device, budget) as cap:
            run.said.append(f"allocator capped at {format_bytes(cap)}")
            skipped = fit_steps(copied, candidate, micro, "cuda", warmup + timed, candidate.accumulation, clock, None)
    # the budget holds the reserved bytes and the context, once: the original model is off the device, the context
    # not in them
    run.peak = int(torch.cuda.max_memory_allocated(device))
    reserved = int(torch.cuda.max_memory_reserved(device))
    if row is not None:
        row.measured_allocated_bytes, row.measured_reserved_bytes = run.peak, reserved
    run.said.insert(0, f"peaks {format_bytes(run.peak)} allocated, {format_bytes(reserved)} reserved")
    if run.error is None:
        run.error = cuda_trial.over_budget(reserved, budget)
    if any(skipped):
        run.said.append(
            f"{sum(skipped)} of {len(skipped)} optimizer steps skipped by the GradScaler (inf "
            "gradients): run beyond those asked, not timed"
        )
    if run.error is None:
        run.timed_seconds = real_step_seconds(clock.step_seconds(), skipped, warmup)
        if skipped and all(skipped):
            run.error = (
                f"the GradScaler skipped all {len(skipped)} optimizer steps (inf or NaN gradients "
                "at every scale): the optimizer never stepped"
            )


def _outcome(candidate: Candidate, run: _TrialRun) -> tuple[bool, int | None, float | None, str]:
    """``(fits, peak bytes, median samples/s, note)`` of a trial's run."""
    tail = "".join(f"; {text}" for text in run.said)
    if run.error is not None:
        return False, None, None, run.error + tail
    if not run.timed_seconds:
        return False, run.peak, None, "no timed step ran" + tail
    median = statistics.median(run.timed_seconds)
    return (
        True,
        run.peak,
        candidate.effective_batch / median,
        f"ran: median step {median * 1e3:.1f} ms of {len(run.timed_seconds)}" + tail,
    )


def run_row(
    inputs: PlanInputs,
    row: PlanRow,
    steps: tuple[int, int, float],
    say: Any,
    clock: TimeBudget | None = None,
    give_up: float = 0.0,
) -> float:
    """Run ``row``'s trial (``steps``: warm-up, timed, seconds) and keep its outcome on the row (its timed steps in
    ``step_seconds``); recorded as a ``"trial"`` phase of ``clock`` when given. ``give_up`` (seconds, CPU): its
    timing stops once its first timed steps' median is above it (:func:`~lightning_memkit.plan.timing.recording_steps`).
    Returns its wall time, seconds."""
    say(f"memkit plan: trial: {row.candidate.describe()} ...")
    started = time.perf_counter()
    with recording_steps(give_up) as runs:
        fits, peak, samples, note = trial(
            inputs.module, row.candidate, inputs.batch, inputs.budget, inputs.device_type, *steps, row=row
        )
    took = time.perf_counter() - started
    row.measured_peak_bytes = peak if fits else None
    row.measured_samples_per_s = samples if fits else None
    row.step_seconds = list(runs[-1]) if fits and runs else []
    row.note, row.status = note, RowStatus.RAN if fits else RowStatus.FAILED
    if fits and runs.gave_up:
        row.note += (
            f"; its timing stopped after {len(row.step_seconds)} steps, slower than {GIVE_UP_FACTOR:g} x the "
            "fastest trial's step: it cannot be chosen"
        )
    if clock is not None:
        clock.phases.append(Phase("trial", took, detail=row.candidate.describe()))
    say(
        f"memkit plan: trial: {row.candidate.describe()} -> {row.note}"
        + (f", peak {format_bytes(peak)}" if peak is not None and fits else "")
        + f" ({took:.1f} s)"
    )
    return took
