"""The planner (lightning_memkit/plan): candidate space and rule, the time model's op counts, plan_fit's real trials on
CPU under a budget the baseline does not fit, the choice between trials, and ``memkit plan``.

Budgets are set from the estimate of the baseline (the estimate counts the bytes the budget's accountant counts, so on
CPU a plan's trial peak is compared with the estimate exactly); figures of FLOPs are computed by hand.
"""

from __future__ import annotations

import io
import itertools
import json
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memkit.estimate import estimate_memory, measure_training_step
from lightning_memkit.estimate.step.settings import accumulating, observing_ops
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.plan import Candidate, PlanError, PlanRow, RowStatus, choice, lightning_runs, plan_fit
from lightning_memkit.plan._torch_compat import is_view_op, op_flops
from lightning_memkit.plan.inputs import TrialSettings
from lightning_memkit.plan.rows import dominated_by, trial_order
from lightning_memkit.plan.space import candidate_space, micro_batches, parse_plan_modes, preference
from lightning_memkit.plan.state import PlanState
from lightning_memkit.plan.time_budget import MIN_BUDGET_SECONDS, TimeBudget
from lightning_memkit.plan.time_model import ROOFLINES, OpCosts, TimeModel, roofline_for
from lightning_memkit.zoo import DemoTransformer
from tests.helpers.live_tensors import describe, live_tensor_bytes, live_tensors, tensors_with_grad_fn
from tests.helpers.models import FrozenBaseStack, LinearStack
from tests.helpers.paths import REPO_ROOT

FAST = {"warmup_steps": 1, "timed_steps": 2, "timed_seconds": 0.2, "verbose": False}


def _tiny_transformer(batch_size: int = 16) -> DemoTransformer:
    return DemoTransformer(
        vocab_size=64,
        d_model=32,
        nhead=2,
        layers=2,
        dim_feedforward=64,
        seq_len=16,
        num_classes=4,
        dropout=0.0,
        batch_size=batch_size,
    )


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _between(module, smaller: int) -> int:
    """A budget halfway between the batch's estimated peak and a micro-batch of ``smaller``'s."""
    return (
        estimate_memory(module, device="cpu").peak_bytes + estimate_memory(module, smaller, device="cpu").peak_bytes
    ) // 2


# ------------------------------------------------------------------------------------------ the space and the rule
def test_micro_batches_divide_the_effective_batch_and_the_space_keeps_it():
    assert micro_batches(64) == [64, 32, 16, 8, 4, 2, 1]
    assert micro_batches(12) == [12, 6, 3, 1]
    assert micro_batches(7) == [7, 1]
    space = candidate_space(48, modes=parse_plan_modes("micro_batch,checkpoint,bf16"), device_type="cpu")
    assert space[0] == Candidate(48, 1)  # the baseline first
    assert all(c.micro_batch * c.accumulation == 48 for c in space)
    assert {c.precision for c in space} == {"32-true", "bf16-mixed"}
    assert len(space) == len(set(space)) <= 64
    # the default changes memory only: no precision, no offload
    assert {c.precision for c in candidate_space(48, device_type="cpu")} == {"32-true"}
    with pytest.raises(ValueError, match="offload"):
        candidate_space(48, modes=parse_plan_modes("micro_batch,offload"), device_type="cpu")
    with pytest.raises(ValueError, match="unknown plan mode 'fp8'"):
        parse_plan_modes("micro_batch,fp8")


def test_the_rule_puts_no_recompute_first_then_a_lower_precision_then_fewer_larger_micro_batches():
    budget = CheckpointBudget(fraction=0.5)
    order = [
        Candidate(8, 4, "bf16-mixed"),
        Candidate(4, 8, "bf16-mixed"),
        Candidate(2, 16, "32-true"),
        Candidate(1, 32, "32-true"),
        Candidate(32, 1, "bf16-mixed", budget),
        Candidate(32, 1, "32-true", budget),
        Candidate(32, 1, "bf16-mixed", "auto"),
        Candidate(32, 1, "32-true", "auto"),
    ]
    shuffled = order[::-1][1::2] + order[::-1][::2]
    assert sorted(shuffled, key=preference) == order


