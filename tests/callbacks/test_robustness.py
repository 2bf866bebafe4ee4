"""Robustness sweep: every memkit callback and CLI verb on unusual but legitimate LightningModules.

Dict batches with non-tensor fields, manual optimization with two optimizers, schedulers and
clipping, gradient accumulation, tied weights, keyword-argument forwards, RNNs, frozen submodules
and buffers, no / two validation loaders, an IterableDataset without ``__len__``, epoch
boundaries, standalone validate/test, and the CLI on a user's file. Each test asserts what a user
relies on: readings at the expected steps, training unchanged where a feature promises it, a clear
error where the input is unsupported.
"""

from __future__ import annotations

import os
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from lightning_memkit import (
    ActivationCheckpointing,
    LayerTrace,
    MaxBatchSize,
    MemoryTracker,
    compare_modes,
    estimate_memory,
    measure_training_step,
)
from lightning_memkit.cli import main
from lightning_memkit.records import read_records
from tests.helpers.event_files import read_scalars
from tests.helpers.models import FLOAT32
from tests.helpers.trainers import make_trainer

D = 16  # feature width of the small models


# ============================================================================================ modules
class Block(nn.Module):
    """A residual block whose forward takes a keyword-only argument."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, *, scale: float = 1.0):
        return torch.relu(self.fc(x)) * scale + x


class Base(pl.LightningModule):
    """Repeated blocks called with a keyword argument, a head, MSE; (x, y) tuple batches."""

    def __init__(self, batch_size: int = 4, samples: int = 48, depth: int = 3, lr: float = 0.1) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.lr = lr
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(D, 1)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, D, generator=generator)
        self.y = torch.randn(samples, 1, generator=generator)

    def forward(self, x, *, scale: float = 1.0):
        for block in self.blocks:
            x = block(x, scale=scale)
        return self.head(x)

    def unpack(self, batch):
        return batch

    def training_step(self, batch, batch_idx):
        x, y = self.unpack(batch)
        return F.mse_loss(self(x, scale=0.5), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class WithValidation(Base):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:8], self.y[:8]), batch_size=self.batch_size)


class TwoValLoaders(Base):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log(f"val_loss_{dataloader_idx}", F.mse_loss(self(x), y), add_dataloader_idx=False)

    def val_dataloader(self):
        return [
            DataLoader(TensorDataset(self.x[:8], self.y[:8]), batch_size=4),
            DataLoader(TensorDataset(self.x[8:12], self.y[8:12]), batch_size=2),
        ]


class _Records(Dataset):
    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index], "id": f"sample-{index}"}


class DictBatch(Base):
    """Batches are dicts of tensors plus a list of strings (default collate)."""

    def unpack(self, batch):
        assert isinstance(batch, dict) and isinstance(batch["id"], list) and isinstance(batch["id"][0], str)
        return batch["x"], batch["y"]

    def train_dataloader(self):
        return DataLoader(_Records(self.x, self.y), batch_size=self.batch_size)


class _Stream(IterableDataset):
    """No __len__: Lightning and memkit cannot know the epoch's length."""

    def __init__(self, x, y, repeats: int = 50) -> None:
        self.x, self.y, self.repeats = x, y, repeats

    def __iter__(self):
        for _ in range(self.repeats):
            for index in range(len(self.x)):
                yield self.x[index], self.y[index]


class Streaming(Base):
    def train_dataloader(self):
        return DataLoader(_Stream(self.x, self.y), batch_size=self.batch_size)


class Scheduled(Base):
    """An LR scheduler stepping every optimizer step (gradient clipping comes from the Trainer)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Tied(Base):
    """The same Linear applied twice, and a decoder whose weight is the encoder's."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shared = nn.Linear(D, D)
        self.decoder = nn.Linear(D, D, bias=False)
        self.decoder.weight = self.shared.weight

    def forward(self, x, *, scale: float = 1.0):
        h = torch.relu(self.shared(x))
        h = torch.relu(self.shared(h)) * scale
        return self.head(self.decoder(h))

    def unique_parameter_bytes(self) -> int:
        return sum(p.numel() for p in self.parameters()) * FLOAT32


