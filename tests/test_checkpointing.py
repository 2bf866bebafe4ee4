"""apply_checkpointing on plain modules: identical gradients and running stats, exact unwrapping,
the auto and budget policies measured exactly, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_memkit.modes.checkpointing import (
    CheckpointBudget,
    apply_checkpointing,
    find_repeated_blocks,
    frozen_running_stats,
    measure_activation_bytes,
    plan_checkpointing,
)

FLOAT32 = 4


def block(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width), nn.Dropout(0.3), nn.ReLU(), nn.Linear(4 * width, width))


class BlockNet(nn.Module):
    """Blocks with dropout and BatchNorm called from a loop over a ModuleList (like most models)."""

    def __init__(self, blocks: int = 4, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _step(model: nn.Module, x: torch.Tensor, seed: int = 7) -> None:
    torch.manual_seed(seed)
    model(x).pow(2).mean().backward()


def _assert_same_training_effect(base: nn.Module, other: nn.Module) -> None:
    for (name, p), (_, q) in zip(base.named_parameters(), other.named_parameters()):
        assert p.grad is not None and q.grad is not None, f"{name} has no gradient"
        assert (p.grad - q.grad).abs().max().item() <= 1e-6, name
    for (name, a), (_, b) in zip(base.named_buffers(), other.named_buffers()):
        assert torch.equal(a, b), f"buffer {name} differs: running statistics updated twice?"


@pytest.mark.parametrize("policy, count", [("auto", 3), ({nn.Sequential}, 4), (lambda name, m: name.startswith("blocks.") and name.count(".") == 1, 4)])
def test_gradients_and_running_stats_identical_with_dropout_and_batchnorm(policy, count):
    torch.manual_seed(0)
    base = BlockNet()
    model = copy.deepcopy(base)
    handle = apply_checkpointing(model, policy)
    assert handle.plan.names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"][:count]
    x = torch.randn(32, 8)  # requires_grad=False: non-reentrant checkpoint still gives every parameter a grad
    for step in range(2):
        _step(base, x, seed=step)
        _step(model, x, seed=step)
        _assert_same_training_effect(base, model)
        assert int(model.blocks[0][1].num_batches_tracked) == step + 1
        base.zero_grad()
        model.zero_grad()


def test_checkpointing_the_first_layer_whose_input_needs_no_grad_still_trains_it():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    model = copy.deepcopy(base)
    apply_checkpointing(model, {nn.Linear, nn.BatchNorm1d})
    x = torch.randn(16, 8)
    _step(base, x)
    _step(model, x)
    _assert_same_training_effect(base, model)


def test_torch_checkpoint_alone_updates_batchnorm_twice_which_is_why_memkit_freezes_it():
    """Pins the torch behaviour memkit corrects: recomputation runs BatchNorm's update again."""
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, requires_grad=True)
    torch_checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2
    bn2 = nn.BatchNorm1d(4, momentum=None)
    with frozen_running_stats([bn2]):
        bn2(x)
    assert int(bn2.num_batches_tracked) == 0
    assert torch.equal(bn2.running_mean, torch.zeros(4)) and torch.equal(bn2.running_var, torch.ones(4))


def test_remove_restores_the_module_exactly():
    torch.manual_seed(0)
    model = BlockNet()
    before_dicts = {name: dict(m.__dict__) for name, m in model.named_modules()}
    keys = list(model.state_dict())
    x = torch.randn(4, 8)
    model.eval()
    expected = model(x)
    handle = apply_checkpointing(model, "auto")
    assert "forward" in model.blocks[0].__dict__
    assert list(model.state_dict()) == keys  # names and state_dict keys never change
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_checkpointing(model, "auto")
    handle.remove()
    handle.remove()  # idempotent
    for name, m in model.named_modules():
        assert m.__dict__.keys() == before_dicts[name].keys(), name
    assert torch.equal(model(x), expected)


