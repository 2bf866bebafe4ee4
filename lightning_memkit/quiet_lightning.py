"""Quiet Lightning runs: a Trainer that memkit fits on its own (a plan's trial, ``memkit estimate --check``) prints
neither Lightning's per-Trainer info lines nor the warnings such short runs always raise."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

from lightning_utilities.core import rank_zero

__all__ = ["quiet_lightning"]


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's per-Trainer info lines and the trials' expected warnings (a bare iterable, few steps) are not
    shown."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
    loggers = [logging.getLogger(name) for name in names]
    # the logger Lightning's rank_zero_info writes to (whichever Lightning package was imported last named it)
    loggers.append(rank_zero.log)
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="lightning")
            warnings.filterwarnings(
                "ignore", message=".*(num_workers|log_every_n_steps|does not have many workers|val_dataloader).*"
            )
            yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)
