"""Memory readings rebuilt from what a run logged, for a run whose ``memkit_memory.json`` is missing.

From the ``memory/`` scalars of its TensorBoard event files (float32 MiB) or a CSVLogger's ``metrics.csv`` (exact).
"""

from __future__ import annotations

import csv
import os

from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.tensorboard.tags import STAGE_TAGS, metric_name

__all__ = ["CSV_METRICS", "scalar_readings", "csv_readings", "rebuilt_summary", "same_readings"]

#: the file Lightning's CSVLogger writes its rows to
CSV_METRICS = "metrics.csv"


class _LoggedReadings:
    """Step readings put back together from memkit's logged values (``<prefix>/<stage>/<field>_MiB`` tags or
    CSV columns, MiB = bytes / 2**20)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.stage_of = {path: stage for stage, path in STAGE_TAGS.items()}
        self.field_of = {metric_name(f): f for f in StepReading.value_fields()}
        self.readings: dict[tuple[str, int], StepReading] = {}

    def field(self, name: str) -> tuple[str, str] | None:
        """The (stage, reading field) a logged name holds, or None: per-rank, summary and foreign names are
        not step readings."""
        parts = (name or "").split("/")
        if len(parts) != 3 or parts[0] != self.prefix or parts[1] not in self.stage_of or parts[2] not in self.field_of:
            return None
        return self.stage_of[parts[1]], self.field_of[parts[2]]

    def set(self, stage: str, name: str, step: int, value: float) -> None:
        reading = self.readings.setdefault((stage, step), StepReading(step=step, stage=stage, rank=-1))
        setattr(reading, name, int(round(value * 2**20 if name.endswith("_bytes") else value)))

    def history(self) -> list[StepReading]:
        """The readings, oldest first (a step's training reading before its validation one)."""
        return sorted(self.readings.values(), key=lambda r: (r.step, r.stage != "train"))


def scalar_readings(directory: str, prefix: str = "memory") -> list[StepReading]:
    """The readings in the memkit scalars of the event files in ``directory`` (float32 MiB: near, not exact)."""
    # TensorBoard's reader: a heavy import, only for a run that has no memkit_memory.json
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = _LoggedReadings(prefix)
    accumulator = EventAccumulator(directory, size_guidance={"scalars": 0})
    accumulator.Reload()
    for tag in accumulator.Tags().get("scalars", []):
        field = logged.field(tag)
        if field is not None:
            for event in accumulator.Scalars(tag):
                logged.set(*field, event.step, event.value)
    return logged.history()


def csv_readings(directory: str, prefix: str = "memory") -> list[StepReading]:
    """The readings in the memkit columns of the CSVLogger's ``metrics.csv`` in ``directory``. The values are
    bytes / 2**20 written as float64, so ``round(value * 2**20)`` is exact."""
    logged = _LoggedReadings(prefix)
    with open(os.path.join(directory, CSV_METRICS), newline="", encoding="utf-8") as file:
        for row in csv.DictReader(file):
            step = row.get("step")
            if not step:  # missing or empty
                continue
            for column, text in row.items():
                field = logged.field(column)
                if field is not None and text not in (None, ""):
                    logged.set(*field, int(float(step)), float(text))
    return logged.history()


def rebuilt_summary(history: list[StepReading], device: str) -> RunSummary:
    """The run summary folded from rebuilt readings (``RunSummary.update``, as MemoryTracker folds them)."""
    summary = RunSummary(device=device)
    for reading in history:
        summary.update(reading)
    return summary


def same_readings(history: list[StepReading], other: list[StepReading], other_exact: bool) -> bool:
    """Whether every reading of ``history`` (rebuilt from a CSV) is one of ``other``'s (the same fit seen by two
    loggers): the same step and stage, each value equal (to float32 MiB's rounding when ``other`` is not exact)."""
    theirs = {(r.step, r.stage): r for r in other}
    for reading in history:
        match = theirs.get((reading.step, reading.stage))
        if match is None:
            return False
        for name, value in reading.values().items():
            known = getattr(match, name)
            if known is None or abs(known - value) > (0 if other_exact else 1e-6 * max(abs(value), 2**20)):
                return False
    return True