class MaskBlock(nn.Module):
    """Dropout, a tensor keyword argument (a mask) and a tuple output, as transformer layers have."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, mask=None):
        h = self.drop(torch.relu(self.fc(x)))
        if mask is not None:
            h = h * mask
        return x + h, h.detach().mean()


class TupleBlocks(Base):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.blocks = nn.ModuleList(MaskBlock() for _ in range(4))

    def forward(self, x, *, scale: float = 1.0):
        mask = (torch.arange(D) % 2).float()
        for block in self.blocks:
            x, _statistic = block(x, mask=mask)
        return self.head(x)


class DictStages(Base):
    """Repeated blocks held in an nn.ModuleDict, called by key."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        del self.blocks
        self.stages = nn.ModuleDict({f"stage{i}": Block() for i in range(4)})

    def forward(self, x, *, scale: float = 1.0):
        for key in self.stages:
            x = self.stages[key](x, scale=scale)
        return self.head(x)


class Recurrent(pl.LightningModule):
    """An nn.LSTM or nn.GRU over (batch, time, features) sequences."""

    def __init__(self, cell: str = "lstm", batch_size: int = 4, samples: int = 32, steps: int = 5) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(8, D, num_layers=2, batch_first=True)
        self.head = nn.Linear(D, 1)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, steps, 8, generator=generator)
        self.y = torch.randn(samples, 1, generator=generator)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _state = self.rnn(x)
        return F.mse_loss(self.head(out[:, -1]), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class FrozenWithBuffers(Base):
    """A frozen stem, a BatchNorm (running statistics) and a registered buffer."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stem = nn.Linear(D, D)
        self.stem.requires_grad_(False)
        self.norm = nn.BatchNorm1d(D)
        self.register_buffer("offset", torch.full((D,), 0.25))

    def forward(self, x, *, scale: float = 1.0):
        x = self.norm(self.stem(x)) + self.offset
        return super().forward(x, scale=scale)

    def trainable_bytes(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad) * FLOAT32


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers, the discriminator stepped before the generator."""

    def __init__(self, batch_size: int = 4, samples: int = 32) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = batch_size
        self.generator = nn.Sequential(nn.Linear(8, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        self.discriminator = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 1))
        self.real = torch.randn(samples, D, generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], 8)
        fake = self.generator(z)
        d_loss = F.softplus(self.discriminator(fake.detach())).mean() + F.softplus(-self.discriminator(real)).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = F.softplus(-self.discriminator(fake)).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        )

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.real), batch_size=self.batch_size)


