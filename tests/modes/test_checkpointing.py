"""apply_checkpointing on plain modules: identical gradients and running stats, exact unwrapping,
the auto and budget policies measured exactly, clear errors."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_memkit.modes.checkpoint_measure import measure_activation_bytes
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget, find_repeated_blocks
from lightning_memkit.modes.checkpoint_wrap import frozen_running_stats
from lightning_memkit.modes.checkpointing import apply_checkpointing, plan_checkpointing

FLOAT32 = 4


def block(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width), nn.Dropout(0.3), nn.ReLU(), nn.Linear(4 * width, width)
    )


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
    for (name, p), (_, q) in zip(base.named_parameters(), other.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, f"{name} has no gradient"
        assert (p.grad - q.grad).abs().max().item() <= 1e-6, name
    for (name, a), (_, b) in zip(base.named_buffers(), other.named_buffers(), strict=True):
        assert torch.equal(a, b), f"buffer {name} differs: running statistics updated twice?"


@pytest.mark.parametrize(
    ("policy", "count"),
    [("auto", 3), ({nn.Sequential}, 4), (lambda name, m: name.startswith("blocks.") and name.count(".") == 1, 4)],
)
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


class OffloadingBlockNet(BlockNet):
    """A model whose own forward keeps copies of its saved tensors (the user's saved_tensors_hooks, as torch's
    save_on_cpu does on a GPU; on a CPU save_on_cpu keeps the tensor itself, and a forward without backward then
    leaves a reference cycle through autograd's C++ graph that no collection frees)."""

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):
            return super().forward(x)


def test_a_budget_on_a_forward_with_its_own_saved_tensor_hooks_says_why_it_cannot_measure():
    """The model's own saved_tensors_hooks are entered inside the forward, so they, not memkit's measuring hooks,
    take every saved tensor: the measuring forward would see no activation and report the budget as unreachable
    ("none of the blocks holds activation memory"). It says what hides them and what to do instead; nothing is
    left wrapped, and a policy that needs no measuring still applies."""
    from tests.helpers.live_tensors import describe, live_tensor_bytes, live_tensors

    torch.manual_seed(0)
    model = OffloadingBlockNet(blocks=4, width=32)
    x = torch.randn(64, 8)
    before = live_tensor_bytes()
    with pytest.raises(ValueError, match=r"its own saved_tensors_hooks.*save_on_cpu.*\"auto\"") as refused:
        apply_checkpointing(model, "budget=0.5", sample=(x,))
    # the error (and the frames it holds) keeps nothing of the measuring forward alive, in a cycle or not
    assert live_tensor_bytes(collect=False) == before, describe(live_tensors(collect=False))
    del refused
    assert live_tensor_bytes() == before, describe(live_tensors())
    assert not any("forward" in m.__dict__ for m in model.modules())
    # the same blocks without the hooks: measured as usual (the detection does not fire on memkit's own hooks)
    plain = BlockNet(blocks=4, width=32)
    plain.load_state_dict(model.state_dict())
    assert measure_activation_bytes(plain, (x,)) > 0
    handle = apply_checkpointing(model, "auto")
    assert any("forward" in m.__dict__ for m in model.modules())
    handle.remove()


class _Scaled(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x) * 2.0  # mul saves the Python number as a 0-dim tensor, which no hook sees


class _AddOne(nn.Module):
    def forward(self, x):
        return x + 1.0  # saves nothing; x carries a graph whose nodes saved their tensors before this forward


def test_forwards_that_save_nothing_of_their_own_are_no_hidden_saves():
    """No false alarm: a forward whose saves are all inputs and parameters (nothing it allocated: the measurement's
    saved set is empty) or a saved Python number, and a forward of an input that carries a graph made before it."""
    from lightning_memkit.modes._torch_compat import next_node_sequence_number, node_sequence_number

    layer, x = nn.Linear(8, 16), torch.randn(4, 8)
    assert measure_activation_bytes(_Scaled(layer), (x,)) == 4 * 16 * FLOAT32  # the output only
    carried = nn.Linear(8, 8)(x)
    assert measure_activation_bytes(_AddOne(), (carried,)) == 4 * 8 * FLOAT32
    # the private torch API the check stands on: autograd numbers the nodes a thread makes in order
    start = next_node_sequence_number()
    assert start is not None and node_sequence_number(carried.grad_fn) < start
    made = carried * 3
    assert node_sequence_number(made.grad_fn) >= start


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
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
    )
    x = torch.randn(5, 8)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    handle = apply_checkpointing(model, "auto")
    assert handle.plan.count == 2  # round(sqrt(9)) = 3 segments, the last one runs plain
    model(x).sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        assert torch.equal(got, want)
    handle.remove()


