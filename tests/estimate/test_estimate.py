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
from lightning_memkit.estimate.cuda.caching_allocator import round_allocation, segment_size
from lightning_memkit.estimate.fake.session import FakeSession
from lightning_memkit.estimate.fake.step_ops import FakeStepOps
from lightning_memkit.estimate.fake.tensors import NOT_ANSWERED, fake_parameter, fake_view, is_fake
from lightning_memkit.modes.mode import Mode
from lightning_memkit.zoo import DemoCNN, DemoMLP, DemoTransformer
from tests.helpers.independent_count import training_step_peak

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
    assert abs(estimate.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (
        estimate.peak_bytes,
        measured.peak_bytes,
    )
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
    assert all(numpy.array_equal(a, b) for a, b in zip(np_rng[1:2], numpy.random.get_state()[1:2], strict=True))


@pytest.mark.parametrize("cls", [DemoMLP, DemoCNN, DemoTransformer])
@pytest.mark.parametrize(("mode", "autocast_dtype"), [("baseline", None), ("bf16", torch.bfloat16)])
def test_estimate_matches_an_independent_count_of_the_real_step(cls, mode, autocast_dtype):
    """Against tests/helpers/independent_count.py (gc walk and its own dispatch counter over a plain-torch loop in
    Lightning's order), not measure_training_step, which shares the estimate's step code. Measured: equal to
    the byte for four of the six, within 192 bytes (0.003%) for the others."""
    torch.manual_seed(0)
    module = _small(cls)
    estimate = estimate_memory(module, mode=mode, device="cpu")
    counted = training_step_peak(module, steps=2, autocast_dtype=autocast_dtype)
    assert abs(estimate.peak_bytes - counted) <= 1e-4 * counted, (estimate.peak_bytes, counted)


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
    # cuBLAS/cuDNN workspaces are allocated inside the simulated step (estimate/cuda/kernels.py), not added on top
    assert view.context_bytes == 512 * MiB and view.workspace_bytes == 0
    assert estimate.required_bytes == view.peak_reserved_bytes + 512 * MiB
    assert any("cuBLAS workspace 32768 KiB" in note for note in estimate.notes)
    assert any("cuDNN workspaces" in note for note in estimate_memory(DemoCNN(), device="cuda").notes)


def test_allocator_model_rules():
    assert round_allocation(1) == 512 and round_allocation(512) == 512 and round_allocation(513) == 1024
    assert segment_size(512) == 2 * MiB and segment_size(1 * MiB) == 2 * MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB and segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB
    model = CudaAllocatorModel()
    model.allocate("a", 3000)  # small pool: 2 MiB segment, block 3072
    model.allocate("b", 5 * MiB)  # large pool: 20 MiB segment, split (15 MiB left)
    model.allocate("c", 5 * MiB)  # reuses the 15 MiB remainder
    assert model.reserved_bytes == 22 * MiB and model.allocated_bytes == 3072 + 10 * MiB
    model.free("b")
    model.free("c")  # merged back into one free 20 MiB block
    model.allocate("d", 19 * MiB)  # fits in the merged block: no new segment; 1 MiB left is not split off
    assert model.reserved_bytes == 22 * MiB and model.allocated_bytes == 3072 + 20 * MiB
    model.allocate("e", 30 * MiB)  # own segment, rounded to 2 MiB
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
        assert is_fake(value) and value.item() == 1.0  # placeholder scalar
        assert torch.ones(1, dtype=torch.bool).item() is True
    assert value.untyped_storage().nbytes() == 4


def test_fake_step_ops_answer_what_the_three_modes_answer():
    # the estimate's accountant does FakeStepOps' work in its own dispatch (one Python mode layer, not three):
    # pinned against what FakeTensorMode, ScalarPlaceholders and LossBuffers answer for the same ops
    session, ops = FakeSession(), FakeStepOps()
    device, item = torch.ops.prim.device.default, torch.ops.aten._local_scalar_dense.default
    with session.fake_mode_only():
        x = torch.empty(4, 3)
        assert is_fake(x) and ops.answer(device, (x,)) == x.device == torch.device("cpu")
        assert ops.answer(item, (x.sum(),)) == 1.0 and ops.answer(item, (torch.ones(1, dtype=torch.bool),)) is True
        assert ops.answer(item, (torch.ones(1, dtype=torch.long),)) == 1
        assert ops.answer(torch.ops.aten.add.Tensor, (x, x)) is NOT_ANSWERED
        assert ops.answer(device, (torch.ones(1, device="meta"),)) == torch.device("meta")  # a fake meta tensor
        mse = torch.ops.aten.mse_loss.default
        plain = mse(x, x)
        kept = ops.adjust(mse, (x, x), {}, plain)
        assert ops.adjust(torch.ops.aten.add.Tensor, (x, x), {}, plain) is plain
        # an optimizer's in-place foreach update on fakes returns nothing and allocates nothing: not dispatched
        add_, mul_ = torch.ops.aten._foreach_add_.List, torch.ops.aten._foreach_mul_.Scalar
        assert add_([x, x], [x, x]) is None and ops.answer(add_, ([x, x], [x, x]), {"alpha": 2}) is None
        assert (
            ops.answer(mul_, ([x], 0.5)) is None
            and ops.answer(torch.ops.aten._foreach_mul.Scalar, ([x], 0.5)) is NOT_ANSWERED
        )
    real = torch.ones(2)
    assert ops.answer(add_, ([real], [real])) is NOT_ANSWERED  # a real tensor is really updated
    assert ops.answer(device, (torch.ones(1, device="meta"),)) is NOT_ANSWERED  # not a fake: left to the dispatcher
    with session.active():
        three_layers = torch.nn.functional.mse_loss(torch.empty(4, 3), torch.empty(4, 3))
    assert kept.dim() == 0 and kept.untyped_storage().nbytes() == three_layers.untyped_storage().nbytes()
    assert (mse in ops.loss_ops) == (
        kept.untyped_storage().nbytes() == 48
    )  # this torch's real mse_loss keeps its buffer


VIEWS = [
    (torch.ops.aten.detach.default, ()),
    (torch.ops.aten.t.default, ()),
    (torch.ops.aten.view.default, ([2, 2, 3],)),
    (torch.ops.aten.transpose.int, (0, 1)),
    (torch.ops.aten.select.int, (1, 2)),
    (torch.ops.aten.expand.default, ([5, 4, 3],)),
    (torch.ops.aten.slice.Tensor, (0, 1, 4, 2)),
    (torch.ops.aten.split.Tensor, (3,)),
    (torch.ops.aten.unbind.int, (1,)),
    (torch.ops.aten.as_strided.default, ([2, 2], [1, 3], 1)),
    (torch.ops.aten.unsqueeze.default, (0,)),
]


@pytest.mark.parametrize(("op", "extra"), VIEWS, ids=[str(op) for op, _ in VIEWS])
def test_fake_view_is_what_fake_tensor_mode_makes_of_a_view(op, extra):
    # the estimate's dispatch answers view ops of a fake itself (half of a fake step's ops): pinned against
    # FakeTensorMode's own result, which fake_view reproduces through private torch APIs
    session, ops = FakeSession(), FakeStepOps()
    with session.fake_mode_only():
        base = (torch.empty(4, 3, requires_grad=True) * 2).detach()  # a non-leaf's alias, as autograd saves them
        made, reference = fake_view(op, (base, *extra)), op(base, *extra)
        assert ops.answer(op, (base, *extra)) is not NOT_ANSWERED
    made_list = list(made) if isinstance(made, (list, tuple)) else [made]
    reference_list = list(reference) if isinstance(reference, (list, tuple)) else [reference]
    assert type(made) is type(reference) and len(made_list) == len(reference_list)
    for mine, theirs in zip(made_list, reference_list, strict=True):
        assert type(mine) is type(theirs) and is_fake(mine) and mine.fake_mode is theirs.fake_mode
        assert mine.device == theirs.device == torch.device("cpu")
        assert (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype) == (
            theirs.shape,
            theirs.stride(),
            theirs.storage_offset(),
            theirs.dtype,
        )
        assert mine.untyped_storage()._cdata == base.untyped_storage()._cdata == theirs.untyped_storage()._cdata
        assert not mine.requires_grad and mine.grad_fn is None
    version = made_list[0]._version
    with session.fake_mode_only():
        base.add_(1)  # a view shares its base's version counter: autograd still sees in-place changes of saved tensors
    assert made_list[0]._version == reference_list[0]._version == version + 1


def test_fake_view_leaves_other_calls_to_fake_tensor_mode():
    session, ops = FakeSession(), FakeStepOps()
    with session.fake_mode_only():
        x = torch.empty(4, 3)
        assert ops.answer(torch.ops.aten._unsafe_view.default, (x, [12])) is NOT_ANSWERED  # not a view op
        assert ops.answer(torch.ops.aten.reshape.default, (x, [12])) is NOT_ANSWERED  # a composite
        assert ops.answer(torch.ops.aten.view_as.default, (x, x)) is NOT_ANSWERED  # two tensors
    assert fake_view(torch.ops.aten.t.default, (torch.ones(2, 3),)) is NOT_ANSWERED  # a real tensor


def test_fake_parameter_is_what_nn_parameter_makes_of_a_fake():
    # the fake copy flags its fresh fakes as parameters instead of letting nn.Parameter detach each one (an op)
    session = FakeSession()
    made, reference = fake_parameter(session.tensor(torch.ones(3, 2))), nn.Parameter(session.tensor(torch.ones(3, 2)))
    assert is_fake(made) and isinstance(made, nn.Parameter) and type(made) is type(reference)
    assert made.requires_grad and made.is_leaf and made.grad_fn is None
    module = nn.Linear(2, 3)
    module.weight = made  # registered as the module's parameter
    assert any(p is made for p in module.parameters())
    frozen = fake_parameter(session.tensor(torch.ones(2)), requires_grad=False)
    assert isinstance(frozen, nn.Parameter) and not frozen.requires_grad
    assert type(fake_parameter(torch.ones(2))) is nn.Parameter  # not a fake: nn.Parameter's own path


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


def test_what_does_not_fit_keeps_its_figures_and_the_other_modes_needs_are_estimated():
    """When batch 1 does not fit, the error carries the batch-1 estimate (the whole breakdown), and mode_needs
    estimates each mode at batch 1: a mode is worth suggesting only where it needs less."""
    from lightning_memkit.estimate import DoesNotFitError, ModeNeed, mode_needs
    from lightning_memkit.estimate.mode_needs import needing_less

    module = DemoTransformer(vocab_size=64, d_model=32, nhead=2, layers=1, dim_feedforward=64, seq_len=16)
    one = estimate_memory(module, 1, mode="bf16", device="cpu")
    with pytest.raises(DoesNotFitError) as raised:
        predict_max_batch_size(module, one.required_bytes - 1, mode="bf16", device="cpu", margin=0.0)
    assert raised.value.estimate.to_dict() | {"elapsed_s": 0} == one.to_dict() | {"elapsed_s": 0}
    assert raised.value.needed_bytes == one.required_bytes and "mode_needs()" in str(raised.value)
    memory = one.required_bytes - 1
    # one layer: the auto checkpoint policy finds no repeated blocks, so that mode cannot be estimated
    needs = mode_needs(module, memory, modes=("bf16", "baseline", "checkpoint"), margin=0.0, device="cpu")
    baseline = estimate_memory(module, 1, device="cpu")
    assert needs[:2] == [
        ModeNeed("bf16", one.required_bytes, one.peak_bytes, False),
        ModeNeed("baseline", baseline.required_bytes, baseline.peak_bytes, baseline.required_bytes <= memory),
    ]
    assert needs[2].mode == "checkpoint" and "found no repeated blocks" in needs[2].error and not needs[2].fits
    less = needing_less(needs, one.required_bytes)
    assert less == ([needs[1]] if baseline.required_bytes < one.required_bytes else [])
    with pytest.raises(ValueError, match="batch size 1"):
        mode_needs(module, memory, batch_size=2)


def test_batch_split_is_batch_1_and_what_a_sample_adds_where_weight_copies_add_nothing():
    from lightning_memkit.estimate import BatchSplit, estimate_batch_split

    module = DemoTransformer(vocab_size=64, d_model=32, nhead=2, layers=1, dim_feedforward=64, seq_len=16)
    split = estimate_batch_split(module, 8, mode="bf16", device="cpu")
    one, eight, nine = (estimate_memory(module, b, mode="bf16", device="cpu") for b in (1, 8, 9))
    assert split == BatchSplit.between(one, eight, nine) and split.batch_size == 8
    assert (split.batch_one_bytes, split.batch_one_required_bytes) == (one.peak_bytes, one.required_bytes)
    assert split.batch_one_by_category == one.by_category
    assert split.per_sample_bytes == nine.peak_bytes - eight.peak_bytes
    assert sum(split.per_sample_by_category.values()) == split.per_sample_bytes
    assert split.peak_phases == (one.peak_phase, eight.peak_phase, nine.peak_phase)
    assert eight.peak_phase == nine.peak_phase == "forward"  # the moment this test reads the growth at
    for name in ("parameters", "buffers", "gradients", "optimizer_state", "autocast_weight_copies"):
        assert split.per_sample_by_category[name] == 0, name
    assert eight.by_category["autocast_weight_copies"] > 0 and split.per_sample_by_category["activations"] > 0
    assert "autocast_weight_copies" in split.summary() and split.to_dict()["peak_phases"] == list(split.peak_phases)
    with pytest.raises(ValueError, match="batch sizes 1, b and b \\+ 1"):
        BatchSplit.between(eight, eight, nine)
    with pytest.raises(ValueError, match="positive integer"):
        estimate_batch_split(module, 0)


def test_predict_max_batch_size_when_memory_is_flat_at_small_batches():
    """A small model whose peak sits in the optimizer step at small batches: the two first estimates are
    equal, so the fitted slope is zero. The search must still reach the real limit (thousands), not creep
    up from the first sizes a percent at a time (it once answered 10)."""
    from lightning_memkit.zoo import DemoTransformer

    module = DemoTransformer(vocab_size=64, d_model=32, nhead=2, layers=1, dim_feedforward=64, seq_len=16, batch_size=4)
    memory = 1 << 30
    prediction = predict_max_batch_size(module, memory, gpu="h100")
    first, second = prediction.estimates[:2]
    assert first[1] == second[1]  # the flat start this test is about
    target = 0.95 * memory
    answer = prediction.batch_size
    assert estimate_memory(module, answer, gpu="h100").required_bytes <= target
    assert estimate_memory(module, answer + max(1, round(0.01 * answer)) + 1, gpu="h100").required_bytes > target
    assert answer > 1000 and len(prediction.estimates) <= 12
    # max_val caps the answer even when the first sizes estimated (the batch's own, and double) fit above it
    capped = predict_max_batch_size(module, memory, gpu="h100", max_val=6)
    assert capped.batch_size == 6 and capped.limited_by_max
    assert capped.predicted_bytes == estimate_memory(module, 6, gpu="h100").required_bytes


def test_bad_input_gets_clear_errors():
    plain = nn.Linear(8, 2)
    with pytest.raises(NoBatchError, match="pass an example batch"):
        estimate_memory(plain, device="cpu")
    with pytest.raises(EstimateError, match="optimizer=lambda params"):
        estimate_memory(plain, batch=torch.randn(4, 8), device="cpu")
    estimate = estimate_memory(
        plain, 16, batch=torch.randn(4, 8), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu"
    )
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


# ------------------------------------------------------------------------ as Lightning would run it
def _gpt():
    from tests.helpers.lightning_gpt import CharDataModule, TinyGPT

    torch.manual_seed(0)
    return TinyGPT(), CharDataModule(batch_size=8)


def test_a_schedule_from_self_trainer_and_a_datamodule_set_up_in_setup_are_estimated_exactly():
    """configure_optimizers reads self.trainer.estimated_stepping_batches (warm-up + cosine) and the
    datamodule makes its dataset in setup(): the estimate runs, and equals the measured step to the byte."""
    module, data = _gpt()
    assert module._trainer is None
    estimate = estimate_memory(module, datamodule=data, device="cpu")
    assert data.prepared == 1 and data.set_up == 1  # prepared and set up as fit does, once per estimate
    measured = measure_training_step(module, datamodule=data)
    assert estimate.peak_bytes == measured.peak_bytes
    assert estimate.batch_size == 8 and estimate.inputs_bytes == 2 * 8 * 16 * 8  # tokens + targets, int64
    assert module._trainer is None  # the stand-in trainer went to the copy only
    for size in (3, 24):
        assert (
            estimate_memory(module, size, datamodule=data, device="cpu").peak_bytes
            == measure_training_step(module, size, datamodule=data).peak_bytes
        )


def test_the_stand_in_trainer_answers_like_a_trainer():
    import lightning.pytorch as pl

    from lightning_memkit.estimate.step.trainer_stand_in import StandInTrainer

    seen = {}

    class Reads(DemoMLP):
        def configure_optimizers(self):
            trainer = self.trainer
            seen.update(
                steps=trainer.estimated_stepping_batches,
                max_steps=trainer.max_steps,
                max_epochs=trainer.max_epochs,
                devices=trainer.num_devices,
                world=trainer.world_size,
                precision=trainer.precision,
                step=self.global_step,
                epoch=self.current_epoch,
            )
            return super().configure_optimizers()

    module = Reads(batch_size=16)  # 512 samples: 32 batches per epoch
    estimate_memory(module, device="cpu")
    assert seen == {
        "steps": 32 * 1000,
        "max_steps": -1,
        "max_epochs": 1000,
        "devices": 1,
        "world": 1,
        "precision": "32-true",
        "step": 0,
        "epoch": 0,
    }
    estimate_memory(
        module,
        device="cpu",
        mode="bf16",
        trainer=pl.Trainer(
            max_steps=70, accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
        ),
    )
    assert seen["steps"] == 70 and seen["max_steps"] == 70 and seen["precision"] == "bf16-mixed"
    # a real Trainer's answer for the same settings
    assert (
        StandInTrainer(max_epochs=3, num_training_batches=10, accumulate_grad_batches=3).estimated_stepping_batches
        == 4 * 3
    )
    with pytest.raises(AttributeError, match="self.trainer.not_a_setting: memkit estimates the step without a Trainer"):
        _ = StandInTrainer().not_a_setting


class _Failing(DemoMLP):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def configure_optimizers(self):
        if self.where == "configure_optimizers":
            raise KeyError("no such optimizer")
        return super().configure_optimizers()

    def training_step(self, batch, batch_idx):
        if self.where == "training_step":
            raise IndexError("bad index")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["configure_optimizers", "training_step"])
