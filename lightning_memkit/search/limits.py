"""What bounds each trial of a batch-size search, decided before the trial runs, and the lines it prints.

On CPU without ``budget=`` nothing stops a trial early: host memory seldom runs out before the step
time grows to minutes (a 0.8M-parameter GPT took 278 s for three steps at batch 1,298), so every
trial there is bounded before it starts:

- **memory**: the search's tensors are counted against a budget (half the host's available memory),
  and the host memory the search may reach is announced: the process's resident memory now plus
  that budget;
- **time**: each trial gets at most :data:`CPU_TRIAL_SECONDS` and all of them :data:`CPU_MAX_SECONDS`
  (``max_seconds=``). The first trial is small (at most :data:`CPU_FIRST_TRIAL_SIZE` samples, below the
  estimate's prediction when there is one) and times a step; every later size is capped so that,
  projected from the seconds per sample of the largest size that ran, it ends within half of its limit,
  and is at most :data:`CPU_GROWTH` times that size (the projection stays close to what was measured).
  A trial whose next step would end past its limit is stopped before it (only a first step can cross it) and counts
  as too slow: the search stops there, with the largest size that ran in time (or, when none did, the size whose
  steps ran too slowly: time, not memory, bounds the batch).

Each trial prints a line as it starts (size, what bounds it, the peak expected) and one as it ends
(outcome, peak, seconds): :class:`BoundedSearch`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
from lightning.pytorch import Callback

from lightning_memkit.errors import MemkitError
from lightning_memkit.search.batch_search import BatchSizeSearch, SearchError, SearchResult, Trial, TrialOutcome
from lightning_memkit.units import format_bytes

__all__ = [
    "CPU_TRIAL_SECONDS",
    "CPU_FIRST_TRIAL_SIZE",
    "CPU_GROWTH",
    "TIME_SAFETY",
    "TrialLimits",
    "TrialTooSlow",
    "BoundedSearch",
    "host_rss_bytes",
    "deadline_callback",
    "is_too_slow",
]

#: seconds one trial may run on CPU without ``budget=`` (all trials together: ``max_seconds``, 60 s by default).
CPU_TRIAL_SECONDS = 20.0
#: the largest first trial on CPU without ``budget=`` (samples): it times a step before any size is projected.
CPU_FIRST_TRIAL_SIZE = 4
#: a later trial is at most this many times the largest size that ran (samples per sample).
CPU_GROWTH = 4
#: the share of a trial's time limit its projected time may fill (a step's time per sample grows with the batch).
TIME_SAFETY = 0.5


class TrialTooSlow(MemkitError, RuntimeError):
    """A trial ran past its time limit (:attr:`TrialLimits.trial_seconds`): it is stopped after its step and counts as
    too slow."""


def host_rss_bytes() -> int:
    """This process's resident memory now (bytes)."""
    return int(psutil.Process().memory_info().rss)


