"""The few private Lightning internals memkit reads, wrapped in one place and pinned by tests.

If a Lightning release renames one of them, the fallback keeps training going and
tests/test_lightning_compat.py says which one moved.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["log_dir", "logging_step", "optimizer_steps_after_batch", "fsdp_activation_checkpointing_configured"]


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


# ---------------------------------------------------------------------------- batch-size search (issue 5)
def fit_data_from_module(trainer: Any) -> bool:
    """Whether the fit's train data comes from the LightningModule or a DataModule (not loaders given to ``fit``).

    Reads ``fit_loop._data_source.is_module()``; falls back to ``True``.
    """
    try:
        return bool(trainer.fit_loop._data_source.is_module())
    except AttributeError:
        return True


def reload_train_dataloader(trainer: Any) -> None:
    """Make the fit loop build its train dataloader again (after the batch size changed).

    Sets ``fit_loop._combined_loader = None`` and calls ``fit_loop.setup_data()``, as Lightning's
    own batch-size finder does.
    """
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop.setup_data()


def train_dataset_length(trainer: Any) -> int | None:
    """The length of the fit's (first) train dataset, or ``None`` for iterable datasets or when unknown."""
    try:
        loaders = trainer.fit_loop._combined_loader.flattened
        return int(len(loaders[0].dataset))
    except (AttributeError, IndexError, TypeError):
        return None


def reset_fit_progress(trainer: Any) -> None:
    """Zero the fit loop's progress counters (epochs, batches, optimizer steps) so a trial starts at step 0."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    fit_loop.epoch_progress.reset()
    epoch_loop.batch_progress.reset()
    epoch_loop.scheduler_progress.reset()
    epoch_loop.automatic_optimization.optim_progress.reset()
    epoch_loop.manual_optimization.optim_step_progress.reset()
    epoch_loop._batches_that_stepped = 0
    fit_loop.restarting = False


def tuner_exit_exception() -> type:
    """Lightning's exception that ends ``fit`` quietly after a tuner callback (``_TunerExitException``)."""
    from lightning.pytorch.utilities.exceptions import _TunerExitException

    return _TunerExitException


def clear_logged_results(trainer: Any) -> None:
    """Forget what ``self.log`` collected in the fit loop (``fit_loop.epoch_loop._results``), so values
    logged during batch-size trials neither leak into training nor clash with its logging."""
    results = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_results", None)
    if results is not None:
        results.clear()


@contextlib.contextmanager
def no_per_step_sigterm_broadcast(trainer: Any):
    """Inside the block, skip the ``torch.distributed.broadcast`` Lightning (>= 2.5) makes every training
    batch to share SIGTERM (``epoch_loop._broadcast_sigterm_tensor``), so a rank that runs out of memory
    alone cannot leave the others waiting in it. A no-op where the method does not exist."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        yield
        return
    epoch_loop._broadcast_sigterm_tensor = lambda: None
    try:
        yield
    finally:
        del epoch_loop._broadcast_sigterm_tensor


_LOOP_FLAGS = ("_restarting", "_loaded_from_state_dict", "_resuming_from_checkpoint", "_restart_stage")


def _loops(loop: Any) -> list[Any]:
    from lightning.pytorch.loops.loop import _Loop

    found = [loop]
    for value in vars(loop).values():
        if isinstance(value, _Loop):
            found += _loops(value)
    return found


def loop_flags(loop: Any) -> list[dict[str, Any]]:
    """The restart flags of ``loop`` and every loop inside it (``loop.load_state_dict`` sets them as if
    resuming from a checkpoint; the batch-size search puts them back with :func:`set_loop_flags`)."""
    return [{name: getattr(each, name) for name in _LOOP_FLAGS if hasattr(each, name)} for each in _loops(loop)]


def set_loop_flags(loop: Any, flags: list[dict[str, Any]]) -> None:
    """Put back flags saved by :func:`loop_flags` (same loop tree)."""
    for each, saved in zip(_loops(loop), flags):
        for name, value in saved.items():
            setattr(each, name, value)


def log_dir(trainer: Any) -> str:
    """Where memkit writes its files for this run: the first logger's ``log_dir``, else the
    trainer's ``default_root_dir`` (public API; here so every callback picks the same place)."""
    for logger in trainer.loggers:
        directory = getattr(logger, "log_dir", None)
        if directory:
            return str(directory)
    return str(trainer.default_root_dir)
