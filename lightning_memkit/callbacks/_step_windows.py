"""When MemoryTracker's measuring windows open and close in Lightning's loop: a training step, a validation run.

One window spans an optimizer step's micro-batches; a validation run inside it sets the training window aside.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_memkit._lightning_compat import logging_step, optimizer_steps_after_batch
from lightning_memkit.meter import MemoryMeter
from lightning_memkit.peak_steps import PeakSchedule
from lightning_memkit.records import StepReading

__all__ = ["StepWindows"]


def _gradients(pl_module: Any) -> list[torch.Tensor]:
    """The parameters' gradients: the one part of the training state that the meter's
    whole-process sweeps cannot find, for a gradient has no Python object until it is read
    (parameters, buffers, optimizer state and the batch are found by the sweeps)."""
    return [p.grad for p in pl_module.parameters() if p.grad is not None]


class StepWindows:
    """Opens, pauses and closes the meter's windows from Lightning's hooks; the caller logs what they read.

    Args:
        meter: the run's meter.
        peaks: which steps read the accountant's exact peak.
        every_n_steps: measure every n-th optimizer step.
        log_validation: measure each validation run too (never the sanity check).
    """

    def __init__(self, meter: MemoryMeter, peaks: PeakSchedule, every_n_steps: int, log_validation: bool) -> None:
        self.meter = meter
        self.peaks = peaks
        self.every_n_steps = every_n_steps
        self.log_validation = log_validation
        self.validating = False

    # ------------------------------------------------------------------ training steps
    def train_batch_start(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """A batch (or micro-batch) starts: open a measured step's window, or resume the open one."""
        meter = self.meter
        if not meter.is_open:
            step = logging_step(trainer)
            if step % self.every_n_steps:
                return
            sized = meter.tensor_probe is not None  # CUDA's peak is read every step anyway
            peak = self.peaks.open_window(step, bool(trainer.loggers), trainer.log_every_n_steps, batch, sized)
            meter.open(step, "train", trainer.global_rank, tensor_peak=peak)
        elif self.peaks.later_micro_batch(batch, meter.tensor_probe is not None):
            probe = meter.tensor_probe
            if probe is not None:  # a window opened without the peak did not sweep; this micro-batch's tensors since
                probe.sweep()
        probe = meter.tensor_probe
        if self.peaks.peaked_from_micro_batch and probe is not None:
            # the meter opened this window without the peak, so its resume() would only adopt the gradients
            probe.start(_gradients(pl_module))
        else:
            meter.resume(_gradients(pl_module))

    def train_batch_end(self, trainer: Any) -> StepReading | None:
        """A batch ends: the window pauses, and closes into its reading when the optimizer steps."""
        meter = self.meter
        if not meter.is_open:
            return None
        meter.pause()
        if not optimizer_steps_after_batch(trainer):
            return None
        self.peaks.close_window()
        return meter.close()

    # ------------------------------------------------------------------ validation runs
    def validation_start(self, trainer: Any) -> None:
        """A validation run starts: one window for the whole run, with its peak."""
        self.validating = self.log_validation and not trainer.sanity_checking
        if not self.validating:
            return
        if self.meter.is_open:
            # a validation run inside an accumulation window (val_check_interval inside an optimizer
            # step): the training window is set aside, not closed (that would log a partial step),
            # and taken back after the run, its peak without the validation's memory
            self.meter.set_aside()
        self.meter.open(logging_step(trainer), "validate", trainer.global_rank, tensor_peak=True)

    def validation_batch_start(self, pl_module: Any) -> None:
        if self.validating:
            self.meter.resume(_gradients(pl_module))

    def validation_batch_end(self) -> None:
        if self.validating:
            self.meter.pause()

    def validation_close(self) -> StepReading | None:
        """The validation run's reading (its window closes); None when the run was not measured."""
        if self.validating and self.meter.is_open:
            return self.meter.close()
        return None

    def validation_done(self) -> None:
        """After the run's reading is logged: the training window set aside for it is taken back."""
        if self.meter.has_window_aside:
            self.meter.take_back()
        self.validating = False