@dataclass
class TrialLimits:
    """The bounds of every trial of one search, fixed before the first trial.

    Attributes:
        trial_seconds: the most one trial may run (seconds); ``None``: no per-trial limit.
        total_seconds: the most all trials together may run (seconds); ``None``: no limit.
        host_bytes: the host memory (resident set, bytes) the search is announced to stay within; ``None``: not
            announced.
        first_size: the largest first trial (samples); ``None``: as the search chooses.
        growth: a later trial is at most this many times the largest size that ran.
        safety: the share of a trial's limit its projected time may fill.
    """

    trial_seconds: float | None = None
    total_seconds: float | None = None
    host_bytes: int | None = None
    first_size: int | None = None
    growth: int = CPU_GROWTH
    safety: float = TIME_SAFETY
    #: why the last size was capped (``"time"``, ``"growth"``) or ``None``; read by the start line.
    capped_by: str | None = field(default=None, init=False)

    @classmethod
    def for_cpu(cls, budget_bytes: int, max_seconds: float) -> TrialLimits:
        """The limits of a CPU search without ``budget=``: ``budget_bytes`` counted tensors (the host memory announced
        is the resident memory now plus that), at most ``max_seconds`` of trials and :data:`CPU_TRIAL_SECONDS` each."""
        return cls(
            trial_seconds=min(CPU_TRIAL_SECONDS, max_seconds),
            total_seconds=max_seconds,
            host_bytes=host_rss_bytes() + budget_bytes,
            first_size=CPU_FIRST_TRIAL_SIZE,
        )

    def announcement(self) -> str:
        """The bounds in words, printed before the first trial."""
        parts = []
        if self.host_bytes is not None:
            parts.append(f"host memory stays under {format_bytes(self.host_bytes)} (resident now plus the budget)")
        if self.trial_seconds is not None:
            parts.append(
                f"each trial runs at most {self.trial_seconds:g}s"
                + (f" and all trials {self.total_seconds:g}s" if self.total_seconds is not None else "")
            )
        if self.first_size is not None:
            parts.append(
                f"the first trial is at most batch {self.first_size} (it times a step; later sizes are projected "
                f"from it to end within {self.safety:.0%} of their limit, at most {self.growth}x the largest that ran)"
            )
        return "; ".join(parts)

    def cap(self, trials: list[Trial]) -> int | None:
        """The largest size the next trial may have (samples), or ``None`` for no cap; sets :attr:`capped_by`."""
        ran = [t for t in trials if t.fits and t.seconds > 0]
        if not ran:
            self.capped_by = "first trial" if self.first_size is not None else None
            return self.first_size
        largest = max(ran, key=lambda t: t.batch_size)
        per_sample = max(t.seconds / t.batch_size for t in ran if t.batch_size == largest.batch_size)
        caps = {"growth": largest.batch_size * self.growth}
        if self.trial_seconds is not None:
            seconds = self.trial_seconds
            if self.total_seconds is not None:
                seconds = min(seconds, self.total_seconds - sum(t.seconds for t in trials))
            caps["time"] = max(0, math.floor(seconds * self.safety / per_sample))
        self.capped_by, size = min(caps.items(), key=lambda item: item[1])
        return size


def deadline_callback(seconds: float) -> Any:
    """A Lightning callback that keeps a trial within ``seconds``: after each step, when the next step (taking as long
    as this one) would end past the limit and the trial has steps left, it raises :class:`TrialTooSlow`, which the
    trial runner counts as a trial too slow to keep. Only a trial's first step can cross the limit (nothing is known
    before it)."""

    class _Deadline(Callback):
        def __init__(self) -> None:
            self.seconds = seconds
            self.started = time.perf_counter()
            self.step_started = self.started

        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            self.step_started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            spent, step = now - self.started, now - self.step_started
            if (
                trainer.fit_loop.epoch_loop.global_step < trainer.fit_loop.epoch_loop.max_steps
                and spent + step > self.seconds
            ):
                raise TrialTooSlow(
                    f"stopped after {spent:.1f}s: a step takes {step:.1f}s, the next would end past the "
                    f"trial's limit of {self.seconds:g}s"
                )

    return _Deadline()


