"""Every memkit callback together, kept after the fit: they hold records, never a tensor.

Counted with gc over the whole process (tests/helpers/live_tensors.py), not with memkit's own accountant.
"""

from __future__ import annotations

import gc

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memkit import ActivationCheckpointing, LayerTrace, MaxBatchSize, MemoryDoctor, MemoryTracker
from lightning_memkit.zoo import DemoTransformer
from tests.helpers.live_tensors import describe, live_tensor_bytes, live_tensors, tensors_with_grad_fn
from tests.helpers.trainers import make_trainer


@pytest.mark.timeout(600)
def test_every_memkit_callback_kept_after_the_fit_holds_no_tensor(tmp_path):
    def fit() -> list:
        model = DemoTransformer(d_model=32, nhead=2, layers=3, dim_feedforward=64, seq_len=16, batch_size=4)
        callbacks = [
            MemoryTracker(verbose=False),
            LayerTrace(at_steps=(1,), verbose=False),
            ActivationCheckpointing("auto", verbose=False),
            MaxBatchSize(max_val=16, budget="64MiB", verbose=False),
            MemoryDoctor(verbose=False),
        ]
        trainer = make_trainer(
            tmp_path,
            max_steps=3,
            callbacks=callbacks,
            logger=TensorBoardLogger(str(tmp_path)),
            limit_val_batches=1,
            val_check_interval=2,
        )
        trainer.fit(model)
        return callbacks

    fit()  # a first fit creates what torch and Lightning keep once per process (lazily made globals)
    gc.collect()
    before = live_tensor_bytes()

    callbacks = fit()  # model and Trainer are gone when fit() returns; the callbacks are kept
    gc.collect()
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())
    assert live_tensor_bytes() == before, describe(live_tensors())
    assert all(callback is not None for callback in callbacks)
    assert callbacks[0].history and callbacks[1].results and callbacks[3].optimal_batch_size

    del callbacks
    gc.collect()
    assert live_tensor_bytes() == before