# ------------------------------------------------------------------------------------------ measuring keeps nothing
def test_measuring_forward_keeps_nothing_and_peaks_like_a_no_grad_forward():
    """The measuring forward replaces every saved tensor by a placeholder: its peak is a no_grad forward's
    (exact, accountant), it still counts exactly what a grad forward keeps for backward, and afterwards the
    process holds what it held before, with no graph."""
    from lightning_memkit import TensorAccountant
    from lightning_memkit.modes.checkpoint_measure import measure_forward
    from tests.helpers.live_tensors import describe, live_tensor_bytes, tensors_with_grad_fn

    torch.manual_seed(0)
    model = BlockNet(blocks=6, width=64)
    x = torch.randn(256, 8)
    peaks, kept = {}, {}
    for grad in (False, True):
        accountant = TensorAccountant()
        with torch.set_grad_enabled(grad), accountant:
            output = model(x)
        peaks[grad], kept[grad] = accountant.peak_bytes, accountant.current_bytes
        del output
    before = live_tensor_bytes()
    measured = measure_forward(model, (x,), {f"blocks.{i}": [model.blocks[i]] for i in range(6)}, count_flops=True)
    assert measured.peak_bytes == peaks[False] < kept[True] / 4
    assert measured.activation_bytes == kept[True]  # what a grad forward keeps alive for backward, to the byte
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())
    assert live_tensor_bytes() == before


def test_a_sample_that_runs_backward_is_a_clear_error_for_a_budget_and_a_warning_otherwise():
    model = BlockNet(blocks=3)
    x = torch.randn(8, 8)

    def step():
        loss = model(x).sum()
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="cannot run a backward"):
        apply_checkpointing(model, "budget=0.5", sample=step)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.warns(RuntimeWarning, match="not measured"):
        handle = apply_checkpointing(model, "auto", sample=step)
    assert handle.plan.count == 2 and handle.plan.baseline_activation_bytes is None
    handle.remove()


# ------------------------------------------------------------------------------------- budget units, class + budget
@pytest.mark.parametrize("value", [1.5, 2, "2", "1e9", "budget=2", "budget=1.5", 0, -0.5, True, "lots"])
def test_a_budget_is_a_fraction_or_a_size_with_a_unit(value):
    from lightning_memkit.modes.checkpoint_policy import parse_budget

    if isinstance(value, str) and value.startswith("budget="):
        parse = functools.partial(apply_checkpointing, BlockNet(), value, sample=(torch.randn(2, 8),))
    else:
        parse = functools.partial(parse_budget, value)
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\].*512MiB"):
        parse()


def test_budget_forms_that_say_their_unit():
    from lightning_memkit.modes.checkpoint_policy import normalize_policy, parse_budget

    assert parse_budget(1) == CheckpointBudget(fraction=1.0)
    assert parse_budget("0.25") == CheckpointBudget(fraction=0.25)
    assert normalize_policy("budget=512MiB") == CheckpointBudget(bytes=512 * 2**20)
    assert normalize_policy("budget=4096B") == CheckpointBudget(bytes=4096)
    assert CheckpointBudget(bytes=4096).bytes == 4096  # bytes= says its unit: an int of bytes
    with pytest.raises(ValueError, match="int of bytes"):
        CheckpointBudget(bytes=4096.5)


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.act, self.drop, self.down = (
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(4 * width, width),
        )

    def forward(self, x):
        return self.down(self.drop(self.act(self.up(x))))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.mlp = MLP(width)

    def forward(self, x):
        h = x + torch.tanh(self.mix(x))
        return h + self.mlp(h)


class TinyGPT(nn.Module):
    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_a_class_policy_with_a_budget_chooses_only_among_its_matches():
    """A budget within a class policy ({MLP}) chooses among the MLP blocks only, never whole blocks."""
    torch.manual_seed(0)
    model = TinyGPT()
    base = copy.deepcopy(model)
    x = torch.randn(64, 8)
    handle = apply_checkpointing(model, CheckpointBudget(fraction=0.8, within={MLP}), sample=(x,))
    plan = handle.plan
    assert plan.count > 0 and all(name.endswith(".mlp") for name in plan.names), plan.names
    assert plan.measured_activation_bytes <= plan.budget_bytes == int(0.8 * plan.baseline_activation_bytes)
    assert plan.policy == "budget=0.8 within {MLP}" and "{MLP}" in plan.note
    _step(base, x)
    _step(model, x)
    _assert_same_training_effect(base, model)
    handle.remove()
    # the MLPs alone cannot reach what whole blocks can: refused with the figure to ask for, not widened
    with pytest.raises(
        ValueError, match=r"cannot be met: checkpointing all 4 candidates \(the modules \{MLP\} matches\)"
    ):
        apply_checkpointing(model, CheckpointBudget(fraction=0.2, within={MLP}), sample=(x,))
    assert apply_checkpointing(model, CheckpointBudget(fraction=0.2), sample=(x,)).plan.count > 0  # blocks can
    with pytest.raises(ValueError, match="matched no module.*MLP"):
        plan_checkpointing(model, CheckpointBudget(fraction=0.5, within={nn.Conv2d}))
    with pytest.raises(ValueError, match="within"):
        CheckpointBudget(fraction=0.5, within="auto")
