"""What ``self.trainer`` holds while a step runs, answered in the estimate as during ``fit``: the optimizers and
schedulers from the module's own ``configure_optimizers``, ``global_step``, ``current_epoch``, ``log_dir``; a step
that raises is named with its file and line."""

from __future__ import annotations

import inspect
import os

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import estimate_memory, measure_training_step
from lightning_memkit.estimate import EstimateError


class ReadsTheTrainer(pl.LightningModule):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.data = TensorDataset(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
        self.seen: list[tuple] = []

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]  # the common logging line
        scheduler = self.lr_schedulers()
        self.seen.append(
            (
                lr,
                type(scheduler).__name__,
                self.trainer.global_step,
                self.trainer.current_epoch,
                os.path.basename(self.trainer.log_dir),
            )
        )
        if self.fail:
            raise ValueError("a bug in the user's step")
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-4)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}


def test_a_step_reading_the_trainers_optimizers_schedulers_and_counters_estimates_as_measured(monkeypatch):
    module = ReadsTheTrainer()
    seen = []  # the estimate steps a copy of the module: what its steps saw is recorded here
    monkeypatch.setattr(ReadsTheTrainer, "training_step", _recording(ReadsTheTrainer.training_step, seen))
    estimate = estimate_memory(module, 4, device="cpu")
    assert seen == [
        (3e-4, "StepLR", 0, 0, "version_0"),
        (3e-4, "StepLR", 1, 0, "version_0"),
    ]  # two steps, as fit counts them
    assert estimate.peak_bytes == measure_training_step(module, 4, device="cpu").peak_bytes


def _recording(step, seen):
    def training_step(self, batch, batch_idx):
        out = step(self, batch, batch_idx)
        seen.append(self.seen[-1])
        return out

    return training_step


def test_a_step_that_raises_names_the_users_file_and_line_and_the_hook():
    with pytest.raises(EstimateError) as raised:
        estimate_memory(ReadsTheTrainer(fail=True), 4, device="cpu")
    line = next(
        i
        for i, text in enumerate(inspect.getsource(ReadsTheTrainer).splitlines())
        if "a bug in the user's step" in text
    )
    first = inspect.getsourcelines(ReadsTheTrainer)[1]
    message = str(raised.value)
    assert message == (
        f"ReadsTheTrainer.training_step failed on fake tensors: ValueError: a bug in the user's step "
        f"(at {__file__}:{first + line})."
    )