class Lazy(Base):
    """An nn.LazyLinear head: its parameters exist only after the first forward."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head = nn.LazyLinear(1)


# ============================================================================================ helpers
def fit(module, tmp_path, callbacks=(), **overrides):
    trainer = make_trainer(tmp_path, callbacks=list(callbacks), **overrides)
    trainer.fit(module)
    return trainer


def train_steps(tracker: MemoryTracker, stage: str = "train") -> list[int]:
    return [r.step for r in tracker.history if r.stage == stage]


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_training(factory, tmp_path, callbacks, **overrides):
    """Training with ``callbacks`` ends with exactly the weights (and buffers) of training without them."""
    torch.manual_seed(0)
    plain = factory()
    fit(plain, tmp_path / "plain", **overrides)
    torch.manual_seed(0)
    wrapped = factory()
    fit(wrapped, tmp_path / "wrapped", callbacks, **overrides)
    expected, got = weights(plain), weights(wrapped)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"{name} differs")
    return wrapped


# ============================================================================================ MemoryTracker
@pytest.mark.parametrize(
    "factory",
    [DictBatch, Tied, FrozenWithBuffers, lambda: Recurrent("gru"), GAN, Streaming],
    ids=["dict-batch", "tied", "frozen-buffers", "gru", "manual-gan", "iterable"],
)
def test_tracker_reads_every_step_of_unusual_modules(factory, tmp_path):
    module = factory()
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)  # the accountant's peak on every step
    trainer = fit(module, tmp_path, [tracker], max_steps=3 if not isinstance(module, GAN) else 6)
    # GAN: two optimizer steps per batch, still one reading per batch (Lightning's logging step)
    assert train_steps(tracker) == [0, 1, 2]
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    for reading in tracker.history:
        assert reading.peak_tensor_bytes >= reading.tensor_bytes >= parameter_bytes
    assert tracker.summary.peak_bytes == max(r.peak_tensor_bytes for r in tracker.history)
    assert trainer.global_step == (6 if isinstance(module, GAN) else 3)


def test_tracker_accumulation_scheduler_and_clipping_one_reading_per_optimizer_step(tmp_path):
    tracker = MemoryTracker(verbose=False)
    module = assert_same_training(
        Scheduled, tmp_path, [tracker], max_steps=2, accumulate_grad_batches=3, gradient_clip_val=0.5
    )
    assert train_steps(tracker) == [0, 1]
    # the scheduler stepped once per optimizer step, memkit or not
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)
    # at each optimizer step's end: weights, their gradients and SGD's momentum buffers are live
    parameter_bytes = sum(p.numel() * 4 for p in module.parameters())
    assert all(r.tensor_bytes >= 3 * parameter_bytes for r in tracker.history)


def test_tracker_every_n_steps_without_validation_logs_only_those_steps(tmp_path):
    tracker = MemoryTracker(every_n_steps=2, log_validation=False, verbose=False, tensor_peak_every_n_steps=1)
    logger = TensorBoardLogger(str(tmp_path), name="run", version="")
    fit(
        WithValidation(),
        tmp_path,
        [tracker],
        max_steps=5,
        logger=logger,
        limit_val_batches=2,
        val_check_interval=2,
        check_val_every_n_epoch=None,
    )
    assert train_steps(tracker) == [0, 2, 4]
    assert train_steps(tracker, "validate") == []
    scalars = read_scalars(logger.log_dir)
    assert [s for s, _ in scalars["memory/train/peak_tensor_MiB"]] == [0, 2, 4]
    assert not [tag for tag in scalars if tag.startswith("memory/val/")]
    assert "val_loss" in scalars  # the user's own validation still ran
    assert os.path.isfile(os.path.join(logger.log_dir, "memkit_memory.json"))


def test_tracker_one_validation_reading_per_run_with_two_val_loaders(tmp_path):
    tracker = MemoryTracker(verbose=False)
    trainer = fit(
        TwoValLoaders(), tmp_path, [tracker], max_steps=4, limit_train_batches=2, max_epochs=2, limit_val_batches=2
    )
    assert train_steps(tracker) == [0, 1, 2, 3]  # across the epoch boundary
    # one reading per validation run (both loaders in one window), at the training step it followed
    # (where Lightning writes the user's own val metrics)
    assert train_steps(tracker, "validate") == [1, 3]
    assert {"val_loss_0", "val_loss_1"} <= set(trainer.callback_metrics)


def test_tracker_without_validation_loop_and_epoch_boundary(tmp_path):
    tracker = MemoryTracker(verbose=False)
    fit(Base(), tmp_path, [tracker], max_epochs=2, limit_train_batches=3, max_steps=-1)
    assert train_steps(tracker) == [0, 1, 2, 3, 4, 5]
    assert train_steps(tracker, "validate") == []


def test_standalone_validate_and_test_with_every_callback_attached(tmp_path):
    class Testable(WithValidation):
        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.mse_loss(self(x), y))

        def test_dataloader(self):
            return self.val_dataloader()

    module = Testable()
    tracker = MemoryTracker(verbose=False)
    callbacks = [
        tracker,
        LayerTrace(),
        ActivationCheckpointing("auto", verbose=False),
        MaxBatchSize(budget="4MiB", verbose=False),
    ]
    before = weights(module)
    trainer = make_trainer(tmp_path, callbacks=callbacks, limit_val_batches=2, limit_test_batches=2)
    validated = trainer.validate(module, verbose=False)
    tested = trainer.test(module, verbose=False)
    assert validated[0]["val_loss"] == pytest.approx(tested[0]["test_loss"])  # same data, same untouched weights
    assert train_steps(tracker, "validate") == [0]  # validate() is measured like a validation run
    assert train_steps(tracker) == []
    for name, value in weights(module).items():
        assert torch.equal(value, before[name])
    assert module.batch_size == 4  # the batch-size search is a fit-only feature


def test_two_memory_trackers_with_different_prefixes_both_read_every_step(tmp_path, rerun_in_own_process):
    # After the rest of the suite the two nested accountants' step-0 peaks differ by 3,336 B (an open defect, not
    # explained yet); the claim is checked in a fresh process.
    if rerun_in_own_process():
        return
    first = MemoryTracker(verbose=False)
    second = MemoryTracker(every_n_steps=2, prefix="mem2", verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="run", version="")
    fit(Base(), tmp_path, [first, second], max_steps=3, logger=logger)
    assert train_steps(first) == [0, 1, 2]
    assert train_steps(second) == [0, 2]
    # two accountants, nested: each counts the same tensors
    assert second.history[0].peak_tensor_bytes == first.history[0].peak_tensor_bytes
    assert [r.peak_tensor_bytes is not None for r in second.history] == [True, True]  # its first two measured steps
    scalars = read_scalars(logger.log_dir)
    assert "memory/train/peak_tensor_MiB" in scalars and "mem2/train/peak_tensor_MiB" in scalars
    # each writes its own records file; the default one (which memkit report reads) is not overwritten
    assert first.records_path != second.records_path
    assert [r.step for r in read_records(first.records_path)[1]] == [0, 1, 2]
    assert [r.step for r in read_records(second.records_path)[1]] == [0, 2]


def test_tracker_history_survives_a_resume_from_checkpoint(tmp_path):
    first = MemoryTracker(verbose=False)
    trainer = fit(Base(), tmp_path, [first], max_steps=2)
    path = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(path)
    resumed = MemoryTracker(verbose=False)
    make_trainer(tmp_path, callbacks=[resumed], max_steps=3).fit(Base(), ckpt_path=path)
    assert train_steps(resumed) == [0, 1, 2]


def test_callbacks_reused_for_a_second_run_measure_it_afresh(tmp_path):
    """Notebooks and sweeps build the callbacks once and give them to several Trainers."""
    tracker, trace = MemoryTracker(verbose=False), LayerTrace(at_steps=(1,), figure=False)
    callbacks = [tracker, trace, ActivationCheckpointing("auto", verbose=False)]
    # each run with its logger: the records file goes to the logger's directory
    fit(Base(), tmp_path / "one", callbacks, max_steps=2, logger=TensorBoardLogger(str(tmp_path / "one")))
    first_records = tracker.records_path
    fit(Base(depth=5), tmp_path / "two", callbacks, max_steps=3, logger=TensorBoardLogger(str(tmp_path / "two")))
    assert train_steps(tracker) == [0, 1, 2]  # the second run's readings only, no step twice
    assert [r.step for r in read_records(tracker.records_path)[1]] == [0, 1, 2]
    assert [r.step for r in read_records(first_records)[1]] == [0, 1]
    assert [r.step for r in trace.results] == [1, 1]  # step 1 traced in each run
    assert trace.results[1].parameter_count > trace.results[0].parameter_count


def test_two_memory_trackers_with_the_same_prefix_are_refused_at_trainer_construction(tmp_path):
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `MemoryTracker`"):
        make_trainer(tmp_path, callbacks=[MemoryTracker(), MemoryTracker(every_n_steps=10)])


# ============================================================================================ LayerTrace
def test_layer_trace_tied_weights_counted_once_and_both_calls_traced(tmp_path):
    module = Tied()
    trace = LayerTrace(at_steps=(1,), figure=False)
    fit(module, tmp_path, [trace], max_steps=2)
    (result,) = trace.results
    assert result.step == 1
    assert result.at_end["parameters"] == module.unique_parameter_bytes()
    # the unused blocks have no gradients; the shared weight has one, once
    assert result.at_end["gradients"] == sum(p.numel() * FLOAT32 for p in module.parameters() if p.grad is not None)
    assert result.at_end["gradients"] == (D * D + D + D + 1) * FLOAT32
    assert [e.call for e in result.module_events("forward", "shared")] == [0, 1]


def test_layer_trace_frozen_submodule_has_no_gradients_and_buffers_are_counted(tmp_path):
    module = FrozenWithBuffers()
    trace = LayerTrace(at_steps=(1,), figure=False)
    fit(module, tmp_path, [trace], max_steps=2)
    (result,) = trace.results
    assert result.at_end["gradients"] == module.trainable_bytes()
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    assert result.at_end["buffers"] == buffer_bytes


@pytest.mark.parametrize(
    ("factory", "overrides"),
    [
        (DictBatch, {}),
        (lambda: Recurrent("lstm"), {}),
        (GAN, {"max_steps": 4}),
        (Scheduled, {"accumulate_grad_batches": 3, "gradient_clip_val": 0.5}),
    ],
    ids=["dict-batch", "lstm", "manual-gan", "accumulate-clip"],
)
def test_layer_trace_on_unusual_steps_traces_the_whole_step(factory, overrides, tmp_path):
    module = factory()
    trace = LayerTrace(at_steps=(1,), figure=False, dirpath=tmp_path)  # no logger here: the file goes where asked
    options = {"max_steps": 2}
    options.update(overrides)
    fit(module, tmp_path, [trace], **options)
    (result,) = trace.results
    assert result.step == 1 and not result.errors
    assert os.path.isfile(trace.paths[0])
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert result.at_end["parameters"] == parameter_bytes
    assert result.peak_bytes > result.start_bytes
    backward_modules = {e.module for e in result.module_events("backward")}
    assert backward_modules, "no backward events"
    if isinstance(module, GAN):  # both optimizers' state exists at step 1
        assert result.at_end["optimizer_state"] == 2 * parameter_bytes + sum(
            4 for opt in module.trainer.optimizers for group in opt.param_groups for _ in group["params"]
        )
    if overrides.get("accumulate_grad_batches") == 3:  # the window covers the three micro-batches
        assert len(result.module_events("forward", "head")) == 3


def test_layer_trace_across_the_epoch_boundary(tmp_path):
    trace = LayerTrace(at_steps=(3,), figure=False)
    fit(Base(), tmp_path, [trace], max_epochs=2, limit_train_batches=3, max_steps=-1)
    assert [r.step for r in trace.results] == [3]


# ============================================================================================ ActivationCheckpointing
@pytest.mark.parametrize(
    ("factory", "policy", "overrides"),
    [
        (Base, "auto", {}),
        (DictBatch, "auto", {}),
        (Tied, {nn.Linear}, {}),
        (FrozenWithBuffers, "auto", {}),
        (lambda: Recurrent("lstm"), {nn.LSTM}, {}),
        (Scheduled, "auto", {"accumulate_grad_batches": 3, "gradient_clip_val": 0.5}),
        (GAN, "auto", {"max_steps": 4}),
        (TupleBlocks, "auto", {}),
        (DictStages, "auto", {}),
    ],
    ids=[
        "kwargs-blocks",
        "dict-batch",
        "tied-linear-set",
        "frozen-batchnorm",
        "lstm-set",
        "accumulate-clip",
        "manual-gan",
        "tuple-mask-dropout",
        "moduledict",
    ],
)
def test_activation_checkpointing_leaves_training_unchanged(factory, policy, overrides, tmp_path):
    callback = ActivationCheckpointing(policy, verbose=False)
    options = {"max_steps": 3}
    options.update(overrides)
    module = assert_same_training(factory, tmp_path, [callback], **options)
    assert callback.plan is not None and callback.plan.count >= 1
    if isinstance(module, DictStages):  # four blocks called from user code: the last runs plain
        assert callback.plan.names == ["stages.stage0", "stages.stage1", "stages.stage2"]
    # restored at the end of fit: the module's own forward is back
    from lightning_memkit.modes.checkpoint_wrap import is_checkpointed

    assert not any(is_checkpointed(m) for m in module.modules())


def test_activation_checkpointing_auto_without_repeated_blocks_is_a_clear_error(tmp_path):
    with pytest.raises(MisconfigurationException, match="ActivationCheckpointing"):
        fit(Recurrent("gru"), tmp_path, [ActivationCheckpointing("auto", verbose=False)], max_steps=1)


def test_activation_checkpointing_with_tracker_keeps_step_readings(tmp_path):
    tracker = MemoryTracker(verbose=False)
    callback = ActivationCheckpointing("auto", verbose=False)
    fit(DictBatch(), tmp_path, [tracker, callback], max_steps=3)
    assert train_steps(tracker) == [0, 1, 2]
    assert callback.plan.measured_activation_bytes is not None


# ============================================================================================ MaxBatchSize
@pytest.mark.parametrize(
    ("factory", "overrides"),
    [
        (DictBatch, {}),
        (Scheduled, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
        (GAN, {}),
        (Streaming, {}),
    ],
    ids=["dict-batch", "scheduler-accumulate", "manual-gan", "iterable"],
)
def test_max_batch_size_with_budget_on_unusual_modules(factory, overrides, tmp_path):
    module = factory()
    before = weights(module)
    finder = MaxBatchSize(budget="24KiB", max_val=64, steps_per_trial=2, verbose=False)
    trainer = make_trainer(tmp_path, callbacks=[finder], max_steps=1, **overrides)
    # the search alone: stop fit right after it
    finder._exit_after_search = True
    trainer.fit(module)
    result = finder.result
    assert result is not None and result.batch_size >= 1
    assert module.batch_size == result.batch_size
    fitting = [t for t in result.trials if t.fits]
    failed = [t for t in result.trials if not t.fits]
    assert failed, "the budget should bind below the dataset's length"
    assert result.batch_size < min(t.batch_size for t in failed)
    assert any(t.batch_size == result.batch_size for t in fitting)  # never a size it did not run
    assert all(t.peak_bytes <= 24 * 1024 for t in fitting)
    for name, value in weights(module).items():  # the trials' training was undone
        assert torch.equal(value, before[name]), name
    if isinstance(module, Scheduled):
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1)


def test_max_batch_size_then_training_keeps_the_scheduler_and_steps(tmp_path):
    tracker = MemoryTracker(verbose=False)
    module = Scheduled()
    finder = MaxBatchSize(budget="24KiB", max_val=64, steps_per_trial=2, verbose=False)
    trainer = fit(module, tmp_path, [finder, tracker], max_steps=2)
    assert not all(t.fits for t in finder.result.trials)  # the state was put back after an out-of-memory trial too
    assert train_steps(tracker) == [0, 1]  # the trials left no readings and no step count behind
    assert trainer.global_step == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


# ============================================================================================ estimate
LSTM_WORKSPACE = (
    "torch's meta kernel for aten.mkldnn_rnn_layer returns an empty oneDNN workspace, so the fake "
    "step misses it (75672 vs 190360 bytes measured); the estimate says so in its notes"
)


@pytest.mark.parametrize(
    "factory",
    [
        DictBatch,
        Tied,
        FrozenWithBuffers,
        pytest.param(
            lambda: Recurrent("lstm"),
            marks=pytest.mark.xfail(torch.backends.mkldnn.is_available(), reason=LSTM_WORKSPACE, strict=True),
        ),
        lambda: Recurrent("gru"),
        Scheduled,
    ],
    ids=["dict-batch", "tied", "frozen-buffers", "lstm", "gru", "scheduler"],
)
def test_estimate_matches_a_measured_step_on_unusual_modules(factory):
    module = factory()
    before = weights(module)
    estimate = estimate_memory(module, 8, device="cpu")
    measured = measure_training_step(module, 8, device="cpu")
    assert estimate.batch_size == 8
    assert estimate.peak_bytes == measured.peak_bytes
    assert estimate.by_category == measured.by_category
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert estimate.by_category["parameters"] == parameter_bytes
    for name, value in weights(module).items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize(
    "loss",
    [
        F.mse_loss,
        F.smooth_l1_loss,
        F.l1_loss,
        F.soft_margin_loss,
        lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), y.clamp(0, 1)),
        lambda out, y: F.cross_entropy(out, y.argmax(1)),
    ],
    ids=["mse", "smooth_l1", "l1", "soft_margin", "bce", "cross_entropy"],
)
def test_estimate_counts_what_real_loss_kernels_hold(loss):
    """Some real loss kernels return the 0-dim loss as a view of the unreduced (64, 500) buffer,
    which lives until the loss is freed: the fake step must hold it too."""
    model = nn.Linear(D, 500)
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, D, generator=generator), torch.rand(64, 500, generator=generator))
    options = {
        "batch": batch,
        "device": "cpu",
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
        "loss_fn": lambda module, b: loss(module(b[0]), b[1]),
    }
    assert estimate_memory(model, **options).peak_bytes == measure_training_step(model, **options).peak_bytes


def test_estimate_of_an_lstm_on_cpu_says_it_misses_the_onednn_workspace():
    estimate = estimate_memory(Recurrent("lstm"), 8, device="cpu")
    if torch.backends.mkldnn.is_available():
        assert any("oneDNN" in note and "measure_training_step" in note for note in estimate.notes)
    assert not any("oneDNN" in note for note in estimate_memory(Recurrent("gru"), 8, device="cpu").notes)


def test_cli_estimate_prints_the_estimates_notes(tmp_path, capsys):
    path = tmp_path / "rnn.py"
    path.write_text("from tests.callbacks.test_robustness import Recurrent\n")
    assert (
        main(
            ["estimate", f"{path}:Recurrent", "--device", "cpu", "--device-memory", "1GiB", "--modes", "baseline,bf16"]
        )
        == 0
    )
    out = capsys.readouterr().out
    if torch.backends.mkldnn.is_available():
        assert out.count("note: nn.LSTM on CPU runs oneDNN") == 1  # once, not once per mode


def test_estimate_manual_optimization_says_what_to_do():
    # the GAN's own training_step is estimated (tests/estimate/test_estimate_unseen.py); a loss_fn= it would ignore is
    # refused
    with pytest.raises(Exception, match="manual optimization.*loss_fn="):
        estimate_memory(GAN(), 4, device="cpu", loss_fn=lambda module, batch: module.generator(batch[0]).sum())


# ============================================================================================ compare_modes
def test_compare_two_modes_on_a_dict_batch_module_same_losses(tmp_path):
    result = compare_modes(
        DictBatch,
        None,
        ["baseline", "checkpoint"],
        max_steps=3,
        accelerator="cpu",
        root_dir=str(tmp_path / "cmp"),
        figures=False,
        verbose=False,
    )
    base, ckpt = result["baseline"], result["checkpoint"]
    assert base.status == ckpt.status == "ok", (base.error, ckpt.error)
    assert base.batch_size == ckpt.batch_size == 4
    assert ckpt.final_train_loss == pytest.approx(base.final_train_loss, rel=1e-6)
    assert len(base.step_peaks) == len(ckpt.step_peaks) == 3
    assert ckpt.checkpoint_regions >= 1
    assert os.path.isfile(result.files["csv"])


def test_compare_two_modes_on_manual_optimization(tmp_path):
    result = compare_modes(
        GAN,
        None,
        ["baseline", "checkpoint"],
        max_steps=4,
        accelerator="cpu",
        root_dir=str(tmp_path / "cmp"),
        figures=False,
        verbose=False,
    )
    for mode in ("baseline", "checkpoint"):
        assert result[mode].status == "ok", result[mode].error
        assert result[mode].peak_allocated_bytes > 0
        assert len(result[mode].step_peaks) == 2  # two optimizer steps per batch: 2 batches


# ============================================================================================ CLI
USER_FILE = """
import torch
import lightning.pytorch as pl
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from helper_data import make_records  # a sibling module, as user projects have