def test_true_half_precision_has_its_own_words_and_ranks_before_mixed_at_the_same_recompute():
    space = candidate_space(8, modes=parse_plan_modes("micro_batch,bf16,bf16-true"), device_type="cpu")
    assert {c.precision for c in space} == {"32-true", "bf16-mixed", "bf16-true"}
    assert {c.precision for c in candidate_space(8, modes=("fp16-true",), device_type="cuda")} == {"32-true", "16-true"}
    # the user's own true half precision is the baseline's; no other precision unless allowed
    assert {c.precision for c in candidate_space(8, precision="bf16-true", device_type="cpu")} == {"bf16-true"}
    assert Candidate(8, 1, "bf16-true").mode.trainer_kwargs("cpu")["precision"] == "bf16-true"
    order = [
        Candidate(8, 1, "bf16-true"),
        Candidate(8, 1, "bf16-mixed"),
        Candidate(4, 2, "bf16-mixed"),
        Candidate(8, 1, "32-true"),
        Candidate(8, 1, "16-true", "auto"),  # recompute first: a plain mixed or fp32 step ranks before
        Candidate(8, 1, "16-mixed", "auto"),
    ]
    assert sorted(order[::-1][1::2] + order[::-1][::2], key=preference) == order
    for modes, message in (("bf16-true,fp16-true", "two true half precisions"), ("bf16,amp", "two mixed")):
        with pytest.raises(ValueError, match=message):
            parse_plan_modes(modes)
    with pytest.raises(ValueError, match="'bf16-true'"):
        Candidate(8, 1, "bf16")


def _row(candidate: Candidate, peak: int, fits: bool = True, status: RowStatus = RowStatus.ESTIMATED) -> PlanRow:
    return PlanRow(candidate, peak, None, None, fits, status=status)


def test_trials_take_each_modes_largest_micro_batch_first_and_skip_what_cannot_be_faster():
    """Of the rows predicted to fit, a checkpointing (or offload) of a micro-batch that fits with less recompute runs
    the same step plus the recompute: no trial. The trials take each mode's largest micro-batch in the rule's order,
    then the smaller ones; a row whose trial failed no longer stands, and the rows it kept from a trial come back."""
    auto, budget = "auto", CheckpointBudget(fraction=0.5)
    plain8, plain4 = _row(Candidate(8, 4), 900), _row(Candidate(4, 8), 600)
    budget8, budget16 = _row(Candidate(8, 4, checkpoint=budget), 700), _row(Candidate(16, 2, checkpoint=budget), 950)
    auto16, auto32 = _row(Candidate(16, 2, checkpoint=auto), 800), _row(Candidate(32, 1, checkpoint=auto), 990)
    too_big = _row(Candidate(16, 2), 2000, fits=False)
    rows = [too_big, auto32, plain4, budget16, auto16, budget8, plain8]
    assert dominated_by(budget8, rows) is plain8 and dominated_by(auto16, rows) is budget16
    assert dominated_by(plain8, rows) is None and dominated_by(auto32, rows) is None
    assert trial_order(rows) == [plain8, budget16, auto32, plain4]
    plain8.status = RowStatus.FAILED  # it ran out of memory for real: its checkpointed twin may fit
    assert dominated_by(budget8, rows) is None
    # plain4 is now the plain mode's largest still standing; budget8, a smaller micro-batch of budget16's mode, after
    assert trial_order(rows) == [plain4, budget16, auto32, budget8]
    budget16.status = RowStatus.RAN
    assert trial_order(rows) == [plain4, auto32, budget8]


# ------------------------------------------------------------------------------------------ time model (GPU rows)
def test_torch_flop_formulas_and_view_schema_on_fake_tensors():
    """Pins the torch internals plan/_torch_compat.py reads (flop_registry, the schema's alias info)."""
    with FakeTensorMode():
        a, b = torch.randn(64, 128), torch.randn(128, 256)
        out = torch.ops.aten.mm.default(a, b)
        assert op_flops(torch.ops.aten.mm.default, (a, b), {}, out) == 2 * 64 * 128 * 256
        assert op_flops(torch.ops.aten.add.Tensor, (a, a), {}, a) == 0
    assert is_view_op(torch.ops.aten.view.default) and is_view_op(torch.ops.aten.t.default)
    assert not is_view_op(torch.ops.aten.add.Tensor) and not is_view_op(torch.ops.aten.add_.Tensor)


def test_the_fake_step_counts_each_linear_layers_flops_by_hand():
    """A Linear stack: forward 2*B*i*o per layer, backward the same for the weight's gradient and, except for the
    first layer (its input needs no gradient), for the input's: exactly what the listener sums per micro-batch."""
    dims, batch = (32, 64, 48, 16), 8
    module = LinearStack(dims, batch_size=batch)
    costs = OpCosts()
    with observing_ops(costs):
        estimate_memory(module, device="cpu")
    layers = list(itertools.pairwise(dims))
    expected = sum(2 * batch * i * o * (2 if index == 0 else 3) for index, (i, o) in enumerate(layers))
    assert costs.micro_batches == 1
    assert costs.micro_batch_flops == expected
    assert costs.optimizer.flops_fp32 + costs.optimizer.flops_low == 0  # SGD: elementwise only
    assert costs.optimizer.count > 0 and costs.micro.bytes > 0


