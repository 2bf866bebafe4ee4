"""The trainer the step's copy of a LightningModule sees: a stand-in that answers ``self.trainer`` as the Trainer (or a
default ``Trainer()``) would at the start of fit, with the optimizers and schedulers ``configure_optimizers`` gave.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, TypeGuard

from torch import nn

from lightning_memkit._lightning_compat import attach_stand_in_trainer, automatic_optimizers_and_schedulers

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.plugins.precision import Precision

    from lightning_memkit.estimate.step.manual_step import ManualStrategy

__all__ = ["DEFAULT_MAX_EPOCHS", "StandInTrainer", "is_lightning_module", "attach_trainer", "give_trainer_optimizers"]

#: ``Trainer()``'s default epochs when neither ``max_epochs`` nor ``max_steps`` is given (Lightning's own default)
DEFAULT_MAX_EPOCHS = 1000


class StandInTrainer:
    """What ``self.trainer`` answers while memkit estimates a step without a Trainer.

    A LightningModule's ``configure_optimizers`` (and sometimes ``training_step``) reads the trainer:
    ``self.trainer.estimated_stepping_batches`` to size a warm-up + cosine schedule, ``max_steps``,
    ``max_epochs``, ``num_devices``, ``world_size``, ``precision``, ``global_step``, ``current_epoch``,
    ``log_dir`` (a path; nothing is created there), and, once the estimate has called the module's own
    ``configure_optimizers``, ``optimizers`` and ``lr_scheduler_configs`` (``self.lr_schedulers()``). The estimate
    attaches this object to its *copy* of the module, never to the user's module. Values are those a
    ``Trainer(**settings)`` would give at the start of ``fit`` (step 0, epoch 0, one device on rank 0),
    or, when the module is attached to a real Trainer, read from it. Memory does not depend on these
    values (a schedule's length changes no tensor), only on the code not failing: so where the train
    loader's length is unknown, ``num_training_batches`` is 1 (``estimated_stepping_batches`` stays a
    positive number that a ``OneCycleLR(total_steps=...)`` accepts).

    An attribute it does not have raises an ``AttributeError`` that names it and says the estimate
    runs without a Trainer.
    """

    #: what ``LightningModule.clip_gradients`` calls; :func:`attach_trainer` gives it
    precision_plugin: Precision
    #: what a manually optimized ``training_step`` steps through (``self.trainer.strategy``), given by the estimate
    strategy: ManualStrategy

    def __init__(
        self,
        *,
        max_steps: int = -1,
        max_epochs: int | None = None,
        num_training_batches: int | float = 1,
        accumulate_grad_batches: int = 1,
        num_devices: int = 1,
        num_nodes: int = 1,
        precision: str = "32-true",
        datamodule: Any = None,
        lightning_module: Any = None,
        log_dir: str | None = None,
    ) -> None:
        if max_epochs is None:
            max_epochs = DEFAULT_MAX_EPOCHS if max_steps == -1 else -1
        self.max_steps = max_steps
        self.max_epochs = max_epochs
        self.num_training_batches = num_training_batches
        self.accumulate_grad_batches = accumulate_grad_batches
        self.num_devices = num_devices
        self.num_nodes = num_nodes
        self.world_size = num_devices * num_nodes
        self.precision = precision
        self.datamodule = datamodule
        self.lightning_module = lightning_module
        self.global_step = 0
        self.current_epoch = 0
        self.global_rank = 0
        self.local_rank = 0
        self.node_rank = 0
        self.is_global_zero = True
        self.training = True
        self.sanity_checking = False
        self.fast_dev_run = False
        self.testing = self.validating = self.predicting = False
        self.logger = None
        self.loggers: list[Any] = []
        self.callbacks: list[Any] = []
        self.optimizers: list[Any] = []
        self.lr_scheduler_configs: list[Any] = []
        self.gradient_clip_val = None
        self.gradient_clip_algorithm = None
        # what Trainer() would give (its default logger's directory); a path, nothing is created there
        self.log_dir = log_dir if log_dir is not None else os.path.join(os.getcwd(), "lightning_logs", "version_0")
        self.default_root_dir = os.getcwd()
        self.limit_train_batches = 1.0
        self.val_check_interval = 1.0
        self.check_val_every_n_epoch = 1
        self.log_every_n_steps = 50

    @property
    def estimated_stepping_batches(self) -> int | float:
        """As ``Trainer.estimated_stepping_batches``: optimizer steps in the whole fit."""
        if self.max_epochs == -1:
            return float("inf") if self.max_steps == -1 else self.max_steps
        total = self.num_training_batches
        if total == float("inf"):
            return self.max_steps
        steps = math.ceil(total / self.accumulate_grad_batches) * max(self.max_epochs, 1)
        return min(steps, self.max_steps) if self.max_steps != -1 else steps

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"self.trainer.{name}: memkit estimates the step without a Trainer, and its stand-in trainer "
            f"answers only what configure_optimizers and training_step usually read (estimated_stepping_batches, "
            f"max_steps, max_epochs, num_devices, world_size, precision, global_step, current_epoch, ...); "
            f"pass loss_fn= / optimizer= to estimate_memory to avoid reading trainer.{name}"
        )

    @classmethod
    def like(cls, trainer: Any, **defaults: Any) -> StandInTrainer:
        """A stand-in with the settings of ``trainer`` (a real, possibly unattached, ``Trainer``); each
        setting it cannot read keeps its default. ``defaults`` (e.g. ``num_training_batches``) fill the rest."""
        settings = dict(defaults)
        if trainer is not None:
            for name, read in (
                ("max_steps", lambda t: t.max_steps),
                ("max_epochs", lambda t: t.max_epochs),
                ("accumulate_grad_batches", lambda t: t.accumulate_grad_batches),
                ("num_devices", lambda t: t.num_devices),
                ("num_nodes", lambda t: t.num_nodes),
                ("precision", lambda t: str(t.precision)),
                ("datamodule", lambda t: t.datamodule),
                ("log_dir", lambda t: t.log_dir),
            ):
                try:
                    value = read(trainer)
                except Exception:  # noqa: BLE001 - a property that needs a running fit keeps the default
                    continue
                if value is not None or name == "max_epochs":
                    settings[name] = value
            try:
                batches = trainer.num_training_batches
                if batches not in (None, float("inf")) and batches > 0:
                    settings["num_training_batches"] = batches
            except Exception:  # noqa: BLE001 - a loader that cannot be sized before the fit keeps the default
                pass
        return cls(**settings)


def is_lightning_module(module: nn.Module) -> TypeGuard[LightningModule]:
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
    # deferred: a LightningModule's copy only
    from lightning.pytorch.plugins.precision import HalfPrecision, Precision

    # what LightningModule.clip_gradients calls (torch's clip_grad_norm_/value_); true half precision's own plugin
    half = mode is not None and mode.true_half_dtype() is not None
    stand_in.precision_plugin = HalfPrecision(mode.precision) if half else Precision()
    attach_stand_in_trainer(module_copy, stand_in)
