"""The batch-size search in ``16-mixed``: a GradScaler skips the optimizer steps whose scaled gradients overflow (its
first ones, at a too large initial scale), and a skipped step allocates no optimizer state. So each trial runs until
``steps_per_trial`` steps were real (search/real_steps.RealSteps), every trial starts from the scale the fit had when
the search began (not from where the last trial's skips left it), and a size is proved with Adam's state in its peak.
The scaler is a real ``torch.amp.GradScaler("cpu")`` under Lightning's ``16-mixed`` plugin (Lightning turns a plain
``precision="16-mixed"`` on CPU into bf16, which has no scaler); its initial scale is high enough to overflow."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.callbacks.max_batch_size import find_max_batch_size

WIDTH, SAMPLES = 512, 64
INITIAL_SCALE = 2.0**24  # fp16's largest finite value is 65504: gradients of order 1 overflow down to 2**15 or so


class _Wide(pl.LightningModule):
    """One Linear whose weights (1 MiB) outweigh its activations at the sizes searched; Adam (two states per
    weight). Records the GradScaler's scale at the start of every fit loop run: each trial's and the fit's."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(WIDTH, WIDTH)
        self.batch_size = 2
        self.start_scales: list[float] = []
        self.data = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).float().pow(2).mean()

    def on_train_start(self):
        self.start_scales.append(float(self.trainer.precision_plugin.scaler.get_scale()))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=self.batch_size, drop_last=True)


@pytest.mark.timeout(300)
def test_fp16_trials_prove_a_size_with_the_optimizer_state_and_start_from_the_fits_scale(tmp_path):
    torch.manual_seed(0)
    module = _Wide()
    scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    result = find_max_batch_size(
        trainer, module, budget=64 * 2**20, init_val=2, max_val=8, use_estimate=False, verbose=False
    )
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    fitting = [trial for trial in result.trials if trial.fits]
    assert len(fitting) >= 2 and result.batch_size == 8, result.trials
    # weights, their gradients and Adam's two states: the optimizer stepped in every trial
    assert all(trial.peak_bytes >= 4 * weights for trial in fitting), [(t.batch_size, t.peak_bytes) for t in fitting]
    # every trial started from the fit's scale: no trial's skipped steps lowered the next one's
    assert module.start_scales == [INITIAL_SCALE] * len(result.trials), module.start_scales
    assert scaler.get_scale() == INITIAL_SCALE  # and the fit's scaler is put back as the search found it