def test_accumulation_in_the_fake_step_matches_a_real_step_exactly():
    """Gradient accumulation (zero_grad on the first micro-batch only) in the estimate: the same bytes as the real
    step with accumulation, and more than without it (the second backward adds to live gradients)."""
    module = LinearStack((64, 256, 256, 8), batch_size=256, samples=256)  # the peak in the backward
    plain = estimate_memory(module, device="cpu").peak_bytes
    with accumulating(2):
        fake = estimate_memory(module, device="cpu").peak_bytes
        real = measure_training_step(module, device="cpu").peak_bytes
    assert fake == real
    assert fake > plain
    with pytest.raises(ValueError, match="positive integer"), accumulating(0):
        pass


def test_a_predicted_step_is_the_sum_of_its_parts_and_small_micro_batches_pay_the_overheads():
    module = LinearStack((32, 64, 48, 16), batch_size=8)
    costs = OpCosts()
    with accumulating(2), observing_ops(costs):
        estimate_memory(module, device="cpu")
    roof = ROOFLINES["h100"]
    model = TimeModel(roof)
    per_micro = (costs.micro.kernel_seconds(roof) + roof.op_overhead_s * costs.micro.count) / costs.micro_batches
    optimizer = costs.optimizer.kernel_seconds(roof) + roof.op_overhead_s * costs.optimizer.count
    assert model.step_seconds(costs, 8) == pytest.approx(8 * (per_micro + roof.batch_overhead_s) + optimizer)
    # the same samples per step in 8 micro-batches of 1 pay 8 x the per-op and per-batch overheads of one
    assert model.step_seconds(costs, 8) > model.step_seconds(costs, 1)
    # offload's copies go over the host link, there and back, per micro-batch
    assert model.step_seconds(costs, 2, offload_bytes=10**9) - model.step_seconds(costs, 2) == pytest.approx(
        2 * 2 * 10**9 / roof.host_link
    )
    assert roofline_for("h100") is ROOFLINES["h100"] and roofline_for("sm80") is ROOFLINES["a100"]


def test_the_recompute_of_checkpointed_regions_is_counted_as_the_forward_again():
    """Checkpointing the stack (its nn.Sequential) runs its forward again inside the backward, up to the last tensor
    the backward needs (torch's non-reentrant checkpoint stops early): the last Linear's matmul is not rerun, its
    output is saved by nothing. The step's FLOPs grow by exactly 2*B*i*o for every other layer."""
    from lightning_memkit.modes.mode import Mode

    dims, batch = (32, 64, 48, 16), 8
    module = LinearStack(dims, batch_size=batch)
    plain, checkpointed = OpCosts(), OpCosts()
    with observing_ops(plain):
        estimate_memory(module, device="cpu")
    with observing_ops(checkpointed):
        estimate_memory(module, device="cpu", mode=Mode(checkpoint=frozenset({torch.nn.Sequential})))
    rerun = sum(2 * batch * i * o for i, o in list(itertools.pairwise(dims))[:-1])
    assert checkpointed.micro_batch_flops - plain.micro_batch_flops == rerun
    assert checkpointed.micro.count > plain.micro.count


# ------------------------------------------------------------------------------------------ timing
def test_a_trials_timing_runs_until_its_steps_add_up_to_the_seconds_asked(monkeypatch):
    """The CPU timing's stop rule: at least ``timed`` steps and at least ``seconds`` of them, at an optimizer step's end
    (every micro-batch of the last step ran), and never more than MAX_TIMED_STEPS; a step's window is one optimizer
    step (its micro-batches), read from the package's StepTimer."""
    module = LinearStack((16, 32, 4), batch_size=4)
    batch = next(iter(module.train_dataloader()))
    candidate = Candidate(2, 2)
    micro = [part[:2] for part in batch] if isinstance(batch, (list, tuple)) else batch[:2]
    seconds = lightning_runs.timing_fit(lightning_runs.copy_of(module), candidate, micro, "cpu", 1, 3, 0.05)
    assert len(seconds) >= 3 and sum(seconds) >= 0.05
    assert sum(seconds[:-1]) < 0.05 or len(seconds) == 3  # it stopped at the first step that made the sum
    monkeypatch.setattr(lightning_runs, "MAX_TIMED_STEPS", 7)
    capped = lightning_runs.timing_fit(lightning_runs.copy_of(module), candidate, micro, "cpu", 1, 3, 1e9)
    assert len(capped) == 7
    once = lightning_runs.timing_fit(lightning_runs.copy_of(module), candidate, micro, "cpu", 1, 3, 0.0)
    assert len(once) == 3
    clock = lightning_runs.StepClock(candidate.accumulation, None)
    assert clock.timer.source == "perf_counter"  # the one step timer of the package


