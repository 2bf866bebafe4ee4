"""The trainer the step's copy of a LightningModule sees: a stand-in that answers ``self.trainer`` as the Trainer (or a
default ``Trainer()``) would at the start of fit, with the optimizers and schedulers ``configure_optimizers`` gave.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memkit._lightning_compat import (
    StandInTrainer,
    attach_stand_in_trainer,
    automatic_optimizers_and_schedulers,
)

__all__ = ["is_lightning_module", "attach_trainer", "give_trainer_optimizers"]


def is_lightning_module(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule (``False`` when Lightning is not installed)."""
    try:
        from lightning.pytorch import LightningModule  # deferred: the estimate imports Lightning only when asked
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, LightningModule)


def give_trainer_optimizers(module_copy: nn.Module, returned: Any) -> None:
    """What ``self.trainer.optimizers`` and ``self.lr_schedulers()`` answer during fit: the optimizers and
    scheduler configs of what the copy's ``configure_optimizers`` returned, read by Lightning's own parser."""
    trainer = getattr(module_copy, "_trainer", None)
    if trainer is None or not hasattr(trainer, "lr_scheduler_configs"):
        return
    trainer.optimizers, trainer.lr_scheduler_configs = automatic_optimizers_and_schedulers(returned)


def attach_trainer(
    module_copy: nn.Module, trainer: Any, batches: int | None, mode: Any, datamodule: Any, target_type: str
) -> None:
    """Give the copy (never ``module``) a stand-in trainer that answers as ``trainer`` (or a default
    ``Trainer()``) would at the start of fit, so ``configure_optimizers`` may read ``self.trainer``."""
    if not is_lightning_module(module_copy):
        return
    defaults: dict[str, Any] = {}
    if batches:
        defaults["num_training_batches"] = batches
    stand_in = StandInTrainer.like(trainer, **defaults)
    if mode is not None:  # the mode being estimated is the precision the step runs in
        amp = "16-mixed" if target_type == "cuda" else "bf16-mixed"  # what "amp" resolves to on the target
        stand_in.precision = {None: "32-true", "amp": amp}.get(mode.precision, mode.precision)
    if datamodule is not None:
        stand_in.datamodule = datamodule
    # Trainer(gradient_clip_val=...) clips every step
    for setting in ("gradient_clip_val", "gradient_clip_algorithm"):
        value = getattr(trainer, setting, None)
        if value is not None:
            setattr(stand_in, setting, value)
    from lightning.pytorch.plugins.precision import Precision  # deferred: a LightningModule's copy only

    # what LightningModule.clip_gradients calls (torch's clip_grad_norm_/value_)
    stand_in.precision_plugin = Precision()
    attach_stand_in_trainer(module_copy, stand_in)
