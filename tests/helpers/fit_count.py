"""The tensor peak of a real Lightning fit, counted by tests/helpers/dispatch_counter.py (no code shared with memkit):
what the estimate of the same step must equal.

Usage in a test::

    from tests.helpers.fit_count import closure_bytes, fit_peak_bytes
    estimate = estimate_memory(make(), batch=batch, mode="bf16-true", device="cpu")
    expected = estimate.peak_bytes + closure_bytes(estimate.peak_phase, loss_bytes=2)
    assert fit_peak_bytes(make(), batch, "bf16-true") == expected
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils._pytree import tree_flatten

from tests.helpers.dispatch_counter import StorageCounter

__all__ = ["fit_peak_bytes", "closure_bytes"]


def closure_bytes(phase: str, loss_bytes: int) -> int:
    """What Lightning's automatic optimization holds beyond the estimate's step at a peak in ``phase``: its closure
    keeps the loss divided by ``accumulate_grad_batches`` and a detached clone of that (``ClosureResult``) from the
    end of ``training_step`` to the end of the optimizer step, where the estimate's step holds the loss itself until
    its backward ends. One loss scalar more in the backward, two in the optimizer step, none in the forward."""
    return {"forward": 0, "backward": 1, "optimizer": 2}[phase] * loss_bytes


class _SameBatch:
    """The same batch ``count`` times, as the train data: no loader makes new tensors between the steps."""

    def __init__(self, batch, count: int) -> None:
        self.batch, self.count = batch, count

    def __iter__(self):
        return iter([self.batch] * self.count)

    def __len__(self) -> int:
        return self.count


class _CountedFit(pl.Callback):
    """Counts a real fit from its start (after the precision plugin converted the module) to its end: the module's
    parameters and buffers, and the batch's tensors ``convert_input`` hands on as they are (integers; every tensor in
    ``32-true``), as they were; every storage an op makes after (the converted floating-point inputs included)."""

    def __init__(self, batch) -> None:
        self.batch = batch
        self.peak_bytes = 0

    def on_train_start(self, trainer, pl_module) -> None:
        half = str(trainer.precision) in ("bf16-true", "16-true")
        leaves = [t for t in tree_flatten(self.batch)[0] if isinstance(t, torch.Tensor)]
        kept = [t for t in leaves if not (half and t.is_floating_point())]
        self.counter = StorageCounter(existing=[*pl_module.parameters(), *pl_module.buffers(), *kept])
        self.counter.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self.counter.__exit__(None, None, None)
        self.peak_bytes = self.counter.peak_bytes


def fit_peak_bytes(module: pl.LightningModule, batch, precision: str, callbacks=(), steps: int = 2) -> int:
    """The tensor peak of ``steps`` real optimizer steps of ``Trainer(precision=precision).fit`` on ``batch``."""
    counted = _CountedFit(batch)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        precision=precision,
        callbacks=[counted, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=_SameBatch(batch, steps))
    return counted.peak_bytes
