"""Find a memory leak and who made it: the memory doctor, with Lightning and with plain PyTorch.

Run::

    python examples/doctor.py

1. Lightning: a LightningModule that keeps each step's output in a list (a classic leak) trains 12 steps
   with ``MemoryDoctor()``; the doctor warns once with the bytes kept per step and the line that made
   them, and prints its verdict at the end (also in ``<log dir>/memkit_doctor.json``).
2. Plain PyTorch: ``DoctorSession`` around a hand-written loop whose wide intermediate ``wide`` is last
   read by ``mean`` but stays bound to its loop variable: when step 1 makes its own ``wide``, step 0's is
   still alive, and that is the step's peak. The step-1 analysis names it (256 KiB, made by
   ``wide = expand(x)``, not read in step 1), the real fix being ``del wide`` after its last use.

The same verdict from the command line: ``memkit doctor examples/doctor.py:LeakyRegressor --steps 20``.
"""

from __future__ import annotations

import tempfile

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import DoctorSession, MemoryDoctor


class LeakyRegressor(pl.LightningModule):
    """A small MLP whose training_step keeps every output (with its graph) in ``self.history``."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 32, generator=generator)
        self.y = torch.randn(512, 16, generator=generator)
        self.history = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.encoder(x)
        self.history.append(out)  # the bug: should be out.detach().mean().item(), or nothing
        return F.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


def lightning_doctor() -> None:
    with tempfile.TemporaryDirectory() as root:
        doctor = MemoryDoctor()  # prints the verdict at the end of fit
        trainer = pl.Trainer(
            max_steps=12,
            callbacks=[doctor],
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(LeakyRegressor())
    leak = doctor.report.leak
    print(
        f"\n-> {leak.bytes_per_step} bytes kept per step; made by {leak.growing[0].op} in {leak.growing[0].module} "
        f"at {leak.growing[0].where}\n"
    )


def plain_pytorch_doctor() -> None:
    expand = nn.Linear(32, 4096).requires_grad_(False)  # frozen, wide
    body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(body.parameters(), lr=0.01)
    model = nn.ModuleDict({"expand": expand, "body": body})
    session = DoctorSession(model, [optimizer], analyse_step=1)
    for step in range(4):
        x = torch.randn(16, 32)
        session.step_start(step, x)
        wide = expand(x)  # 16 x 4096 floats = 256 KiB
        gate = torch.sigmoid(
            wide.mean(dim=1, keepdim=True)
        )  # the last use of `wide`, which stays bound until reassigned
        loss = (body(x) * gate).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        session.step_end(step)
    session.close()
    print(session.report().liveness.format())


if __name__ == "__main__":
    lightning_doctor()
    plain_pytorch_doctor()
