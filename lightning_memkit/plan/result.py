"""What a plan found: :class:`PlanRow` (one candidate's predicted and measured figures) and :class:`Plan` (the rows, the
best configuration, and how to train it: :meth:`Plan.trainer_arguments`, :meth:`Plan.yaml`, :meth:`Plan.table`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_memkit.errors import MemkitError
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget, describe_policy
from lightning_memkit.plan.space import Candidate
from lightning_memkit.plan.strategy_arguments import strategy_argument, strategy_yaml
from lightning_memkit.plan.time_budget import Phase, budget_text
from lightning_memkit.plan.time_model import OpCosts, StepTerms
from lightning_memkit.search.batch_guard import ProvedBatch
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

if TYPE_CHECKING:  # trials.py imports this module to build rows
    from lightning_memkit.plan.trials import TrialRecord

__all__ = ["Plan", "PlanError", "PlanRow", "RowStatus", "trainer_kwargs"]


class PlanError(MemkitError, ValueError):
    """The plan cannot be made as asked; the message says what to change."""


class RowStatus(str, enum.Enum):
    """Where a candidate's row stands in a plan (a ``str``: ``"ran"``, ...)."""

    #: predicted, no trial (yet)
    ESTIMATED = "estimated"
    #: the estimate failed (the note says why): no prediction, no trial
    NOT_ESTIMATED = "not estimated"
    #: its trial fit the budget and was timed
    RAN = "ran"
    #: its trial ran out of memory, went over the budget, was refused or timed nothing (the note says which)
    FAILED = "failed"
    #: no trial: the same program as a row the trials could take, more recompute or offload on a micro-batch that fits
    #: with less, or no time left in the plan's budget (the note says which)
    NOT_RUN = "not run"


@dataclass
class PlanRow:
    """One candidate's figures.

    Attributes:
        candidate: the configuration.
        predicted_peak_bytes: the estimate's peak (bytes; on CUDA what the device needs: allocator and context
            included); ``None`` when the estimate failed (see ``note``).
        predicted_step_s: predicted seconds per optimizer step (all its micro-batches) from the roofline time model
            (:mod:`~lightning_memkit.plan.time_model`) of a CUDA plan; ``None`` on CPU (a CPU plan's trials time the
            candidates: no model of a CPU's kernels ranks them) and when the estimate failed.
        predicted_samples_per_s: effective batch / predicted step time (samples per second), or ``None``.
        fits: whether the prediction fits the budget (with :data:`~lightning_memkit.plan.rows.CUDA_MARGIN` on CUDA).
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
        step_seconds: the timed optimizer steps of the row's trial, seconds each (their spread is the machine's noise);
            empty when it did not run or failed.
        terms: a CUDA plan's predicted step by term (:class:`~lightning_memkit.plan.time_model.StepTerms`: compute,
            recompute, optimizer, loop, offload, and on several devices the bytes sent and their time), or ``None``.
        round_seconds: when the plan timed this row again side by side with the rule's first
            (:mod:`~lightning_memkit.plan.choice`), its median step in each round, seconds; empty otherwise.
        status: where the row stands (:class:`RowStatus`).
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
    step_seconds: list[float] = field(default_factory=list, repr=False, compare=False)
    round_seconds: list[float] = field(default_factory=list, repr=False, compare=False)
    terms: StepTerms | None = field(default=None, repr=False, compare=False)
    status: RowStatus = field(default=RowStatus.ESTIMATED, compare=False)

    @property
    def ran(self) -> bool:
        """Whether a real trial ran this candidate to the end within the budget."""
        return self.measured_samples_per_s is not None

    def keep(self, record: TrialRecord) -> None:
        """Take a trial's :class:`~lightning_memkit.plan.trials.TrialRecord`: its measured figures, note and status."""
        median = record.median_step_s
        self.measured_peak_bytes = record.peak_bytes if record.fits else None
        self.measured_samples_per_s = self.candidate.effective_batch / median if record.fits and median else None
        self.measured_allocated_bytes, self.measured_reserved_bytes = record.allocated_bytes, record.reserved_bytes
        self.step_seconds = list(record.step_seconds) if record.fits else []
        self.note = record.note
        self.status = RowStatus.RAN if record.fits else RowStatus.FAILED


