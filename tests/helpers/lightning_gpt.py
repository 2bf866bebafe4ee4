"""A small GPT written the way a Lightning user writes one: tied embeddings, blocks in an nn.ModuleList,
AdamW with a warm-up + cosine schedule sized from ``self.trainer.estimated_stepping_batches``, and a
LightningDataModule that keeps ``batch_size`` in its hparams and makes its datasets in ``setup()``.

The estimate, ``memkit estimate --datamodule`` and MaxBatchSize are tested on it (tests/estimate/test_estimate.py).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(pl.LightningModule):
    def __init__(
        self,
        vocab: int = 64,
        d_model: int = 32,
        heads: int = 2,
        layers: int = 2,
        seq_len: int = 16,
        lr: float = 3e-3,
        warmup: int = 4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        total = self.trainer.estimated_stepping_batches
        warmup = min(self.hparams.warmup, max(1, int(total) - 1))

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CharDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 8, samples: int = 256, vocab: int = 64, seq_len: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.prepared = self.set_up = 0

    def prepare_data(self) -> None:
        self.prepared += 1

    def setup(self, stage: str) -> None:
        self.set_up += 1
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(
            0, self.hparams.vocab, (self.hparams.samples, self.hparams.seq_len + 1), generator=generator
        )
        self.train_set = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)
