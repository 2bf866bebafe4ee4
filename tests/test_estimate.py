"""estimate_memory: fake-tensor step vs the same step measured on real tensors, categories, allocator model."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch import nn

from lightning_memkit.estimate import (
    CudaAllocatorModel,
    EstimateError,
    NoBatchError,
    estimate_memory,
    measure_training_step,
    predict_max_batch_size,
)
from lightning_memkit.estimate.allocator import round_allocation, segment_size
from lightning_memkit.estimate.fake import FakeSession, is_fake
from lightning_memkit.modes.mode import Mode
from lightning_memkit.zoo import DemoCNN, DemoMLP, DemoTransformer

MiB = 2**20

def _small(cls):
    if cls is DemoTransformer:
        return cls(layers=2, d_model=64, dim_feedforward=128, seq_len=32, batch_size=8)
    return cls()


@pytest.mark.parametrize("cls", [DemoMLP, DemoCNN, DemoTransformer])
@pytest.mark.parametrize("mode", ["baseline", "bf16", "checkpoint", Mode(checkpoint=frozenset({nn.Linear, nn.Conv2d}))])
def test_estimate_within_one_percent_of_the_measured_step_and_touches_nothing(cls, mode):
    torch.manual_seed(0)
    module = _small(cls)
    mode_value = mode
    state = {k: v.clone() for k, v in module.state_dict().items()}
    rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), numpy.random.get_state()
    estimate = estimate_memory(module, mode=mode_value, device="cpu")
    measured = measure_training_step(module, mode=mode_value)
    assert estimate.source == "fake" and measured.source == "measured"
    assert abs(estimate.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (estimate.peak_bytes, measured.peak_bytes)
    assert estimate.peak_phase == measured.peak_phase
    assert sum(estimate.by_category.values()) == estimate.peak_bytes
    # categories that do not depend on kernels are exact
    for name in ("parameters", "buffers", "inputs", "gradients"):
        assert estimate.by_category[name] == measured.by_category[name], name
    assert estimate.parameters_bytes == sum(p.numel() * 4 for p in module.parameters())
    # the user's module and every RNG are bit for bit as before
    assert state.keys() == module.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and py_rng == random.getstate()
    assert all(numpy.array_equal(a, b) for a, b in zip(np_rng[1:2], numpy.random.get_state()[1:2]))


def test_batch_size_reshapes_the_dataloader_batch_and_activations_grow():
    module = DemoCNN(batch_size=4)
    small, large = estimate_memory(module, 8, device="cpu"), estimate_memory(module, 32, device="cpu")
    assert small.batch_size == 8 and large.batch_size == 32
    assert large.inputs_bytes == 32 * 3 * 32 * 32 * 4 + 32 * 8  # images (fp32) + int64 labels
    assert large.activations_bytes > 3 * small.activations_bytes
    assert large.parameters_bytes == small.parameters_bytes


def test_cuda_view_rounds_and_adds_documented_allowances():
    estimate = estimate_memory(DemoMLP(), device="cuda")
    view = estimate.cuda
    assert view is not None
    assert view.peak_allocated_bytes >= estimate.peak_bytes
    assert view.peak_reserved_bytes % (2 * MiB) == 0 and view.peak_reserved_bytes >= view.peak_allocated_bytes
    assert view.context_bytes == 512 * MiB and view.workspace_bytes == 32 * MiB  # no convolutions: cuBLAS only
    assert estimate.required_bytes == view.peak_reserved_bytes + 544 * MiB
    assert estimate_memory(DemoCNN(), device="cuda").cuda.workspace_bytes == 96 * MiB  # + cuDNN allowance


def test_allocator_model_rules():
    assert round_allocation(1) == 512 and round_allocation(512) == 512 and round_allocation(513) == 1024
    assert segment_size(512) == 2 * MiB and segment_size(1 * MiB) == 2 * MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB and segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB
    model = CudaAllocatorModel()
    model.allocate("a", 3000)              # small pool: 2 MiB segment, block 3072
    model.allocate("b", 5 * MiB)           # large pool: 20 MiB segment, split (15 MiB left)
    model.allocate("c", 5 * MiB)           # reuses the 15 MiB remainder
    assert model.reserved_bytes == 22 * MiB and model.allocated_bytes == 3072 + 10 * MiB
    model.free("b"); model.free("c")       # merged back into one free 20 MiB block
    model.allocate("d", 19 * MiB)          # fits in the merged block: no new segment; 1 MiB left is not split off
    assert model.reserved_bytes == 22 * MiB and model.allocated_bytes == 3072 + 20 * MiB
    model.allocate("e", 30 * MiB)          # own segment, rounded to 2 MiB
    view = model.view(context_bytes=7)
    assert view.peak_reserved_bytes == 52 * MiB and view.segments == 3 and view.device_bytes == 52 * MiB + 7


def test_fake_session_pins_the_private_fake_tensor_api():
    module = nn.Linear(4, 3)
    before = module.weight.detach().clone()
    session = FakeSession()
    fake = session.module_copy(module)
    assert is_fake(fake.weight) and fake.weight.requires_grad and fake.weight.shape == (3, 4)
    assert not is_fake(module.weight) and torch.equal(module.weight, before)
    with session.active():
        value = fake(session.empty((2, 4), torch.float32)).sum()
        assert is_fake(value) and value.item() == 1.0   # placeholder scalar
        assert torch.ones(1, dtype=torch.bool).item() is True
    assert value.untyped_storage().nbytes() == 4


def test_predict_max_batch_size_matches_the_measured_limit():
    module = DemoCNN(batch_size=8)
    memory = 64 * MiB
    prediction = predict_max_batch_size(module, memory, margin=0.05, device="cpu")
    target = 0.95 * memory
    assert measure_training_step(module, prediction.batch_size).peak_bytes <= target
    step = max(1, round(0.01 * prediction.batch_size))
    assert measure_training_step(module, prediction.batch_size + step + 1).peak_bytes > target
    assert len(prediction.estimates) <= 6
    with pytest.raises(ValueError, match="does not fit .* even at batch size 1"):
        predict_max_batch_size(module, 100_000, device="cpu")


def test_bad_input_gets_clear_errors():
    plain = nn.Linear(8, 2)
    with pytest.raises(NoBatchError, match="pass an example batch"):
        estimate_memory(plain, device="cpu")
    with pytest.raises(EstimateError, match="optimizer=lambda params"):
        estimate_memory(plain, batch=torch.randn(4, 8), device="cpu")
    estimate = estimate_memory(plain, 16, batch=torch.randn(4, 8), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu")
    assert estimate.inputs_bytes == 16 * 8 * 4 and estimate.gradients_bytes == (8 * 2 + 2) * 4
    with pytest.raises(ValueError, match="positive integer"):
        estimate_memory(DemoMLP(), 0, device="cpu")
    with pytest.raises(EstimateError, match="mode 'checkpoint:.*Conv2d"):  # a policy that matches nothing in an MLP
        estimate_memory(DemoMLP(), mode=Mode(checkpoint=frozenset({nn.Conv2d})), device="cpu")


def test_a_checkpoint_budget_mode_is_estimated_exactly_on_fake_tensors():
    """The budget policy measures its blocks on the fake step's own forward: the estimate equals the
    measured step to the byte, and a tighter budget checkpoints more."""
    from lightning_memkit.zoo import DemoTransformer

    module = DemoTransformer(vocab_size=50, d_model=32, nhead=2, layers=4, dim_feedforward=64, seq_len=16, batch_size=8)
    peaks = {}
    for mode in ("baseline", "checkpoint:budget=0.6", "checkpoint:budget=0.2"):
        estimate = estimate_memory(module, 8, mode=mode, device="cpu")
        assert estimate.peak_bytes == measure_training_step(module, 8, mode=mode).peak_bytes, mode
        peaks[mode] = estimate.peak_bytes
    assert peaks["checkpoint:budget=0.2"] < peaks["checkpoint:budget=0.6"] < peaks["baseline"]
