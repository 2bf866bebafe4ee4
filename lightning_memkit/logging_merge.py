"""A reading's logger metrics merged into the logger's own write at the same step, so one row holds both.

Each logger's ``log_metrics`` is wrapped while a run lasts; what Lightning does not write itself is written apart.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["PendingRow", "LoggerMerge"]


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
                if pending is not None and step == pending.step and "epoch" in metrics and _logger in pending.loggers:
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