class Records(Dataset):
    def __init__(self, n):
        self.items = make_records(n)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, *, scale=1.0):
        return torch.relu(self.fc(x)) * scale + x


class UserModel(pl.LightningModule):
    def __init__(self, batch_size=4, depth=3):
        super().__init__()
        self.batch_size = batch_size
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(16, 1)

    def forward(self, x, *, scale=1.0):
        for block in self.blocks:
            x = block(x, scale=scale)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch["x"], scale=0.5), batch["y"])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch["x"]), batch["y"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Records(32), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(Records(8), batch_size=self.batch_size)
"""

HELPER_FILE = """
import torch


def make_records(n):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(16, generator=g), "y": torch.randn(1, generator=g), "id": f"r{i}"} for i in range(n)]
"""


LAZY_FILE = """
import torch
import lightning.pytorch as pl
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader


class Lazy(pl.LightningModule):
    def __init__(self, batch_size=4):
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        from lazy_helper import dataset  # imported only when the loader is built
        return DataLoader(dataset(32), batch_size=self.batch_size)


class NotAModule:
    pass
"""

LAZY_HELPER = """
import torch


def dataset(n):
    return torch.utils.data.TensorDataset(torch.randn(n, 16), torch.randn(n, 1))
"""


@pytest.fixture
def user_file(tmp_path):
    (tmp_path / "helper_data.py").write_text(textwrap.dedent(HELPER_FILE))
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return str(path)


def test_cli_trace_estimate_compare_on_a_user_file(user_file, tmp_path, capsys):
    assert main(["trace", f"{user_file}:UserModel", "--batch-size", "8", "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0" in out and "head" in out and "parameters" in out

    assert (
        main(
            [
                "estimate",
                f"{user_file}:UserModel",
                "--device",
                "cpu",
                "--device-memory",
                "64MiB",
                "--batch-size",
                "8",
                "--modes",
                "baseline,checkpoint",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "baseline" in out and "checkpoint" in out and "max batch" in out

    logdir = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                f"{user_file}:UserModel",
                "--modes",
                "baseline,checkpoint",
                "--steps",
                "2",
                "--accelerator",
                "cpu",
                "--logdir",
                str(logdir),
                "--no-figures",
                "--val-batches",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "baseline" in out and "checkpoint" in out
    assert os.path.isfile(logdir / "compare.json")


@pytest.mark.parametrize(
    ("verb", "extra"), [("trace", []), ("estimate", ["--device-memory", "1GiB"]), ("compare", ["--steps", "1"])]
)
def test_cli_wrong_class_name_is_a_clear_error(verb, extra, user_file, capsys):
    status = main([verb, f"{user_file}:UserModle", *extra])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert status == 2
    assert "has no 'UserModle'" in text and "UserModel" in text  # names what the file does define
    assert "Traceback" not in text


@pytest.mark.parametrize(
    ("verb", "extra"), [("trace", []), ("estimate", ["--device-memory", "1GiB"]), ("compare", ["--steps", "1"])]
)
def test_cli_missing_file_is_a_clear_error(verb, extra, tmp_path, capsys):
    status = main([verb, f"{tmp_path / 'nope.py'}:UserModel", *extra])
    captured = capsys.readouterr()
    assert status == 2
    assert "does not exist" in captured.out + captured.err


def test_cli_user_file_importing_a_sibling_lazily(tmp_path, capsys):
    (tmp_path / "lazy_helper.py").write_text(textwrap.dedent(LAZY_HELPER))
    path = tmp_path / "lazy_model.py"
    path.write_text(textwrap.dedent(LAZY_FILE))
    assert main(["trace", f"{path}:Lazy", "--batch-size", "4", "--step", "0"]) == 0
    assert "net.0" in capsys.readouterr().out
    assert main(["estimate", f"{path}:Lazy", "--device", "cpu", "--device-memory", "1GiB"]) == 0
    assert "max batch" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("verb", "extra"), [("trace", []), ("estimate", ["--device-memory", "1GiB"]), ("compare", ["--steps", "1"])]
)
def test_cli_not_a_lightning_module_is_refused_before_training(verb, extra, tmp_path, capsys):
    path = tmp_path / "lazy_model.py"
    path.write_text(textwrap.dedent(LAZY_FILE))
    argv = [verb, f"{path}:NotAModule", *extra]
    if verb == "compare":
        argv += ["--logdir", str(tmp_path / "cmp")]
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2
    assert "is not a LightningModule class" in captured.out + captured.err
    assert not (tmp_path / "cmp").exists()  # nothing trained, nothing written


def test_lazy_modules_train_measured_traced_and_checkpointed_unchanged(tmp_path):
    """A lazy module's parameters have no storage before the first forward: memkit must not break training."""
    tracker, trace = MemoryTracker(verbose=False), LayerTrace(at_steps=(0, 1), figure=False)
    module = assert_same_training(
        Lazy, tmp_path, [tracker, trace, ActivationCheckpointing("auto", verbose=False)], max_steps=2
    )
    assert train_steps(tracker) == [0, 1]
    parameter_bytes = sum(p.numel() * FLOAT32 for p in module.parameters())
    assert [r.at_end["parameters"] for r in trace.results] == [
        parameter_bytes,
        parameter_bytes,
    ]  # materialized in step 0


def test_lazy_modules_get_a_clear_error_where_a_step_must_run_first(tmp_path):
    with pytest.raises(MisconfigurationException, match="lazy modules.*run one forward"):
        fit(Lazy(), tmp_path, [MaxBatchSize(budget="1MiB", verbose=False)], max_steps=1)
    with pytest.raises(Exception, match="lazy modules.*run one forward"):
        estimate_memory(Lazy(), 8, device="cpu")
