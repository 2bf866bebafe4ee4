"""A plan's real trials: a candidate trained with a real Lightning ``Trainer`` on a deep copy of the module, its peak
measured within the memory budget and its steps timed (:func:`trial`, which returns a :class:`TrialRecord`), and
that record kept on the candidate's row (:func:`run_row`)."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from lightning_memkit.compiled import compiled_parts
from lightning_memkit.compiled._torch_compat import reset_compiled
from lightning_memkit.estimate.data.batches import preserved_rng, rebatch
from lightning_memkit.oom import is_out_of_memory
from lightning_memkit.plan import cuda_trial
from lightning_memkit.plan.cuda_trial import cuda_device, release
from lightning_memkit.plan.inputs import PlanInputs
from lightning_memkit.plan.lightning_runs import StepClock, copy_of, fit_steps, timing_fit
from lightning_memkit.plan.result import PlanRow
from lightning_memkit.plan.space import Candidate
from lightning_memkit.quiet_lightning import quiet_lightning
from lightning_memkit.search.batch_guard import ProvedBatch
from lightning_memkit.search.budget import MemoryBudget
from lightning_memkit.search.real_steps import real_step_seconds
from lightning_memkit.units import format_bytes

__all__ = ["TrialRecord", "TrialSteps", "proved_batch", "run_row", "trial"]


@dataclass(frozen=True)
class TrialSteps:
    """How long a trial runs.

    Attributes:
        warmup: optimizer steps run before the timed ones.
        timed: optimizer steps timed, at least.
        seconds: CPU: the timed steps go on until they add up to this many seconds (0: ``timed`` steps once).
    """

    warmup: int
    timed: int
    seconds: float = 0.0


@dataclass
class TrialRecord:
    """What one real trial measured.

    Attributes:
        fits: it ran its steps within the memory budget and timed at least one.
        peak_bytes: its peak, bytes: the accountant's on CPU (every tensor counted against the budget), the device's
            ``max_memory_allocated`` on CUDA; ``None`` when it failed before a peak was read.
        step_seconds: its timed optimizer steps, seconds each (on CUDA, by CUDA events; a ``16-mixed`` trial's steps
            the GradScaler skipped are left out).
        note: what happened, for the plan's table (``ran: median step ...``, ``out of memory: ...``).
        allocated_bytes, reserved_bytes: CUDA: the device's own peaks (``max_memory_allocated``,
            ``max_memory_reserved``), also when the trial failed (how far it got), bytes; ``None`` on CPU.
    """

    fits: bool
    peak_bytes: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    note: str = ""
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None

    @property
    def median_step_s(self) -> float | None:
        """The median of :attr:`step_seconds`, seconds per optimizer step (``None`` without one)."""
        return statistics.median(self.step_seconds) if self.step_seconds else None


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
    steps: TrialSteps,
    offload_bytes: int = 0,
) -> TrialRecord:
    """One real trial of ``candidate`` on a deep copy of ``module`` (``module``, its optimizer state and the RNG
    states are left as they were).

    On CPU the memory and the time are measured in two fits of the same copy: first two optimizer steps under a
    :class:`~lightning_memkit.search.budget.MemoryBudget` (the accountant counts every tensor against the budget and
    stops an over-budget step cleanly; the second step is the steady state; an accumulation of 2 has the peak of any
    larger one), then, when it fit, ``steps`` without the accountant (its per-op bookkeeping would be in the time).
    On CUDA one fit does both (``max_memory_allocated`` costs nothing), on the plan's device (:func:`cuda_device`)
    and as a card of the budget's size would run it (:mod:`~lightning_memkit.plan.cuda_trial`): the module under
    plan waits in host memory while its copy trains (one model on the device, as in the real fit), the caching
    allocator is capped at the budget less the CUDA context, and it fits when its peak reserved bytes plus the context
    are within the budget. An offload trial whose predicted pinned host bytes (``offload_bytes``) the host cannot
    spare is refused before it runs. A ``16-mixed`` trial runs until its steps were real
    (:class:`~lightning_memkit.search.real_steps.RealSteps`). A compiled module's caches are reset before and after the
    trial, also when it fails (it compiles at its own micro-batch, as the real fit will; CUDA-graph pools are freed);
    an error other than running out of memory propagates with its frames cleared: it holds none of the trial's tensors.
    """
    cuda = device_type == "cuda"
    if cuda and offload_bytes:
        refusal = cuda_trial.host_refusal(offload_bytes, psutil.virtual_memory().available)
        if refusal is not None:
            return TrialRecord(False, note=refusal)
    device = cuda_device() if cuda else None
    compiled = bool(compiled_parts(module))
    record = TrialRecord(False)
    said: list[str] = []
    if compiled:
        reset_compiled()
        said.append("compiled: dynamo's caches reset before and after the trial")
    # on CUDA the module under plan is in host memory until the copy is gone (off_device)
    with (
        preserved_rng(),
        quiet_lightning(),
        cuda_trial.off_device(module, device) if device is not None else contextlib.nullcontext(),
    ):
        copied = micro = None
        try:
            copied = copy_of(module)
            micro = rebatch(batch, candidate.micro_batch)
            if device is not None:  # on CUDA
                _cuda_fit(copied, candidate, micro, budget, steps, device, record, said)
            else:
                _cpu_fit(copied, candidate, micro, budget, steps, record)
        except BaseException as error:
            traceback.clear_frames(error.__traceback__)  # the error keeps its lines, not the trial's tensors
            raise
        finally:
            del copied, micro
            if compiled:
                reset_compiled()  # CUDA-graph pools go with the trees, before the cache is emptied
            release(cuda)
    return _concluded(record, said)


@contextlib.contextmanager
def _out_of_memory_is_an_outcome(record: TrialRecord) -> Iterator[None]:
    """Running out of memory ends the block as the trial's outcome (``record.note``); any other error propagates.
    The error's frames are cleared: they hold the trial's tensors."""
    try:
        yield
    except BaseException as error:  # only out-of-memory is a trial's outcome: the rest is raised again
        if not is_out_of_memory(error):
            raise
        record.note = "out of memory: " + str(error).splitlines()[0][:200]
        traceback.clear_frames(error.__traceback__)
        del error


def _cpu_fit(
    copied: Any, candidate: Candidate, micro: Any, budget: int, steps: TrialSteps, record: TrialRecord
) -> None:
    """CPU: two optimizer steps under a MemoryBudget (its accountant's peak; an accumulation of 2 has the peak of any
    larger one), then, when they fit, the timing without the accountant."""
    with _out_of_memory_is_an_outcome(record):
        guard = MemoryBudget(budget)
        fit_steps(copied, candidate, micro, "cpu", 2, min(candidate.accumulation, 2), None, guard)
        record.peak_bytes = guard.accountant.peak_bytes
        del guard
        record.step_seconds = timing_fit(copied, candidate, micro, "cpu", steps.warmup, steps.timed, steps.seconds)


def _cuda_fit(
    copied: Any,
    candidate: Candidate,
    micro: Any,
    budget: int,
    steps: TrialSteps,
    device: torch.device,
    record: TrialRecord,
    said: list[str],
) -> None:
    """CUDA: one fit of the warm-up and timed steps under the allocator capped at the budget, timed by CUDA events;
    the device's own peaks, also after running out of memory (how far it got), go on the record."""
    clock = StepClock(candidate.accumulation, device)
    skipped: list[bool] = []
    with _out_of_memory_is_an_outcome(record):
        release(True)
        torch.cuda.reset_peak_memory_stats(device)
        with cuda_trial.capped_allocator(device, budget) as cap:
            said.append(f"allocator capped at {format_bytes(cap)}")
            total = steps.warmup + steps.timed
            skipped = fit_steps(copied, candidate, micro, "cuda", total, candidate.accumulation, clock, None)
    # the budget holds the reserved bytes and the context, once: the original model is off the device, the context
    # not in them
    record.peak_bytes = record.allocated_bytes = int(torch.cuda.max_memory_allocated(device))
    record.reserved_bytes = int(torch.cuda.max_memory_reserved(device))
    said.insert(
        0, f"peaks {format_bytes(record.allocated_bytes)} allocated, {format_bytes(record.reserved_bytes)} reserved"
    )
    if not record.note:
        record.note = cuda_trial.over_budget(record.reserved_bytes, budget) or ""
    if any(skipped):
        said.append(
            f"{sum(skipped)} of {len(skipped)} optimizer steps skipped by the GradScaler (inf gradients): run beyond "
            "those asked, not timed"
        )
    if not record.note:
        record.step_seconds = real_step_seconds(clock.step_seconds(), skipped, steps.warmup)
        if skipped and all(skipped):
            record.note = (
                f"the GradScaler skipped all {len(skipped)} optimizer steps (inf or NaN gradients at every scale): "
                "the optimizer never stepped"
            )