@dataclass
class Plan:
    """What :func:`plan_fit` found.

    Attributes:
        rows: those predicted to fit in the order of the plan's rule (:func:`~lightning_memkit.plan.space.preference`:
            no recompute first, then a lower precision where allowed, no offload, fewer and larger micro-batches),
            then the rest by predicted peak.
        best: the candidate chosen among those that fit in a real trial: the rule's first, unless another was
            measured faster by more than :data:`~lightning_memkit.plan.choice.MIN_GAIN` (``None`` when none fit, or
            none could run here).
        fits_as_is: the baseline (the user's batch, nothing changed) fits: ``best`` is the baseline.
        budget_bytes: the memory budget (bytes).
        effective_batch: the user's samples per optimizer step (every candidate keeps it).
        trials: how many real trials ran (at most :data:`~lightning_memkit.plan.inputs.MAX_TRIALS`).
        device: ``"cpu"`` or ``"cuda"``.
        notes: what the reader should know (which batch it used, no GPU here, what was left out and why).
        seconds: wall time of the plan, seconds.
        batch_shapes: the shapes of the data's worst batch every estimate and trial was cut from.
        proved_micro_batch: the micro-batch the best candidate's trial ran (its bytes and shapes), which AutoFit's
            guard holds training batches to; ``None`` without a best.
        max_seconds: the time budget, seconds in all (``max_seconds`` as given, or the default:
            :mod:`~lightning_memkit.plan.time_budget`).
        phases: what the plan did and what it left out, in order (:class:`~lightning_memkit.plan.time_budget.Phase`:
            its name, seconds, and why it was left out).
        reason: one line on why :attr:`best` was chosen (``""`` without one).
        world_size: the devices the plan is for (on several, each row's figures are one rank's).
        wrap: the module classes FSDP wraps as units (its repeated blocks), which :meth:`trainer_arguments` and
            :meth:`yaml` give FSDP as its ``auto_wrap_policy``; ``None`` on one device.
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
    reason: str = ""
    world_size: int = 1
    wrap: frozenset[type] | None = None

    @property
    def skipped(self) -> dict[str, str]:
        """The phases left out and why (``{"trial": "...", "rounds": "..."}``)."""
        return {phase.name: phase.skipped for phase in self.phases if phase.skipped}

    @property
    def best_row(self) -> PlanRow | None:
        """The row of :attr:`best`."""
        return next((row for row in self.rows if row.candidate == self.best), None) if self.best is not None else None

    def trainer_arguments(self) -> dict[str, Any]:
        """``lightning.pytorch.Trainer`` arguments for :attr:`best`: ``accumulate_grad_batches``, ``precision``, on
        several devices ``devices`` and ``strategy`` (a registered name, or an ``FSDPStrategy`` wrapping
        :attr:`wrap`), and when it checkpoints or offloads ``callbacks`` (an
        :class:`~lightning_memkit.ActivationCheckpointing`, an :class:`~lightning_memkit.ActivationOffload`: what the
        best's trial ran with). The micro-batch is the dataloader's batch size (:attr:`Candidate.micro_batch`). Empty
        when there is no best.
        """
        if self.best is None:
            return {}
        kwargs = trainer_kwargs(self.best, self.device)
        arguments: dict[str, Any] = {}
        if self.best.strategy is not None:
            arguments["devices"] = self.best.world_size
            arguments["strategy"] = strategy_argument(self.best.strategy, self.wrap, self.best.world_size)
        arguments["accumulate_grad_batches"] = self.best.accumulation
        arguments["precision"] = kwargs["precision"]
        if kwargs.get("callbacks"):
            arguments["callbacks"] = kwargs["callbacks"]
        return arguments

    def yaml(self) -> str:
        """A LightningCLI config snippet for :attr:`best` (``trainer:``, with its checkpointing and offload callbacks,
        and the micro-batch as ``batch_size``)."""
        if self.best is None:
            return "# memkit plan: no configuration fit in a real trial\n"
        best = self.best
        lines = [f"# memkit plan: {best.describe()} (effective batch {best.effective_batch})", "trainer:"]
        if best.strategy is not None:
            lines += [f"  devices: {best.world_size}", *strategy_yaml(best.strategy, self.wrap, best.world_size)]
        lines += [f"  accumulate_grad_batches: {best.accumulation}", f"  precision: {best.precision}"]
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
        """The table: each candidate estimated, in the plan's order, with its predicted peak, whether it fits, its
        predicted step on CUDA, and what its trial measured; then the choice and why, and the notes."""
        head = (
            f"memkit plan: effective batch {self.effective_batch}, budget {format_bytes(self.budget_bytes)} "
            f"on {self.device}; {self.trials} real trial{'s' if self.trials != 1 else ''}"
            + (
                f"; planned in {self.seconds:.0f} s of a {budget_text(self.max_seconds)} s time budget"
                if self.max_seconds is not None
                else ""
            )
        )
        predicted = any(row.predicted_step_s is not None for row in self.rows)
        communicates = any(row.terms is not None and row.terms.comm_bytes for row in self.rows)
        columns = ["configuration", "predicted peak" + (" per rank" if self.world_size > 1 else ""), "fits"]
        columns += ["compute", "recompute", "sent", "comm"] if communicates else []
        columns += ["predicted step", "samples/s"] if predicted else []
        columns += ["measured peak", "measured samples/s", "note"]
        table = format_table(tuple(columns), [self._cells(row, predicted, communicates) for row in self.rows])
        tail = [f"best: {self.best.describe()}: {self.reason}"] if self.best is not None and self.reason else []
        tail += [f"note: {n}" for n in self.notes]
        return head + "\n" + table + "".join("\n" + line for line in tail)

    def _cells(self, row: PlanRow, predicted: bool, communicates: bool) -> tuple[str, ...]:
        def size(value: int | None) -> str:
            return format_bytes(value) if value is not None else "-"

        cells = [
            ("* " if row.candidate == self.best else "  ") + row.candidate.describe(),
            size(row.predicted_peak_bytes),
            "yes" if row.fits else "no",
        ]
        if communicates:
            terms = row.terms
            cells += (
                [f"{terms.compute_s * 1e3:.0f} ms", f"{terms.recompute_s * 1e3:.0f} ms", size(terms.comm_bytes)]
                + [f"{terms.comm_s * 1e3:.0f} ms"]
                if terms is not None
                else ["-"] * 4
            )
        if predicted:
            cells += [
                f"{row.predicted_step_s * 1e3:.1f} ms" if row.predicted_step_s is not None else "-",
                f"{row.predicted_samples_per_s:.1f}" if row.predicted_samples_per_s is not None else "-",
            ]
        measured = row.measured_samples_per_s
        cells += [size(row.measured_peak_bytes), f"{measured:.1f}" if measured is not None else "-", row.note]
        return tuple(cells)


def _is_budget(policy: Any) -> bool:
    return isinstance(policy, CheckpointBudget)


def trainer_kwargs(candidate: Candidate, accelerator: str) -> dict[str, Any]:
    """The candidate's ``precision`` and ``callbacks`` for a Trainer: its checkpointing callback does not measure
    (a measuring forward at the first batch would add its own peak to the step's) unless its policy is a budget,
    which needs the measurement to choose its blocks."""
    extra = {} if candidate.checkpoint is None or _is_budget(candidate.checkpoint) else {"measure": False}
    return candidate.mode.trainer_kwargs(accelerator, verbose=False, **extra)


def _policy_yaml(policy: Any) -> str:
    if isinstance(policy, CheckpointBudget) and policy.within is None:
        return policy.describe()
    if isinstance(policy, str):
        return policy
    if isinstance(policy, frozenset):
        return "[" + ", ".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in policy)) + "]"
    return describe_policy(policy)
