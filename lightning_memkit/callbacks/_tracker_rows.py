"""Where MemoryTracker's readings go in the loggers: into the row Lightning writes at their step, else a row of
their own when Lightning logs that step without writing one.

A reading's metrics wait (:class:`~lightning_memkit.logging_merge.LoggerMerge`) for Lightning's own
``log_metrics`` call at their step, the one that carries ``epoch``, so they land in the same row as the user's
metrics; what Lightning does not take is written apart at the next hook that flushes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_memkit.logging_merge import LoggerMerge, PendingRow
from lightning_memkit.records import StepReading
from lightning_memkit.tensorboard.tags import step_metrics

__all__ = ["ReadingRows"]


class ReadingRows:
    """The pending row of one tracker: held until Lightning's own row at its step takes it, or flushed."""

    def __init__(self) -> None:
        self._merge = LoggerMerge()

    def wrap(self, loggers: Iterable[Any]) -> None:
        """Hold rows for these loggers (a fit's set-up); nothing is pending."""
        self._merge.pending = None
        self._merge.wrap(loggers)

    def unwrap(self) -> None:
        """Give the loggers back as they were; a pending row is dropped."""
        self._merge.pending = None
        self._merge.unwrap()

    def hold(
        self, trainer: Any, logged: StepReading, ranks: Iterable[StepReading], prefix: str, every_n_steps: int
    ) -> None:
        """Hold ``logged`` (and each rank's reading, under ``per_rank``) for Lightning's own row at its step, after
        flushing the row held before."""
        metrics = step_metrics(logged, prefix)
        for rank_reading in ranks:
            metrics.update(step_metrics(rank_reading, prefix, rank=rank_reading.rank))
        # Lightning's own log_metrics call for this step (its logger connector's, which carries the
        # epoch) gets these values too, so they land in the same row as the user's metrics; if
        # Lightning writes nothing at this step, flush decides at the next hook.
        self.flush(trainer, every_n_steps)
        self._merge.pending = PendingRow(logged.step, metrics, list(trainer.loggers), logged.stage)

    def flush(self, trainer: Any, every_n_steps: int) -> None:
        """Write a reading Lightning's own logging did not take: always for a validation run or
        with ``every_n_steps > 1``; with ``every_n_steps=1`` only at Lightning's logging steps
        (``log_every_n_steps``), where it wrote nothing itself because nothing else was logged."""
        pending = self._merge.take()
        every = trainer.log_every_n_steps
        if pending is None or (
            pending.stage == "train" and every_n_steps == 1 and (not every or (pending.step + 1) % every)
        ):
            return  # Lightning does not log this step: the reading stays in history only
        row = dict(pending.metrics, epoch=trainer.current_epoch)  # an int, as in the rows Lightning writes itself
        for logger in pending.loggers:
            logger.log_metrics(row, step=pending.step)