def _concluded(record: TrialRecord, said: list[str]) -> TrialRecord:
    """The record with its outcome: it fits when nothing failed and a step was timed; its note says so."""
    tail = "".join(f"; {text}" for text in said)
    if record.note:  # it failed: the note says how
        record.step_seconds = []
    elif record.median_step_s is None:
        record.note = "no timed step ran"
    else:
        record.fits = True
        record.note = f"ran: median step {record.median_step_s * 1e3:.1f} ms of {len(record.step_seconds)}"
    record.note += tail
    return record


def run_row(inputs: PlanInputs, row: PlanRow, steps: TrialSteps, say: Callable[[str], None]) -> float:
    """Run ``row``'s trial and keep its record on the row; returns its wall time, seconds."""
    say(f"memkit plan: trial: {row.candidate.describe()} ...")
    started = time.perf_counter()
    record = trial(
        inputs.module, row.candidate, inputs.batch, inputs.budget, inputs.device_type, steps, row.offload_bytes
    )
    took = time.perf_counter() - started
    row.keep(record)
    say(
        f"memkit plan: trial: {row.candidate.describe()} -> {row.note}"
        + (f", peak {format_bytes(record.peak_bytes)}" if record.fits and record.peak_bytes is not None else "")
        + f" ({took:.1f} s)"
    )
    return took
