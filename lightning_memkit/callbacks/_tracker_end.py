"""What MemoryTracker leaves when a fit ends: the run's summary in every logger (with the batch-size search's note
beside it) or, when the fit fails, the out-of-memory report and the words that say how the fit ended.

The records file, written either way, is the tracker's own (``MemoryTracker.save_records``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memkit._lightning_compat import log_dir, logging_step
from lightning_memkit.oom import OomMoment, write_run_oom_report
from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.tensorboard.tags import summary_metrics

__all__ = ["batch_search_note", "log_summary", "ended_by", "write_oom_report"]


def batch_search_note(trainer: Any) -> str | None:
    """The note a batch-size search (MaxBatchSize) gives for the summary: its trial peak beside the run peak, with
    what each counts; the last callback's that gives one, else ``None``."""
    found = None
    for callback in trainer.callbacks:
        note = getattr(callback, "summary_note", None)
        text = note() if callable(note) else None
        if isinstance(text, str):
            found = text
    return found


def log_summary(trainer: Any, summary: RunSummary, prefix: str) -> int:
    """Log the summary's metrics (``<prefix>/summary/...``) to every logger at the logging step, and save each
    logger; returns that step."""
    metrics = summary_metrics(summary, prefix)
    step = logging_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
    return step


def ended_by(exception: BaseException) -> str:
    """``summary.extra["ended_by"]``: the exception's type and message, at most 500 characters."""
    message = str(exception)
    text = f"{type(exception).__name__}: {message}" if message else type(exception).__name__
    return text[:500]


def write_oom_report(
    trainer: Any,
    oom_dir: str | os.PathLike | None,
    summary: RunSummary,
    history: Sequence[StepReading],
    reading: StepReading | None,
    exception: BaseException,
    snapshot: bool,
) -> str | None:
    """Write the OOM report into ``oom_dir`` (default: the first logger's log dir) and warn where it is; ``None``,
    with a warning, when it cannot be written. ``reading``: the failed step's, closed at the failure."""
    directory = oom_dir or log_dir(trainer)
    moment = OomMoment(
        step=logging_step(trainer),
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        rank=trainer.global_rank,
    )
    try:
        path = write_run_oom_report(directory, moment, summary, history, reading, exception, snapshot=snapshot)
        rank_zero_warn(f"memkit: out of memory at step {moment.step}; report written to {path}")
    except OSError as error:
        rank_zero_warn(f"memkit: out of memory, and the report could not be written to {directory}: {error}")
        return None
    return path
