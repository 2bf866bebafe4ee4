"""The batch-size search: jump near the answer with a prediction, confirm with real trials, bisect only
between a size that ran and one that ran out of memory. No Lightning here: a trial is any callable.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.largest_batch import AffineGrowth
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["Trial", "SearchResult", "BatchSizeSearch", "SearchError"]


class SearchError(MemkitError, RuntimeError):
    """The search found no batch size that runs; the message says what to do."""


class TrialOutcome(str, enum.Enum):
    """How a trial ended (a ``str``: ``"fits"``, ...)."""

    #: every step ran (within the budget)
    FITS = "fits"
    #: a step ran out of memory, or over the budget
    OUT_OF_MEMORY = "out of memory"
    #: its next step would have ended past its time limit (:class:`~lightning_memkit.search.limits.TrialTooSlow`)
    TOO_SLOW = "too slow"


@dataclass
class Trial:
    """One real trial (sizes in bytes, time in seconds).

    Attributes:
        batch_size: the size tried.
        fits: ``True`` when every step of the trial ran (on every rank, under DDP).
        peak_bytes: the trial's peak (accountant bytes under a budget, ``max_memory_reserved`` on
            CUDA; the maximum over ranks), ``None`` when unknown.
        seconds: wall time of the trial.
        error: the out-of-memory message of a failed trial.
        batch_bytes: the bytes of the largest batch the trial trained on (``None`` when unknown).
        batch_shapes: that batch's tensor shapes, e.g. ``input_ids (14, 256), labels (14,)``.
        outcome: how it ended (:class:`TrialOutcome`; by default ``FITS`` when it fit, else ``OUT_OF_MEMORY``).
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None = None
    seconds: float = 0.0
    error: str | None = None
    batch_bytes: int | None = None
    batch_shapes: str = ""
    outcome: TrialOutcome | None = None

    def __post_init__(self) -> None:
        if self.outcome is None:
            self.outcome = TrialOutcome.FITS if self.fits else TrialOutcome.OUT_OF_MEMORY


@dataclass
class SearchResult:
    """What the search found.

    Attributes:
        batch_size: the largest size that ran (always one of the trials that fit).
        trials: every trial, in order.
        predicted: the estimate's prediction the search started from (``None`` without one).
        capacity_bytes: the memory the search fitted into (``None`` when unknown).
        smallest_failure: the smallest size that ran out of memory (``None`` if none did).
        reason: why the search stopped (``"converged"``, ``"max_val"``, ``"max_trials"``, ``"dataset"``, ``"time"``:
            the next trial would have run past ``max_seconds``).
        estimate_seconds: time spent estimating before the first trial.
        seconds: total wall time, estimate included.
        estimate_unavailable: why there was no prediction (the estimate's error, ``use_estimate=False``), ``None``
            with one.
        dataset_length: the train dataset's length in samples (``None`` for an iterable dataset or when unknown).
        batch_note: which batches the trials trained on: the data's worst batch at each size, or the loader's own
            batches where the data cannot be enumerated (then the answer holds for the batches drawn).
    """

    batch_size: int
    trials: list[Trial] = field(default_factory=list)
    predicted: int | None = None
    capacity_bytes: int | None = None
    smallest_failure: int | None = None
    reason: str = ""
    estimate_seconds: float = 0.0
    seconds: float = 0.0
    estimate_unavailable: str | None = None
    dataset_length: int | None = None
    batch_note: str = ""

    @property
    def trial_count(self) -> int:
        """How many real trials ran."""
        return len(self.trials)

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)

    def table(self) -> str:
        """The trials as a plain-text table."""
        predicted = (
            f"predicted {self.predicted}"
            if self.predicted is not None
            else f"the estimate was unavailable ({self.estimate_unavailable})"
            if self.estimate_unavailable
            else "no prediction"
        )
        rows = [
            # every trial has an outcome once built (__post_init__)
            (i + 1, t.batch_size, t.outcome.value if t.outcome else "", format_bytes(t.peak_bytes), f"{t.seconds:.2f}s")
            for i, t in enumerate(self.trials)
        ]
        head = (
            f"memkit batch-size search: {self.batch_size} "
            f"({self.reason}; {predicted}, {self.trial_count} trials, {self.seconds:.2f}s)"
        )
        table = format_table(("trial", "batch", "outcome", "peak", "time"), rows)
        proved = self.proved_trial()
        tail = "".join(
            f"\n{line}"
            for line in (
                self.batch_note,
                f"batch {self.batch_size}: {proved.batch_shapes}" if proved and proved.batch_shapes else "",
            )
            if line
        )
        return head + "\n" + table + tail

    def proved_trial(self) -> Trial | None:
        """The last trial that fitted at the size found (its batch is the largest this search proved), or ``None``."""
        fitted = [t for t in self.trials if t.fits and t.batch_size == self.batch_size]
        return fitted[-1] if fitted else None