# ------------------------------------------------------------------------------------------ the choice
def _ran(candidate: Candidate, steps: list[float]) -> PlanRow:
    row = _row(candidate, 100)
    row.status, row.step_seconds = RowStatus.RAN, list(steps)
    row.measured_samples_per_s = candidate.effective_batch / sorted(steps)[len(steps) // 2]
    return row


def _choosing(rows: list[PlanRow], max_seconds: float, trial_seconds: float = 1.0) -> PlanState:
    from lightning_memkit.plan.inputs import PlanInputs

    inputs = PlanInputs(module=None, batch=None, effective=32, budget=10**9, device_type="cpu")
    settings = TrialSettings(3, 1, 2, 0.2, max_seconds)
    state = PlanState(inputs, settings, TimeBudget(max_seconds, time.perf_counter(), lambda text: None), lambda t: None)
    state.rows = rows
    state.trial_seconds = {id(row): trial_seconds for row in rows}
    return state


def _rounds(monkeypatch, ratio_of) -> list[str]:
    """The side-by-side rounds' timings stand in for the machine: ``ratio_of(candidate, round)`` is a configuration's
    step over the rule's first's (0.1 s) in that round; returns the order the rounds timed them in."""
    timed: list[str] = []

    def timing(module, candidate, batch, device_type, warmup, steps, seconds):
        timed.append(candidate.describe())
        round_ = sum(each == timed[0] for each in timed) - 1
        return [0.1 * ratio_of(candidate, round_)] * steps

    monkeypatch.setattr(choice, "timed_step", timing)
    return timed


def test_the_rules_first_is_chosen_unless_another_trial_is_measured_faster_by_more_than_min_gain(monkeypatch):
    """The rule's first among the trials that fit is the choice; a trial the rule ranks after it that ran faster is
    timed side by side with it (rounds of alternating order) until the per-round ratios tell whether it is faster
    by more than MIN_GAIN: 20% faster is chosen after MIN_ROUNDS rounds, 10% slower loses after MIN_ROUNDS, 3% faster
    is timed while the budget pays (at most MAX_ROUNDS) and not chosen (the rule keeps a choice a change of load could
    flip), and a pair the rounds never tell apart stays with the rule after MAX_ROUNDS."""
    first_candidate, other_candidate = Candidate(8, 4), Candidate(32, 1, checkpoint="auto")
    for ratio, chosen, rounds in (
        (0.8, other_candidate, choice.MIN_ROUNDS),
        (1.1, first_candidate, choice.MIN_ROUNDS),
        (0.97, first_candidate, choice.MAX_ROUNDS),
    ):
        first = _ran(first_candidate, [0.100, 0.101, 0.099])
        other = _ran(other_candidate, [0.096, 0.095, 0.097])  # faster in its trial, by less than MIN_GAIN
        order = _rounds(monkeypatch, lambda c, r, ratio=ratio: ratio if c == other_candidate else 1.0)
        state = _choosing([first, other], max_seconds=3600)
        choice.choose(state)
        assert state.best.candidate == chosen, (ratio, state.reason)
        assert len(first.round_seconds) == len(other.round_seconds) == rounds
        # alternating order, round by round: (other, first), (first, other), ...
        assert order[:4] == [other_candidate.describe(), first_candidate.describe()] * 1 + [
            first_candidate.describe(),
            other_candidate.describe(),
        ]
        assert [(p.name, p.detail) for p in state.clock.phases] == [("rounds", f"{rounds} rounds")]
    assert state.reason.startswith("the plan's rule ranks it first among the trials that fit; micro 32 x 1")
    assert "not shown faster by more than 5% over 10 side-by-side rounds, so the rule keeps" in state.reason
    # a 20% gain is said as such
    first, other = _ran(first_candidate, [0.1] * 3), _ran(other_candidate, [0.09] * 3)
    _rounds(monkeypatch, lambda c, r: 0.8 if c == other_candidate else 1.0)
    state = _choosing([first, other], max_seconds=3600)
    choice.choose(state)
    assert state.reason == "measured 25% faster than the rule's first, micro 8 x 4, 32-true, over 3 side-by-side rounds"
    # rounds that swing both ways (20% faster, even, 20% slower, ...) never tell the pair apart: the rule's first,
    # after MAX_ROUNDS
    first, other = _ran(first_candidate, [0.1] * 3), _ran(other_candidate, [0.09] * 3)
    _rounds(monkeypatch, lambda c, r: (0.8, 1.0, 1.2)[r % 3] if c == other_candidate else 1.0)
    state = _choosing([first, other], max_seconds=3600)
    choice.choose(state)
    assert state.best is first and len(first.round_seconds) == choice.MAX_ROUNDS


def test_without_time_for_rounds_the_rule_keeps_the_choice(monkeypatch):
    """A trial's own timing decides nothing: when the budget cannot pay for the side-by-side rounds, even a trial
    that ran much faster in its own timing (trials a minute apart: the machine's load may have changed) does not
    override the rule, and the reason says the rounds had no time."""
    _rounds(monkeypatch, lambda c, r: pytest.fail("no round fits the budget"))
    first = _ran(Candidate(8, 4), [0.100, 0.102, 0.098, 0.101])
    clear = _ran(Candidate(32, 1, checkpoint="auto"), [0.050, 0.051, 0.049, 0.050])
    state = _choosing([first, clear], max_seconds=1e-3, trial_seconds=5.0)
    choice.choose(state)
    assert state.best is first
    assert state.reason.endswith(
        "not shown faster by more than 5% (no time was left to time it side by side), so the rule keeps the choice"
    )
    assert state.clock.phases[0].name == "rounds" and "a round takes about 5 s" in state.clock.phases[0].skipped
    # a trial slower in its own timing is still timed side by side (its own timing may be the machine's load): here
    # the rounds show it slower, and the rule's first keeps the choice
    slow = _ran(Candidate(32, 1, checkpoint="auto"), [0.2] * 4)
    _rounds(monkeypatch, lambda c, r: 2.0 if c == slow.candidate else 1.0)
    state = _choosing([slow, first], max_seconds=3600)
    choice.choose(state)
    assert state.best is first and [p.name for p in state.clock.phases] == ["rounds"]
    assert state.reason.endswith(
        "not shown faster by more than 5% over 3 side-by-side rounds, so the rule keeps the choice"
    )
    # and one 15% faster in the rounds wins, though its own trial timed it slower
    _rounds(monkeypatch, lambda c, r: 0.85 if c == slow.candidate else 1.0)
    state = _choosing([_ran(slow.candidate, [0.2] * 4), _ran(first.candidate, [0.1] * 4)], max_seconds=3600)
    choice.choose(state)
    assert state.best.candidate == slow.candidate and state.reason.startswith("measured 18% faster")
    # the only trial that fit: no rounds
    state = _choosing([_ran(first.candidate, [0.1] * 4)], max_seconds=3600)
    choice.choose(state)
    assert state.reason == "the plan's rule ranks it first among the trials that fit, the only trial that fit"


# ------------------------------------------------------------------------------------------ plan_fit
@pytest.mark.timeout(600)
def test_plan_fits_a_budget_the_baseline_does_not_in_at_most_three_trials():
    module = _tiny_transformer(batch_size=8)
    budget = _between(module, 2)
    before_state = _state(module)
    rng = torch.get_rng_state()
    plan = plan_fit(module, device_memory=budget, device="cpu", max_seconds=3600, **FAST)
    assert not plan.fits_as_is
    assert plan.best is not None and plan.effective_batch == 8
    assert 1 <= plan.trials <= 3
    assert all(row.candidate.effective_batch == 8 for row in plan.rows)
    row = plan.best_row
    assert row.ran and row.measured_peak_bytes <= budget
    # on CPU the estimate counts what the trial's accountant counts, up to the few scalars Lightning's loop makes
    # (the estimate stands in for its trainer): within 1 KiB
    assert abs(row.measured_peak_bytes - row.predicted_peak_bytes) <= 1024
    # never a configuration that did not run; each row's status says where it stands
    assert sum(r.measured_samples_per_s is not None for r in plan.rows) <= plan.trials
    assert all((r.status is RowStatus.RAN) == r.ran for r in plan.rows)
    assert {r.status for r in plan.rows} <= {RowStatus.RAN, RowStatus.ESTIMATED, RowStatus.FAILED, RowStatus.NOT_RUN}
    # the rows that fit first, in the rule's order; a CPU plan predicts no step time (its trials time the steps)
    fitting = [r for r in plan.rows if r.fits]
    assert plan.rows[: len(fitting)] == fitting
    assert [preference(r.candidate) for r in fitting] == sorted(preference(r.candidate) for r in fitting)
    assert all(r.predicted_step_s is None and r.costs is None for r in plan.rows)
    assert plan.rows[-1].candidate == Candidate(8, 1) and not plan.rows[-1].fits  # the baseline does not fit
    # the first trial was the rule's first that fits: the largest micro-batch without checkpointing
    plain = [r for r in fitting if r.candidate.checkpoint is None]
    assert plain and plain[0].status in (RowStatus.RAN, RowStatus.FAILED)
    assert plain[0].candidate.micro_batch == max(r.candidate.micro_batch for r in plain)
    # the module, its state and the RNG are as they were; the trials ran on a copy
    assert all(torch.equal(value, before_state[name]) for name, value in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters()) and module._trainer is None
    assert torch.equal(rng, torch.get_rng_state())
    arguments = plan.trainer_arguments()
    assert arguments["accumulate_grad_batches"] == plan.best.accumulation
    assert arguments["precision"] == "32-true"
    assert f"accumulate_grad_batches: {plan.best.accumulation}" in plan.yaml()
    assert f"batch_size: {plan.best.micro_batch}" in plan.yaml()
    # the table: the choice marked, and one line on why
    table = plan.table()
    assert f"* {plan.best.describe()}" in table and f"best: {plan.best.describe()}: {plan.reason}" in table
    names = [phase.name for phase in plan.phases]
    assert names[0] == "estimate" and names.count("trial") == plan.trials and plan.max_seconds == 3600
    assert all(phase.seconds > 0 for phase in plan.phases if not phase.skipped)


def _below_fp32_weights(module: FrozenBaseStack) -> int:
    """A budget above the bf16-true step's estimated peak and below the module's fp32 weights alone."""
    half = estimate_memory(module, mode="bf16-true", device="cpu").peak_bytes
    return (half + 4 * module.frozen_parameter_elements()) // 2


@pytest.mark.timeout(600)
def test_a_plan_allowed_bf16_true_trains_a_frozen_base_whose_fp32_weights_exceed_the_budget():
    module = FrozenBaseStack()
    budget = _below_fp32_weights(module)
    with pytest.raises(PlanError, match="only true half precision keeps them in it.*bf16-true in the modes"):
        plan_fit(module, device_memory=budget, device="cpu", modes="micro_batch,bf16", **FAST)
    plan = plan_fit(module, device_memory=budget, device="cpu", modes="micro_batch,bf16-true", trials=2, **FAST)
    assert {row.candidate.precision for row in plan.rows} == {"32-true", "bf16-true"}
    assert all(row.fits == (row.candidate.precision == "bf16-true") for row in plan.rows)
    assert plan.best == Candidate(8, 1, "bf16-true")  # the rule's first: no recompute, the largest micro-batch
    row = plan.best_row
    # the trial ran Trainer(precision="bf16-true") on a copy converted on the host first, as a fit converts it before
    # the device sees it: its peak is the bf16 step's (the fp32 weights alone would be over the budget)
    assert row.ran and row.measured_peak_bytes <= budget
    assert abs(row.measured_peak_bytes - row.predicted_peak_bytes) <= 1024
    assert plan.trainer_arguments() == {"accumulate_grad_batches": 1, "precision": "bf16-true"}
    assert "  precision: bf16-true\n" in plan.yaml() and "* micro 8 x 1, bf16-true" in plan.table()
    assert {p.dtype for p in module.parameters()} == {torch.float32}  # the trials converted copies


@pytest.mark.timeout(600)
def test_plan_leaves_no_tensor_behind():
    module = LinearStack((32, 256, 256, 8), batch_size=32, optimizer="adam")
    budget = _between(module, 4)
    plan_fit(module, device_memory=budget, device="cpu", trials=1, **FAST)  # lazily made globals of torch and Lightning
    before = live_tensor_bytes()
    plan = plan_fit(module, device_memory=budget, device="cpu", trials=2, **FAST)
    assert plan.best is not None and plan.trials <= 2
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())
    assert live_tensor_bytes() == before, describe(live_tensors())


