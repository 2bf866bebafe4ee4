"""A plan's rows: each candidate's estimate (its peak from one fake step; on CUDA also its step time from the
roofline model), their order by the plan's rule, and which of them a trial should take."""

from __future__ import annotations

import contextlib
from typing import Any

from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.estimate.step.settings import accumulating, observing_ops
from lightning_memkit.plan.inputs import PlanInputs
from lightning_memkit.plan.rank_space import comm_bytes, optimizer_share
from lightning_memkit.plan.result import PlanRow, RowStatus
from lightning_memkit.plan.space import Candidate, preference, recompute_level
from lightning_memkit.plan.time_model import OpCosts, TimeModel
from lightning_memkit.units import format_bytes

__all__ = [
    "CUDA_MARGIN",
    "dominated_by",
    "estimate_families",
    "estimate_row",
    "model_states_floor",
    "ranked",
    "trial_order",
]

#: the share of a CUDA device's memory a candidate must leave free to count as fitting (the caching allocator's slack)
CUDA_MARGIN = 0.05


def estimate_row(inputs: PlanInputs, candidate: Candidate, model: TimeModel | None) -> PlanRow:
    """``candidate``'s row: its peak from one fake step (an accumulation of 2 has the peak of any larger one; on
    several devices one rank's, :func:`~lightning_memkit.estimate.distributed.per_rank.estimate_distributed_memory`)
    and whether it fits ``inputs.budget``; with a ``model`` (a CUDA plan) also its step time, by term, from the same
    fake step's ops. A row with a note when it cannot be estimated."""
    return _estimated(inputs, candidate, model)[0]


def _estimated(inputs: PlanInputs, candidate: Candidate, model: TimeModel | None) -> tuple[PlanRow, Any]:
    """:func:`estimate_row`'s row, and the estimate it came from (``None`` when the estimate failed)."""
    # a step whose ops are known already runs unobserved, so the estimate may answer from the fake step another
    # strategy ran (an observed step always runs)
    costs = OpCosts() if model is not None and _costs_key(candidate) not in inputs.op_costs else None
    cuda = inputs.device_type == "cuda"
    try:
        with (
            accumulating(min(candidate.accumulation, 2)),
            observing_ops(costs) if costs is not None else contextlib.nullcontext(),
        ):
            estimate = _estimate(inputs, candidate, cuda)
    except (EstimateError, ValueError) as error:
        note = f"not estimated: {str(error).splitlines()[0][:160]}"
        return PlanRow(candidate, None, None, None, False, note=note, status=RowStatus.NOT_ESTIMATED), None
    peak = int(estimate.required_bytes)
    single = getattr(estimate, "single", estimate)
    offload_bytes = int(getattr(single, "host_bytes", 0) or 0) if candidate.offload else 0
    terms = None
    costs = _shared_costs(inputs, candidate, costs) if model is not None else None
    if model is not None and costs is not None:
        parameters = inputs.devices.parameters
        sent = comm_bytes(candidate, parameters) if parameters is not None else 0
        terms = model.step_terms(costs, candidate.accumulation, offload_bytes, sent, optimizer_share(candidate))
    step_s = terms.total_s if terms is not None else None
    row = PlanRow(
        candidate,
        peak,
        step_s,
        candidate.effective_batch / step_s if step_s else None,
        peak <= _usable_bytes(inputs),
        costs=costs,
        offload_bytes=offload_bytes,
        terms=terms,
    )
    return row, estimate


def _usable_bytes(inputs: PlanInputs) -> float:
    """What a candidate may need to fit: the budget, less :data:`CUDA_MARGIN` of it on a CUDA device."""
    return inputs.budget * (1 - CUDA_MARGIN) if inputs.device_type == "cuda" else inputs.budget


