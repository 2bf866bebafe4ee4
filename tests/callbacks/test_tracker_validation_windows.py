"""Every validation run is measured, wherever Lightning starts it: inside a gradient-accumulation
window (``val_check_interval`` falling mid optimizer step), every n-th epoch, and after fit."""

from __future__ import annotations

import csv
import os

from lightning.pytorch.loggers import CSVLogger

from lightning_memkit import MemoryTracker
from tests.helpers.models import LinearStack
from tests.helpers.trainers import make_trainer

MiB = 2**20


def _csv_rows(logger):
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:
        return list(csv.DictReader(file))


def test_validation_runs_inside_an_accumulation_window_are_each_measured(tmp_path):
    """accumulate_grad_batches=4, limit_train_batches=8 over a dataset of 2 batches, val_check_interval=0.5:
    each epoch is one optimizer step (Lightning steps at the epoch's end), and validation runs after its
    first micro-batch (inside the accumulation window) and after its second; max_steps=2 makes 4 runs.
    Each has its own memory/val/* values in its val_loss row; each training step still gets one reading."""
    logger = CSVLogger(str(tmp_path), name="csv")
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)
    model = LinearStack(batch_size=4, samples=8, log_loss=True, val_batches=1)
    trainer = make_trainer(
        tmp_path,
        max_steps=2,
        accumulate_grad_batches=4,
        limit_train_batches=8,
        val_check_interval=0.5,
        limit_val_batches=1,
        logger=logger,
        callbacks=[tracker],
    )
    trainer.fit(model)
    rows = _csv_rows(logger)
    val_rows = [r for r in rows if r.get("val_loss")]
    measured = [r for r in val_rows if r.get("memory/val/tensor_MiB")]
    validate = [r for r in tracker.history if r.stage == "validate"]
    assert len(val_rows) == 4, [r["step"] for r in val_rows]
    assert len(measured) == 4 and len(validate) == 4
    assert [float(r["memory/val/tensor_MiB"]) * MiB for r in measured] == [r.tensor_bytes for r in validate]
    assert [float(r["memory/val/peak_tensor_MiB"]) * MiB for r in measured] == [r.peak_tensor_bytes for r in validate]
    assert all(r.peak_tensor_bytes >= r.tensor_bytes > 0 for r in validate)
    train = [r for r in tracker.history if r.stage == "train"]
    assert [r.step for r in train] == [0, 1]


def test_a_window_set_aside_keeps_its_peak_and_leaves_out_the_other_windows_memory():
    """MemoryMeter.set_aside / take_back (what the tracker does around a validation run inside an
    accumulation window), with tensors of known bytes in the meter's "step" scope."""
    import torch

    from lightning_memkit.meter import MemoryMeter

    meter = MemoryMeter("cpu", tensor_scope="step", nvml=False, host=False)
    try:
        meter.open(0)
        meter.resume()
        big = torch.empty(2**18, dtype=torch.float32)  # 1 MiB
        del big
        kept = torch.empty(2**14, dtype=torch.float32)  # 64 KiB, alive across the other window
        meter.set_aside()
        assert meter.has_window_aside and not meter.is_open
        meter.open(0, "validate")
        meter.resume()
        larger = torch.empty(2**20, dtype=torch.float32)  # 4 MiB, the other window's
        del larger
        other = meter.close()
        assert other.peak_tensor_bytes == 2**16 + 2**22 and other.stage == "validate"
        meter.take_back()
        meter.resume()
        after = torch.empty(2**16, dtype=torch.float32)  # 256 KiB
        reading = meter.close()
        assert reading.stage == "train" and not meter.has_window_aside
        assert reading.peak_tensor_bytes == 2**20  # the 1 MiB before set_aside (freed before `kept`), not the 4 MiB
        assert reading.tensor_bytes == 2**16 + 2**18
        del kept, after
    finally:
        meter.shutdown()


def test_every_n_epochs_and_validate_after_fit_are_measured(tmp_path):
    tracker = MemoryTracker(verbose=False)
    model = LinearStack(batch_size=8, samples=32, val_batches=1)
    trainer = make_trainer(
        tmp_path, max_epochs=4, max_steps=-1, check_val_every_n_epoch=2, limit_val_batches=1, callbacks=[tracker]
    )
    trainer.fit(model)
    validate = [r.step for r in tracker.history if r.stage == "validate"]
    assert validate == [7, 15]  # 4 steps an epoch, after epochs 2 and 4, at the step Lightning logs val_loss at
    trainer.validate(model, verbose=False)
    assert [r.step for r in tracker.history if r.stage == "validate"] == [7, 15, 16]
