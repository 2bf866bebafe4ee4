"""A plan on several devices (:func:`plan_devices`): every candidate of the world size (a strategy, micro-batch x
accumulation, precision, checkpointing) estimated for one rank, and the choice among those that fit.

Nothing is trialled: a plan answers for ``world_size`` devices this process does not hold. On a CUDA target the
candidates are ranked by their predicted step (:class:`~lightning_memkit.plan.time_model.StepTerms`: compute,
recompute, optimizer, the training loop, and the bytes the rank sends at the interconnect's bandwidth), and the
fastest that fits is the choice; on a CPU, where no model of the kernels ranks them, the rule's first that fits
(:func:`~lightning_memkit.plan.space.preference`). With ``max_world_size`` it plans on the fewest devices that fit
(1, 2, 4, ..., where the effective batch divides evenly): one device is planned as usual, trials included.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_memkit.estimate.step.settings import reusing_fake_copies
from lightning_memkit.plan.rank_space import rank_space, world_sizes
from lightning_memkit.plan.result import PlanRow, RowStatus
from lightning_memkit.plan.rows import estimate_families, ranked
from lightning_memkit.plan.state import PlanState
from lightning_memkit.plan.time_model import TimeModel, roofline_for
from lightning_memkit.units import format_bytes

__all__ = ["plan_devices"]


def plan_devices(state: PlanState, one_device: Callable[[PlanState], None]) -> None:
    """Plan on ``inputs.devices.world_size`` devices, or on the fewest up to it (``fewest``); ``one_device`` plans a
    world size of 1 (its estimate, trials and choice)."""
    inputs = state.inputs
    devices = inputs.devices
    sizes = world_sizes(inputs.effective, devices.world_size) if devices.fewest else [devices.world_size]
    crowded: list[int] = []
    for n in sizes:
        state.world_size, state.rows = n, []
        if n == 1:
            one_device(state)
        else:
            _estimate_ranks(state, n)
        if any(row.fits for row in state.rows) or n == sizes[-1]:
            break
        crowded.append(n)
    if devices.fewest:
        fits = any(row.fits for row in state.rows)
        state.notes.insert(
            0,
            (f"fewest devices: {state.world_size}" if fits else f"no candidate fits on up to {devices.world_size}")
            + (f" ({', '.join(map(str, crowded))}: no candidate fits)" if crowded else ""),
        )
    if state.world_size > 1:
        _choose_predicted(state)


def _estimate_ranks(state: PlanState, world_size: int) -> None:
    """Estimate one rank of every candidate on ``world_size`` devices (per strategy and mode from the largest
    micro-batch down, as on one device)."""
    inputs = state.inputs
    devices = inputs.devices
    model = None if inputs.cpu else TimeModel(roofline_for(inputs.gpu), devices.interconnect)
    inputs.space = rank_space(
        inputs.effective,
        world_size,
        devices.strategies,
        modes=inputs.modes,
        device_type=inputs.device_type,
        precision=inputs.precision,
        can_checkpoint=devices.wrap is not None,
        can_accumulate=bool(inputs.module.automatic_optimization),
    )
    started = time.perf_counter()
    # a mode's first micro-batch that fits is its best: a smaller one runs the same samples in more steps (on CUDA
    # each op's roofline time at half the batch is at least half, the loop's and the collectives' per micro-batch
    # costs repeat; on CPU the rule ranks it after), and nothing is trialled to say otherwise
    with reusing_fake_copies():
        skipped = estimate_families(inputs, state.rows, model, fits_per_mode=1)
    took = time.perf_counter() - started
    state.clock.ran("estimate", took, f"{len(state.rows)} candidates on {world_size} devices")
    fitting = sum(row.fits for row in state.rows)
    state.say(
        f"memkit plan: {len(state.rows)} candidates on {world_size} devices estimated, {fitting} predicted to fit "
        f"{format_bytes(inputs.budget)} per device ({took:.1f} s)"
    )
    if skipped:
        state.notes.append(
            f"{skipped} smaller micro-batches not estimated: below one that fits in the same strategy and mode, they "
            "run the same samples in more steps and cannot be predicted faster"
        )


def _choose_predicted(state: PlanState) -> None:
    """The best of the candidates that fit: the fastest predicted step (CUDA), else the rule's first."""
    inputs = state.inputs
    by_time = not inputs.cpu
    fitting = [row for row in ranked(state.rows, by_time=by_time) if row.fits]
    if not fitting:
        return
    best = state.best = fitting[0]
    if by_time and best.terms is not None:
        terms = best.terms
        state.reason = (
            f"the fastest predicted step of the {len(fitting)} that fit: {terms.total_s * 1e3:.0f} ms (compute "
            f"{terms.compute_s * 1e3:.0f} ms, recompute {terms.recompute_s * 1e3:.0f} ms, optimizer "
            f"{terms.optimizer_s * 1e3:.0f} ms, {format_bytes(terms.comm_bytes)} sent in {terms.comm_s * 1e3:.0f} ms)"
        )
    else:
        state.reason = f"the plan's rule ranks it first of the {len(fitting)} that fit"
    state.reason += f"; predicted, not trialled (this process holds one device, the plan is for {state.world_size})"
    _mark_predicted(state.rows, best)


def _mark_predicted(rows: list[PlanRow], best: PlanRow) -> None:
    for row in rows:
        if row.fits and row.status is RowStatus.ESTIMATED:
            row.note = "predicted best: no trial on several devices" if row is best else "predicted: no trial"