class BoundedSearch(BatchSizeSearch):
    """:class:`~lightning_memkit.search.batch_search.BatchSizeSearch` whose every trial is bounded by
    :class:`TrialLimits` before it runs, and printed as it starts and as it ends.

    Args:
        limits: the bounds (``None``: only the printing).
        say: prints one line (``None``: silent).
        **kwargs: :class:`~lightning_memkit.search.batch_search.BatchSizeSearch`'s arguments.
    """

    def __init__(
        self,
        run_trial: Callable[[int], Trial],
        *,
        limits: TrialLimits | None = None,
        say: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> None:
        self.limits = limits
        self.say = say or (lambda text: None)
        #: the running trial's deadline callback (:func:`deadline_callback`), for the trial runner to install
        self.deadline: Any = None
        if limits is not None and limits.first_size is not None:
            first = kwargs.get("init_val")
            if first is None:
                predicted = kwargs.get("predicted")
                first = self._aim_of(predicted, kwargs.get("margin", 0.05)) if predicted else limits.first_size
            kwargs["init_val"] = max(1, min(first, limits.first_size, kwargs.get("max_val", 8192)))
            limits.capped_by = "first trial" if kwargs["init_val"] < first else None
        super().__init__(self._bounded(run_trial), **kwargs)
        self._ended = self.on_trial
        self.on_trial = self._end_line

    @staticmethod
    def _aim_of(predicted: int, margin: float) -> int:
        return max(1, math.floor(predicted * (1 - margin / 4)))

    def _bounded(self, run_trial: Callable[[int], Trial]) -> Callable[[int], Trial]:
        def run(size: int) -> Trial:
            self.say(self._start_line(size))
            limits = self.limits
            self.deadline = (
                deadline_callback(limits.trial_seconds)
                if limits is not None and limits.trial_seconds is not None
                else None
            )
            return run_trial(size)

        return run

    def _start_line(self, size: int) -> str:
        bounds = []
        limits = self.limits
        if limits is not None and limits.trial_seconds is not None:
            bounds.append(f"at most {limits.trial_seconds:g}s")
        model = self._model()
        expected = ""
        if model is not None:
            expected = f", expected peak {format_bytes(int(model.fixed_bytes + model.per_sample_bytes * size))}"
        capped = ""
        if limits is not None and limits.capped_by is not None:
            capped = {
                "first trial": " (small: it times a step)",
                "time": f" (capped by time: projected to end within {limits.safety:.0%} of its limit)",
                "growth": f" (capped at {limits.growth}x the largest size that ran)",
            }[limits.capped_by]
        return (
            f"memkit: trial {len(self.trials) + 1}: batch {size} starts{capped}"
            + (f", {', '.join(bounds)}" if bounds else "")
            + expected
        )

    def _end_line(self, trial: Trial) -> None:
        outcome = trial.outcome.value if trial.outcome else ""  # every trial has one once built (__post_init__)
        self.say(
            f"memkit: trial {len(self.trials)}: batch {trial.batch_size} -> {outcome}, peak "
            f"{format_bytes(trial.peak_bytes)} ({trial.seconds:.2f}s)"
        )
        if self._ended is not None:
            self._ended(trial)

    def _next(self, lo: int, hi: int | None) -> int:
        size = super()._next(lo, hi)
        cap = None if self.limits is None else self.limits.cap(self.trials)
        if cap is not None and size > cap:
            return cap
        if self.limits is not None:
            self.limits.capped_by = None
        return size

    def _out_of_time(self, size: int) -> bool:
        if self.trials and is_too_slow(self.trials[-1]):
            return True  # a smaller size would only be faster: the largest that ran in time is the answer
        ran = [t.batch_size for t in self.trials if t.fits]
        if self.limits is not None and ran and size <= max(ran):
            return True  # the limits leave no larger size to try
        return super()._out_of_time(size)

    def run(self) -> SearchResult:
        started = time.perf_counter()
        try:
            result = super().run()
        except SearchError:
            slow = [t for t in self.trials if is_too_slow(t)]
            if not slow or any(t.fits for t in self.trials):
                raise
            # Nothing finished its steps in time, but the first too-slow trial ran steps without running out of memory:
            # time, not memory, bounds the batch, and that size is the answer (its steps ran).
            first = slow[0]
            return SearchResult(
                first.batch_size,
                list(self.trials),
                self.predicted,
                self.capacity_bytes,
                None,
                "time",
                0.0,
                time.perf_counter() - started,
            )
        if any(is_too_slow(t) for t in self.trials) and result.reason in ("converged", "max_trials"):
            result.reason = "time"
        return result


def is_too_slow(trial: Trial) -> bool:
    """Whether ``trial`` was stopped by its time limit (:class:`TrialTooSlow`) rather than by memory."""
    return trial.outcome is TrialOutcome.TOO_SLOW
