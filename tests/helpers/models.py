"""Models whose tensor bytes are computable by hand: a stack of Linear layers and a fine-tune of one whose frozen
weights are most of its memory."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FLOAT32 = 4  # bytes per element


class LinearStack(pl.LightningModule):
    """``Linear(d0, d1) -> ReLU -> ... -> Linear(d_{L-1}, d_L)``, loss ``out.pow(2).sum()``.

    The batch is ``(x,)`` with ``x`` of shape ``(batch_size, d0)``. Nothing is logged from
    ``training_step`` unless ``log_loss`` is set, so every live tensor is one a test can name.
    """

    def __init__(
        self,
        dims=(32, 64, 48, 16),
        batch_size: int = 8,
        optimizer: str = "sgd",
        samples: int = 64,
        log_loss: bool = False,
        val_batches: int = 0,
    ) -> None:
        super().__init__()
        self.dims = tuple(dims)
        self.batch_size = batch_size
        self.optimizer_name = optimizer
        self.log_loss = log_loss
        self.val_batches = val_batches
        layers: list[nn.Module] = []
        for index in range(len(dims) - 1):
            layers.append(nn.Linear(dims[index], dims[index + 1]))
            if index < len(dims) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randn(samples, dims[0], generator=generator)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).sum()
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).sum()
        if self.log_loss:
            self.log("val_loss", loss)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self):
        size = self.batch_size * max(self.val_batches, 1)
        return DataLoader(TensorDataset(self.data[:size]), batch_size=self.batch_size)

    # ---- sizes, by hand, in bytes (float32) --------------------------------------------
    def parameter_bytes(self) -> int:
        """Weights ``d_i * d_{i+1}`` plus biases ``d_{i+1}`` of every layer."""
        d = self.dims
        return sum(d[i] * d[i + 1] + d[i + 1] for i in range(len(d) - 1)) * FLOAT32

    def activation_bytes(self, layer: int) -> int:
        """Bytes of the output of Linear ``layer`` (0-based) for one batch: ``B * d_{layer+1}``."""
        return self.batch_size * self.dims[layer + 1] * FLOAT32


class FrozenBaseStack(LinearStack):
    """A :class:`LinearStack` whose layers but the last are frozen, trained with Adam: a fine-tune whose frozen weights
    are most of its memory (a LoRA's base), so that only true half precision (2 bytes per weight) fits a budget below
    its fp32 weights."""

    def __init__(self, dims=(64, 512, 512, 8), batch_size: int = 8, **kwargs) -> None:
        super().__init__(dims, batch_size=batch_size, optimizer="adam", **kwargs)
        for layer in list(self.net)[:-1]:
            layer.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def frozen_parameter_elements(self) -> int:
        return sum(p.numel() for p in self.parameters() if not p.requires_grad)
