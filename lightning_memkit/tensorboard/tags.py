"""The names memkit logs under: one place, so sinks, the dashboard and tests agree.

Byte fields are logged in MiB (bytes / 2**20, exact in float64) with the unit in the name:
``peak_allocated_bytes`` of a training step becomes ``memory/train/peak_allocated_MiB``.
"""

from __future__ import annotations

import re

from lightning_memkit.records import COUNT_FIELDS, MEMORY_FIELDS, RunSummary, StepReading
from lightning_memkit.units import MiB

__all__ = [
    "DEFAULT_PREFIX",
    "STAGE_TAGS",
    "metric_name",
    "step_tag",
    "step_metrics",
    "summary_metrics",
    "DASHBOARD_TAG_PART",
    "FRAME_TAG_PART",
    "is_frame_tag",
    "is_rebased_tag",
]

DEFAULT_PREFIX = "memory"
#: StepReading.stage -> the path part in the tag.
STAGE_TAGS = {"train": "train", "validate": "val"}
#: the path part of the dashboard's redrawn lines: ``<prefix>/dashboard/train/host_rss_MiB_above_1490_MiB`` is
#: ``memory/train/host_rss_MiB`` minus 1,490 MiB, the base its chart's title names (written at fit end, see
#: :func:`~lightning_memkit.tensorboard.readable.readable_layout`).
DASHBOARD_TAG_PART = "dashboard"
#: the path part of a frame line's tag: ``<prefix>/dashboard/frame/train/peak_tensor/low_4.43_MiB``.
FRAME_TAG_PART = DASHBOARD_TAG_PART + "/frame"


def is_frame_tag(tag: str) -> bool:
    """Whether ``tag`` is a frame line of the dashboard (a flat line that holds a chart's range), not a reading."""
    return f"/{FRAME_TAG_PART}/" in tag


def is_rebased_tag(tag: str) -> bool:
    """Whether ``tag`` is a line the dashboard redrew above a base (``..._KiB_above_4628.4_KiB``)."""
    return re.search(r"_above_[0-9.]+_(B|KiB|MiB|GiB)$", tag) is not None


def metric_name(field: str) -> str:
    """``peak_allocated_bytes`` -> ``peak_allocated_MiB``; count fields keep their name."""
    if field in MEMORY_FIELDS:
        return field[: -len("_bytes")] + "_MiB"
    if field in COUNT_FIELDS:
        return field
    raise KeyError(f"unknown StepReading field {field!r}")


def step_tag(field: str, stage: str = "train", prefix: str = DEFAULT_PREFIX, rank: int | None = None) -> str:
    """The full tag of one field, e.g. ``memory/train/peak_allocated_MiB``.

    With ``rank`` the per-rank tag, e.g. ``memory/train/rank1/peak_allocated_MiB``.
    """
    middle = f"{STAGE_TAGS.get(stage, stage)}/" + (f"rank{rank}/" if rank is not None else "")
    return f"{prefix}/{middle}{metric_name(field)}"


def step_metrics(reading: StepReading, prefix: str = DEFAULT_PREFIX, rank: int | None = None) -> dict[str, float]:
    """The logger metrics of a reading: MiB for bytes, plain numbers for counts."""
    metrics = {}
    for field, value in reading.values().items():
        metrics[step_tag(field, reading.stage, prefix, rank)] = value / MiB if field in MEMORY_FIELDS else float(value)
    return metrics


def summary_metrics(summary: RunSummary, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """The run summary's scalars: ``memory/summary/run_peak_MiB`` and friends."""
    metrics = {}
    if summary.peak_bytes is not None:
        metrics[f"{prefix}/summary/run_peak_MiB"] = summary.peak_bytes / MiB
        if summary.peak_step is not None:  # read with the peak
            metrics[f"{prefix}/summary/run_peak_step"] = float(summary.peak_step)
    if summary.capacity_bytes:
        metrics[f"{prefix}/summary/capacity_MiB"] = summary.capacity_bytes / MiB
    if summary.peak_fraction is not None:
        metrics[f"{prefix}/summary/run_peak_fraction"] = summary.peak_fraction
    return metrics
