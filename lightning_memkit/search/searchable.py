"""What a batch-size search needs of a fit: its settings, and the checks that say what to change when it cannot run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.errors import MemkitError

__all__ = ["BatchSizeSearchError", "SearchConfig", "check_searchable"]


class BatchSizeSearchError(MemkitError, ValueError):
    """The search cannot run on this setup; the message says what to change."""


@dataclass
class SearchConfig:
    """The search's settings (see :class:`~lightning_memkit.callbacks.max_batch_size.MaxBatchSize`)."""

    margin: float = 0.05
    init_val: int | None = None
    max_val: int = 8192
    steps_per_trial: int = 3
    max_trials: int = 25
    budget: int | None = None
    batch_arg_name: str = "batch_size"
    keep_effective_batch_size: bool = False
    use_estimate: bool = True
    verbose: bool = True
    max_seconds: float | None = None
    #: the activation-checkpointing policy the trials train with (the caller finds it: the search never
    #: looks at callbacks)
    checkpoint_policy: Any = None


def _lightning_getattr(module: Any, name: str) -> Any:
    return lightning_getattr(module, name)


def _lightning_setattr(module: Any, name: str, value: Any) -> None:
    lightning_setattr(module, name, value)


def check_searchable(trainer: Any, module: Any, config: SearchConfig) -> None:
    """Raise :class:`BatchSizeSearchError` (saying what to do) when the search cannot run."""
    if not compat.fit_data_from_module(trainer):
        raise BatchSizeSearchError(
            "the batch-size search cannot resize dataloaders passed straight to trainer.fit(...): move them into "
            "the LightningModule's or a LightningDataModule's train_dataloader(), built with self.batch_size"
        )
    if not lightning_hasattr(module, config.batch_arg_name):
        raise BatchSizeSearchError(
            f"no '{config.batch_arg_name}' found on {type(module).__name__}, its hparams or the datamodule: add "
            f"self.{config.batch_arg_name} = <int> (or a hyperparameter of that name) and build train_dataloader() "
            "with it, or give batch_arg_name= the attribute you use"
        )
    # the search sets the size for each trial where Lightning's finder does: a read-only one must stop it here
    for holder, where in _batch_size_holders(module, config.batch_arg_name):
        try:
            setattr(holder, config.batch_arg_name, getattr(holder, config.batch_arg_name))
        except AttributeError as error:
            raise BatchSizeSearchError(
                f"the batch-size search sets {where}.{config.batch_arg_name} for each trial, and it cannot be set "
                f"({error}): make it a plain attribute (self.{config.batch_arg_name} = <int> in __init__) or give its "
                f"property a setter (@{config.batch_arg_name}.setter), or give "
                "batch_arg_name= an attribute that can be set"
            ) from None
    if any(torch.nn.parameter.is_lazy(p) for p in module.parameters()):
        raise BatchSizeSearchError(
            f"{type(module).__name__} has lazy modules (nn.LazyLinear, ...) whose parameters do not exist before the "
            "first forward, so a trial cannot be undone: run one forward with an example batch before trainer.fit "
            "(e.g. in __init__), or leave MaxBatchSize out"
        )


def _batch_size_holders(module: Any, name: str) -> list[tuple[Any, str]]:
    """The objects ``lightning_setattr`` sets ``name`` on (the module, the datamodule; a hparams dict is
    always settable), each with the class name a message gives it."""
    holders = [(module, type(module).__name__)] if hasattr(module, name) else []
    trainer = getattr(module, "_trainer", None)
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and hasattr(datamodule, name):
        holders.append((datamodule, type(datamodule).__name__))
    return holders