@pytest.mark.timeout(300)
def test_a_module_that_fits_as_is_is_left_as_it_is(capsys):
    module = LinearStack((32, 64, 48, 16), batch_size=8)
    plan = plan_fit(module, device_memory="64MiB", device="cpu", **{**FAST, "verbose": True})
    assert plan.fits_as_is and plan.best == Candidate(8, 1)
    assert plan.trials == 1 and len(plan.rows) == 1
    assert [phase.name for phase in plan.phases] == ["estimate", "trial"] and plan.skipped == {}
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("memkit plan: baseline micro 8 x 1, 32-true: predicted peak ")
    assert "memkit plan: best micro 8 x 1, 32-true: the batch fits as it is: nothing to change" in out
    # the default time budget: the estimate plus at least MIN_BUDGET_SECONDS
    assert plan.max_seconds >= plan.phases[0].seconds + MIN_BUDGET_SECONDS
    assert plan.rows[0].measured_peak_bytes == plan.rows[0].predicted_peak_bytes
    assert plan.trainer_arguments() == {"accumulate_grad_batches": 1, "precision": "32-true"}


@pytest.mark.timeout(600)
def test_the_time_budget_is_kept_after_the_first_trial_that_fits(capsys):
    """A budget too short for anything: the estimate and the first trial still run (the choice must have run), every
    other trial is left out with its reason, said as it happens and kept in the plan's phases."""
    module = _tiny_transformer(batch_size=8)
    plan = plan_fit(
        module, device_memory=_between(module, 2), device="cpu", max_seconds=0.001, **{**FAST, "verbose": True}
    )
    out = capsys.readouterr().out
    assert plan.max_seconds == 0.001 and plan.trials == 1 and plan.best_row.ran
    phases = [(phase.name, bool(phase.skipped)) for phase in plan.phases]
    assert phases == [("estimate", False), ("trial", False), ("trial", True)]
    assert "and 0 s are left" in plan.skipped["trial"] and "memkit plan: trial of micro " in out
    assert any(
        note.startswith(f"planned in {plan.seconds:.1f} s of a 0 s time budget (max_seconds)") for note in plan.notes
    )