def test_an_error_names_the_hook_that_failed(where):
    with pytest.raises(EstimateError, match=rf"^_Failing\.{where} failed on fake tensors: (KeyError|IndexError)"):
        estimate_memory(_Failing(where), device="cpu")


def test_a_failing_datamodule_hook_is_named():
    from tests.helpers.lightning_gpt import CharDataModule

    class Broken(CharDataModule):
        def setup(self, stage):
            raise FileNotFoundError("data/train.txt")

    module, _ = _gpt()
    with pytest.raises(
        NoBatchError, match=r"Broken\.setup\('fit'\) failed while memkit took a sample batch: FileNotFoundError"
    ):
        estimate_memory(module, datamodule=Broken(), device="cpu")


# ------------------------------------------------------------------------ wherever the parameters live
def test_a_module_on_the_meta_device_estimates_like_the_same_module_on_cpu():
    from tests.helpers.lightning_gpt import CharDataModule, TinyGPT

    data = CharDataModule(batch_size=8)
    on_cpu = TinyGPT()
    with torch.device("meta"):
        on_meta = TinyGPT()
    assert on_meta.head.weight.device.type == "meta"
    for mode in ("baseline", "bf16", "checkpoint"):
        cpu_estimate = estimate_memory(on_cpu, datamodule=data, mode=mode, device="cpu")
        meta_estimate = estimate_memory(on_meta, datamodule=data, mode=mode, device="cpu")
        assert (
            meta_estimate.peak_bytes == cpu_estimate.peak_bytes
            and meta_estimate.by_category == cpu_estimate.by_category
        ), mode
        assert (
            estimate_memory(on_meta, 16, datamodule=data, mode=mode, device="cuda").cuda
            == estimate_memory(on_cpu, 16, datamodule=data, mode=mode, device="cuda").cuda
        )
    assert on_meta.head.weight.device.type == "meta"  # untouched
    with pytest.raises(EstimateError, match="meta device"):
        measure_training_step(on_meta, datamodule=data)


