"""A plan's rows: each candidate's estimate (its peak and ops from one fake step, its step time from the time model),
their ranking, their time re-predicted as trials run, and which rows run the same program (a trial of one proves the
other)."""

from __future__ import annotations

import statistics

from lightning_memkit.estimate.core import EstimateError, accumulating, estimate_memory, observing_ops
from lightning_memkit.plan.inputs import PlanInputs
from lightning_memkit.plan.result import PlanRow, RowStatus
from lightning_memkit.plan.space import Candidate
from lightning_memkit.plan.time_model import OpCosts, TimeModel

__all__ = [
    "CUDA_MARGIN",
    "contenders",
    "estimate_families",
    "estimate_row",
    "needless_trial",
    "observation",
    "ranked",
    "repredict",
    "same_shapes",
    "signature",
]

#: the share of a CUDA device's memory a candidate must leave free to count as fitting (the caching allocator's slack)
CUDA_MARGIN = 0.05


def estimate_row(inputs: PlanInputs, candidate: Candidate, model: TimeModel) -> PlanRow:
    """``candidate``'s row: its peak and ops from one fake step (an accumulation of 2 has the peak of any larger
    one), its step time from ``model``, whether it fits ``inputs.budget``; a row with a note when it cannot be
    estimated."""
    costs = OpCosts()
    cuda = inputs.device_type == "cuda"
    try:
        with accumulating(min(candidate.accumulation, 2)), observing_ops(costs):
            estimate = estimate_memory(
                inputs.module,
                candidate.micro_batch,
                batch=inputs.batch,
                mode=candidate.mode,
                device=inputs.device_type,
                datamodule=inputs.datamodule,
                gpu=inputs.gpu if cuda else None,
            )
    except (EstimateError, ValueError) as error:
        note = f"not estimated: {str(error).splitlines()[0][:160]}"
        return PlanRow(candidate, None, None, None, False, note=note, status=RowStatus.NOT_ESTIMATED)
    peak = int(estimate.required_bytes)
    usable = inputs.budget * (1 - CUDA_MARGIN) if cuda else inputs.budget
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


def estimate_families(inputs: PlanInputs, rows: list[PlanRow], model: TimeModel) -> int:
    """Estimate the candidates not in ``rows`` yet, per mode (precision, checkpointing, offload) from the largest
    micro-batch down, stopping two micro-batches after the first that fits; returns how many were left out."""
    families: dict[tuple, list[Candidate]] = {}
    for candidate in inputs.space:
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
                row = estimate_row(inputs, candidate, model)
                rows.append(row)
            if row.predicted_peak_bytes is None:  # this mode cannot be estimated (its note says why): nor its smaller
                break
            fitting += row.fits
    return skipped


def ranked(rows: list[PlanRow]) -> list[PlanRow]:
    """Those predicted to fit, fastest first, then the rest by predicted peak (those not estimated last)."""
    fitting = sorted((r for r in rows if r.fits), key=lambda r: -(r.predicted_samples_per_s or 0.0))
    rest = sorted(
        (r for r in rows if not r.fits), key=lambda r: (r.predicted_peak_bytes is None, r.predicted_peak_bytes or 0)
    )
    return fitting + rest


def signature(row: PlanRow) -> tuple:
    """What makes two rows the same program: batch split, precision, offload, predicted peak and the step's ops."""
    costs = row.costs
    ops = (
        (costs.micro.count, costs.micro.flops_fp32, costs.micro.flops_low, costs.micro.bytes)
        if costs is not None
        else None
    )
    return same_shapes(row) + (row.predicted_peak_bytes, ops)


def observation(row: PlanRow) -> tuple[OpCosts, int, float, int, str]:
    """A trial that ran, as the time model's fit takes it: ``(costs, accumulation, measured seconds per step,
    micro-batch, precision)``."""
    c = row.candidate
    return row.costs, c.accumulation, c.effective_batch / row.measured_samples_per_s, c.micro_batch, c.precision


def contenders(rows: list[PlanRow]) -> list[PlanRow]:
    """The rows predicted to fit that a trial could choose, ranked: estimated, not tried yet, one per program (a
    budget that chose every block is the same step as ``auto``), and no checkpointing of a micro-batch predicted to
    fit without it (the same step plus the recompute: never faster)."""
    fitting = [r for r in ranked(rows) if r.fits and r.costs is not None and r.status is RowStatus.ESTIMATED]
    plain = {same_shapes(r) for r in fitting if r.candidate.checkpoint is None}
    chosen: list[PlanRow] = []
    seen: set[tuple] = set()
    for row in fitting:
        if (row.candidate.checkpoint is not None and same_shapes(row) in plain) or signature(row) in seen:
            continue
        seen.add(signature(row))
        chosen.append(row)
    return chosen


def repredict(rows: list[PlanRow], model: TimeModel, measured_errors: bool = False) -> None:
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
                errors.setdefault(same_shapes(row), []).append(measured / row.predicted_step_s)
    for row in rows:
        if row.costs is not None:
            if measured_errors and row.ran:  # its own measurement (a median over its group could reorder two that ran)
                row.predicted_step_s = row.candidate.effective_batch / row.measured_samples_per_s
            elif same_shapes(row) in errors:
                row.predicted_step_s *= statistics.median(errors[same_shapes(row)])
            row.predicted_samples_per_s = row.candidate.effective_batch / row.predicted_step_s


def needless_trial(row: PlanRow, rows: list[PlanRow]) -> str | None:
    """Why ``row`` needs no trial, given the trials that ran (its note), or ``None``: the same program as one that
    ran (a budget that chose every block: same peak and ops), or a checkpointed configuration whose micro-batch
    already fit without checkpointing (it runs the same step plus the recompute: it cannot be faster)."""
    twin = next((r for r in rows if r.ran and signature(r) == signature(row)), None)
    if twin is not None:
        return f"not run: the same step as {twin.candidate.describe()} (peak and ops)"
    if row.candidate.checkpoint is not None:
        plain = next(
            (r for r in rows if r.ran and r.candidate.checkpoint is None and same_shapes(r) == same_shapes(row)), None
        )
        if plain is not None:
            return (
                f"not run: {plain.candidate.describe()} fit, and checkpointing it runs the same step plus the recompute"
            )
    return None


def same_shapes(row: PlanRow) -> tuple:
    """What rows whose steps run the same kernels on the same shapes share (checkpointing apart)."""
    c = row.candidate
    return c.micro_batch, c.accumulation, c.precision, c.offload
