"""MemoryTracker's rows in the loggers: a reading's metrics merged into the row Lightning writes at their step, else a
row of their own when Lightning logs that step without writing one; and the run's summary row at fit end.

Each logger's ``log_metrics`` is wrapped while a run lasts (:class:`LoggerMerge`): a reading's metrics wait for
Lightning's own ``log_metrics`` call at their step, the one that carries ``epoch``, so they land in the same row as the
user's metrics; what Lightning does not take is written apart at the next hook that flushes (:class:`ReadingRows`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_memkit._lightning_compat import logging_step
from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.tensorboard.tags import step_metrics, summary_metrics

__all__ = ["PendingRow", "LoggerMerge", "ReadingRows", "log_summary"]


@dataclass
class PendingRow:
    """Metrics waiting for Lightning's own ``log_metrics`` call at their step.

    Attributes:
        step: the step the metrics belong to.
        metrics: ``{name: value}`` to add to that call.
        loggers: the loggers that have not got them yet.
        stage: the reading's stage (``"train"``, ``"validate"``).
    """

    step: int
    metrics: dict[str, float]
    loggers: list[Any]
    stage: str


class LoggerMerge:
    """Holds one :class:`PendingRow` and adds it to each wrapped logger's own call for its step (the call that
    carries ``epoch``: Lightning's logger connector's). The wrappers hold this object weakly: a logger kept
    after the run never keeps it alive."""

    def __init__(self) -> None:
        self.pending: PendingRow | None = None
        self._wrapped: list[tuple[Any, Any]] = []

    def wrap(self, loggers: Iterable[Any]) -> None:
        """Wrap each logger's ``log_metrics`` (an instance attribute over the class's method)."""
        self.unwrap()
        reference = weakref.ref(self)
        for logger in loggers:
            original = logger.log_metrics

            def log_metrics(metrics, step=None, *args, _original=original, _logger=logger, **kwargs):
                merge = reference()
                pending = merge.pending if merge is not None else None
                if (
                    merge is not None
                    and pending is not None
                    and step == pending.step
                    and "epoch" in metrics
                    and _logger in pending.loggers
                ):
                    pending.loggers.remove(_logger)
                    metrics = {**metrics, **pending.metrics}
                    if not pending.loggers:
                        merge.pending = None
                return _original(metrics, step, *args, **kwargs)

            logger.log_metrics = log_metrics
            self._wrapped.append((logger, log_metrics))

    def unwrap(self) -> None:
        """Give each logger its class's own ``log_metrics`` back (where the wrapper is still the one set)."""
        for logger, wrapper in self._wrapped:
            if vars(logger).get("log_metrics") is wrapper:
                del logger.log_metrics
        self._wrapped = []

    def take(self) -> PendingRow | None:
        """The pending row, if some logger has not got it yet; nothing is pending afterwards."""
        pending, self.pending = self.pending, None
        return pending if pending is not None and pending.loggers else None


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


def log_summary(trainer: Any, summary: RunSummary, prefix: str) -> int:
    """Log the summary's metrics (``<prefix>/summary/...``) to every logger at the logging step, and save each
    logger; returns that step."""
    metrics = summary_metrics(summary, prefix)
    step = logging_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
    return step
