"""Activation checkpointing for any nn.Module: apply a policy (choose, measure, wrap) and plan it.

The entry points, :func:`apply_checkpointing` and :func:`plan_checkpointing`; the policies and the choice of
regions live in ``checkpoint_policy``, the records in ``checkpoint_plan``, the wrapping in ``checkpoint_wrap`` and the
measuring in ``checkpoint_measure``.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from lightning_memkit.modes.checkpoint_measure import (
    BlockProfile,
    MeasureError,
    block_profiles,
    measure_forward,
)
from lightning_memkit.modes.checkpoint_plan import CheckpointPlan, CheckpointSegment
from lightning_memkit.modes.checkpoint_policy import (
    CheckpointBudget,
    CheckpointPolicy,
    Region,
    budget_candidates,
    describe_policy,
    no_match_error,
    normalize_policy,
    regions_for,
)
from lightning_memkit.modes.checkpoint_wrap import (
    CheckpointHandle,
    unwrap_modules,
    wrap_regions,
)
from lightning_memkit.units import format_bytes

__all__ = ["apply_checkpointing", "plan_checkpointing"]


def _segments(regions: list[Region], profiles: dict[str, BlockProfile] | None) -> list[CheckpointSegment]:
    out = []
    for region in regions:
        p = (profiles or {}).get(region.name)
        out.append(
            CheckpointSegment(
                region.name,
                tuple(region.module_names),
                None if p is None else p.saved_bytes,
                None if p is None else p.predicted_saving_bytes,
                None if p is None else p.recompute_flops,
                None if p is None else p.forward_seconds,
            )
        )
    return out


def _plan_budget(module: nn.Module, budget: CheckpointBudget, sample: Any) -> tuple[CheckpointPlan, list[nn.Module]]:
    if sample is None:
        raise ValueError(
            "a budget policy measures activation memory on a sample: pass sample=(inputs,) "
            "or sample=lambda: model.training_step(batch, 0)"
        )
    candidates = budget_candidates(module, budget)
    if not candidates:
        raise no_match_error(module, budget)
    try:
        profiled = measure_forward(module, sample, {r.name: r.modules for r in candidates}, count_flops=True)
    except MeasureError as error:
        raise ValueError(f"a budget policy needs a measuring forward, and it failed: {error}") from error
    profiles = block_profiles(profiled)
    baseline = profiled.activation_bytes
    peak = profiled.peak_bytes
    target = budget.target_bytes(baseline)
    plan = CheckpointPlan(describe_policy(budget), [], baseline, baseline, target, measuring_peak_bytes=peak)
    if baseline <= target:
        plan.note = "the baseline already meets the budget; nothing checkpointed"
        return plan, []
    useful = [r for r in candidates if profiles[r.name].predicted_saving_bytes > 0]
    among = (
        f"the modules {describe_policy(budget.within)} matches"
        if budget.within is not None
        else f"the blocks of {type(module).__name__}"
    )
    if not useful:
        raise ValueError(
            f"budget {format_bytes(target)} cannot be met: none of {among} holds activation memory "
            "that checkpointing would free; use a larger budget or another set of module classes"
        )

    def cost(region: Region) -> float:
        p = profiles[region.name]
        return float(p.recompute_flops) if p.recompute_flops > 0 else p.forward_seconds * 1e12

    # Greedy knapsack: most bytes freed per unit of recompute first, until the prediction meets the budget.
    order = sorted(useful, key=lambda r: -profiles[r.name].predicted_saving_bytes / max(cost(r), 1e-9))
    need = baseline - target
    count = 0
    freed = 0
    while count < len(order) and freed < need:
        freed += profiles[order[count].name].predicted_saving_bytes
        count += 1
    # The prediction ignores interactions; measure and add blocks until the budget is met exactly.
    while True:
        chosen = order[:count]
        wrapped = wrap_regions(chosen)
        try:
            measured = measure_forward(module, sample)
        except MeasureError as error:
            unwrap_modules(wrapped)
            raise ValueError(f"a budget policy needs a measuring forward, and it failed: {error}") from error
        peak = max(peak, measured.peak_bytes)
        if measured.activation_bytes <= target or count >= len(order):
            break
        unwrap_modules(wrapped)
        count += 1
    plan.measured_activation_bytes = measured.activation_bytes
    plan.measuring_peak_bytes = peak
    plan.segments = _segments(chosen, profiles)
    if measured.activation_bytes > target:
        unwrap_modules(wrapped)
        got = measured.activation_bytes
        raise ValueError(
            f"budget {format_bytes(target)} cannot be met: checkpointing all {len(order)} candidates ({among}) leaves "
            f"{format_bytes(got)} of activation memory (baseline {format_bytes(baseline)}); "
            f"choose a budget of at least {format_bytes(got)} (budget='{got}B') or {got / baseline:.2f} of the baseline"
        )
    plan.note = f"{count} of {len(order)} candidates ({among}), chosen by bytes freed per recompute FLOP"
    return plan, wrapped


def apply_checkpointing(module: nn.Module, policy: CheckpointPolicy = "auto", sample: Any = None) -> CheckpointHandle:
    """Checkpoint submodules of ``module`` (non-reentrant) and return a handle that undoes it.

    Args:
        module: any ``nn.Module`` (a LightningModule included). It is changed in place: the chosen
            modules get an instance ``forward``; names, parameters and ``state_dict`` are untouched.
        policy: ``"auto"`` (repeated blocks: same-class children of a ModuleList/ModuleDict/Sequential; a
            Sequential run of n blocks is cut into about sqrt(n) segments, ModuleList blocks are one
            segment each), a set of module classes, a callable ``(qualified_name, module) -> bool``,
            or a :class:`CheckpointBudget` (``"budget=0.5"``: a fraction of the baseline activation
            memory; ``"budget=512MiB"``: a size), which measures activation memory on ``sample`` and
            checkpoints the blocks that meet the budget at the least recompute FLOPs, among the
            modules its ``within=`` policy matches when given. The outermost match wins when a match
            contains another.
        sample: input for the measuring forwards (a tensor, tuple of args, dict of kwargs, or a
            zero-argument callable running the forward). Required for budgets; with other policies it
            fills in each region's saved bytes, predicted saving and FLOPs and the measured totals.
            Measuring keeps no activation (see :func:`measure_forward`): its peak is about a
            ``no_grad`` forward's, and nothing it made outlives the call.

    Raises:
        ValueError: when the policy matches nothing (the message lists the model's module classes),
            or a budget cannot be met. A failing measuring forward is an error for a budget; for other
            policies it warns and the plan stays unmeasured.

    Usage::

        handle = apply_checkpointing(model, {nn.TransformerEncoderLayer})
        print(handle.plan.summary())
        ...
        handle.remove()   # model is exactly as before
    """
    policy = normalize_policy(policy)
    if isinstance(policy, CheckpointBudget):
        plan, wrapped = _plan_budget(module, policy, sample)
        return CheckpointHandle(plan, wrapped)
    regions, note = regions_for(module, policy)
    if not regions:
        raise no_match_error(module, policy)
    plan = CheckpointPlan(describe_policy(policy), note=note)
    profiles = None
    if sample is not None:
        try:
            profiled = measure_forward(module, sample, {r.name: r.modules for r in regions}, count_flops=True)
            profiles = block_profiles(profiled)
            plan.baseline_activation_bytes = profiled.activation_bytes
            plan.measuring_peak_bytes = profiled.peak_bytes
        except MeasureError as error:
            warnings.warn(
                f"memkit checkpointing: not measured ({error}); the regions are checkpointed all the same",
                RuntimeWarning,
                stacklevel=2,
            )
            sample = None
    plan.segments = _segments(regions, profiles)
    wrapped = wrap_regions(regions)
    if sample is not None:
        try:
            measured = measure_forward(module, sample)
            plan.measured_activation_bytes = measured.activation_bytes
            plan.measuring_peak_bytes = max(plan.measuring_peak_bytes or 0, measured.peak_bytes)
        except MeasureError as error:
            warnings.warn(
                f"memkit checkpointing: the checkpointed forward was not measured ({error})",
                RuntimeWarning,
                stacklevel=2,
            )
    return CheckpointHandle(plan, wrapped)


def plan_checkpointing(module: nn.Module, policy: Any = "auto") -> CheckpointPlan:
    """The regions ``policy`` would checkpoint, without wrapping or measuring (budgets need a sample: use
    :func:`apply_checkpointing`).

    Raises:
        ValueError: when the policy matches nothing; for a budget policy (it needs a measured sample),
            unless its ``within=`` policy matches nothing, which is reported instead.
    """
    policy = normalize_policy(policy)
    if isinstance(policy, CheckpointBudget):
        if policy.within is not None and not budget_candidates(module, policy):
            raise no_match_error(module, policy)
        raise ValueError("a budget plan needs a measured sample: call apply_checkpointing(module, policy, sample=...)")
    regions, note = regions_for(module, policy)
    if not regions:
        raise no_match_error(module, policy)
    return CheckpointPlan(describe_policy(policy), _segments(regions, None), note=note)