def test_parameters_and_batch_on_different_devices_meet_on_one_fake_device():
    """Parameters on one device and the batch on another (as when a module already sits on the GPU and the
    loader yields CPU tensors) must not fail with 'found two different devices': every fake is a CPU fake."""
    module = DemoMLP()
    with torch.device("meta"):
        meta_module = DemoMLP()
    batch = next(iter(module.train_dataloader()))
    assert (
        estimate_memory(meta_module, batch=batch, device="cuda").peak_bytes
        == estimate_memory(module, batch=batch, device="cuda").peak_bytes
    )
    meta_batch = tuple(t.to("meta") for t in batch)
    assert (
        estimate_memory(module, batch=meta_batch, device="cpu").peak_bytes
        == estimate_memory(module, batch=batch, device="cpu").peak_bytes
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_a_module_already_on_cuda_estimates_without_touching_the_device():
    from tests.helpers.lightning_gpt import CharDataModule, TinyGPT

    data = CharDataModule(batch_size=8)
    on_cpu = TinyGPT()
    on_cuda = TinyGPT().cuda()
    before = torch.cuda.memory_allocated()
    for mode in ("baseline", "bf16"):
        assert (
            estimate_memory(on_cuda, datamodule=data, mode=mode).peak_bytes
            == estimate_memory(on_cpu, datamodule=data, mode=mode).peak_bytes
        )
    assert torch.cuda.memory_allocated() == before
    measured = measure_training_step(on_cuda, datamodule=data)  # the batch goes to the module's device, as in Lightning
    assert measured.peak_bytes > 0


def test_a_checkpointed_step_that_fails_leaves_the_reused_fake_copy_unwrapped():
    """The checkpointing wrappers come off the block's fake copy even when the step fails after wrapping it (here in
    the optimizer's construction), so the next estimate of the same copy is the plain step's."""
    from lightning_memkit.estimate.step.settings import reusing_fake_copies

    module, data = _gpt()
    fresh = estimate_memory(module, 4, datamodule=data, device="cuda").to_dict()

    def no_optimizer(params):
        raise RuntimeError("no optimizer")

    with reusing_fake_copies():
        with pytest.raises(EstimateError, match="no optimizer"):
            estimate_memory(module, 4, datamodule=data, mode="checkpoint", device="cuda", optimizer=no_optimizer)
        after = estimate_memory(module, 4, datamodule=data, device="cuda").to_dict()
    for field in ("peak_bytes", "by_category", "peak_phase"):
        assert after[field] == fresh[field], field


def test_the_fake_copy_is_reused_across_modes_and_sizes_and_gives_the_same_figures():
    from lightning_memkit.estimate.step.settings import reusing_fake_copies

    module, data = _gpt()
    fresh = {
        (mode, size): estimate_memory(module, size, datamodule=data, mode=mode, device="cuda").to_dict()
        for mode in ("baseline", "bf16+checkpoint")
        for size in (4, 8)
    }
    data.set_up = 0
    with reusing_fake_copies():
        reused = {
            (mode, size): estimate_memory(module, size, datamodule=data, mode=mode, device="cuda").to_dict()
            for mode in ("baseline", "bf16+checkpoint")
            for size in (4, 8)
        }
    assert data.set_up == 1  # one sample batch for all four
    for key in fresh:
        for field in ("peak_bytes", "by_category", "cuda", "peak_phase"):
            assert fresh[key][field] == reused[key][field], (key, field)