def test_bad_input_is_refused_with_what_to_do():
    module = LinearStack((32, 64, 48, 16), batch_size=8)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    with pytest.raises(PlanError, match="below the model's parameters alone"):
        plan_fit(module, device_memory=params - 1, device="cpu", **FAST)
    with pytest.raises(PlanError, match="batch_size=0"):
        plan_fit(module, batch_size=0, device_memory="64MiB", device="cpu", **FAST)
    with pytest.raises(PlanError, match="give 1 to 3"):
        plan_fit(module, trials=4, device_memory="64MiB", device="cpu", **FAST)
    with pytest.raises(PlanError, match="offload"):
        plan_fit(module, modes="micro_batch,offload", device_memory="64MiB", device="cpu", **FAST)
    with pytest.raises(PlanError, match="split evenly over world_size=3"):
        plan_fit(module, world_size=3, batch_size=8, device_memory="64MiB", device="cpu", **FAST)
    with pytest.raises(PlanError, match="not one"):
        plan_fit(torch.nn.Linear(2, 2), device_memory="64MiB", device="cpu", **FAST)
    with pytest.raises(PlanError, match="a size such as"):
        plan_fit(module, device_memory="lots", device="cpu", **FAST)
    with pytest.raises(PlanError, match=r"timed_seconds=-1: give seconds >= 0"):
        plan_fit(module, device_memory="64MiB", device="cpu", **{**FAST, "timed_seconds": -1})
    for wrong in (0, -1, "60", True, float("nan")):
        with pytest.raises(PlanError, match=r"max_seconds=.*: give a positive number of seconds"):
            plan_fit(module, device_memory="64MiB", device="cpu", max_seconds=wrong, **FAST)


