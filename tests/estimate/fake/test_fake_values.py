"""What a fake step answers when user code asks about values: as the real step answers, so it takes the same
Python path. Each library check is pinned by a test that fails if the library changes it."""

from __future__ import annotations

import inspect
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import estimate_memory
from lightning_memkit.estimate.fake.known_values import known_value
from lightning_memkit.estimate.fake.session import FakeSession
from lightning_memkit.estimate.fake.step_ops import FakeStepOps
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from tests.helpers.dispatch_counter import StorageCounter

torchmetrics = pytest.importorskip("torchmetrics")


def _in_fake_step(body):
    """Run ``body(session)`` inside a fake step's dispatch stack (the fake mode, the estimate's accountant)."""
    session = FakeSession()
    accountant = StepAccountant(record_events=False, fake_ops=FakeStepOps())
    with session.fake_mode_only(), accountant:
        return body(session)


def test_nan_and_inf_checks_of_fakes_answer_false_and_fills_answer_their_value():
    def body(session):
        x = torch.empty(4, 3)  # a fake: no values
        nans = torch.isnan(x)
        assert known_value(nans) is False and not bool(nans.any()) and not torch.isinf(x).any().item()
        assert bool((~nans).all())  # finite data: every element is not NaN
        weights = torch.zeros_like(nans).bool()
        assert known_value(weights) is False and not bool((nans | weights).any())
        assert torch.full((2,), 3.5).max().item() == 3.5
        y = torch.ones(3)
        y.add_(torch.empty(3))  # an in-place update by unknown values: forgotten
        assert known_value(y) is None
        return True

    assert _in_fake_step(body)


def test_loader_integers_stay_real_and_ops_on_them_run_for_real():
    def body(session):
        mask = torch.ones(2, 5, dtype=torch.long)  # real, made before the step as a loader's batch is
        as_bool = mask.to(torch.bool)
        positions = torch.arange(5)
        assert type(as_bool) is torch.Tensor and type(positions) is torch.Tensor  # not fakes
        assert bool(as_bool.all()) and positions.tolist() == [0, 1, 2, 3, 4]
        return True

    assert _in_fake_step(body)


def test_torchmetrics_nan_check_reads_isnan_any():
    # torchmetrics warns "Encountered `nan` values" and drops them by boolean indexing when isnan(x).any() is true
    from torchmetrics.aggregation import BaseAggregator

    source = inspect.getsource(BaseAggregator._cast_and_nan_check_input)
    assert "torch.isnan(x)" in source and "nans.any()" in source and "Encountered `nan` values" in source


class MetricModule(pl.LightningModule):
    """torchmetrics in a step as users write it: a MeanMetric called like a module and logged, a CatMetric (a list
    state), an accuracy."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
        self.train_loss = torchmetrics.MeanMetric()
        self.losses = torchmetrics.CatMetric()
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(16, 16, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        )

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_loss(loss)
        self.losses.update(loss.detach())
        self.accuracy(logits, y)
        self.log("train_loss", self.train_loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_estimate_of_a_module_with_torchmetrics_prints_no_library_warning_and_equals_the_real_step():
    module = MetricModule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate = estimate_memory(module, 4, device="cpu")
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    # the real step (Lightning's order, two steps) counted independently of memkit
    model = MetricModule()
    model.load_state_dict(module.state_dict())
    batch = next(iter(model.train_dataloader()))
    optimizer = model.configure_optimizers()
    counter = StorageCounter(existing=[*model.parameters(), *model.buffers(), *batch])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        with counter:
            for index in range(2):
                loss = model.training_step(batch, index)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                del loss
                optimizer.step()
    assert abs(estimate.peak_bytes - counter.peak_bytes) <= 64


def test_a_compiled_lightning_module_is_estimated_as_its_eager_program_with_a_note():
    from lightning_memkit.estimate.api import COMPILED_NOTE, compiled_original

    module = MetricModule()
    compiled = torch.compile(module)  # Trainer.fit takes it; compiling happens at the first call only
    assert compiled_original(compiled) is module and compiled_original(module) is None  # pins OptimizedModule._orig_mod
    eager = estimate_memory(module, 4, device="cpu")
    estimate = estimate_memory(compiled, 4, device="cpu")
    assert estimate.peak_bytes == eager.peak_bytes and estimate.by_category == eager.by_category
    assert COMPILED_NOTE in estimate.notes and COMPILED_NOTE not in eager.notes
    from lightning_memkit.estimate import predict_max_batch_size

    assert (
        predict_max_batch_size(compiled, "64MiB", device="cpu").batch_size
        == predict_max_batch_size(module, "64MiB", device="cpu").batch_size
    )
