"""The memkit dashboard: which logged memory scalars TensorBoard draws together, and how.

The layout is a custom-scalars layout (TensorBoard's "Custom Scalars" tab) built from the tag
names in :mod:`lightning_memkit.tensorboard.tags`; ``dashboard.register_dashboard`` writes it
once per run from whichever memkit callback reaches fit start first.
"""

from __future__ import annotations

import re
from typing import Any

from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX, STAGE_TAGS

__all__ = ["TRACE_TAG_PART", "dashboard_layout"]

#: the path part of LayerTrace's scalars: ``memory/trace/{peak,end}_MiB``, ``memory/trace/{peak,end}/<category>_MiB``.
TRACE_TAG_PART = "trace"

#: Multiline charts: (title, [tag regex, ...]); "{train}" is ``<prefix>/train``.
_CUDA_CHARTS = [
    ("CUDA allocator: allocated vs reserved vs step peak (MiB)",
     [r"{train}/(allocated|reserved|peak_allocated|peak_reserved)_MiB$"]),
    ("CUDA allocator: fragmentation (MiB)", [r"{train}/fragmentation_MiB$"]),
    ("CUDA allocator: retries after flushing the cache, OOMs (count)", [r"{train}/(alloc_retries|ooms)$"]),
    ("NVML device memory vs what the allocator holds (MiB)",
     [r"{train}/(device_used|process_device|reserved|device_total)_MiB$"]),
]
_TENSOR_CHARTS = [
    ("tensors: live at step end vs step peak, exact (MiB)", [r"{train}/(tensor|peak_tensor)_MiB$"]),
]
_HOST_CHARTS = [  # with the accountant: what the tensors hold against what the process holds
    ("host: tensor bytes vs step peak vs process RSS (MiB)",
     [r"{train}/(tensor|peak_tensor|host_rss|host_peak_rss)_MiB$"]),
]
_HOST_ONLY_CHARTS = [
    ("host: process RSS at step end vs step peak (MiB)", [r"{train}/(host_rss|host_peak_rss)_MiB$"]),
]
_VALIDATION_CHARTS = [
    ("validation runs: peaks (MiB)", [r"{val}/peak_[a-z_]+_MiB$"]),
]
_TRACE_CHARTS = [
    ("layer trace: categories at the traced step's peak (MiB)", [r"{trace}/peak/[a-z_]+_MiB$"]),
    ("layer trace: categories at the traced step's end (MiB)", [r"{trace}/end/[a-z_]+_MiB$"]),
    ("layer trace: traced step's peak vs end (MiB)", [r"{trace}/(peak|end)_MiB$"]),
]
_RANK_CHARTS = [
    ("per rank: step peak (MiB)", [r"{train}/rank[0-9]+/peak_(allocated|tensor)_MiB$"]),
]
_RANK_CUDA_CHARTS = [
    ("per rank: reserved (MiB)", [r"{train}/rank[0-9]+/reserved_MiB$"]),
]
_RANK_HOST_CHARTS = [
    ("per rank: host RSS (MiB)", [r"{train}/rank[0-9]+/host_rss_MiB$"]),
]
_COMPARE_CHARTS = [
    ("modes overlaid: step peak (MiB; one line per mode's run)", [r"{train}/peak_(allocated|tensor)_MiB$"]),
]
_COMPARE_CUDA_CHARTS = [
    ("modes overlaid: reserved (MiB; one line per mode's run)", [r"{train}/reserved_MiB$"]),
]
_COMPARE_HOST_CHARTS = [
    ("modes overlaid: host RSS (MiB; one line per mode's run)", [r"{train}/host_rss_MiB$"]),
]


def dashboard_layout(
    prefix: str = DEFAULT_PREFIX,
    cuda: bool = False,
    tensors: bool = True,
    host: bool = True,
    validation: bool = True,
    trace: bool = False,
    ranks: bool = False,
    compare: bool = False,
) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout as ``SummaryWriter.add_custom_scalars`` takes it.

    ``{category title: {chart title: ["Multiline", [tag regex, ...]]}}``; each regex is
    anchored (TensorBoard matches it from the tag's start), so a chart shows exactly the tags
    memkit logs under ``prefix``. Switch off the groups a run cannot have, so the dashboard
    shows no empty charts.

    Args:
        prefix: the first part of every memkit tag (MemoryTracker's ``prefix``).
        cuda: CUDA allocator and NVML charts (allocated vs reserved vs peak, fragmentation,
            allocator retries, NVML device memory vs reserved).
        tensors: the exact tensor accountant's chart (live tensor bytes vs step peak).
        host: tensor bytes vs host RSS.
        validation: the per-validation-run peaks.
        trace: LayerTrace's category breakdown at the traced step's peak and end
            (``<prefix>/trace/peak/<category>_MiB``, ``.../end/<category>_MiB``).
        ranks: per-rank charts (DDP with ``MemoryTracker(per_rank=True)``).
        compare: the ``memkit compare`` category first: each mode is a TensorBoard run under one
            root, so these charts draw one line per mode (step peak; reserved on CUDA; host RSS).
    """
    escaped = re.escape(prefix)
    parts = {
        "train": f"{escaped}/{STAGE_TAGS['train']}",
        "val": f"{escaped}/{STAGE_TAGS['validate']}",
        "trace": f"{escaped}/{TRACE_TAG_PART}",
    }

    def charts(specs: list[tuple[str, list[str]]]) -> dict[str, list[Any]]:
        return {title: ["Multiline", ["^" + regex.format(**parts) for regex in regexes]] for title, regexes in specs}

    layout: dict[str, dict[str, list[Any]]] = {}
    if compare:
        layout["memkit: modes compared"] = charts(
            _COMPARE_CHARTS + (_COMPARE_CUDA_CHARTS if cuda else []) + (_COMPARE_HOST_CHARTS if host else []))
    step_charts: list[tuple[str, list[str]]] = []
    if cuda:
        step_charts += _CUDA_CHARTS
    if tensors:
        step_charts += _TENSOR_CHARTS
    if host:
        step_charts += _HOST_CHARTS if tensors else _HOST_ONLY_CHARTS
    if validation:
        step_charts += _VALIDATION_CHARTS
    if step_charts:
        layout["memkit: memory per step"] = charts(step_charts)
    if trace:
        layout["memkit: layer trace"] = charts(_TRACE_CHARTS)
    if ranks:
        layout["memkit: per rank (DDP)"] = charts(
            _RANK_CHARTS + (_RANK_CUDA_CHARTS if cuda else []) + (_RANK_HOST_CHARTS if host else []))
    return layout