# ------------------------------------------------------------------------------------------ the command
def _memkit(argv: list[str]) -> tuple[int, str, str]:
    from lightning_memkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


SPEC = "lightning_memkit.zoo:DemoTransformer"
ARGS = json.dumps(
    {
        "vocab_size": 64,
        "d_model": 32,
        "nhead": 2,
        "layers": 2,
        "dim_feedforward": 64,
        "seq_len": 16,
        "num_classes": 4,
        "dropout": 0.0,
        "batch_size": 8,
    }
)


@pytest.mark.timeout(300)
def test_memkit_plan_says_a_module_that_fits_changes_nothing(tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = _memkit(
        [
            "plan",
            SPEC,
            "--init-args",
            ARGS,
            "--device",
            "cpu",
            "--device-memory",
            "256MiB",
            "--trials",
            "1",
            "--max-seconds",
            "120",
            "--json",
            str(path),
        ]
    )
    assert code == 0, err
    assert "fits in 256.00 MiB as is (batch 8): nothing to change" in out
    # without --verbose: one line saying what runs, then the table and the choice; no progress line per phase
    assert out.startswith("memkit plan: estimating the candidates, then at most 1 real trial (--verbose")
    assert "memkit plan: trial:" not in out and "best: micro 8 x 1, 32-true: the batch fits as it is" in out
    data = json.loads(path.read_text())
    assert data["fits_as_is"] and data["trials"] == 1 and data["effective_batch"] == 8
    assert data["max_seconds"] == 120 and [p["name"] for p in data["phases"]] == ["estimate", "trial"]
    assert data["trainer_arguments"] == {"accumulate_grad_batches": 1, "precision": "32-true"}
    assert data["reason"] == "the batch fits as it is: nothing to change"
    assert [row["status"] for row in data["rows"]] == ["ran"]  # the baseline, fitting as is: the one row


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trials", "5"], "--trials 5: give 1 to 3"),
        (["--max-seconds", "0"], "--max-seconds 0: give a positive number of seconds"),
        (["--device-memory", "-1GiB"], "a memory size is positive"),
        (["--device-memory", "4"], "has no unit"),
        (["--batch-size", "0"], "--batch-size 0: give a positive integer"),
        (["--modes", "micro_batch,offload"], "offload"),
        (["--world-size", "2", "--strategy", "fsdp"], "'fsdp' does not run on cpu processes"),
        (["--device-memory", "1KiB"], "below the model's parameters alone"),
        (["--modes", "micro_batch,bf16-true,fp16-true"], "two true half precisions"),
    ],
)
def test_memkit_plan_refuses_bad_arguments_with_exit_status_2(argv, message):
    code, out, err = _memkit(["plan", SPEC, "--init-args", ARGS, "--device", "cpu", *argv])
    assert code == 2
    assert message in err and err.startswith("memkit plan: ")


