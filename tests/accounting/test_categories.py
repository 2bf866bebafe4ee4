"""The category breakdown: the ZeRO paper's arithmetic, exactly, and the time-resolved
saved-for-backward attribution."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.accounting.categories import (
    CATEGORIES,
    CategoryAttributor,
    CategoryBreakdown,
    category_breakdown,
    cuda_memory_extras,
)
from lightning_memkit.trace.tracer import trace_step

F32 = 4


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def adam_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("warm_up", [True, False], ids=["step-1", "first-step-lazy-state"])
def test_zero_arithmetic_mlp_adam_exact(warm_up):
    model = make_mlp()
    psi = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    if warm_up:
        adam_step(model, optimizer, x, y)
    with trace_step(model, optimizer, inputs=(x, y)) as tracer:
        adam_step(model, optimizer, x, y)
    end = tracer.result.at_end
    assert tracer.result.parameter_count == psi
    assert end["parameters"] == 4 * psi
    assert end["gradients"] == 4 * psi
    # exp_avg and exp_avg_sq (fp32) plus one fp32 step counter per parameter tensor
    assert end["optimizer_state"] == 8 * psi + F32 * tensors
    assert end["inputs"] == x.nbytes + y.nbytes
    assert end["activations"] == 0  # the graph is gone
    assert end.total_bytes == tracer.result.end_bytes
    # the same numbers without running a step
    static = category_breakdown(model, [optimizer], inputs=(x, y))
    assert static.bytes_by_category == end.bytes_by_category


def test_peak_breakdown_sums_to_the_peak_and_holds_activations():
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    adam_step(model, optimizer, x, y)
    optimizer.zero_grad(set_to_none=True)
    with trace_step(model, optimizer, inputs=(x, y)) as tracer:
        loss = nn.functional.cross_entropy(model(x), y)
        forward_live = tracer.accountant.current_bytes
        snapshot = tracer.attributor.breakdown()  # end of forward: what autograd holds
        loss.backward()
        optimizer.step()
    psi = sum(p.numel() for p in model.parameters())
    # saved for backward at the end of forward: the ReLU outputs (also the next Linear's inputs;
    # the first Linear's input is x, an input), cross-entropy's log-softmax output and the
    # 0-dim fp32 total weight nll_loss keeps
    hidden = 16 * 128 * F32
    assert snapshot["activations"] == 2 * hidden + 16 * 10 * F32 + F32
    assert snapshot["gradients"] == 0 and snapshot.total_bytes == forward_live
    peak = tracer.result.at_peak
    assert peak.total_bytes == tracer.result.peak_bytes
    assert sum(peak.bytes_by_category.values()) == peak.total_bytes
    assert peak["parameters"] == 4 * psi and peak["optimizer_state"] == 8 * psi + F32 * 6


def test_saved_tensors_are_time_resolved():
    accountant = TensorAccountant()
    attributor = CategoryAttributor(accountant)
    weight = nn.Parameter(torch.randn(8, 8))
    attributor.assign([weight], "parameters")
    with accountant, attributor.watch_saved_tensors():
        x = torch.randn(4, 8, requires_grad=True)
        attributor.assign([x], "inputs")
        hidden = (x @ weight).tanh()  # tanh saves its output
        tick_saved = attributor.tick
        records_saved = accountant.live_records()
        hidden.sum().backward()
    del hidden
    assert attributor.breakdown_of(records_saved, tick_saved)["activations"] == 4 * 8 * F32
    assert attributor.breakdown()["activations"] == 0
    assert attributor.breakdown()["gradients"] == 0  # weight.grad was never assigned a role...
    assert attributor.breakdown()["temporaries"] == weight.grad.nbytes + x.grad.nbytes  # ...so it is a temporary


def test_tied_weights_count_once_and_roles_do_not_double():
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    breakdown = category_breakdown(model, inputs=[embedding.weight])
    assert breakdown["parameters"] == 10 * 4 * F32 and breakdown["inputs"] == 0


def test_breakdown_record_round_trip_and_errors():
    breakdown = category_breakdown(make_mlp())
    assert set(breakdown.bytes_by_category) == set(CATEGORIES)
    assert CategoryBreakdown.from_dict(breakdown.to_dict()) == breakdown
    with pytest.raises(KeyError, match="choose from"):
        breakdown["activation"]
    with pytest.raises(ValueError, match="choose from"):
        CategoryAttributor(TensorAccountant()).assign([torch.ones(1)], "weights")


def test_cuda_extras_are_none_off_cuda():
    assert cuda_memory_extras("cpu") == {
        "reserved_minus_allocated_bytes": None,
        "nvml_unseen_bytes": None,
        "allocator_allocated_bytes": None,
    }