class BatchSizeSearch:
    """Find the largest batch size that runs, in as few real trials as a prediction allows.

    The search keeps the largest size that ran (``lo``) and the smallest that ran out of memory
    (``hi``) and stops when ``lo >= (1 - margin) * hi`` (or ``hi == lo + 1``), or at ``max_val``.
    The next size comes from an affine memory model ``fixed + per_sample * batch``: the
    estimate's slope, re-anchored on the measured peaks of the trials that ran (two or more such
    trials give a fit of their own). Without a model it doubles, then bisects.

    Args:
        run_trial: ``batch_size -> Trial``; it must catch out-of-memory and return ``fits=False``.
        capacity_bytes: the memory the peaks are compared with (needed to use a model).
        growth: the estimate's :class:`~lightning_memkit.estimate.largest_batch.AffineGrowth`, if any.
        predicted: the estimate's predicted largest size (the first trial, a little below it).
        init_val: the first size tried (overrides ``predicted`` for the first trial).
        max_val: the largest size ever tried.
        margin: the bracket tolerance: the answer is within ``margin`` of a size that failed.
        max_trials: at most this many trials.
        on_trial: called with each :class:`Trial` as it ends (progress display).
        max_seconds: stop before a trial that, projected from the last trial's seconds per sample,
            would end past this many seconds of trials (``None``: no limit). The answer is then the
            largest size that ran, not a memory limit.
    """

    def __init__(
        self,
        run_trial: Callable[[int], Trial],
        *,
        capacity_bytes: int | None = None,
        growth: AffineGrowth | None = None,
        predicted: int | None = None,
        init_val: int | None = None,
        max_val: int = 8192,
        margin: float = 0.05,
        max_trials: int = 25,
        on_trial: Callable[[Trial], None] | None = None,
        max_seconds: float | None = None,
    ) -> None:
        if not 0 < margin < 1:
            raise ValueError(f"margin={margin!r}: give a fraction in (0, 1), e.g. 0.05")
        for name, value in (("max_val", max_val), ("max_trials", max_trials)) + (
            (("init_val", init_val),) if init_val is not None else ()
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: give a positive integer")
        if init_val is not None and init_val > max_val:
            raise ValueError(f"init_val={init_val} is larger than max_val={max_val}; give init_val <= max_val")
        self.run_trial = run_trial
        self.capacity_bytes = capacity_bytes
        self.growth = growth
        self.predicted = predicted
        self.init_val = init_val
        self.max_val = max_val
        self.margin = margin
        self.max_trials = max_trials
        self.on_trial = on_trial
        if max_seconds is not None and not max_seconds > 0:
            raise ValueError(f"max_seconds={max_seconds!r}: give a positive number of seconds, or None for no limit")
        self.max_seconds = max_seconds
        self.trials: list[Trial] = []

    # ------------------------------------------------------------------ the model
    def _model(self) -> AffineGrowth | None:
        measured = [(t.batch_size, t.peak_bytes) for t in self.trials if t.fits and t.peak_bytes]
        if len({b for b, _ in measured}) >= 2:
            return AffineGrowth.fit(measured[-2:] if len(measured) > 2 else measured)
        if measured and self.growth is not None:
            size, peak = measured[-1]
            return AffineGrowth(peak - self.growth.per_sample_bytes * size, self.growth.per_sample_bytes)
        if self.growth is not None:
            return self.growth
        if measured:  # peak/size overstates the slope, so this is on the safe side
            size, peak = measured[-1]
            return AffineGrowth(0.0, peak / size)
        return None

    def _target(self) -> int | None:
        model = self._model()
        if model is None or self.capacity_bytes is None:
            return None
        return model.largest_fitting(self.capacity_bytes)

    def _aim(self, size: float) -> int:
        """A little below a predicted maximum, so the trial is likely to fit."""
        return max(1, math.floor(size * (1 - self.margin / 4)))

    def _next(self, lo: int, hi: int | None) -> int:
        target = self._target()
        failures_in_a_row = 0
        for trial in reversed(self.trials):
            if trial.fits:
                break
            failures_in_a_row += 1
        if hi is None:
            if target is None:
                candidate = lo * 2
            elif target * (1 - self.margin / 2) <= lo:
                candidate = math.floor(lo / (1 - self.margin))  # if this fails, the bracket is closed
            else:
                candidate = self._aim(target)
        elif lo == 0:
            if target is not None and target < hi and failures_in_a_row < 2:
                candidate = self._aim(target)
            elif failures_in_a_row < 2:
                candidate = math.floor(hi * (1 - self.margin))
            else:
                candidate = hi // 2
        else:
            closing = min(hi - 1, math.floor(lo / (1 - self.margin)))
            if target is not None and lo < self._aim(target) < hi:
                candidate = self._aim(target)
                if candidate <= lo:
                    candidate = closing
            elif target is not None and target <= lo:
                candidate = closing
            else:
                candidate = (lo + hi) // 2
        upper = self.max_val if hi is None else min(hi - 1, self.max_val)
        return max(lo + 1, min(candidate, upper))

    def _out_of_time(self, size: int) -> bool:
        """Whether a trial at ``size`` would end past ``max_seconds`` (only once a size has run)."""
        ran = [t for t in self.trials if t.fits]
        if self.max_seconds is None or not ran:
            return False
        spent = sum(t.seconds for t in self.trials)
        last = ran[-1]
        return spent + last.seconds * size / last.batch_size > self.max_seconds

    # ------------------------------------------------------------------ the loop
    def run(self) -> SearchResult:
        """Run trials until the bracket closes; returns the largest size that ran.

        Raises:
            SearchError: when even batch size 1 runs out of memory, or no trial fit within ``max_trials``.
        """
        started = time.perf_counter()
        lo, hi = 0, None
        if self.init_val is not None:
            size = self.init_val
        elif self.predicted is not None:
            size = self._aim(self.predicted) if self.predicted > 1 else 1
        else:
            size = 2
        size = max(1, min(size, self.max_val))
        reason = "max_trials"
        for _ in range(self.max_trials):
            trial = self.run_trial(size)
            self.trials.append(trial)
            if self.on_trial is not None:
                self.on_trial(trial)
            if trial.fits:
                lo = max(lo, size)
            else:
                hi = size if hi is None else min(hi, size)
            if lo >= self.max_val:
                reason = "max_val"
                break
            if hi == 1:
                break
            if lo and hi is not None and (hi - lo <= 1 or lo >= (1 - self.margin) * hi):
                reason = "converged"
                break
            size = self._next(lo, hi)
            if self._out_of_time(size):
                reason = "time"
                break
        if lo == 0:
            detail = f" (a budget of {format_bytes(self.capacity_bytes)})" if self.capacity_bytes else ""
            raise SearchError(
                f"no batch size ran: the smallest tried, {min(t.batch_size for t in self.trials)}, ran out of "
                f"memory{detail}. The model itself may not fit: try a memory-saving mode (bf16, "
                "checkpoint), a smaller model, or more memory"
            )
        return SearchResult(
            lo, list(self.trials), self.predicted, self.capacity_bytes, hi, reason, 0.0, time.perf_counter() - started
        )