def test_deepcopy_of_a_checkpointed_module_is_checkpointed_on_its_own_weights():
    torch.manual_seed(0)
    model = BlockNet()
    apply_checkpointing(model, "auto")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(1.0)
    x = torch.randn(8, 8)
    _step(clone, x)
    assert all(p.grad is not None for p in clone.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_auto_on_16_sequential_blocks_makes_4_segments_and_saves_memory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), *[block() for _ in range(16)], nn.Linear(16, 2))
    plan = plan_checkpointing(model, "auto")
    # sqrt(16) = 4 segments of 4 blocks; the 4th runs plain (backward would recompute it at once)
    assert plan.names == ["<root>[1:5]", "<root>[5:9]", "<root>[9:13]"]
    assert "16 Sequential blocks in 4 segments" in plan.note and "last segment (<root>[13:17])" in plan.note
    x = torch.randn(32, 8)
    base = copy.deepcopy(model)
    handle = apply_checkpointing(model, "auto", sample=(x,))
    assert handle.plan.measured_activation_bytes < handle.plan.baseline_activation_bytes / 3
    _step(base, x)
    _step(model, x)
    _assert_same_training_effect(base, model)


def test_auto_on_a_modulelist_checkpoints_each_block():
    runs = find_repeated_blocks(BlockNet(blocks=16))
    assert [r.container_name for r in runs] == ["blocks"]
    assert plan_checkpointing(BlockNet(blocks=16), "auto").names == [f"blocks.{i}" for i in range(15)]


def test_measure_activation_bytes_is_exact():
    # Linear(8,64) output h is freed by ReLU (ReLU saves its result r); the second Linear saves r;
    # the output stays. The input x and the parameters existed before and are not counted.
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(10, 8)
    assert measure_activation_bytes(model, (x,)) == 10 * 64 * FLOAT32 + 10 * 4 * FLOAT32


@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_budget_fraction_is_met_as_measured_exactly(fraction):
    torch.manual_seed(0)
    model = BlockNet(blocks=6, width=32)
    x = torch.randn(64, 8)
    baseline = measure_activation_bytes(model, (x,))
    handle = apply_checkpointing(model, CheckpointBudget(fraction=fraction), sample=(x,))
    measured = measure_activation_bytes(model, (x,))
    assert handle.plan.baseline_activation_bytes == baseline
    assert handle.plan.measured_activation_bytes == measured
    assert measured <= int(fraction * baseline)
    assert 0 < handle.plan.count < 6  # not everything: the cheapest set that meets the budget
    handle.remove()
    assert measure_activation_bytes(model, (x,)) == baseline


def test_budget_in_bytes_and_an_unreachable_budget():
    torch.manual_seed(0)
    model = BlockNet(blocks=4, width=32)
    x = torch.randn(64, 8)
    baseline = measure_activation_bytes(model, (x,))
    handle = apply_checkpointing(model, f"budget={baseline * 3 // 4}B", sample=(x,))
    assert measure_activation_bytes(model, (x,)) <= baseline * 3 // 4
    handle.remove()
    with pytest.raises(ValueError, match="cannot be met.*choose a budget of at least"):
        apply_checkpointing(model, CheckpointBudget(bytes=1024), sample=(x,))
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing left wrapped
    with pytest.raises(ValueError, match="sample"):
        apply_checkpointing(model, "budget=0.5")


def test_policy_that_matches_nothing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"matched no module.*BatchNorm1d"):
        apply_checkpointing(BlockNet(), {nn.Conv2d})
    with pytest.raises(ValueError, match="found no repeated blocks.*policy="):
        apply_checkpointing(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "auto")  # too short a chain to cut
    with pytest.raises(ValueError, match="not understood|unknown"):
        apply_checkpointing(BlockNet(), "everything")
    with pytest.raises(ValueError, match="fraction"):
        CheckpointBudget(fraction=1.5)


def test_checkpointing_frees_measured_activation_memory_and_predicts_it():
    torch.manual_seed(0)
    model = BlockNet(blocks=4, width=32)
    x = torch.randn(64, 8)
    handle = apply_checkpointing(model, "auto", sample=(x,))
    plan = handle.plan
    assert all(s.saved_bytes > 0 and s.recompute_flops > 0 for s in plan.segments)
    # the prediction is what the exact accountant then measures
    assert plan.baseline_activation_bytes - plan.measured_activation_bytes == plan.predicted_saving_bytes
    assert "blocks.0" in plan.summary() and plan.to_dict()["count"] == 3


def test_auto_cuts_a_plain_sequential_chain_when_no_block_repeats():
    """An MLP's Linear/ReLU stack has no run of same-class children; 'auto' still segments the chain
    (about sqrt(n) segments, the last one plain) and the gradients stay identical."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    handle = apply_checkpointing(model, "auto")
    assert handle.plan.count == 2  # round(sqrt(9)) = 3 segments, the last one runs plain
    model(x).sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.equal(got, want)
    handle.remove()
