"""TensorBoard's line-chart y axis as its d3 scale draws it: the range, the ticks and their labels.

A port of d3's ``nice``, ``ticks``, ``quantile`` and ``.3~g`` and of TensorBoard's smoothing, checked without a browser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from decimal import ROUND_HALF_UP, Decimal

__all__ = ["smoothed", "tensorboard_y_range", "tensorboard_ticks", "tick_label"]

# d3's thresholds between tick steps of 1, 2, 5 and 10 times a power of ten
_E10, _E5, _E2 = math.sqrt(50), math.sqrt(10), math.sqrt(2)


def smoothed(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's line smoothing (a debiased exponential moving average; constant series unchanged)."""
    if all(v == values[0] for v in values):
        return list(values)
    out, last = [], 0.0
    for count, v in enumerate(values, start=1):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**count) if weight != 1 else last)
    return out


def _quantile(ordered: Sequence[float], p: float) -> float:
    """d3.quantile: linear interpolation between the two closest ranks."""
    i = (len(ordered) - 1) * p
    lo = math.floor(i)
    return ordered[lo] if lo + 1 >= len(ordered) else ordered[lo] + (ordered[lo + 1] - ordered[lo]) * (i - lo)


def _step_factor(step: float) -> tuple[int, int]:
    """(power of ten, factor 1, 2, 5 or 10) of d3's tick step nearest ``step``."""
    power = math.floor(math.log10(step))
    error = step / 10**power
    factor = 10 if error >= _E10 else 5 if error >= _E5 else 2 if error >= _E2 else 1
    return power, factor


def _tick_increment(start: float, stop: float, count: int) -> float:
    """d3's tickIncrement: the tick step for ``count`` ticks (1, 2 or 5 times a power of ten; negative: 1/step)."""
    step = (stop - start) / count
    if not step > 0:  # an empty domain (start == stop after rounding): d3 answers NaN and its nice() stops
        return math.nan
    power, factor = _step_factor(step)
    return factor * 10**power if power >= 0 else -(10**-power) / factor


def _nice(start: float, stop: float, count: int = 10) -> tuple[float, float]:
    """d3's linear ``scale.nice()``: the domain rounded outwards to the tick step."""
    previous = None
    given = start, stop
    for _ in range(10):
        step = _tick_increment(start, stop, count)
        if math.isnan(step):  # d3 breaks out without setting the domain: the one it was given stays
            return given
        if step == previous:
            break
        if step > 0:
            start, stop = math.floor(start / step) * step, math.ceil(stop / step) * step
        else:
            start, stop = math.ceil(start * step) / step, math.floor(stop * step) / step
        previous = step
    return start, stop


def tensorboard_y_range(values: Iterable[float], ignore_outliers: bool = True) -> tuple[float, float]:
    """The y range TensorBoard's line chart draws for these values (MiB, or whatever they are).

    As TensorBoard 2.x computes it (its ``LinearScale``): with "Ignore outliers in chart scaling"
    (ticked by default) only the values between the 5th and 95th percentile count (d3's
    interpolated quantiles), none left (e.g. two distinct values) gives ``[0, 1]``; one value v
    gives ``[0, 2v]`` (``[-1, 1]`` for 0); else the extent padded by 5 % each side and rounded
    outwards to d3's tick step. Pass the smoothed values: TensorBoard scales to the smoothed line.
    """
    ordered = sorted(v for v in values if math.isfinite(v))
    if not ordered:
        return 0.0, 1.0
    if ignore_outliers:
        low_q, high_q = _quantile(ordered, 0.05), _quantile(ordered, 0.95)
        ordered = [v for v in ordered if low_q <= v <= high_q]
        if not ordered:
            return 0.0, 1.0
    low, high = ordered[0], ordered[-1]
    if low == high:
        return (-1.0, 1.0) if low == 0 else ((2 * low, 0.0) if low < 0 else (0.0, 2 * low))
    pad = (high - low + 2.220446049250313e-16) * 0.05
    return _nice(low - pad, high + pad)


def _js_round(x: float) -> int:
    """JavaScript's ``Math.round`` (halves up, not to even)."""
    return math.floor(x + 0.5)


def tensorboard_ticks(low: float, high: float, count: int = 10) -> list[float]:
    """The y-axis ticks TensorBoard draws over ``[low, high]`` (d3's ``ticks(10)``)."""
    if not high > low:
        return [low]
    power, factor = _step_factor((high - low) / count)
    if power < 0:
        inc = 10**-power / factor
        first, last = _js_round(low * inc), _js_round(high * inc)
        first += first / inc < low
        last -= last / inc > high
        return [(first + i) / inc for i in range(last - first + 1)]
    inc = 10**power * factor
    first, last = _js_round(low / inc), _js_round(high / inc)
    first += first * inc < low
    last -= last * inc > high
    return [(first + i) * inc for i in range(last - first + 1)]


def _significant(x: float, digits: int) -> tuple[str, int]:
    """The ``digits`` significant digits of |x| and its exponent, rounded as JavaScript does (ties away from zero)."""
    exact = abs(Decimal(x))
    exponent = exact.adjusted()
    scaled = int(exact.scaleb(digits - 1 - exponent).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    if scaled >= 10**digits:
        exponent += 1
        scaled = int(exact.scaleb(digits - 1 - exponent).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    return str(scaled), exponent


def tick_label(x: float, digits: int = 3) -> str:
    """A y-axis tick label as TensorBoard writes it: d3's ``.3~g``, or ``.3~e`` from 10,000 up and below 0.01.

    ``4.4296`` -> ``4.43``, ``1494`` -> ``1.49e+3``, ``12345`` -> ``1.235e+4``, ``0.005`` -> ``5e-3``.
    """
    magnitude = abs(x)
    if magnitude < 1e-15:
        return "0"
    sign = "-" if x < 0 else ""
    exponential = magnitude >= 1e4 or magnitude < 0.01
    figures, exponent = _significant(x, digits + 1 if exponential else digits)
    if exponential or exponent < -6 or exponent >= digits:
        mantissa = figures[0] + "." + figures[1:]
    elif exponent >= 0:
        mantissa = figures[: exponent + 1] + "." + figures[exponent + 1 :]
    else:
        mantissa = "0." + "0" * (-exponent - 1) + figures
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    if exponential or exponent < -6 or exponent >= digits:
        return f"{sign}{mantissa}e{'+' if exponent >= 0 else '-'}{abs(exponent)}"
    return sign + mantissa
