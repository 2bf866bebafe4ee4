"""The estimated training step under Lightning's manual optimization: ``training_step`` runs the forward, backward and
optimizer steps itself, through a stand-in strategy that labels and attributes each phase as the automatic step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from lightning_memkit._lightning_compat import lightning_optimizers, manual_optimizers_and_schedulers
from lightning_memkit.estimate.step.hook_errors import hook
from lightning_memkit.estimate.step.lightning_step import StepLoop, labelled_optimizer_step, use_foreach
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from lightning_memkit.estimate.step.trainer_stand_in import StandInTrainer, is_lightning_module

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

__all__ = ["ManualStrategy", "run_manual_steps"]


class ManualStrategy:
    """What a LightningModule under manual optimization reaches through ``self.trainer.strategy`` in its own
    ``training_step``: ``manual_backward`` calls :meth:`backward` (Lightning's ``Strategy.backward``: the
    module's ``backward`` hook, i.e. ``loss.backward()``) and each ``self.optimizers()`` wrapper's ``step``
    calls :meth:`optimizer_step` (``optimizer.step(closure=...)``, the closure run inside the step as torch's
    optimizers do). The phases are labelled and attributed as the automatic step's are."""

    def __init__(self, acc: StepAccountant, module_copy: LightningModule) -> None:
        self.acc, self.module = acc, module_copy
        self._lightning_optimizers: list[Any] = []

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The module's ``backward`` hook on ``closure_loss``, labelled ``backward``; the new gradients attributed."""
        name = type(self.module).__name__
        with self.acc.labelled("backward"), hook(f"the backward of the loss ({name}.manual_backward)"):
            self.module.backward(closure_loss, *args, **kwargs)
        self.acc.attributor.assign_module(self.module)  # the new gradients
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """``optimizer.step(closure=closure)`` of the optimizer a ``LightningOptimizer`` wraps, labelled
        ``optimizer``."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return labelled_optimizer_step(self.acc, optimizer, closure=closure, **kwargs)


def run_manual_steps(loop: StepLoop, optimizer: Callable | None) -> None:
    """Lightning's manual optimization: ``configure_optimizers`` (or ``optimizer=``) gives the optimizers and
    schedulers, the stand-in trainer answers ``self.optimizers()`` (Lightning's ``LightningOptimizer`` wrappers
    over :class:`ManualStrategy`), ``self.lr_schedulers()`` and ``toggle_optimizer``, and ``training_step``
    runs the forward, backward and steps itself, under the precision's autocast as Lightning runs it."""
    module_copy, acc = loop.module, loop.acc
    name = type(module_copy).__name__
    if not is_lightning_module(module_copy):
        raise EstimateError(f"{name} is a plain nn.Module: manual optimization is a LightningModule's")
    with hook(f"{name}.configure_optimizers" if optimizer is None else "optimizer="):
        if optimizer is None:
            optimizers, configs = manual_optimizers_and_schedulers(module_copy.configure_optimizers())
        else:
            optimizers, configs = [optimizer(module_copy.parameters())], []
    if not optimizers:
        raise EstimateError(
            f"{name}.configure_optimizers returned no optimizer; a manually optimized module steps its own optimizers"
        )
    if loop.foreach:
        for each in optimizers:
            use_foreach(each)
    strategy = ManualStrategy(acc, module_copy)
    strategy._lightning_optimizers = lightning_optimizers(optimizers, strategy)
    trainer = cast(StandInTrainer, module_copy.trainer)  # what attach_trainer gave the copy
    trainer.optimizers, trainer.lr_scheduler_configs = optimizers, configs
    trainer.strategy = strategy  # its precision_plugin is attach_trainer's (what clip_gradients calls)
    for step in range(1, loop.steps + 1):
        acc.step = step
        with acc.labelled("forward"), loop.autocast(), hook(f"{name}.training_step"):
            module_copy.training_step(loop.batch, step - 1)
        trainer.global_step += 1
        acc.attributor.assign_optimizers(optimizers)
