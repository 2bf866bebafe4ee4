"""Will one training step fit? :func:`estimate_memory` predicts its memory on fake tensors, and
:func:`measure_training_step` measures the same step on a real copy, categorised the same way.

Both run the same step code (forward, zero_grad, backward, optimizer step, in Lightning's order) on a *copy* of the
module under the tensor accountant (estimate/step/runner.py), so the two numbers are comparable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.step.memory_estimate import MemoryEstimate
from lightning_memkit.estimate.step.runner import StepRequest, run

if TYPE_CHECKING:
    from lightning.pytorch import LightningDataModule, Trainer

    from lightning_memkit.estimate.cuda.gpu_target import GpuLike
    from lightning_memkit.modes.mode import ModeLike

__all__ = ["estimate_memory", "measure_training_step", "compiled_original", "COMPILED_NOTE"]


def estimate_memory(
    module: nn.Module,
    batch_size: int | None = None,
    *,
    batch: Any = None,
    mode: ModeLike = None,
    device: str | torch.device = "cuda",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    datamodule: LightningDataModule | None = None,
    trainer: Trainer | None = None,
    gpu: GpuLike = None,
) -> MemoryEstimate:
    """Predict a training step's memory without running it: fake tensors, no real memory, no GPU needed.

    Runs two full training steps (forward via ``training_step``, ``zero_grad``, backward, the
    optimizer's step, in Lightning's order) on a fake-tensor copy of ``module`` and counts every
    tensor with the accountant. ``module``, its optimizer and every RNG state are left untouched.

    Args:
        module: a LightningModule (optimizer from ``configure_optimizers``) or a plain ``nn.Module``
            (give ``optimizer=`` and, unless ``module(batch).sum()`` is the loss, ``loss_fn=``).
        batch_size: the batch size to estimate. The batch is the worst one the ``train_dataloader()`` of
            ``datamodule`` or the module can produce, re-shaped to this size (its rows repeated or cut, largest
            first); ``None`` keeps the loader's size.
        batch: an example batch instead of the data's worst batch (re-shaped if ``batch_size`` is given), or a
            :class:`~lightning_memkit.estimate.data.worst_batch.WorstBatch` from ``find_worst_batch`` (e.g. found with
            ``size_of=`` on a large dataset). Without it the batch is the worst the train dataloader can produce: its
            dataset's largest samples, collated by its own ``collate_fn`` (see ``find_worst_batch``), so the answer
            holds for every batch of the run; :attr:`MemoryEstimate.batch_note` says which batch it was.
        mode: a mode string or :class:`~lightning_memkit.modes.mode.Mode` (``"bf16"``, ``"checkpoint"``...).
        device: the target device. For ``"cuda"`` the caching-allocator view is added
            (:attr:`MemoryEstimate.cuda`); the step itself always runs on CPU fakes, so a CPU-only
            torch can estimate for a GPU.
        optimizer: ``params -> optimizer`` for plain modules, or to override ``configure_optimizers``.
        loss_fn: ``(module, batch) -> loss``; default ``training_step(batch, 0)`` for a LightningModule.
        gpu: for a CUDA target, the GPU whose kernels to model: ``"h100"``, ``"a100"``, ``"sm90"``, ``(8, 0)``...
            (default: this machine's GPU, else an H100); see :mod:`lightning_memkit.estimate.cuda.kernels`.
        datamodule: a LightningDataModule to take the sample batch from: it is prepared and set up as
            ``Trainer.fit`` does (``prepare_data()``, ``setup("fit")``) before its ``train_dataloader()`` is read.
        trainer: the (unattached) ``Trainer`` the module will be fit with: ``self.trainer`` in the copy's
            ``configure_optimizers`` / ``training_step`` answers with its ``max_steps``, ``max_epochs``,
            ``accumulate_grad_batches``, ``num_devices``... Default: the module's own trainer if it is
            attached to one, else what a default ``Trainer()`` would answer at the start of fit (see
            :class:`~lightning_memkit.estimate.step.trainer_stand_in.StandInTrainer`).

    The module may live anywhere (CPU, CUDA, the meta device): the fake copy's parameters and the
    batch are CPU fakes of the same shapes and dtypes, so nothing is read from or allocated on the
    module's device. Inside :func:`reusing_fake_copies` the fake copy and sample batch are reused.

    Returns:
        a :class:`MemoryEstimate` (bytes): the peak, its categories, and the CUDA allocator view.

    Raises:
        NoBatchError: no batch anywhere (the message says what to pass).
        EstimateError: the step cannot run on fake tensors; the message names the hook that failed
            (``configure_optimizers``, ``training_step``, the backward, the optimizer step) and the error.

    A ``torch.compile``'d module (``OptimizedModule``, as ``Trainer.fit`` takes it) is estimated as the eager
    program of the module it wraps, and every such estimate carries a note saying so.
    """
    original = compiled_original(module)
    request = StepRequest(
        original if original is not None else module,
        batch,
        batch_size,
        mode,
        device,
        optimizer,
        loss_fn,
        datamodule,
        trainer,
        gpu,
        fake=True,
    )
    estimate = run(request)
    if original is not None:
        estimate.notes.append(COMPILED_NOTE)
    return estimate


#: the note on an estimate of a ``torch.compile``'d module
COMPILED_NOTE = (
    "torch.compile: this is the eager program's figure (the module torch.compile wraps, run without "
    "compiling); the compiled program's memory differs (fused kernels, other saved tensors)"
)


def compiled_original(module: Any) -> nn.Module | None:
    """The module a ``torch.compile``'d ``module`` wraps (``OptimizedModule._orig_mod``), or ``None`` when ``module``
    is not one (torch's private class, read through estimate/_torch_compat.py)."""
    return _torch_compat.compiled_original(module)


def measure_training_step(
    module: nn.Module,
    batch_size: int | None = None,
    *,
    batch: Any = None,
    mode: ModeLike = None,
    device: str | torch.device = "cpu",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    datamodule: LightningDataModule | None = None,
    trainer: Trainer | None = None,
) -> MemoryEstimate:
    """Measure what :func:`estimate_memory` predicts: the same two steps on a real deep copy of ``module``.

    Same arguments (``batch_size`` in samples, ``batch``, ``mode``, ``device``, ``optimizer``, ``loss_fn``,
    ``datamodule``, ``trainer``) and result as :func:`estimate_memory` (``source="measured"``); it allocates real
    memory and takes real compute time. The step runs where the module's parameters are (the batch is
    moved there, as Lightning does); ``device`` only decides whether the CUDA allocator view is added.
    ``module`` and RNG states are untouched. A module on the meta device cannot be measured.
    """
    return run(
        StepRequest(module, batch, batch_size, mode, device, optimizer, loss_fn, datamodule, trainer, fake=False)
    )
