"""The probe interface: reset the step's peak, run the step, read.

A probe reads one source of memory numbers and returns them as :class:`StepReading` field
values. No probe imports Lightning; a failing probe is switched off by :class:`ProbeSet`.
"""

from __future__ import annotations

import contextlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TypeVar

from lightning_memkit.errors import MemkitError

__all__ = ["MemoryProbe", "ProbeSet", "ProbeUnavailable"]


class ProbeUnavailable(MemkitError, RuntimeError):
    """Raised by a probe's constructor when its source cannot be read here (no NVML, say)."""


class MemoryProbe(ABC):
    """One source of memory readings, with a torchmetrics-like lifecycle.

    ``reset_peak()`` opens a step's peak window, the step runs, ``read()`` returns the
    values (``{StepReading field name: int}``). ``read`` must be cheap and must not
    synchronize a CUDA device.
    """

    #: short name used in warnings, e.g. ``"nvml"``.
    name: str = "probe"

    def reset_peak(self) -> None:  # noqa: B027 - optional: a probe without a peak keeps this no-op
        """Start a new peak window. Probes without peaks need not override this."""

    @abstractmethod
    def read(self) -> dict[str, int]:
        """Return the current values, in bytes or counts, keyed by StepReading field name."""

    def close(self) -> None:  # noqa: B027 - optional: a probe that holds nothing keeps this no-op
        """Release what the probe holds (NVML handle, dispatch mode)."""


ProbeT = TypeVar("ProbeT", bound=MemoryProbe)


class ProbeSet:
    """Several probes read as one; a probe that fails warns once and steps aside.

    Training must never break because of a measurement: the first exception from a probe
    is turned into a warning naming the probe and the reason, and the probe is dropped.
    """

    def __init__(self, probes: Iterable[MemoryProbe]) -> None:
        self.probes: list[MemoryProbe] = list(probes)
        self.disabled: dict[str, str] = {}

    def _guard(self, probe: MemoryProbe, action: str, call):
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - a probe must never break training: disabled, with one warning
            self._disable(probe, f"{action} failed: {type(error).__name__}: {error}")
            return None

    def _disable(self, probe: MemoryProbe, reason: str) -> None:
        if probe in self.probes:
            self.probes.remove(probe)
        self.disabled[probe.name] = reason
        warnings.warn(
            f"memkit: the {probe.name!r} memory probe is switched off for this run ({reason}); "
            "training continues without its readings.",
            RuntimeWarning,
            stacklevel=3,
        )
        with contextlib.suppress(Exception):  # the probe already failed: closing it must not fail training
            probe.close()

    def reset_peak(self) -> None:
        """Open a new peak window on every probe."""
        for probe in list(self.probes):
            self._guard(probe, "reset_peak", probe.reset_peak)

    def read(self) -> dict[str, int]:
        """Merge every probe's values into one dict."""
        values: dict[str, int] = {}
        for probe in list(self.probes):
            result = self._guard(probe, "read", probe.read)
            if result:
                values.update(result)
        return values

    def close(self) -> None:
        """Close every probe."""
        for probe in self.probes:
            with contextlib.suppress(Exception):  # a probe must never break training, closing included
                probe.close()
        self.probes = []

    def find(self, kind: type[ProbeT]) -> ProbeT | None:
        """The first active probe of class ``kind``, if any."""
        return next((p for p in self.probes if isinstance(p, kind)), None)
