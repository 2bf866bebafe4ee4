"""Where the callbacks write their files: the run's log directory, and only when the run logs somewhere.

One rule for MemoryTracker (``memkit_memory.json``), LayerTrace (``memkit_trace_step<N>.json``)
and MemoryDoctor (``memkit_doctor.json``): no file lands in the working directory unless asked.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.loggers.logger import DummyLogger

__all__ = ["log_dir", "logging_loggers", "run_files_dir", "file_target"]


def log_dir(trainer: Any) -> str:
    """Where memkit writes its files for this run: the first logger's ``log_dir``, else the
    trainer's ``default_root_dir`` (one rule, so every callback picks the same place)."""
    for logger in trainer.loggers:
        directory = getattr(logger, "log_dir", None)
        if directory:
            return str(directory)
    return str(trainer.default_root_dir)


def logging_loggers(trainer: Any) -> list[Any]:
    """The trainer's loggers that log somewhere: all but ``fast_dev_run``'s ``DummyLogger``."""
    return [logger for logger in trainer.loggers if not isinstance(logger, DummyLogger)]


def run_files_dir(trainer: Any) -> str | None:
    """The first logger's log dir, or ``None`` when the run logs nowhere: ``logger=False``, or
    ``fast_dev_run``, whose ``DummyLogger`` stands in for the loggers Lightning switches off (its
    ``log_dir`` would be ``default_root_dir``, the working directory by default)."""
    if not logging_loggers(trainer):
        return None
    return log_dir(trainer)


def file_target(trainer: Any, asked: str | os.PathLike | None, filename: str) -> str | None:
    """Where a callback's file goes: the path ``asked`` for, else ``filename`` in :func:`run_files_dir`, else
    ``None`` (no logger, or fast_dev_run's stand-in: nothing written into the working directory unless asked)."""
    if asked is not None:
        return os.fspath(asked)
    directory = run_files_dir(trainer)
    return None if directory is None else os.path.join(directory, filename)