def test_memkit_plan_refuses_a_missing_file():
    code, _, err = _memkit(["plan", "no_such_file.py:Model", "--device", "cpu"])
    assert code == 2 and "does not exist" in err


def test_the_roofline_table_in_the_docs_is_the_one_in_the_code():
    import re

    text = (Path(REPO_ROOT) / "docs" / "plan.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", text, flags=re.M)
    table = {name: tuple(float(v) for v in values) for name, *values in rows}
    expected = {
        name: (r.fp32_flops / 1e12, r.low_flops / 1e12, r.bandwidth / 1e9, r.host_link / 1e9, r.memory_bytes / 2**30)
        for name, r in ROOFLINES.items()
    }
    assert table.keys() == expected.keys()
    for name, values in table.items():
        assert values == pytest.approx(expected[name]), name


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a GPU here the plan runs real trials (tested in the GPU lane)"
)
def test_a_gpu_plan_without_a_gpu_is_the_prediction_only():
    module = _tiny_transformer(batch_size=8)
    need = estimate_memory(module, device="cuda", gpu="h100").required_bytes
    plan = plan_fit(module, gpu="h100", device_memory=2 * need, modes="micro_batch", verbose=False)
    assert plan.device == "cuda" and plan.trials == 0 and plan.best is None and not plan.fits_as_is
    assert plan.rows[0].fits and plan.rows[0].predicted_peak_bytes == need
    assert all(row.measured_samples_per_s is None for row in plan.rows)
    assert any("no GPU here" in note for note in plan.notes)
    assert plan.trainer_arguments() == {}
    code, out, err = _memkit(["plan", SPEC, "--init-args", ARGS, "--gpu", "h100", "--modes", "micro_batch"])
    assert code == 1 and "no GPU here" in out  # no best configuration: nothing ran


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_plan_on_a_gpu_fits_a_budget_the_baseline_does_not():
    """The GPU lane: the same plan on a CUDA device, trials timed with CUDA events, peaks from the allocator."""
    module = DemoTransformer(
        vocab_size=1000, d_model=256, nhead=4, layers=4, dim_feedforward=1024, seq_len=256, dropout=0.0, batch_size=64
    )
    need = estimate_memory(module, device="cuda").required_bytes
    small = estimate_memory(module, 8, device="cuda").required_bytes
    budget = (need + small) // 2
    plan = plan_fit(module, device="cuda", device_memory=budget, **FAST)
    assert plan.device == "cuda" and not plan.fits_as_is
    assert plan.best is not None and plan.best.effective_batch == 64 and 1 <= plan.trials <= 3
    row = plan.best_row
    assert row.ran and row.measured_peak_bytes <= budget
    assert all(p.device.type == "cpu" and p.grad is None for p in module.parameters())  # trials ran on a copy


@pytest.mark.timeout(300)
def test_training_with_the_plan_follows_the_unplanned_run():
    """The same effective batch: 2 micro-batches of 4 with accumulate_grad_batches=2 train on the same samples per
    optimizer step as batches of 8 (a mean loss, no dropout, the same shuffled order): the loss curve, per optimizer
    step the mean of its micro-batches' losses, is the same to float tolerance (Adam's steps then differ by < 1e-4)."""
    import lightning.pytorch as pl

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append(float(outputs["loss"]))

    def train(batch_size: int, accumulate: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        pl.seed_everything(0, verbose=False)
        model = _tiny_transformer(batch_size=batch_size)
        losses = Losses()
        trainer = pl.Trainer(
            max_steps=3,
            accumulate_grad_batches=accumulate,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[losses],
        )
        trainer.fit(model)
        # Lightning hands on_train_batch_end each micro-batch's loss divided by the accumulation (what it
        # backpropagates)
        per_step = [sum(losses.values[i : i + accumulate]) for i in range(0, len(losses.values), accumulate)]
        return per_step, _state(model)

    module = _tiny_transformer(batch_size=8)
    budget = (
        estimate_memory(module, device="cpu").peak_bytes + estimate_memory(module, 4, device="cpu").peak_bytes
    ) // 2
    plan = plan_fit(module, device_memory=budget, device="cpu", modes="micro_batch", trials=1, **FAST)
    assert plan.best == Candidate(4, 2)  # the only micro-batch of 8 between the two estimates, without checkpointing
    planned, planned_state = train(plan.best.micro_batch, plan.trainer_arguments()["accumulate_grad_batches"])
    unplanned, unplanned_state = train(8, 1)
    assert len(planned) == len(unplanned) == 3
    assert planned == pytest.approx(unplanned, rel=1e-5)
    assert max(float((planned_state[k] - v).abs().max()) for k, v in unplanned_state.items()) < 1e-4
