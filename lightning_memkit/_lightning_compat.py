"""The few private Lightning internals memkit reads, wrapped in one place and pinned by tests.

If a Lightning release renames one of them, the fallback keeps training going and
tests/test_lightning_compat.py says which one moved.
"""

from __future__ import annotations

from typing import Any

__all__ = ["logging_step", "optimizer_steps_after_batch", "fsdp_activation_checkpointing_configured"]


def logging_step(trainer: Any) -> int:
    """The step that Lightning's own ``self.log`` metrics are written at.

    Lightning logs at ``fit_loop.epoch_loop._batches_that_stepped`` (optimizer steps,
    counted once per batch even with several optimizers); memkit uses the same axis so memory
    lines up with the loss curve. Falls back to ``trainer.global_step``.
    """
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return int(trainer.global_step)


def optimizer_steps_after_batch(trainer: Any) -> bool:
    """Whether the batch now ending is the last of its optimizer step (no more accumulation).

    Reads ``fit_loop.epoch_loop._should_accumulate()``; falls back to ``True`` so a memory
    window never stays open across the whole epoch.
    """
    try:
        return not trainer.fit_loop.epoch_loop._should_accumulate()
    except AttributeError:
        return True


def fsdp_activation_checkpointing_configured(strategy: Any) -> bool | None:
    """``None`` when ``strategy`` is not Lightning's FSDPStrategy; else whether it was given an
    ``activation_checkpointing_policy`` (read from the private ``_activation_checkpointing_kwargs``)."""
    try:
        from lightning.pytorch.strategies import FSDPStrategy
    except ImportError:
        return None
    if not isinstance(strategy, FSDPStrategy):
        return None
    return bool(getattr(strategy, "_activation_checkpointing_kwargs", None))