def model_states_floor(estimate: Any) -> tuple[int, str]:
    """Bytes every configuration of ``estimate``'s strategy, precision and offload holds at the moment of its peak,
    whatever its micro-batch, accumulation or checkpointing, and what they are: a lower bound of each of their peaks.

    Always the parameters. In the optimizer's step, also the optimizer state and the gradients (every configuration
    runs the same optimizer step on the same gradients). In the second step's forward, also the optimizer state (made
    by the first step) and the first step's gradients (Lightning sets them to ``None`` after the forward). Elsewhere
    in the second step, the optimizer state."""
    single = getattr(estimate, "single", estimate)
    categories = estimate.by_category
    parts = ["parameters"]
    if single.peak_step == 2 or single.peak_phase == "optimizer":
        parts.append("optimizer_state")
    if single.peak_phase == "optimizer" or (single.peak_step == 2 and single.peak_phase == "forward"):
        parts.append("gradients")
    return sum(int(categories.get(part, 0)) for part in parts), ", ".join(parts)


def _estimate(inputs: PlanInputs, candidate: Candidate, cuda: bool) -> Any:
    """The candidate's estimate: one device's, or on several one rank's under its strategy."""
    common = {
        "batch": inputs.batch,
        "mode": candidate.mode,
        "device": inputs.device_type,
        "datamodule": inputs.datamodule,
        "gpu": inputs.gpu if cuda else None,
    }
    if candidate.strategy is None:
        return estimate_memory(inputs.module, candidate.micro_batch, **common)
    return estimate_distributed_memory(
        inputs.module,
        candidate.micro_batch,
        strategy=candidate.strategy,
        world_size=candidate.world_size,
        wrap=inputs.devices.wrap,
        **common,
    )


def _costs_key(candidate: Candidate) -> tuple:
    """What makes two candidates' per-rank steps run the same ops (the strategy apart)."""
    c = candidate
    return c.micro_batch, min(c.accumulation, 2), c.precision, repr(c.checkpoint), c.offload


def _shared_costs(inputs: PlanInputs, candidate: Candidate, costs: OpCosts | None) -> OpCosts | None:
    """The ops of the candidate's per-rank step: those just observed (kept for the other strategies), or those
    observed when another strategy ran the same step; ``None`` when no op was seen (an estimate answered from its
    memo runs no step): no step time is predicted then, rather than a step of no ops."""
    key = _costs_key(candidate)
    if costs is not None and costs.micro.count:
        inputs.op_costs.setdefault(key, costs)
    return inputs.op_costs.get(key)


def estimate_families(inputs: PlanInputs, rows: list[PlanRow], model: TimeModel | None, fits_per_mode: int = 2) -> int:
    """Estimate the candidates not in ``rows`` yet, per mode (strategy, precision, checkpointing, offload) from the
    largest micro-batch down, stopping after ``fits_per_mode`` that fit (smaller ones fit too, and the rule ranks
    them after); returns how many were left out.

    A candidate whose strategy, precision and offload already showed model states above the budget
    (:func:`model_states_floor` of an estimated row) gets a row that says so, without a step: no micro-batch or
    checkpointing can fit it (DDP's full copy of a 7B's states on every rank)."""
    families: dict[tuple, list[Candidate]] = {}
    for candidate in inputs.space:
        family = (candidate.strategy, candidate.precision, repr(candidate.checkpoint), candidate.offload)
        families.setdefault(family, []).append(candidate)
    done = {row.candidate: row for row in rows}
    floors: dict[tuple, tuple[int, str]] = {}
    skipped = 0
    for members in families.values():
        fitting = 0
        for candidate in sorted(members, key=lambda c: -c.micro_batch):
            if fitting >= fits_per_mode:
                skipped += 1
                continue
            row = done.get(candidate)
            if row is None:
                above = _row_above_floor(inputs, candidate, floors)
                if above is not None:
                    rows.append(above)
                    continue
                row = _estimate_with_floor(inputs, candidate, model, floors)
                rows.append(row)
            if row.predicted_peak_bytes is None:  # this mode cannot be estimated (its note says why): nor its smaller
                break
            fitting += row.fits
    return skipped


def _states_key(candidate: Candidate) -> tuple:
    """What makes two candidates' model states the same: strategy, world size, precision, offload."""
    return candidate.strategy, candidate.world_size, candidate.precision, candidate.offload


