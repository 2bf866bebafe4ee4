"""Step timing that means the same on every device: GPU time from CUDA events on CUDA, a host clock
elsewhere, with no host synchronisation per step; the spread of a run's step times, and the one rule that tells two
sets of step times apart.

On CUDA the host only *launches* work: a host clock around a step measures the launches (28.4 ms was
reported for a BERT-base step whose synchronised time on an H100 was 299 ms). :class:`StepTimer`
records a CUDA event at each end of a window on the current stream and reads ``elapsed_time`` only
once both events have completed (``Event.query()``, which never blocks), or after the run.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StepTimer", "TimeSpread", "time_spread", "within_noise", "faster_by", "TIME_SOURCES"]

#: what each ``StepTimer.source`` measures, for tables and docs.
TIME_SOURCES: dict[str, str] = {
    "cuda_events": (
        "GPU time: CUDA events recorded on the current stream at the window's ends, read after the step completed"
    ),
    "perf_counter": "wall time (time.perf_counter) from the window's start to its end",
    "process_time": "this process's CPU time (time.process_time) from the window's start to its end",
}


def _device_type(device: Any) -> str:
    if device is None:
        return "cpu"
    if isinstance(device, bool):
        raise ValueError(
            f"StepTimer({device!r}): give a device (torch.device, 'cuda:0', "
            "'cpu', an int for a CUDA device), not a bool"
        )
    if isinstance(device, int):
        return "cuda"  # as torch.device(0) is cuda:0
    if isinstance(device, str):
        return device.split(":")[0].lower()
    return getattr(device, "type", str(device))


class StepTimer:
    """Times windows (e.g. training steps): GPU time on CUDA, a host clock elsewhere.

    Usage::

        timer = StepTimer(model.device)          # CUDA events on CUDA, perf_counter on CPU
        for batch in loader:
            timer.start(); train_step(batch); timer.stop()
        print(timer.times_s())                   # seconds per window, in order

    On CUDA, ``start()``/``stop()`` record an event on ``torch.cuda.current_stream(device)`` and never
    wait for the device: a window's duration is read once its end event has completed, found with the
    non-blocking ``Event.query()`` at later ``stop()`` calls, or at :meth:`times_s` (which waits for the
    last windows, after the run). At most ``max_pending`` windows wait unread; past that the oldest is
    waited for (the host would be that many steps ahead of the device, which CUDA's launch queue
    does not allow in practice). The time is the device stream's time between the two events: the
    step's kernels and any gap in which the device waited for the host inside the window.

    Elsewhere ``clock`` (default ``time.perf_counter``, wall seconds) is read at both ends.

    Args:
        device: the device the timed work runs on (``torch.device``, ``"cuda:0"``, ``"cpu"``, ``None`` = CPU;
            an int is that CUDA device, as ``torch.device(0)`` is ``cuda:0``).
        clock: the host clock for non-CUDA devices, returning seconds.
        max_pending: CUDA windows kept unread at most (bounded memory; see above).

    Attributes:
        source: ``"cuda_events"`` or the host clock's name (``"perf_counter"``, ``"process_time"``);
            :data:`TIME_SOURCES` says what each measures.
    """

    def __init__(
        self, device: Any = None, *, clock: Callable[[], float] = time.perf_counter, max_pending: int = 64
    ) -> None:
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"StepTimer(max_pending={max_pending!r}): give a positive integer, e.g. 64")
        self.device = device
        self.clock = clock
        self.max_pending = max_pending
        self._cuda = _device_type(device) == "cuda"
        if self._cuda:
            if not torch.cuda.is_available():
                raise ValueError(
                    f"StepTimer(device={device!r}): CUDA is not available here; pass the device the work runs on"
                )
            self.source = "cuda_events"
        else:
            self.source = getattr(clock, "__name__", "clock")
        self._done: list[float] = []
        self._pending: deque[tuple[Any, Any]] = deque()
        self._started: Any = None

    # ------------------------------------------------------------------ windows
    @property
    def running(self) -> bool:
        """Whether a window is open (``start()`` called, ``stop()`` not yet)."""
        return self._started is not None

    def start(self) -> None:
        """Open a window.

        Raises:
            RuntimeError: when a window is already open.
        """
        if self._started is not None:
            raise RuntimeError("StepTimer.start(): a window is already open; call stop() first")
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._started = event
        else:
            self._started = self.clock()

    def stop(self) -> None:
        """Close the open window (its time is available once the device reached it).

        Raises:
            RuntimeError: when no window is open.
        """
        if self._started is None:
            raise RuntimeError("StepTimer.stop(): no window is open; call start() first")
        started, self._started = self._started, None
        if not self._cuda:
            self._done.append(self.clock() - started)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._pending.append((started, end))
        self.poll()
        while len(self._pending) > self.max_pending:
            self._resolve_oldest(wait=True)

    def cancel(self) -> None:
        """Drop the open window, if any (e.g. a step that raised)."""
        self._started = None

    # ------------------------------------------------------------------ reading
    @property
    def pending(self) -> int:
        """CUDA windows closed but not yet read (their end event not reached yet)."""
        return len(self._pending)

    def poll(self) -> int:
        """Read every window whose end event has completed, oldest first, without waiting; returns how many."""
        read = 0
        while self._pending and self._pending[0][1].query():
            self._resolve_oldest(wait=False)
            read += 1
        return read

    def _resolve_oldest(self, wait: bool) -> None:
        start, end = self._pending.popleft()
        if wait:
            end.synchronize()
        self._done.append(start.elapsed_time(end) / 1000.0)  # milliseconds -> seconds

    def times_s(self) -> list[float]:
        """Every closed window's duration in seconds, in order. On CUDA this waits for the windows not
        yet completed, so call it after the timed run, not inside it."""
        while self._pending:
            self._resolve_oldest(wait=True)
        return list(self._done)

    def drain(self) -> list[float]:
        """The durations read so far (seconds, in order), forgotten here: for a long run that consumes
        them as it goes. Never waits; windows still pending come in a later call."""
        self.poll()
        done, self._done = self._done, []
        return done

    def reset(self) -> None:
        """Forget every window, open, pending or read."""
        self._done.clear()
        self._pending.clear()
        self._started = None


@dataclass(frozen=True)
class TimeSpread:
    """The spread of a set of step times, in seconds.

    Attributes:
        count: how many times.
        median_s: the median.
        q1_s, q3_s: the first and third quartiles (``statistics.quantiles(..., method="inclusive")``;
            both equal the value for a single time).
        min_s, max_s: the extremes.
    """

    count: int
    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float

    @property
    def iqr_s(self) -> float:
        """Interquartile range, ``q3_s - q1_s``."""
        return self.q3_s - self.q1_s


def time_spread(times_s: Sequence[float]) -> TimeSpread | None:
    """Median, quartiles and extremes of ``times_s`` (seconds), or ``None`` for no times."""
    values = [float(t) for t in times_s]
    if not values:
        return None
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return TimeSpread(len(values), statistics.median(values), q1, q3, min(values), max(values))


def within_noise(a: TimeSpread | None, b: TimeSpread | None) -> bool | None:
    """Whether two runs' step times cannot be told apart: their interquartile ranges overlap.

    The one rule memkit applies to a time difference: when the middle halves of two sets of step times overlap, the
    difference of their medians is smaller than the step-to-step spread and is reported as noise (a mode's step
    time against the baseline's in ``memkit compare``; a plan's trials, :func:`faster_by`). ``None`` when either run
    has no times.
    """
    if a is None or b is None:
        return None
    return a.q1_s <= b.q3_s and b.q1_s <= a.q3_s


def faster_by(times_s: Sequence[float], reference_s: Sequence[float], gain: float = 0.0) -> bool | None:
    """Whether ``times_s`` are faster than ``reference_s`` by more than ``gain`` (0.05: 5%) by :func:`within_noise`'s
    rule: ``True`` when the middle half of ``times_s`` times ``1 + gain`` lies wholly below the middle half of
    ``reference_s``, ``False`` when it lies wholly above it, ``None`` when they overlap (not told apart yet) or either
    is empty.

    Paired timings (the same rounds, seconds apart, of two configurations on a machine whose speed drifts) are
    compared as their per-round ratios against ``[1.0]``: ``faster_by(ratios, [1.0], gain)``.
    """
    scaled = time_spread([t * (1 + gain) for t in times_s])
    reference = time_spread(reference_s)
    if scaled is None or reference is None or within_noise(scaled, reference):
        return None
    return scaled.q3_s < reference.q1_s
