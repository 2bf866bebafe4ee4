"""``plan_fit``: the fastest way to train the user's effective batch within a memory budget, proved by real trials.

1. The baseline (the user's batch as is) is estimated on fake tensors; when it fits, one real trial confirms it and
   the plan changes nothing.
2. Otherwise every candidate of the space (:mod:`lightning_memkit.plan.space`) is estimated in one fake step each,
   which gives both its peak (:func:`~lightning_memkit.estimate.estimate_memory`) and its ops' FLOPs and bytes
   (:class:`~lightning_memkit.plan.time_model.OpCosts`), hence its predicted step time.
3. The candidates predicted to fit (on CUDA with :data:`CUDA_MARGIN` of the memory kept free for the allocator; on
   CPU the estimate counts the same bytes as the budget) are ranked by predicted samples/s, and the top ones run as
   real trials (at most ``trials``, 3): a real Lightning ``Trainer`` on a deep copy of the module (the module, its
   optimizer state and the RNG states are untouched), :data:`WARMUP_STEPS` optimizer steps of warm-up then
   :data:`TIMED_STEPS` timed ones (``perf_counter`` on CPU, CUDA events on GPU; the median), the peak measured (the
   accountant under a :class:`~lightning_memkit.search.budget.MemoryBudget` on CPU, so an over-budget trial fails
   cleanly; on CUDA the device's own peaks, the allocator capped at the budget and the module under plan off the
   device: :mod:`~lightning_memkit.plan.cuda_trial`). On CPU the time model is first calibrated (Lightning's loop,
   checkpointing's cost and the once-per-step part measured apart; real steps at the smallest micro-batch with
   accumulation 1 and :data:`CALIBRATION_ACCUMULATION`, and at each larger one predicted to fit) where that can
   change the choice (:func:`_calibration_needless`), every trial refits it, a trial's timing runs for
   :data:`TIMED_SECONDS`, and when several ran they are timed again in interleaved rounds.
4. The best is the fastest trial that fit: never a configuration that did not run. A trial whose difference from the
   fastest is within the machine's measured noise (:func:`_ties`) is a tie, settled by the lower peak.

The plan keeps to a wall-time budget (:mod:`lightning_memkit.plan.time_budget`: ``max_seconds``, by default the
estimate plus 20 baseline steps), stated at the start: the estimate and trials until one fits always run, every
other phase only where its predicted cost fits what is left, and each phase's cost is said as it ends.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import math
import statistics
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.batches import rebatch
from lightning_memkit.plan.space import Candidate, candidate_space, parse_plan_modes
from lightning_memkit.search.batch_guard import ProvedBatch
from lightning_memkit.plan.checkpoint_cost import measure_checkpoint_overheads
from lightning_memkit.plan.time_budget import MIN_TIMED_STEPS, Phase, TimeBudget, budget_text, describe_seconds
from lightning_memkit.plan.time_model import OpCosts, TimeModel, calibrate_cpu, roofline_for
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = [
    "Plan",
    "PlanRow",
    "PlanError",
    "plan_fit",
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

#: the share of a CUDA device's memory a candidate must leave free to count as fitting (the caching allocator's slack)
CUDA_MARGIN = 0.05
#: optimizer steps run before the timed ones in a real trial
WARMUP_STEPS = 1
#: optimizer steps timed in a real trial (their median), at least
TIMED_STEPS = 4
#: CPU: a trial's timing goes on past TIMED_STEPS until its timed steps add up to this many seconds (at most
#: MAX_TIMED_STEPS): a CPU's speed drifts by tens of percent over fractions of a second, and a few 15 ms steps
#: measured one phase of it, not the configuration
TIMED_SECONDS = 1.0
#: the most optimizer steps a trial times
MAX_TIMED_STEPS = 200
#: CPU: when several trials ran, each is timed this many times more (each timing half the plan's ``timed_seconds``,
#: :data:`TIMED_SECONDS` by default), in rounds of alternating order, and they are compared round by round
RETIMING_ROUNDS = 3
#: the most real trials a plan runs
MAX_TRIALS = 3
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
#: CPU: the fewest rounds the interleaved timing or the calibration runs when the time budget cannot pay for all of
#: them (one round says nothing of the machine's noise); fewer, and the phase is left out
MIN_ROUNDS = 2
#: CPU: a trial's timing stops after its first :data:`MIN_TIMED_STEPS` timed steps when their median is more than this
#: many times the fastest trial's step so far: it cannot be chosen (nor be a tie: the machine's noise is a few
#: percent to tens of percent), and its remaining steps would only spend the time budget
GIVE_UP_FACTOR = 1.5
#: a trial is a tie with the fastest when their difference (the mean of the per-round log ratios after interleaved
#: rounds, else the log ratio of the trials' medians) is within this many standard errors of the machine's measured
#: noise (the spread of the per-round ratios, pooled over the trials; without rounds the spread of the trials' own
#: timed steps): a tie is settled by the lower measured peak, with no more rounds (a 0.5 s timing moves by about 15%
#: from one round to the next on a 2-core VM: more rounds cannot settle a few percent in a plan's time)
TIE_ERRORS = 2.0
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


class PlanError(MemkitError, ValueError):
    """The plan cannot be made as asked; the message says what to change."""


@dataclass
class PlanRow:
    """One candidate's figures.

    Attributes:
        candidate: the configuration.
        predicted_peak_bytes: the estimate's peak (bytes; on CUDA what the device needs: allocator and context
            included); ``None`` when the estimate failed (see ``note``).
        predicted_step_s: predicted seconds per optimizer step (all its micro-batches). On CPU, once a trial ran at
            the row's micro-batch (same precision and offload: the same shapes, only checkpointing differs), the time
            model's prediction scaled by its error there (the median of measured / predicted over those trials): a
            CPU's small kernels are not linear in the batch, and what the model misses at one micro-batch it misses
            alike in each checkpointing of it. A row that ran is then predicted at its own measurement.
        predicted_samples_per_s: effective batch / predicted step time (samples per second).
        fits: whether the prediction fits the budget (with :data:`CUDA_MARGIN` on CUDA).
        measured_peak_bytes: the real trial's peak (bytes), ``None`` when not run or when it ran out of memory.
        measured_samples_per_s: the real trial's median samples per second, ``None`` when not run or failed.
        note: what happened (estimate error, trial outcome).
        costs: the fake step's ops (:class:`~lightning_memkit.plan.time_model.OpCosts`: FLOPs, bytes, counts) the
            predicted time comes from; ``None`` when the estimate failed.
        offload_bytes: bytes of saved activations one micro-batch moves to host memory and back (offload only), bytes.
        measured_allocated_bytes, measured_reserved_bytes: CUDA: the trial's peaks by the device's own counters
            (``max_memory_allocated``, ``max_memory_reserved``; the budget holds the reserved bytes and the CUDA
            context), also when it ran out of memory or over the budget (how far it got), bytes; ``None`` on CPU
            and when no trial ran.
        model_step_s: the time model's own prediction (seconds per optimizer step) before any trial ran: on CPU after
            its calibration when one ran (not when the baseline fit as is, or no smaller micro-batch was estimated),
            with no trial's measurement in it (``predicted_step_s`` carries them); on CUDA the same as
            ``predicted_step_s``. ``None`` when the estimate failed.
        step_seconds: the timed steps of the row's trial (seconds each; CPU: the machine's noise is their spread),
            empty when it did not run (or ran on CUDA).
    """

    candidate: Candidate
    predicted_peak_bytes: int | None
    predicted_step_s: float | None
    predicted_samples_per_s: float | None
    fits: bool
    measured_peak_bytes: int | None = None
    measured_samples_per_s: float | None = None
    note: str = ""
    costs: OpCosts | None = field(default=None, repr=False, compare=False)
    offload_bytes: int = field(default=0, repr=False, compare=False)
    measured_allocated_bytes: int | None = field(default=None, compare=False)
    measured_reserved_bytes: int | None = field(default=None, compare=False)
    model_step_s: float | None = field(default=None, compare=False)
    step_seconds: list[float] = field(default_factory=list, repr=False, compare=False)

    @property
    def ran(self) -> bool:
        """Whether a real trial ran this candidate to the end within the budget."""
        return self.measured_samples_per_s is not None


@dataclass
class Plan:
    """What :func:`plan_fit` found.

    Attributes:
        rows: ranked by predicted samples/s among those predicted to fit, then the rest.
        best: the fastest candidate that fit in a real trial (``None`` when none did, or none could run here).
        fits_as_is: the baseline (the user's batch, nothing changed) fits: ``best`` is the baseline.
        budget_bytes: the memory budget (bytes).
        effective_batch: the user's samples per optimizer step (every candidate keeps it).
        trials: how many real trials ran (at most :data:`MAX_TRIALS`).
        device: ``"cpu"`` or ``"cuda"``.
        notes: what the reader should know (which batch it used, no GPU here, calibration, failed trials).
        seconds: wall time of the plan, seconds.
        batch_shapes: the shapes of the data's worst batch every estimate and trial was cut from.
        proved_micro_batch: the micro-batch the best candidate's trial ran (its bytes and shapes), which AutoFit's
            guard holds training batches to; ``None`` without a best.
        max_seconds: the time budget, seconds in all (``max_seconds`` as given, or the default:
            :mod:`~lightning_memkit.plan.time_budget`).
        phases: what the plan did and what it left out, in order (:class:`~lightning_memkit.plan.time_budget.Phase`:
            its name, seconds, and why it was left out).
    """

    rows: list[PlanRow]
    best: Candidate | None
    fits_as_is: bool
    budget_bytes: int
    effective_batch: int
    trials: int
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    batch_shapes: str = ""
    proved_micro_batch: ProvedBatch | None = None
    max_seconds: float | None = None
    phases: list[Phase] = field(default_factory=list)

    @property
    def skipped(self) -> dict[str, str]:
        """The phases left out and why (``{"calibration": "...", "rounds": "..."}``; a trial left out is
        ``"trial"``)."""
        return {phase.name: phase.skipped for phase in self.phases if phase.skipped}

    @property
    def best_row(self) -> PlanRow | None:
        """The row of :attr:`best`."""
        return next((row for row in self.rows if row.candidate == self.best), None) if self.best is not None else None

    def trainer_arguments(self) -> dict[str, Any]:
        """``lightning.pytorch.Trainer`` arguments for :attr:`best`: ``accumulate_grad_batches``, ``precision`` and,
        when it checkpoints or offloads, ``callbacks`` (an :class:`~lightning_memkit.ActivationCheckpointing`, an
        :class:`~lightning_memkit.ActivationOffload`: what the best's trial ran with). The micro-batch is the
        dataloader's batch size (:attr:`Candidate.micro_batch`). Empty when there is no best.
        """
        if self.best is None:
            return {}
        kwargs = _trainer_kwargs(self.best, self.device)
        arguments: dict[str, Any] = {
            "accumulate_grad_batches": self.best.accumulation,
            "precision": kwargs["precision"],
        }
        if kwargs.get("callbacks"):
            arguments["callbacks"] = kwargs["callbacks"]
        return arguments

    def yaml(self) -> str:
        """A LightningCLI config snippet for :attr:`best` (``trainer:``, with its checkpointing and offload callbacks,
        and the micro-batch as ``batch_size``)."""
        if self.best is None:
            return "# memkit plan: no configuration fit in a real trial\n"
        best = self.best
        lines = [
            f"# memkit plan: {best.describe()} (effective batch {best.effective_batch})",
            "trainer:",
            f"  accumulate_grad_batches: {best.accumulation}",
            f"  precision: {best.precision}",
        ]
        if best.checkpoint is not None or best.offload:
            lines.append("  callbacks:")
        if best.checkpoint is not None:
            lines += [
                "    - class_path: lightning_memkit.ActivationCheckpointing",
                "      init_args:",
                f"        policy: {_policy_yaml(best.checkpoint)}",
            ]
            if not _is_budget(best.checkpoint):
                lines.append("        measure: false")
        if best.offload:
            lines.append("    - class_path: lightning_memkit.ActivationOffload")
        lines += [
            "model:  # or data: wherever your dataloader takes its batch size",
            f"  batch_size: {best.micro_batch}",
        ]
        return "\n".join(lines) + "\n"

    def table(self) -> str:
        """The ranked table: configuration, predicted peak, step time, samples/s, fits, measured figures."""
        head = (
            f"memkit plan: effective batch {self.effective_batch}, budget {format_bytes(self.budget_bytes)} "
            f"on {self.device}; "
            f"{self.trials} real trial{'s' if self.trials != 1 else ''}"
            + (
                f"; planned in {self.seconds:.0f} s of a {budget_text(self.max_seconds)} s time budget"
                if self.max_seconds is not None
                else ""
            )
        )
        rows = []
        for row in self.rows:
            rows.append(
                (
                    ("* " if row.candidate == self.best else "  ") + row.candidate.describe(),
                    format_bytes(row.predicted_peak_bytes) if row.predicted_peak_bytes is not None else "-",
                    f"{row.predicted_step_s * 1e3:.1f} ms" if row.predicted_step_s is not None else "-",
                    f"{row.predicted_samples_per_s:.1f}" if row.predicted_samples_per_s is not None else "-",
                    "yes" if row.fits else "no",
                    format_bytes(row.measured_peak_bytes) if row.measured_peak_bytes is not None else "-",
                    f"{row.measured_samples_per_s:.1f}" if row.measured_samples_per_s is not None else "-",
                    row.note,
                )
            )
        table = format_table(
            (
                "configuration",
                "predicted peak",
                "step",
                "samples/s",
                "fits",
                "measured peak",
                "measured samples/s",
                "note",
            ),
            rows,
        )
        tail = "\n".join(f"note: {n}" for n in self.notes)
        return head + "\n" + table + ("\n" + tail if tail else "")


def _is_budget(policy: Any) -> bool:
    from lightning_memkit.modes.checkpointing import CheckpointBudget

    return isinstance(policy, CheckpointBudget)


def _trainer_kwargs(candidate: Candidate, accelerator: str) -> dict[str, Any]:
    """The candidate's ``precision`` and ``callbacks`` for a Trainer: its checkpointing callback does not measure
    (a measuring forward at the first batch would add its own peak to the step's) unless its policy is a budget,
    which needs the measurement to choose its blocks."""
    extra = {} if candidate.checkpoint is None or _is_budget(candidate.checkpoint) else {"measure": False}
    return candidate.mode.trainer_kwargs(accelerator, verbose=False, **extra)


def _policy_yaml(policy: Any) -> str:
    from lightning_memkit.modes.checkpointing import CheckpointBudget, describe_policy

    if isinstance(policy, CheckpointBudget) and policy.within is None:
        return policy.describe()
    if isinstance(policy, str):
        return policy
    if isinstance(policy, frozenset):
        return "[" + ", ".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in policy)) + "]"
    return describe_policy(policy)


# ------------------------------------------------------------------------------------------ inputs
def _budget_bytes(device_memory: Any, device_type: str, gpu: Any) -> int:
    from lightning_memkit.units import parse_bytes

    if device_memory is not None:
        if isinstance(device_memory, bool):
            raise PlanError(f"device_memory={device_memory!r}: give bytes (an int) or a size such as '4GiB'")
        try:
            budget = parse_bytes(device_memory) if isinstance(device_memory, str) else int(device_memory)
        except (ValueError, TypeError) as error:
            raise PlanError(
                f"device_memory={device_memory!r}: {error}; give bytes (an int) or a size such as '4GiB'"
            ) from None
        if budget <= 0:
            raise PlanError(f"device_memory={device_memory!r}: a memory size is positive; give e.g. '4GiB'")
        return budget
    if device_type == "cuda":
        if gpu is not None or not torch.cuda.is_available():
            roof = roofline_for(gpu)
            return roof.memory_bytes
        from lightning_memkit.plan.cuda_trial import device_budget_bytes

        device = _cuda_device()
        _release(True)
        free, total = torch.cuda.mem_get_info(device)
        read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = float(read(device)) if read is not None else None
        return device_budget_bytes(free, torch.cuda.memory_reserved(device), total, fraction)
    from lightning_memkit.search.lightning import host_search_budget_bytes

    return host_search_budget_bytes()


def _device_type(device: Any, gpu: Any) -> str:
    if device is None:
        return "cuda" if gpu is not None or torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type if not isinstance(device, str) or device not in ("gpu",) else "cuda"
    if kind not in ("cpu", "cuda"):
        raise PlanError(f"device={device!r}: plan_fit plans for 'cpu' or 'cuda'")
    if gpu is not None and kind != "cuda":
        raise PlanError(f"gpu={gpu!r} names a CUDA device; drop it or give device='cuda'")
    return kind


def _cuda_device() -> torch.device:
    """The CUDA device a plan's budget, trials and peaks are on: the current one, which :func:`plan_fit` sets to the
    plan's own for the plan (:func:`_plan_device`)."""
    return torch.device("cuda", torch.cuda.current_device())


def _plan_device(device: Any) -> Any:
    """``torch.cuda.device(index)`` for a CUDA plan on this machine, so that its budget, trials and peaks are on the
    device ``device`` names (``"cuda:1"``, ``torch.device("cuda", 1)``; the current one when it names no index) and
    the current device is set back after the plan (a trial's Trainer sets it); a null context for a CPU plan or
    where no GPU is (a CUDA plan is then a prediction)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    try:
        target = torch.device("cuda" if device is None or device == "gpu" else device)
    except (RuntimeError, TypeError, ValueError):  # _device_type says what is wrong with it
        return contextlib.nullcontext()
    if target.type != "cuda":
        return contextlib.nullcontext()
    index = torch.cuda.current_device() if target.index is None else target.index
    if not 0 <= index < torch.cuda.device_count():
        raise PlanError(
            f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"0 to {torch.cuda.device_count() - 1}"
        )
    return torch.cuda.device(index)


def _user_precision(module: Any) -> str:
    trainer = getattr(module, "_trainer", None)
    text = str(getattr(trainer, "precision", "32-true")) if trainer is not None else "32-true"
    return text if text in ("32-true", "bf16-mixed", "16-mixed") else "32-true"


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's per-Trainer info lines and the trials' expected warnings (a bare iterable, few steps) are not
    shown."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
    loggers = [logging.getLogger(name) for name in names]
    try:  # the logger Lightning's rank_zero_info writes to (whichever Lightning package was imported last named it)
        from lightning_utilities.core import rank_zero

        loggers.append(rank_zero.log)
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="lightning")
            warnings.filterwarnings(
                "ignore", message=".*(num_workers|log_every_n_steps|does not have many workers|val_dataloader).*"
            )
            yield
    finally:
        for each, level in zip(loggers, levels):
            each.setLevel(level)


# ------------------------------------------------------------------------------------------ estimates
def _estimate_row(
    module: Any,
    candidate: Candidate,
    batch: Any,
    device_type: str,
    gpu: Any,
    datamodule: Any,
    budget: int,
    model: TimeModel,
) -> PlanRow:
    from lightning_memkit.estimate.core import EstimateError, accumulating, estimate_memory, observing_ops

    costs = OpCosts()
    try:
        mode = candidate.mode
        with accumulating(min(candidate.accumulation, 2)), observing_ops(costs):
            estimate = estimate_memory(
                module,
                candidate.micro_batch,
                batch=batch,
                mode=mode,
                device=device_type,
                datamodule=datamodule,
                gpu=gpu if device_type == "cuda" else None,
            )
    except (EstimateError, ValueError) as error:
        return PlanRow(candidate, None, None, None, False, note=f"not estimated: {str(error).splitlines()[0][:160]}")
    peak = int(estimate.required_bytes)
    usable = budget * (1 - CUDA_MARGIN) if device_type == "cuda" else budget
    offload_bytes = (
        int(getattr(estimate, "offload_bytes", 0) or getattr(estimate, "host_bytes", 0) or 0)
        if candidate.offload
        else 0
    )
    step_s = model.step_seconds(costs, candidate.accumulation, offload_bytes)
    return PlanRow(
        candidate,
        peak,
        step_s,
        candidate.effective_batch / step_s,
        peak <= usable,
        costs=costs,
        offload_bytes=offload_bytes,
        model_step_s=step_s,
    )


def _estimate_families(
    module: Any,
    space: list[Candidate],
    rows: list[PlanRow],
    batch: Any,
    device_type: str,
    gpu: Any,
    datamodule: Any,
    budget: int,
    model: TimeModel,
) -> int:
    """Estimate the candidates not in ``rows`` yet, per mode (precision, checkpointing, offload) from the largest
    micro-batch down, stopping two micro-batches after the first that fits; returns how many were left out."""
    families: dict[tuple, list[Candidate]] = {}
    for candidate in space:
        families.setdefault((candidate.precision, repr(candidate.checkpoint), candidate.offload), []).append(candidate)
    done = {row.candidate: row for row in rows}
    skipped = 0
    for members in families.values():
        fitting = 0
        for candidate in sorted(members, key=lambda c: -c.micro_batch):
            if fitting >= 2:
                skipped += 1
                continue
            row = done.get(candidate)
            if row is None:
                row = _estimate_row(module, candidate, batch, device_type, gpu, datamodule, budget, model)
                rows.append(row)
            if (
                row.predicted_peak_bytes is None
            ):  # this mode cannot be estimated (its note says why): its smaller ones neither
                break
            fitting += row.fits
    return skipped


def _ranked(rows: list[PlanRow]) -> list[PlanRow]:
    fitting = sorted((r for r in rows if r.fits), key=lambda r: -(r.predicted_samples_per_s or 0.0))
    rest = sorted(
        (r for r in rows if not r.fits), key=lambda r: (r.predicted_peak_bytes is None, r.predicted_peak_bytes or 0)
    )
    return fitting + rest


# ------------------------------------------------------------------------------------------ trials
class _Batches:
    """The same batch ``count`` times: the trial's training data (no loader time in the timing)."""

    def __init__(self, batch: Any, count: int) -> None:
        self.batch, self.count = batch, count

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.count):
            yield self.batch

    def __len__(self) -> int:
        return self.count


def _clock(
    accumulation: int, cuda: bool, warmup: int = 0, timed: int = 0, seconds: float = 0.0, give_up: float = 0.0
) -> Any:
    """A callback timing every optimizer step; on CPU, when ``seconds`` is given, it stops the fit once ``timed`` steps
    after ``warmup`` have run and add up to ``seconds`` (the fit's ``max_steps`` is the cap); when ``give_up`` is
    given, also once :data:`MIN_TIMED_STEPS` timed steps (``timed`` when fewer) have a median above it (seconds)."""
    from lightning.pytorch import Callback

    class _StepClock(Callback):
        """Marks the start of the first micro-batch and the end of every optimizer step."""

        def __init__(self) -> None:
            self.marks: list[Any] = []
            self.gave_up = False

        def _enough(self) -> bool:
            done = len(self.marks) - 1 - warmup  # timed steps ended
            if give_up > 0 and done >= min(timed, MIN_TIMED_STEPS):
                steps = [b - a for a, b in zip(self.marks[warmup:], self.marks[warmup + 1 :])]
                if statistics.median(steps) > give_up:
                    self.gave_up = True
                    return True
            return done >= timed and self.marks[-1] - self.marks[warmup] >= seconds

        def _mark(self) -> None:
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                self.marks.append(time.perf_counter())

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self._mark()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % accumulation == 0:
                self._mark()
                if (seconds > 0 or give_up > 0) and not cuda and self._enough():
                    trainer.should_stop = True  # at an optimizer step's end: the loop stops before the next batch

        def step_seconds(self) -> list[float]:
            if cuda:
                torch.cuda.synchronize()
                return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
            return [b - a for a, b in zip(self.marks, self.marks[1:])]

    return _StepClock()


def _fit(
    module: Any,
    candidate: Candidate,
    batch: Any,
    device_type: str,
    steps: int,
    accumulation: int,
    clock: Any,
    guard: Any,
) -> list[bool]:
    """``steps`` optimizer steps of ``accumulation`` micro-batches of ``batch`` with a real Trainer in the candidate's
    precision and checkpointing (under ``guard``, a MemoryBudget, when given), on the plan's CUDA device
    (:func:`_cuda_device`) or the CPU. In ``16-mixed`` the fit goes on until ``steps`` optimizer steps were real, at
    most :data:`~lightning_memkit.plan.real_steps.MAX_SKIPPED_STEPS` more (the GradScaler skips a step whose gradients
    overflow: it allocates no optimizer state); returns whether each optimizer step was skipped (empty in the other
    precisions)."""
    from lightning.pytorch import Trainer

    from lightning_memkit.meter import training_state_tensors
    from lightning_memkit.plan.real_steps import MAX_SKIPPED_STEPS, RealSteps

    cuda = device_type == "cuda"
    kwargs = _trainer_kwargs(candidate, "gpu" if cuda else "cpu")
    gate = RealSteps(steps) if kwargs["precision"] == "16-mixed" else None
    most = steps + (MAX_SKIPPED_STEPS if gate is not None else 0)
    callbacks = ([clock] if clock is not None else []) + kwargs["callbacks"] + ([gate] if gate is not None else [])
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=[_cuda_device().index] if cuda else 1,
        max_steps=most,
        accumulate_grad_batches=accumulation,
        precision=kwargs["precision"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    data = _Batches(batch, most * accumulation)
    try:
        if guard is not None:
            guard.adopt(training_state_tensors(module, (), batch), "state")
            with guard:
                trainer.fit(module, train_dataloaders=data)
        else:
            trainer.fit(module, train_dataloaders=data)
    finally:
        module._trainer = None  # the trainer (and its optimizers' state) goes with this call
        del trainer, data
    return gate.skipped if gate is not None else []


def _proved(batch: Any, best: Candidate | None) -> ProvedBatch | None:
    """The micro-batch ``best``'s trial ran: ``batch`` cut to its micro-batch size."""
    if best is None:
        return None
    return ProvedBatch.of(rebatch(batch, best.micro_batch), f"the plan's trial of {best.describe()}")


def _copy_of(module: Any) -> Any:
    attached = getattr(module, "_trainer", None)
    copied = copy.deepcopy(module, {id(attached): None} if attached is not None else {})
    copied._trainer = None
    return copied


def _release(cuda: bool) -> None:
    """Free what the last run left: the device's cached blocks and, on CUDA, the caching host allocator's pinned
    ones (an offload trial's: kept for the rest of the process otherwise)."""
    from lightning_memkit.plan._torch_compat import empty_host_cache

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        empty_host_cache()


def _timing_fit(
    copied: Any, candidate: Candidate, micro: Any, device_type: str, warmup: int, timed: int, seconds: float
) -> list[float]:
    """``warmup`` optimizer steps, then at least ``timed`` timed ones (on CPU, until they add up to ``seconds``, at
    most :data:`MAX_TIMED_STEPS`) of ``candidate`` on ``copied``: the timed steps' seconds."""
    cuda = device_type == "cuda"
    timing = 0.0 if cuda else seconds
    steps = warmup + (max(timed, MAX_TIMED_STEPS) if timing > 0 else timed)
    give_up = _RECORDED_STEPS[-1].give_up if _RECORDED_STEPS and not cuda else 0.0
    clock = _clock(candidate.accumulation, cuda, warmup, timed, timing, give_up)
    _fit(copied, candidate, micro, device_type, steps, candidate.accumulation, clock, None)
    timed_seconds = clock.step_seconds()[warmup:]
    if _RECORDED_STEPS:
        _RECORDED_STEPS[-1].append(timed_seconds)
        _RECORDED_STEPS[-1].gave_up = _RECORDED_STEPS[-1].gave_up or clock.gave_up
    return timed_seconds


class _Runs(list):
    """The timed steps of each timing run inside :func:`_recording_steps` (a list per run), whether one gave up."""

    give_up: float = 0.0
    gave_up: bool = False


#: the timed steps of every timing run, while :func:`_recording_steps` records them (a trial's own steps, which the
#: trial's ``(fits, peak, samples/s, note)`` leaves out: the tie rule reads the machine's noise from their spread)
_RECORDED_STEPS: list[_Runs] = []


@contextlib.contextmanager
def _recording_steps(give_up: float = 0.0) -> Iterator[_Runs]:
    """The timed steps of each timing run inside the block (a list per run, in order). ``give_up`` (seconds, CPU):
    a timing run stops once :data:`MIN_TIMED_STEPS` of its timed steps have a median above it (a trial that cannot
    be chosen: :data:`GIVE_UP_FACTOR`); ``gave_up`` then says so."""
    runs = _Runs()
    runs.give_up = give_up
    _RECORDED_STEPS.append(runs)
    try:
        yield runs
    finally:
        del _RECORDED_STEPS[next(i for i, each in enumerate(_RECORDED_STEPS) if each is runs)]


def _timed_step(
    module: Any, candidate: Candidate, batch: Any, device_type: str, warmup: int, timed: int, seconds: float = 0.0
) -> list[float]:
    """The seconds of the timed optimizer steps of ``candidate`` (see :func:`_timing_fit`) on a deep copy of
    ``module``, no budget: the CPU time model's calibration, and the interleaved rounds that time the trials again."""
    from lightning_memkit.estimate.batches import preserved_rng, rebatch

    cuda = device_type == "cuda"
    with preserved_rng(), _quiet_lightning():
        copied = _copy_of(module)
        micro = rebatch(batch, candidate.micro_batch)
        timed_seconds = _timing_fit(copied, candidate, micro, device_type, warmup, timed, seconds)
        del copied, micro
    _release(cuda)
    return timed_seconds


def _split_calibration(
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


def _calibration_steps(
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
                statistics.median(_timed_step(module, probes[index], batch, device_type, 1, 2, seconds / 2))
            )
        done = round_ + 1
        if done < rounds and keep_going is not None:
            if not keep_going(done, each, (time.perf_counter() - started) / done):
                break
    return each


def _loop_overheads(accumulation: int = 8, warmup: int = 1, timed: int = 10) -> tuple[float, float, float]:
    """Lightning's own cost on this CPU, seconds: ``(per micro-batch, per optimizer step, per run)``, from a module
    with one ``Linear(1, 1)`` trained with accumulation 1 and ``accumulation`` (the medians' difference is the
    micro-batches' cost, the rest the step's; a run's wall time beyond its steps is what building, setting up and
    tearing down a Trainer costs, which the time budget prices every real run at). The fake step sees the model's
    ops, not the loop around them (hooks, the closure, the batch's transfer, ``zero_grad``), which is what makes many
    small micro-batches slow on a CPU."""
    from lightning.pytorch import LightningModule

    class _Nothing(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layer(batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    medians, runs = [], []
    with _quiet_lightning():
        for each in (1, accumulation):
            started = time.perf_counter()
            steps = _timing_fit(_Nothing(), Candidate(1, each), torch.zeros(1, 1), "cpu", warmup, timed, 0.0)
            medians.append(statistics.median(steps))
            runs.append(time.perf_counter() - started - sum(steps) - warmup * medians[-1])
    per_batch = max(medians[1] - medians[0], 0.0) / (accumulation - 1)
    return per_batch, max(medians[0] - per_batch, 0.0), max(min(runs), 0.0)


def _trial(
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
    (``max_memory_allocated`` costs nothing), on the plan's device (:func:`_cuda_device`) and as a card of the
    budget's size would run it (:mod:`~lightning_memkit.plan.cuda_trial`): the module under plan waits in host memory
    while its copy trains (one model on the device, as in the real fit, not two), the caching allocator is capped at
    the budget less the CUDA context (the trial runs out of memory where such a card would), and it fits when its
    peak reserved bytes plus the context are within the budget. Its peaks (allocated and reserved, also when it
    failed: how far it got) go on ``row`` and in the note. An offload trial whose predicted pinned host bytes
    (``row.offload_bytes``) the host cannot spare is refused before it runs. A ``16-mixed`` trial runs until
    ``warmup + timed`` optimizer steps were real (:class:`~lightning_memkit.plan.real_steps.RealSteps`: the steps the
    GradScaler skipped allocate no optimizer state and are not timed). A compiled module's caches are reset before and
    after the trial (it compiles at its own micro-batch, as the real fit will; CUDA-graph pools are freed)."""
    from lightning_memkit.compiled import compiled_parts
    from lightning_memkit.compiled._torch_compat import reset_compiled
    from lightning_memkit.estimate.batches import preserved_rng, rebatch
    from lightning_memkit.oom import is_out_of_memory
    from lightning_memkit.plan import cuda_trial
    from lightning_memkit.plan.real_steps import real_step_seconds
    from lightning_memkit.search.budget import MemoryBudget

    cuda = device_type == "cuda"
    host_bytes = row.offload_bytes if row is not None and candidate.offload else 0
    if cuda and host_bytes:
        import psutil

        refusal = cuda_trial.host_refusal(host_bytes, psutil.virtual_memory().available)
        if refusal is not None:
            return False, None, None, refusal
    device = _cuda_device() if cuda else None
    compiled = bool(compiled_parts(module))
    if compiled:
        reset_compiled()
    error_text = None
    peak = None
    said: list[str] = []  # what the note adds: a CUDA trial's peaks, skipped fp16 steps, a compiled module's reset
    # on CUDA the module under plan is in host memory until the copy is gone (off_device)
    with (
        preserved_rng(),
        _quiet_lightning(),
        cuda_trial.off_device(module, device) if cuda else contextlib.nullcontext(),
    ):
        copied = _copy_of(module)
        micro = rebatch(batch, candidate.micro_batch)
        clock = _clock(candidate.accumulation, cuda) if cuda else None  # on CPU _timing_fit times the steps
        timed_seconds: list[float] = []
        skipped: list[bool] = []
        try:
            if cuda:
                _release(cuda)
                torch.cuda.reset_peak_memory_stats(device)
                with cuda_trial.capped_allocator(device, budget) as cap:
                    said.append(f"allocator capped at {format_bytes(cap)}")
                    skipped = _fit(
                        copied, candidate, micro, device_type, warmup + timed, candidate.accumulation, clock, None
                    )
            else:
                guard = MemoryBudget(budget)
                _fit(copied, candidate, micro, device_type, 2, min(candidate.accumulation, 2), None, guard)
                peak = guard.accountant.peak_bytes
                del guard
                timed_seconds = _timing_fit(copied, candidate, micro, device_type, warmup, timed, seconds)
        except BaseException as error:  # noqa: BLE001 - only out-of-memory is a trial's outcome
            if not is_out_of_memory(error):
                raise
            error_text = "out of memory: " + str(error).splitlines()[0][:200]
            traceback.clear_frames(error.__traceback__)
            del error
        if cuda:
            # the device's own peaks, also after running out of memory (how far it got); the budget holds the
            # reserved bytes and the context, once: the original model is off the device, the context not in them
            peak = int(torch.cuda.max_memory_allocated(device))
            reserved = int(torch.cuda.max_memory_reserved(device))
            if row is not None:
                row.measured_allocated_bytes, row.measured_reserved_bytes = peak, reserved
            said.insert(0, f"peaks {format_bytes(peak)} allocated, {format_bytes(reserved)} reserved")
            if error_text is None:
                error_text = cuda_trial.over_budget(reserved, budget)
            if any(skipped):
                said.append(
                    f"{sum(skipped)} of {len(skipped)} optimizer steps skipped by the GradScaler (inf "
                    "gradients): run beyond those asked, not timed"
                )
            if error_text is None:
                timed_seconds = real_step_seconds(clock.step_seconds(), skipped, warmup)
                if skipped and all(skipped):
                    error_text = (
                        f"the GradScaler skipped all {len(skipped)} optimizer steps (inf or NaN gradients "
                        "at every scale): the optimizer never stepped"
                    )
        del copied, micro, clock
        if compiled:
            reset_compiled()  # CUDA-graph pools go with the trees, before the cache is emptied
            said.append("compiled: dynamo's caches reset before and after the trial")
        _release(cuda)
    tail = "".join(f"; {text}" for text in said)
    if error_text is not None:
        return False, None, None, error_text + tail
    if not timed_seconds:
        return False, peak, None, "no timed step ran" + tail
    median = statistics.median(timed_seconds)
    return (
        True,
        peak,
        candidate.effective_batch / median,
        f"ran: median step {median * 1e3:.1f} ms of {len(timed_seconds)}" + tail,
    )


# ------------------------------------------------------------------------------------------ the plan
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
        a :class:`Plan`; ``plan.best`` is ``None`` when nothing fit in a real trial, or no trial could run here
        (a CUDA plan on a machine without a GPU: predictions only).

    Raises:
        PlanError: bad input (the message says what to do): not a LightningModule, a budget below the model's
            parameters, a batch size that is not a positive integer, ``trials`` outside 1..3, several devices,
            ``max_seconds`` that is not a positive number.
    """
    from lightning_memkit.estimate.batches import preserved_rng

    # the CPU calibration's and the trials' random numbers leave the caller's RNG streams as they were; a CUDA plan
    # runs on the device it names (the current device is set back after)
    with preserved_rng(), _plan_device(device):
        return _plan_fit(
            module,
            batch_size,
            device_memory,
            gpu,
            device,
            modes,
            datamodule,
            trials,
            world_size,
            strategy,
            verbose,
            warmup_steps,
            timed_steps,
            timed_seconds,
            max_seconds,
        )


def _plan_fit(
    module: Any,
    batch_size: Any,
    device_memory: Any,
    gpu: Any,
    device: Any,
    modes: Any,
    datamodule: Any,
    trials: Any,
    world_size: Any,
    strategy: Any,
    verbose: bool,
    warmup_steps: Any,
    timed_steps: Any,
    timed_seconds: Any,
    max_seconds: Any = None,
) -> Plan:
    started = time.perf_counter()
    say = (lambda text: print(text, flush=True)) if verbose else (lambda text: None)
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # pragma: no cover
        raise PlanError("plan_fit runs real Lightning trials: install lightning") from None
    if not isinstance(module, LightningModule):
        raise PlanError(
            f"plan_fit plans a LightningModule's training (its trials run a real Trainer); {type(module).__name__} "
            "is not one: wrap it in a LightningModule with training_step and configure_optimizers"
        )
    if isinstance(trials, bool) or not isinstance(trials, int) or not 1 <= trials <= MAX_TRIALS:
        raise PlanError(
            f"trials={trials!r}: give 1 to {MAX_TRIALS} "
            f"(the plan proves its choice in at most {MAX_TRIALS} real trials)"
        )
    for name, value in (("warmup_steps", warmup_steps), ("timed_steps", timed_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup_steps" else 1):
            raise PlanError(
                f"{name}={value!r}: give a {'non-negative' if name == 'warmup_steps' else 'positive'} integer"
            )
    if (
        isinstance(timed_seconds, bool)
        or not isinstance(timed_seconds, (int, float))
        or not 0 <= timed_seconds < float("inf")
    ):
        raise PlanError(f"timed_seconds={timed_seconds!r}: give seconds >= 0 (0: time timed_steps steps once)")
    if max_seconds is not None and (
        isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0
    ):
        raise PlanError(
            f"max_seconds={max_seconds!r}: give a positive number of seconds (the plan's time budget; "
            "inf: none), or None for the default (the estimate plus 20 baseline steps)"
        )
    if world_size != 1 or strategy is not None:
        raise PlanError(
            f"plan_fit plans one device (world_size=1, no strategy); for world_size={world_size!r}, "
            f"strategy={strategy!r} use `memkit estimate --strategy` for the per-rank memory"
        )
    try:
        plan_modes = parse_plan_modes(modes)
    except ValueError as error:
        raise PlanError(str(error)) from None
    device_type = _device_type(device, gpu)
    budget = _budget_bytes(device_memory, device_type, gpu)

    from lightning_memkit.estimate.batches import NoBatchError, batch_size_of
    from lightning_memkit.estimate.worst_batch import worst_batch_and_length

    try:
        # every estimate and trial runs on the data's worst batch, so what the plan proves holds for the run
        worst, _ = worst_batch_and_length(module, datamodule)
    except NoBatchError as error:
        raise PlanError(str(error)) from None
    batch = worst.batch
    effective = batch_size if batch_size is not None else batch_size_of(batch)
    if effective is None or isinstance(effective, bool) or not isinstance(effective, int) or effective < 1:
        raise PlanError(
            f"batch_size={effective!r}: give the effective batch as a positive integer (samples per optimizer step)"
        )
    state_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    if state_bytes > budget:
        raise PlanError(
            f"the budget of {format_bytes(budget)} is below the model's parameters alone "
            f"({format_bytes(state_bytes)}): "
            "no micro-batch, checkpointing or precision makes it fit; give more memory or a smaller model"
        )
    manual = not module.automatic_optimization
    from lightning_memkit.modes.checkpoint_policy import find_repeated_blocks

    can_checkpoint = bool(find_repeated_blocks(module))
    user_precision = _user_precision(module)
    try:
        space = candidate_space(
            effective,
            modes=plan_modes,
            device_type=device_type,
            precision=user_precision,
            can_checkpoint=can_checkpoint,
            can_accumulate=not manual,
        )
    except ValueError as error:
        raise PlanError(str(error)) from None
    notes: list[str] = []
    if "checkpoint" in plan_modes and not can_checkpoint:
        notes.append(f"no checkpointing candidates: {type(module).__name__} has no repeated blocks to checkpoint")
    if manual and "micro_batch" in plan_modes:
        notes.append(
            "manual optimization: no gradient accumulation (Lightning's accumulate_grad_batches does not apply)"
        )
    can_run = device_type == "cpu" or torch.cuda.is_available()
    if device_type == "cpu":
        model = TimeModel(calibrate_cpu())  # the roofline of this CPU's kernels, measured here
    else:
        model = TimeModel(roofline_for(gpu))

    from lightning_memkit.estimate.core import reusing_fake_copies

    rows: list[PlanRow] = []
    trials_run = 0
    best: PlanRow | None = None
    fits_as_is = False
    clock = TimeBudget(max_seconds, started, say)
    cpu = device_type == "cpu"
    with reusing_fake_copies():
        baseline = _estimate_row(module, space[0], batch, device_type, gpu, datamodule, budget, model)
        rows.append(baseline)
        say(
            f"memkit plan: baseline {baseline.candidate.describe()}: predicted peak "
            f"{format_bytes(baseline.predicted_peak_bytes) if baseline.predicted_peak_bytes is not None else '-'} "
            f"of {format_bytes(budget)}"
        )
        clock.state(baseline.predicted_step_s, baseline.candidate.micro_batch)
        if baseline.fits and can_run:
            clock.estimated(1, 1)
            trials_run += 1
            _run_row(module, baseline, batch, budget, device_type, warmup_steps, timed_steps, say, clock=clock)
            if baseline.ran:
                fits_as_is, best = True, baseline
                baseline.note = "fits as is: nothing to change; " + baseline.note
        if not fits_as_is:
            estimating = time.perf_counter()
            skipped = _estimate_families(module, space, rows, batch, device_type, gpu, datamodule, budget, model)
            clock.estimated(
                len(rows),
                sum(row.fits for row in rows),
                time.perf_counter() - estimating if clock.estimate_s is not None else None,
            )
            if skipped:
                notes.append(
                    f"{skipped} smaller micro-batches not estimated: below two that fit in the same mode they fit too "
                    "(memory grows with the micro-batch) and are slower (the same FLOPs in more, smaller steps)"
                )
    if not fits_as_is:
        if not can_run:
            notes.append(
                "no GPU here: the table is the prediction only and nothing ran; run memkit plan on the GPU "
                "for real trials and a best configuration"
            )
        base_model, observations, calibrations = model, [], []
        if cpu and can_run:
            measuring = time.perf_counter()
            # Lightning's own cost per micro-batch and per step, measured here: what no op of the fake step shows
            per_batch, per_step, clock.fit_overhead_s = _loop_overheads()
            per_call, per_inside = 0.0, 0.0
            if any(r.costs is not None and r.costs.regions for r in rows):
                # what torch's checkpoint runs in Python per checkpointed call and per op inside one, measured here:
                # on a CPU it outweighs the recomputed FLOPs of a small micro-batch
                per_call, per_inside = measure_checkpoint_overheads()
            base_model = model = TimeModel(
                dataclasses.replace(
                    model.roofline,
                    batch_overhead_s=per_batch,
                    step_overhead_s=per_step,
                    checkpoint_call_s=per_call,
                    checkpoint_op_s=per_inside,
                )
            )
            clock.ran(
                "overheads",
                time.perf_counter() - measuring,
                say="Lightning's loop"
                + (" and checkpointing's Python" if per_call or per_inside else "")
                + " measured apart",
            )
        _repredict(rows, model)
        # the model the time budget prices every real run with (the measured / predicted ratio of the steps that ran
        # scales it): before the calibration, as the baseline's step was predicted
        reference = model

        def expected_step(row: PlanRow) -> float:
            if row.ran:
                return row.candidate.effective_batch / row.measured_samples_per_s
            return clock.expected(
                reference.step_seconds(
                    row.costs,
                    row.candidate.accumulation,
                    row.offload_bytes,
                    row.candidate.micro_batch,
                    row.candidate.precision,
                ),
                row.candidate.micro_batch,
            )

        def trial_cost(row: PlanRow, timed: int = timed_steps, seconds: float = timed_seconds) -> float:
            return clock.trial_cost(
                expected_step(row), row.candidate.accumulation, warmup_steps, timed, seconds, MAX_TIMED_STEPS, cpu
            )

        if baseline.costs is not None:
            clock.baseline_step_s = reference.step_seconds(baseline.costs, 1)
            clock.rebase()
        if cpu and can_run:
            calibration = _calibrate(
                module,
                rows,
                batch,
                model,
                trials,
                clock,
                user_precision,
                effective,
                (per_batch, per_step),
                timed_seconds,
                lambda: sum(trial_cost(row) for row in _contenders(rows)[:trials]),
            )
            if calibration is not None:
                base_model, calibrations, note = calibration
                observations += calibrations
                model = base_model.fit(observations)
                notes.append(note)
                clock.rebase()
        _repredict(rows, model)
        for row in rows:  # what the model alone says, kept beside the ranking the trials will refine
            row.model_step_s = row.predicted_step_s
        # without a calibration the model's ranking is a guess: the trials first run the candidates that are the
        # fastest under some plausible time model (the most plausible first), then follow the ranking
        cover = [] if calibrations or not (cpu and can_run) else _plausible_winners(_contenders(rows), model)
        if len(cover) > 1:
            notes.append(
                "the time model was not calibrated: the trials ran first the candidates that are the fastest "
                "under some plausible time model: " + "; ".join(r.candidate.describe() for r in cover)
            )
        while can_run and trials_run < trials:
            queue = [r for r in _ranked(rows) if r.fits and r.measured_peak_bytes is None and not r.note]
            if not queue:
                break
            waiting_cover = [r for r in cover if any(r is q for q in queue)]
            queue = waiting_cover + [r for r in queue if not any(r is c for c in waiting_cover)]
            row = queue[0]
            skipped = _needless_trial(row, rows)
            if skipped is not None:
                row.note = skipped
                continue
            # the trials share what is left of the time budget (a trial times fewer steps to keep to its share);
            # until one has fit, a trial runs whatever the budget says: the plan's choice must have run
            waiting = min(trials - trials_run, sum(_needless_trial(r, rows) is None for r in queue))
            timing = clock.fitting_steps(
                expected_step(row),
                row.candidate.accumulation,
                warmup_steps,
                timed_steps,
                timed_seconds,
                MAX_TIMED_STEPS,
                cpu,
                clock.left() / max(waiting, 1),
            )
            shortest = min(timed_steps, MIN_TIMED_STEPS)
            if timing is None and trial_cost(row, shortest, 0.0) <= clock.left():
                timing = (shortest, 0.0)  # more than its share, its fewest steps: the trials after it may not run
            if timing is None:
                if any(r.ran for r in rows):
                    cost = describe_seconds(trial_cost(row, shortest, 0.0))
                    clock.skip(
                        "trial",
                        f"{cost} with {shortest} timed steps, and {max(clock.left(), 0):.0f} s of "
                        "the time budget are left",
                        detail=row.candidate.describe(),
                    )
                    break
                timing = (shortest, 0.0)
            timed, seconds = timing
            if (timed, seconds) != (timed_steps, timed_seconds):
                say(
                    f"memkit plan: trial of {row.candidate.describe()}: {timed} timed steps, to keep to the time "
                    f"budget ({describe_seconds(trial_cost(row, timed, seconds))}, {max(clock.left(), 0):.0f} s left)"
                )
            trials_run += 1
            fastest = min((r.candidate.effective_batch / r.measured_samples_per_s for r in rows if r.ran), default=0.0)
            _run_row(
                module,
                row,
                batch,
                budget,
                device_type,
                warmup_steps,
                timed,
                say,
                seconds,
                clock,
                give_up=GIVE_UP_FACTOR * fastest if cpu else 0.0,
            )
            if row.ran and row.costs is not None:
                clock.observe(
                    reference.step_seconds(row.costs, row.candidate.accumulation, row.offload_bytes),
                    row.candidate.effective_batch / row.measured_samples_per_s,
                    micro_batch=row.candidate.micro_batch,
                )
                clock.rebase()
            if row.ran and cpu and row.costs is not None:
                # CPU: every trial that ran refits the time model (scale of the kernels, per-op overhead), and the
                # candidates not run yet are ranked again
                observations.append(_observation(row))
                model = base_model.fit(observations)
                _repredict(rows, model, measured_errors=True)
        ran = [r for r in rows if r.ran]
        timings = None
        if cpu and timed_seconds > 0 and len(ran) > 1:
            per_round = sum(
                clock.timing_cost(expected_step(row), warmup_steps, timed_steps, timed_seconds / 2, MAX_TIMED_STEPS)
                for row in ran
            )
            rounds = max(
                (n for n in range(MIN_ROUNDS, RETIMING_ROUNDS + 1) if n * per_round <= clock.left()), default=0
            )
            if rounds:
                timing_rounds = time.perf_counter()
                timings = _interleaved_rounds(
                    module,
                    ran,
                    batch,
                    device_type,
                    warmup_steps,
                    timed_steps,
                    timed_seconds,
                    say,
                    rounds,
                    keep_going=lambda seconds: seconds <= clock.left(),
                )
                rounds = min(len(timings[id(row)]) - 1 for row in ran)
                clock.ran(
                    "rounds",
                    time.perf_counter() - timing_rounds,
                    detail=f"{rounds} rounds",
                    say=f"rounds: the {len(ran)} trials timed {rounds} more times each, in rounds of alternating order",
                )
                observations = calibrations + [_observation(r) for r in ran if r.costs is not None]
                model = base_model.fit(observations)
                _repredict(rows, model, measured_errors=True)
                notes.append(
                    f"each trial was timed {1 + rounds} times in rounds of alternating order and priced "
                    "round by round against the one with the lowest median: a CPU's speed drifts by tens of "
                    "percent while a plan runs"
                )
            else:
                clock.skip(
                    "rounds",
                    f"{MIN_ROUNDS} rounds of the {len(ran)} trials would take "
                    f"{describe_seconds(MIN_ROUNDS * per_round)}, and {max(clock.left(), 0):.0f} s of "
                    "the time budget are left: the trials' own timings decide, a difference within "
                    "their steps' noise is a tie",
                )
        if cpu and observations:
            notes.append(
                f"CPU time model fitted: kernels {model.scale:.2f} x the measured roofline, "
                f"{model.roofline.op_overhead_s * 1e6:.1f} us per op; Lightning's loop measured apart: "
                f"{model.roofline.batch_overhead_s * 1e3:.2f} ms per micro-batch, "
                + (
                    f"{model.roofline.step_overhead_s * 1e3:.2f} ms per step"
                    if model.step_s is None
                    else f"{model.step_s * 1e3:.2f} ms once per step with the optimizer (calibrated)"
                )
                + (
                    "; each micro-batch size's correction of its ops (measured / modelled): "
                    + ", ".join(
                        f"{size}{'' if precision == user_precision else f' ({precision})'}: {factor:.2f}"
                        for (precision, size), factor in sorted(model.micro_factors.items())
                    )
                    if model.micro_factors
                    else ""
                )
                + (
                    f"; checkpointing measured apart: {model.roofline.checkpoint_call_s * 1e3:.2f} ms per "
                    f"checkpointed call, {model.roofline.checkpoint_op_s * 1e6:.1f} us per op inside one"
                    if model.roofline.checkpoint_call_s or model.roofline.checkpoint_op_s
                    else ""
                )
            )
        best, tie = _settle(ran, timings, say)
        if tie is not None:
            notes.append(tie)
        rows = _ranked(rows)
        if best is None and can_run:
            notes.append(_no_best_note(rows))
    notes.insert(0, f"batch: {worst.describe()}; micro-batches are its largest samples")
    seconds = time.perf_counter() - started
    notes.append(
        f"time budget {budget_text(clock.total)} s "
        f"({'max_seconds' if clock.given is not None else 'the default'}); "
        f"planned in {seconds:.1f} s: {clock.summary()}"
    )
    notes += [
        f"{phase.name}{f' of {phase.detail}' if phase.detail else ''} left out: {phase.skipped}"
        for phase in clock.phases
        if phase.skipped
    ]
    plan = Plan(
        rows,
        best.candidate if best is not None else None,
        fits_as_is,
        budget,
        effective,
        trials_run,
        device_type,
        notes,
        seconds,
        batch_shapes=worst.shapes(),
        proved_micro_batch=_proved(batch, best.candidate if best is not None else None),
        max_seconds=clock.total,
        phases=list(clock.phases),
    )
    if fits_as_is:
        say(
            f"memkit plan: the baseline fits in {format_bytes(budget)} as is; nothing to change "
            f"({seconds:.1f} s: {clock.summary()})"
        )
    elif best is not None:
        say(
            f"memkit plan: best {best.candidate.describe()} ({best.measured_samples_per_s:.1f} samples/s measured, "
            f"{trials_run} trials) in {seconds:.1f} s of a {budget_text(clock.total)} s time budget: {clock.summary()}"
        )
    return plan


def _no_best_note(rows: list[PlanRow]) -> str:
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


def _signature(row: PlanRow) -> tuple:
    """What makes two rows the same program: batch split, precision, offload, predicted peak and the step's ops."""
    costs = row.costs
    ops = (
        (costs.micro.count, costs.micro.flops_fp32, costs.micro.flops_low, costs.micro.bytes)
        if costs is not None
        else None
    )
    return _same_shapes(row) + (row.predicted_peak_bytes, ops)


def _observation(row: PlanRow) -> tuple[OpCosts, int, float, int, str]:
    """A trial that ran, as the time model's fit takes it: ``(costs, accumulation, measured seconds per step,
    micro-batch, precision)``."""
    c = row.candidate
    return row.costs, c.accumulation, c.effective_batch / row.measured_samples_per_s, c.micro_batch, c.precision


def _calibration_rows(rows: list[PlanRow], small: PlanRow, precision: str) -> list[PlanRow]:
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
            and not r.note
            and not r.candidate.offload
            and r.candidate.precision == precision
            and size > small.candidate.micro_batch
            and (size not in chosen or r.costs.micro.count < chosen[size].costs.micro.count)
        ):
            chosen[size] = r
    return [chosen[size] for size in sorted(chosen)[-CALIBRATION_SIZES:]]


def _contenders(rows: list[PlanRow]) -> list[PlanRow]:
    """The rows predicted to fit that a trial could choose, ranked: estimated, not tried yet, one per program (a
    budget that chose every block is the same step as ``auto``), and no checkpointing of a micro-batch predicted to
    fit without it (the same step plus the recompute: never faster)."""
    fitting = [r for r in _ranked(rows) if r.fits and r.costs is not None and not r.note]
    plain = {_same_shapes(r) for r in fitting if r.candidate.checkpoint is None}
    chosen: list[PlanRow] = []
    seen: set[tuple] = set()
    for row in fitting:
        if (row.candidate.checkpoint is not None and _same_shapes(row) in plain) or _signature(row) in seen:
            continue
        seen.add(_signature(row))
        chosen.append(row)
    return chosen


def _plausible_models(model: TimeModel, contenders: list[PlanRow]) -> Iterator[TimeModel]:
    """``model`` varied over the plausible grid: its kernel scale times each of :data:`PLAUSIBLE_SCALES`, its per-op
    overhead times each of :data:`PLAUSIBLE_OP_OVERHEADS`, each contender's micro-batch ops times ``(largest /
    micro-batch) ** e`` for each ``e`` of :data:`PLAUSIBLE_SIZE_EXPONENTS` (``largest``: the largest contender's)."""
    largest = max(r.candidate.micro_batch for r in contenders)
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
                        for r in contenders
                    },
                )


def _plausible_winners(contenders: list[PlanRow], model: TimeModel) -> list[PlanRow]:
    """The contenders that are the fastest under some plausible time model (:func:`_plausible_models`), those that
    win under more of them first (then in ``contenders``' order): the trials to run when the model is not
    calibrated, so that the fastest under whichever of them is right gets a trial."""
    if not contenders:
        return []
    wins = {id(row): 0 for row in contenders}
    for variant in _plausible_models(model, contenders):
        fastest = min(
            contenders,
            key=lambda r: variant.step_seconds(
                r.costs, r.candidate.accumulation, r.offload_bytes, r.candidate.micro_batch, r.candidate.precision
            ),
        )
        wins[id(fastest)] += 1
    order = {id(row): index for index, row in enumerate(contenders)}
    return sorted((row for row in contenders if wins[id(row)]), key=lambda r: (-wins[id(r)], order[id(r)]))


def _calibration_needless(rows: list[PlanRow], trials: int, model: TimeModel) -> str | None:
    """Why the CPU calibration cannot change the choice, or ``None`` when it can. The calibration only picks which
    candidates run trials; the trials choose. It cannot change the choice when the candidates a trial could choose
    (:func:`_contenders`) are no more than the trials (every one of them runs), nor when every candidate that is the
    fastest under some plausible time model (:func:`_plausible_winners`) gets a trial: whichever model is right, its
    fastest runs."""
    contenders = _contenders(rows)
    if len(contenders) <= trials:
        return (
            f"{len(contenders)} candidate{'s' if len(contenders) != 1 else ''} predicted to fit could be chosen "
            f"and up to {trials} trials run {'them all' if len(contenders) != 1 else 'it'}: the trials decide"
        )
    winners = _plausible_winners(contenders, model)
    if len(winners) > trials:
        return None
    return (
        f"of the {len(contenders)} candidates that could be chosen, {len(winners)} "
        f"{'is' if len(winners) == 1 else 'are'} the fastest under some plausible time model (kernels "
        f"{min(PLAUSIBLE_SCALES):g} to {max(PLAUSIBLE_SCALES):g} x, per-op cost {min(PLAUSIBLE_OP_OVERHEADS):g} to "
        f"{max(PLAUSIBLE_OP_OVERHEADS):g} x the measured, a micro-batch k times smaller up to k ** "
        f"{max(PLAUSIBLE_SIZE_EXPONENTS):g} times slower per sample): "
        + "; ".join(row.candidate.describe() for row in winners)
        + f"; {'it gets a trial' if len(winners) == 1 else 'each gets a trial'}: the trials decide"
    )


def _calibrate(
    module: Any,
    rows: list[PlanRow],
    batch: Any,
    model: TimeModel,
    trials: int,
    clock: TimeBudget,
    precision: str,
    effective: int,
    overheads: tuple[float, float],
    timed_seconds: float,
    reserve: Any,
) -> tuple[TimeModel, list[tuple], str] | None:
    """The CPU calibration of ``model`` where it can change the choice and its cost fits the time budget (left out
    otherwise, and why is recorded in ``clock``): ``(the model with the once-per-step part measured, the
    calibration's observations, its note)``, or ``None``.

    Timed real steps at the smallest micro-batch estimated (where the per-op overhead weighs most), with
    accumulation 1 and CALIBRATION_ACCUMULATION, and at each larger micro-batch predicted to fit (_calibration_rows:
    as one of its rows runs it, checkpointing too, so within the budget), with accumulation 1: a calibration of the
    time model, not a trial (no budget, no candidate chosen by it), said in the notes.
    The first two's difference is a micro-batch's time, the rest the once-per-step part (the optimizer, zero_grad,
    the loop), the same for every candidate: measured, it keeps the optimizer's many cheap ops out of the per-op
    overhead fitted to the model's. The larger ones part the kernels' time from the per-op overhead (at one
    micro-batch they are in one ratio): a CPU's small micro-batches pay per op (autograd, the modules' Python,
    kernels too small for the cores) several times what a tiny op alone costs: fitted at one micro-batch, the model
    alone ranked a CNN's larger micro-batches at Spearman 0.09 against the pooled brute force (issue 25; 1.00 with a
    second size). And each size gets its own correction (TimeModel.micro_factors): a CPU's kernels do not scale
    smoothly with the batch (a DemoResNet step costs 2x at micro-batch 2 what it costs at 1, 2.3x at 4), which left
    the model alone at Spearman 0.64 on that CNN's tight budget with the smallest and largest sizes only.

    It runs in up to :data:`CALIBRATION_ROUNDS` rounds where the time budget left, less ``reserve()`` seconds kept
    for the trials (priced at the machine's speed as measured so far), pays for them: it is left out when
    :data:`MIN_ROUNDS` rounds are predicted not to fit, and stops after a round when the next, priced as the rounds
    so far took, does not fit."""
    small = min(
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
    if small is None or small.candidate.micro_batch >= effective:
        clock.skip("calibration", "no micro-batch smaller than the batch was estimated")
        return None
    needless = _calibration_needless(rows, trials, model)
    if needless is not None:
        clock.skip("calibration", needless)
        return None
    larger = _calibration_rows(rows, small, precision)
    probes = [
        Candidate(small.candidate.micro_batch, accumulation, precision)
        for accumulation in (1, CALIBRATION_ACCUMULATION)
    ]
    probes += [dataclasses.replace(r.candidate, accumulation=1) for r in larger]
    sources = [small, small] + larger
    predicted = [
        model.step_seconds(r.costs, p.accumulation, 0, p.micro_batch, p.precision) for r, p in zip(sources, probes)
    ]
    per_round = sum(
        clock.timing_cost(clock.expected(step, probe.micro_batch), 1, 2, timed_seconds / 2, MAX_TIMED_STEPS)
        for step, probe in zip(predicted, probes)
    )
    rounds = max(
        (n for n in range(MIN_ROUNDS, CALIBRATION_ROUNDS + 1) if n * per_round + reserve() <= clock.left()), default=0
    )
    if not rounds:
        clock.skip(
            "calibration",
            f"{MIN_ROUNDS} rounds of its {len(probes)} timings would take "
            f"{describe_seconds(MIN_ROUNDS * per_round)}, and {max(clock.left(), 0):.0f} s of "
            f"the time budget are left, {describe_seconds(reserve())} of them kept for the "
            "trials (the time model ranks the candidates from its roofline and measured "
            "overheads)",
        )
        return None

    def keep_going(done: int, timings: list[list[float]], seconds: float) -> bool:
        # the machine's speed as the rounds so far measured it prices the trials kept for; the next round as these
        for index, (step, measured) in enumerate(zip(predicted, timings)):
            clock.observe(step, statistics.median(measured), ("calibration", index), probes[index].micro_batch)
        return seconds + reserve() <= clock.left()

    per_batch, per_step = overheads
    calibrating = time.perf_counter()
    timings = _calibration_steps(module, probes, batch, "cpu", timed_seconds, rounds, keep_going=keep_going)
    calibrating = time.perf_counter() - calibrating
    rounds = len(timings[0])
    for index, (step, measured) in enumerate(zip(predicted, timings)):
        clock.observe(step, statistics.median(measured), ("calibration", index), probes[index].micro_batch)
    clock.ran(
        "calibration",
        calibrating,
        detail=f"{rounds} rounds",
        say=f"calibration: {rounds} rounds of {len(probes)} timings (micro-batch "
        f"{', '.join(str(p.micro_batch) for p in [probes[0]] + probes[2:])})",
    )
    one, many = statistics.median(timings[0]), statistics.median(timings[1])
    per_micro, once = _split_calibration(timings[0], timings[1], per_batch, per_step)
    calibrated = dataclasses.replace(model, step_s=once)
    observations = [
        (small.costs, 1, one, small.candidate.micro_batch, precision),
        (small.costs, CALIBRATION_ACCUMULATION, many, small.candidate.micro_batch, precision),
    ]
    observations += [
        (r.costs, 1, statistics.median(t), r.candidate.micro_batch, precision) for r, t in zip(larger, timings[2:])
    ]
    note = (
        f"CPU time model: real steps at micro-batch {small.candidate.micro_batch} with accumulation "
        f"1 and {CALIBRATION_ACCUMULATION}"
        + "".join(f", {p.describe()}" for p in probes[2:])
        + f" calibrate it (not trials; {calibrating:.1f} s, {rounds} rounds): "
        + (
            f"{per_micro * 1e3:.2f} ms per micro-batch, {once * 1e3:.2f} ms once per step (the optimizer, the loop)"
            if once is not None
            else "too noisy to part a micro-batch from the once-per-step part (the optimizer priced from its ops)"
        )
        + "; each size timed gets its own correction of its ops; each trial refits it"
    )
    return calibrated, observations, note


def _repredict(rows: list[PlanRow], model: TimeModel, measured_errors: bool = False) -> None:
    """Every estimated row's predicted step from ``model``; with ``measured_errors`` (CPU), scaled by the model's
    error on the trials that ran at the row's micro-batch (see :attr:`PlanRow.predicted_step_s`)."""
    errors: dict[tuple, list[float]] = {}
    for row in rows:
        if row.costs is not None:
            row.predicted_step_s = model.step_seconds(
                row.costs,
                row.candidate.accumulation,
                row.offload_bytes,
                row.candidate.micro_batch,
                row.candidate.precision,
            )
            if measured_errors and row.ran:
                measured = row.candidate.effective_batch / row.measured_samples_per_s
                errors.setdefault(_same_shapes(row), []).append(measured / row.predicted_step_s)
    for row in rows:
        if row.costs is not None:
            if measured_errors and row.ran:  # its own measurement (a median over its group could reorder two that ran)
                row.predicted_step_s = row.candidate.effective_batch / row.measured_samples_per_s
            elif _same_shapes(row) in errors:
                row.predicted_step_s *= statistics.median(errors[_same_shapes(row)])
            row.predicted_samples_per_s = row.candidate.effective_batch / row.predicted_step_s


def _needless_trial(row: PlanRow, rows: list[PlanRow]) -> str | None:
    """Why ``row`` needs no trial, given the trials that ran (its note), or ``None``: the same program as one that
    ran (a budget that chose every block: same peak and ops), or a checkpointed configuration whose micro-batch
    already fit without checkpointing (it runs the same step plus the recompute: it cannot be faster)."""
    twin = next((r for r in rows if r.note.startswith("ran") and _signature(r) == _signature(row)), None)
    if twin is not None:
        return f"not run: the same step as {twin.candidate.describe()} (peak and ops)"
    if row.candidate.checkpoint is not None:
        plain = next(
            (r for r in rows if r.ran and r.candidate.checkpoint is None and _same_shapes(r) == _same_shapes(row)), None
        )
        if plain is not None:
            return (
                f"not run: {plain.candidate.describe()} fit, and checkpointing it runs the same step plus the recompute"
            )
    return None


def _same_shapes(row: PlanRow) -> tuple:
    """What rows whose steps run the same kernels on the same shapes share (checkpointing apart)."""
    c = row.candidate
    return c.micro_batch, c.accumulation, c.precision, c.offload


def _run_row(
    module: Any,
    row: PlanRow,
    batch: Any,
    budget: int,
    device_type: str,
    warmup: int,
    timed: int,
    say: Any,
    seconds: float = 0.0,
    clock: TimeBudget | None = None,
    give_up: float = 0.0,
) -> float:
    """Run ``row``'s trial and keep its outcome on the row (its timed steps in ``step_seconds``); recorded as a
    ``"trial"`` phase of ``clock`` when given. ``give_up`` (seconds, CPU): its timing stops once its first timed
    steps' median is above it (:func:`_recording_steps`). Returns its wall time, seconds."""
    say(f"memkit plan: trial: {row.candidate.describe()} ...")
    started = time.perf_counter()
    with _recording_steps(give_up) as runs:
        fits, peak, samples, note = _trial(
            module, row.candidate, batch, budget, device_type, warmup, timed, seconds, row=row
        )
    took = time.perf_counter() - started
    row.measured_peak_bytes = peak if fits else None
    row.measured_samples_per_s = samples if fits else None
    row.step_seconds = list(runs[-1]) if fits and runs else []
    row.note = note
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


def _interleaved_rounds(
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
    noise is a tie (:func:`_settle`). The configurations fit already (the trial measured their peak): no budget here.
    ``rounds=0``: each row keeps its trial's own timing, nothing compared. ``keep_going(seconds per round so far)``,
    when given, is asked after each round from the :data:`MIN_ROUNDS`-th on whether to run the next (the time
    budget's check). Returns each row's timings (``id(row)`` -> seconds per step: its trial's median, then one per
    round)."""
    timings = {id(row): [_observation(row)[2]] for row in ran}  # the trial's own first: in no round with the others
    started = time.perf_counter()
    for round_ in range(rounds):
        if MIN_ROUNDS <= round_ and keep_going is not None and not keep_going((time.perf_counter() - started) / round_):
            rounds = round_
            break
        for row in ran[::-1] if round_ % 2 == 0 else ran:
            again = statistics.median(
                _timed_step(module, row.candidate, batch, device_type, warmup, timed, seconds / 2)
            )
            timings[id(row)].append(again)
    steps = {id(row): statistics.median(timings[id(row)]) for row in ran}
    how: dict[int, str] = {}  # how a row was priced: none for a row at the median of its own timings
    if rounds > 0 and len(ran) > 1:
        anchor = min(ran, key=lambda row: steps[id(row)])
        for row in ran:
            if row is not anchor:
                ratio = statistics.median(_round_ratios(timings, row, anchor))
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


def _round_ratios(timings: dict[int, list[float]], row: PlanRow, to: PlanRow) -> list[float]:
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


def _ties(ran: list[PlanRow], timings: dict[int, list[float]] | None = None) -> tuple[PlanRow | None, list[tuple]]:
    """The fastest trial, and each other trial against it: ``(row, apart, noise)``, both log ratios of steps:
    ``apart`` how much slower the row is, ``noise`` :data:`TIE_ERRORS` standard errors of that difference as the
    machine's measured noise gives it (``None`` where it was not measured: CUDA trials keep no steps). The row is a
    tie with the fastest when ``apart <= noise``.

    After at least :data:`MIN_ROUNDS` interleaved rounds (``timings`` from :func:`_interleaved_rounds`) the noise is
    the spread of the per-round log ratios to the fastest, pooled over the trials, over the square root of the rounds;
    without them, the spread of the log steps within each trial's timing (:func:`_step_spread`) makes the standard
    error of the two trials' medians (1.25 x that of a mean)."""
    if not ran:
        return None, []
    fastest = max(ran, key=lambda row: row.measured_samples_per_s)
    step = {id(row): row.candidate.effective_batch / row.measured_samples_per_s for row in ran}
    others = [row for row in ran if row is not fastest]
    rounds = min((len(timings[id(row)]) - 1 for row in ran), default=0) if timings else 0
    compared = []
    if rounds >= MIN_ROUNDS:
        logs = {id(row): [math.log(r) for r in _round_ratios(timings, row, fastest)] for row in others}
        variance = _pooled_variance(list(logs.values()))
        for row in others:
            noise = None if variance is None else TIE_ERRORS * math.sqrt(variance / len(logs[id(row)]))
            compared.append((row, math.log(step[id(row)] / step[id(fastest)]), noise))
        return fastest, compared
    spread = _step_spread(ran)
    for row in others:
        counts = (len(row.step_seconds), len(fastest.step_seconds))
        noise = None
        if spread is not None and min(counts) > 0:
            noise = TIE_ERRORS * math.sqrt(math.pi / 2) * spread * math.sqrt(1 / counts[0] + 1 / counts[1])
        compared.append((row, math.log(step[id(row)] / step[id(fastest)]), noise))
    return fastest, compared


def _step_spread(ran: list[PlanRow]) -> float | None:
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


def _settle(ran: list[PlanRow], timings: dict[int, list[float]] | None, say: Any) -> tuple[PlanRow | None, str | None]:
    """The best of the trials that ran: the fastest, unless trials within the machine's measured noise of it
    (:func:`_ties`) have a lower measured peak: a tie is settled by the lower peak (the same speed as far as the
    plan can tell, more memory left), with no more rounds. Returns ``(best, the tie's note or None)``."""
    fastest, compared = _ties(ran, timings)
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
