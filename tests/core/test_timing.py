"""lightning_memkit.timing on CPU: StepTimer's windows with an injected host clock (exact), its misuse
errors, the spread and the within-noise rule. The CUDA-event path is in tests/gpu/test_cuda.py."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from lightning_memkit.timing import TIME_SOURCES, StepTimer, TimeSpread, time_spread, within_noise


class ListClock:
    """A host clock that returns the given readings in order (seconds)."""

    def __init__(self, readings):
        self.readings = list(readings)
        self.__name__ = "list_clock"

    def __call__(self) -> float:
        return self.readings.pop(0)


def test_host_clock_windows_are_the_differences_of_the_readings():
    clock = ListClock([10.0, 10.25, 11.0, 11.5, 20.0, 20.125])
    timer = StepTimer("cpu", clock=clock)
    assert timer.source == "list_clock" and not timer.running
    for _ in range(3):
        timer.start()
        assert timer.running
        timer.stop()
    assert timer.times_s() == [0.25, 0.5, 0.125]
    assert timer.pending == 0  # a host clock never waits on anything
    assert timer.drain() == [0.25, 0.5, 0.125] and timer.drain() == [] and timer.times_s() == []
    assert clock.readings == []


def test_default_source_is_perf_counter_and_none_means_cpu():
    timer = StepTimer()
    assert timer.source == "perf_counter" and timer.source in TIME_SOURCES
    assert StepTimer(torch.device("cpu"), clock=time.process_time).source == "process_time"
    timer.start()
    timer.stop()
    (elapsed,) = timer.times_s()
    assert elapsed >= 0


def test_misuse_is_a_clear_error_and_cancel_drops_the_open_window():
    timer = StepTimer(clock=ListClock([1.0, 2.0, 5.0, 5.5]))
    with pytest.raises(RuntimeError, match="no window is open"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="already open"):
        timer.start()
    timer.cancel()  # the window opened at 1.0 is dropped, not timed
    assert not timer.running
    timer.start()
    timer.stop()
    assert timer.times_s() == [3.0]
    timer.reset()
    assert timer.times_s() == [] and not timer.running
    with pytest.raises(ValueError, match="max_pending"):
        StepTimer(max_pending=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match="CUDA is not available"):
        StepTimer("cuda:0")


def test_time_spread_is_statistics_own_median_and_inclusive_quartiles():
    times = [0.31, 0.29, 0.5, 0.3, 0.28, 0.33, 0.9]
    spread = time_spread(times)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    assert spread == TimeSpread(7, statistics.median(times), q1, q3, 0.28, 0.9)
    assert spread.iqr_s == q3 - q1
    assert time_spread([0.2]) == TimeSpread(1, 0.2, 0.2, 0.2, 0.2, 0.2)
    assert time_spread([]) is None


def test_within_noise_is_an_overlap_of_the_interquartile_ranges():
    base = TimeSpread(10, 1.0, 0.9, 1.1, 0.8, 1.5)
    assert within_noise(TimeSpread(10, 1.15, 1.05, 1.3, 1.0, 1.4), base) is True  # 1.05 <= 1.1: overlap
    assert within_noise(TimeSpread(10, 1.3, 1.2, 1.4, 1.1, 1.5), base) is False  # starts above the baseline's q3
    assert within_noise(TimeSpread(10, 0.7, 0.6, 0.85, 0.5, 0.9), base) is False  # ends below the baseline's q1
    assert within_noise(TimeSpread(10, 1.0, 0.95, 1.05, 0.9, 1.1), base) is True  # inside
    assert within_noise(None, base) is None and within_noise(base, None) is None