def _estimate_with_floor(
    inputs: PlanInputs, candidate: Candidate, model: TimeModel | None, floors: dict[tuple, tuple[int, str]]
) -> PlanRow:
    """:func:`estimate_row`, keeping the estimate's :func:`model_states_floor` for its strategy and precision (the
    highest seen), with where it was measured."""
    row, estimate = _estimated(inputs, candidate, model)
    if estimate is not None:
        floor, parts = model_states_floor(estimate)
        if floor > floors.get(_states_key(candidate), (0, ""))[0]:
            floors[_states_key(candidate)] = (floor, f"{parts} in the step of {candidate.describe()}")
    return row


def _row_above_floor(inputs: PlanInputs, candidate: Candidate, floors: dict[tuple, tuple[int, str]]) -> PlanRow | None:
    """A row for a candidate whose model states alone exceed the budget (no step run), else ``None``."""
    floor, source = floors.get(_states_key(candidate), (0, ""))
    if floor <= _usable_bytes(inputs):
        return None
    note = f"does not fit: its model states alone need {format_bytes(floor)} whatever the micro-batch ({source})"
    return PlanRow(candidate, None, None, None, False, note=note, status=RowStatus.NOT_ESTIMATED)


def ranked(rows: list[PlanRow], by_time: bool = False) -> list[PlanRow]:
    """Those predicted to fit in the rule's order (:func:`~lightning_memkit.plan.space.preference`; ``by_time``: the
    fastest predicted step first, the rule's order between equals), then the rest by predicted peak (those not
    estimated last)."""

    def order(row: PlanRow) -> tuple:
        speed = -(row.predicted_samples_per_s or 0.0) if by_time else 0.0
        return speed, preference(row.candidate)

    fitting = sorted((r for r in rows if r.fits), key=order)
    rest = sorted(
        (r for r in rows if not r.fits), key=lambda r: (r.predicted_peak_bytes is None, r.predicted_peak_bytes or 0)
    )
    return fitting + rest


def dominated_by(row: PlanRow, rows: list[PlanRow]) -> PlanRow | None:
    """A row that makes ``row``'s trial needless, or ``None``: one predicted to fit (and not failed in a trial) that
    runs the same micro-batch in the same precision with less recompute or no offload where ``row`` offloads, and no
    more of the other (``row`` runs the same step plus the recompute or the copies: it cannot be faster; a
    checkpointing budget that chose every block is no faster than ``auto``)."""
    c = row.candidate
    mine = (recompute_level(c), c.offload)
    for other in ranked(rows):
        o = other.candidate
        if other is row or not _standing(other) or (o.micro_batch, o.precision) != (c.micro_batch, c.precision):
            continue
        theirs = (recompute_level(o), o.offload)
        if theirs != mine and theirs[0] <= mine[0] and theirs[1] <= mine[1]:
            return other
    return None


def _standing(row: PlanRow) -> bool:
    """Predicted to fit, and not failed in a trial."""
    return row.fits and row.status in (RowStatus.ESTIMATED, RowStatus.RAN)


def trial_order(rows: list[PlanRow]) -> list[PlanRow]:
    """The rows a trial should take next, in order: predicted to fit, not tried yet, not made needless by another
    (:func:`dominated_by`); first each mode's largest micro-batch still standing (the rule ranks a mode's smaller
    ones after it), in the rule's order, then the rest in the rule's order."""
    standing = [r for r in ranked(rows) if _standing(r) and dominated_by(r, rows) is None]

    def mode(row: PlanRow) -> tuple:
        c = row.candidate
        return c.precision, repr(c.checkpoint), c.offload

    largest: dict[tuple, PlanRow] = {}
    for row in standing:  # in the rule's order: a mode's first row is its largest micro-batch
        largest.setdefault(mode(row), row)
    waiting = [r for r in standing if r.status is RowStatus.ESTIMATED]
    return [r for r in waiting if largest[mode(r)] is r] + [r for r in waiting if largest[mode(r)] is not r]
