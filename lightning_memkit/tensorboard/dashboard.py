"""memkit's TensorBoard extras for a Lightning run: the dashboard layout, the memory figure, the summary table.

Sinks only: everything here reads records (RunSummary, StepReading) and writes them to the
first TensorBoardLogger's ``SummaryWriter`` on global rank zero; without one it does nothing.
"""

from __future__ import annotations

import glob
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.summary_table import format_summary, format_table
from lightning_memkit.tensorboard.layout import COMPARE_CATEGORY, dashboard_layout, layout_from_tags, prune_layout
from lightning_memkit.tensorboard.readable import readable_layout
from lightning_memkit.tensorboard.tags import DASHBOARD_TAG_PART, DEFAULT_PREFIX, step_metrics
from lightning_memkit.units import format_bytes

__all__ = [
    "tensorboard_experiment",
    "register_dashboard",
    "log_memory_summary",
    "markdown_code",
    "SUMMARY_TEXT_TAG",
    "FIGURE_TAG",
    "DEVICE_TEXT_TAG",
    "device_table",
    "read_layout",
    "write_layout",
    "update_dashboards",
    "DASHBOARD_OPTIONS_ATTRIBUTE",
    "LAYER_TRACE_ATTRIBUTE",
    "read_run_scalars",
]

#: the TensorBoard text tag of the run summary table (``<prefix>/`` + this).
SUMMARY_TEXT_TAG = "summary/table"
#: the TensorBoard image tag of the memory-per-step figure (``<prefix>/`` + this).
FIGURE_TAG = "summary/memory_per_step"
#: the TensorBoard text tag of the device table: NVML capacity, use and headroom (``<prefix>/`` + this).
DEVICE_TEXT_TAG = "summary/device"


# the SummaryWriters that hold a memkit layout, so several callbacks of one run register it once;
# weak, so that a new logger on a recreated log dir (a notebook re-run) gets its layout again
_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()
# the layout each of them got, so fit end can drop the charts the run left empty
_LAYOUTS: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def tensorboard_experiment(trainer: Any) -> Any | None:
    """The ``SummaryWriter`` of the first TensorBoardLogger among ``trainer.loggers``.

    ``None`` off global rank zero or when the trainer has no TensorBoardLogger: memkit's
    TensorBoard extras (layout, figures, tables) are skipped there, silently.
    """
    if not getattr(trainer, "is_global_zero", True):
        return None
    from lightning.pytorch.loggers import TensorBoardLogger  # deferred: the core (modes) imports this module

    for logger in getattr(trainer, "loggers", []):
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


#: a callback attribute: a dict of :func:`dashboard_layout` options the callback asks for
#: (e.g. ``{"compare": True}`` on the callback ``memkit compare`` adds to each mode's Trainer).
DASHBOARD_OPTIONS_ATTRIBUTE = "memkit_dashboard_options"


def _validates(trainer: Any) -> bool:
    """Whether this fit will run validation (else the validation chart would stay empty)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden  # deferred: as TensorBoardLogger's

    module = getattr(trainer, "lightning_module", None)
    limit = getattr(trainer, "limit_val_batches", 1)
    return bool(limit) and module is not None and is_overridden("validation_step", module)


@runtime_checkable
class _StepTracker(Protocol):
    """What the per-step charts need from a callback (MemoryTracker has it). Found by these
    attributes, not by class, so this sink never imports the callbacks (a lower layer)."""

    memkit_opens_step_window: bool
    prefix: str
    tensor_accounting: Any
    host: bool
    log_validation: bool
    per_rank: bool


#: a callback attribute: ``True`` on a callback that logs layer traces (LayerTrace), so the layout gets their charts.
LAYER_TRACE_ATTRIBUTE = "memkit_layer_trace"


def _layout_for(trainer: Any, overrides: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """The layout that fits this trainer's device, world size and memkit callbacks."""
    callbacks = list(getattr(trainer, "callbacks", []))
    tracker = next((c for c in callbacks if isinstance(c, _StepTracker)), None)
    tracer = next((c for c in callbacks if getattr(c, LAYER_TRACE_ATTRIBUTE, False) is True), None)
    try:
        cuda = trainer.strategy.root_device.type == "cuda"
    except Exception:  # noqa: BLE001 - a strategy not set up yet may raise anything: no CUDA panels
        cuda = False
    options: dict[str, Any] = {
        "cuda": False,
        "tensors": False,
        "host": False,
        "validation": False,
        "ranks": False,
        "trace": tracer is not None,
        "prefix": getattr(tracer, "prefix", DEFAULT_PREFIX),
    }
    if tracker is not None:  # the per-step charts need MemoryTracker's scalars
        accountant = tracker.tensor_accounting
        world_size = getattr(trainer, "world_size", 1)
        options.update(
            prefix=tracker.prefix,
            cuda=cuda,
            tensors=accountant is True or (accountant == "auto" and not cuda),
            host=tracker.host,
            validation=tracker.log_validation and _validates(trainer),
            # the world size: with more than three ranks the per-rank charts split into groups of ranks
            ranks=world_size if tracker.per_rank and world_size > 1 else False,
        )
    for callback in callbacks:
        asked = getattr(callback, DASHBOARD_OPTIONS_ATTRIBUTE, None)
        if isinstance(asked, dict):
            options.update(asked)
    options.update(overrides)
    return dashboard_layout(**options)


def register_dashboard(trainer: Any, **layout_options: Any) -> bool:
    """Write memkit's custom-scalars layout into the run's TensorBoard log, once per run.

    Call it from any memkit callback's ``on_fit_start``; the first call writes the layout that
    fits the trainer (its device, world size and memkit callbacks), later calls for the same
    TensorBoard writer (the same run) do nothing. Only on global rank zero and only when a TensorBoardLogger is among
    ``trainer.loggers``; otherwise it does nothing.

    What the layout holds is read from the trainer: per-step charts when a MemoryTracker is
    among the callbacks (CUDA/NVML charts on CUDA, per-rank charts under DDP with
    ``per_rank=True``), layer-trace charts with a LayerTrace; a callback may ask for more with
    a ``memkit_dashboard_options`` dict attribute (e.g. ``{"compare": True}``), and
    ``layout_options`` (keyword arguments of :func:`~lightning_memkit.tensorboard.layout.dashboard_layout`)
    override everything.

    Returns:
        whether this call wrote the layout.
    """
    experiment = tensorboard_experiment(trainer)
    if experiment is None or not hasattr(experiment, "add_custom_scalars"):
        return False
    layout = _layout_for(trainer, layout_options)
    if not layout:  # e.g. LayerTrace alone: its data is a figure and tables, no chart to lay out
        return False
    with _LOCK:
        if experiment in _REGISTERED:
            return False
        _REGISTERED.add(experiment)
        _LAYOUTS[experiment] = layout
    experiment.add_custom_scalars(layout)
    experiment.flush()
    return True


def _steps_per_tag(history: Sequence[StepReading], prefix: str, world_size: int) -> dict[str, int]:
    """``{tag: number of steps logged}`` of what MemoryTracker logged from ``history``; per-rank
    tags (``.../rank<r>/...``) count as their run-level tag (the history holds the reduced readings)."""
    steps: dict[str, set[int]] = {}
    for reading in history:
        for tag in step_metrics(reading, prefix):
            steps.setdefault(tag, set()).add(reading.step)
            stage_part = tag[len(prefix) + 1 :].split("/", 1)
            if stage_part[0] == "train":
                for rank in range(max(world_size, 1)):
                    steps.setdefault(f"{prefix}/train/rank{rank}/{stage_part[1]}", set()).add(reading.step)
    return {tag: len(s) for tag, s in steps.items()}


def _refresh_layout(trainer: Any, experiment: Any, history: Sequence[StepReading], prefix: str) -> bool:
    """At fit end: rewrite the run's layout without the charts it left empty or single-step
    (no NVML reading, a validation run that never came or came once), and readable for the values
    it logged (:func:`~lightning_memkit.tensorboard.readable.readable_layout`: a chart TensorBoard
    would clip is left out, a chart whose axis labels would repeat draws its lines above a named
    base; those lines are written here, at the steps of the logged ones). The values are read back
    from the run's event files, as TensorBoard reads them. Returns whether it rewrote the layout."""
    layout = _LAYOUTS.get(experiment)
    if not layout:
        return False
    pruned = prune_layout(layout, _steps_per_tag(history, prefix, getattr(trainer, "world_size", 1)))
    run_dir = getattr(experiment, "log_dir", None) or getattr(experiment, "logdir", None)
    lines: dict[str, list[tuple[int, float]]] = {}
    if run_dir and hasattr(experiment, "add_scalar"):
        experiment.flush()
        try:
            runs = {run_dir: read_run_scalars(run_dir, prefix)}
            siblings = _compare_siblings(run_dir) if COMPARE_CATEGORY in pruned else []
            runs.update((sibling, read_run_scalars(sibling, prefix)) for sibling in siblings)
            pruned, derived = readable_layout(pruned, runs, prefix=prefix)
            lines = _new_lines(run_dir, derived.get(run_dir, {}), prefix) if siblings else derived.get(run_dir, {})
            for sibling in siblings:  # the modes compared so far: one layout, one base for all of them
                if read_layout(sibling) != pruned:
                    write_layout(sibling, pruned, _new_lines(sibling, derived.get(sibling, {}), prefix))
        except Exception as error:  # noqa: BLE001 - never break training for a dashboard
            warnings.warn(
                f"memkit: the dashboard of {run_dir} keeps its fit-start layout ({type(error).__name__}: {error})",
                stacklevel=2,
            )
    for tag, points in lines.items():
        for step, value in points:
            experiment.add_scalar(tag, value, global_step=step)
    if pruned == layout:
        return False
    _LAYOUTS[experiment] = pruned
    # TensorBoard's Custom Scalars tab shows a run's last layout event (it reads one point of the
    # config tag, the last): this one replaces the fit-start layout
    experiment.add_custom_scalars(pruned)
    return True


def _compare_siblings(run_dir: str) -> list[str]:
    """The other runs of the ``memkit compare`` root that ``run_dir`` (a mode's run) is in: the run
    directories beside it whose layout is the modes-compared one."""
    root = os.path.dirname(os.path.abspath(run_dir))
    dirs = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "events.out.tfevents.*"))})
    return [
        d for d in dirs if os.path.abspath(d) != os.path.abspath(run_dir) and COMPARE_CATEGORY in (read_layout(d) or {})
    ]


def read_run_scalars(
    run_dir: str, prefix: str = DEFAULT_PREFIX, rebased: bool = False
) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the scalars in ``run_dir``'s event files (read with
    TensorBoard's own reader, every point), without the dashboard's rebased lines
    (``<prefix>/dashboard/...``, which are made from the others), or only those with ``rebased=True``."""
    # deferred: TensorBoard's event reader is heavy (~150 modules), only reading a run back needs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    own = f"{prefix}/{DASHBOARD_TAG_PART}/"
    return {
        tag: sorted((e.step, e.value) for e in accumulator.Scalars(tag))
        for tag in accumulator.Tags()["scalars"]
        if tag.startswith(own) == rebased
    }


def _new_lines(
    run_dir: str, lines: dict[str, list[tuple[int, float]]], prefix: str
) -> dict[str, list[tuple[int, float]]]:
    """The rebased lines ``run_dir`` does not hold yet (a line's tag names its base: the same tag is the same line)."""
    if not lines:
        return {}
    held = read_run_scalars(run_dir, prefix, rebased=True)
    return {tag: points for tag, points in lines.items() if tag not in held}


def markdown_code(text: str) -> str:
    """Fixed-width text as a Markdown code block (TensorBoard's text tab renders Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def log_memory_summary(
    trainer: Any, summary: RunSummary, history: Sequence[StepReading], step: int, prefix: str = DEFAULT_PREFIX
) -> bool:
    """Log the run summary table (text) and the memory-per-step figure (image) at ``step``.

    Both come from the same records: the table is :func:`~lightning_memkit.summary_table.format_summary`,
    the figure :func:`~lightning_memkit.tensorboard.figures.memory_per_step_figure`.
    Tags: ``<prefix>/summary/table`` and ``<prefix>/summary/memory_per_step``.

    Returns:
        whether anything was written (False off rank zero or without a TensorBoardLogger).
    """
    experiment = tensorboard_experiment(trainer)
    if experiment is None:
        return False
    from lightning_memkit.tensorboard.figures import figure_rgb, memory_per_step_figure  # matplotlib: heavy

    experiment.add_text(
        f"{prefix}/{SUMMARY_TEXT_TAG}", markdown_code(format_summary(summary, history)), global_step=step
    )
    device = device_table(history)
    if device:
        experiment.add_text(f"{prefix}/{DEVICE_TEXT_TAG}", markdown_code(device), global_step=step)
    _refresh_layout(trainer, experiment, history, prefix)
    if history:
        image = figure_rgb(memory_per_step_figure(summary, history))
        experiment.add_image(f"{prefix}/{FIGURE_TAG}", image, global_step=step, dataformats="HWC")
    experiment.flush()
    return True


def device_table(history: Sequence[StepReading]) -> str | None:
    """The device's capacity, use and headroom over the run (NVML), as a fixed-width table; ``None`` without NVML.

    The dashboard draws no capacity line (at 80 GB it flattens every other line): these are the
    numbers instead. All from NVML's own readings, so they add up: headroom = capacity - the most
    used by all processes at any measured step. "outside the allocator" is this process's device
    memory minus the allocator's reserved bytes at the same step: the CUDA context, cuBLAS/cuDNN
    workspaces, NCCL buffers (memory ``torch.cuda`` does not count).
    """

    readings = [r for r in history if r.device_total_bytes]
    if not readings:
        return None
    total = max(r.device_total_bytes or 0 for r in readings)
    used = [(r.device_used_bytes, r) for r in readings if r.device_used_bytes is not None]
    rows = [["capacity (NVML total)", format_bytes(total)]]
    if used:
        used_bytes, fullest = max(used, key=lambda pair: pair[0])
        rows.append(
            ["most used, all processes", f"{format_bytes(used_bytes)} at step {fullest.step} ({fullest.stage})"]
        )
        rows.append(
            [
                "headroom at that step",
                f"{format_bytes(total - used_bytes)} ({(total - used_bytes) / total:.1%} of capacity)",
            ]
        )
    processes = [(r.process_device_bytes, r) for r in readings if r.process_device_bytes is not None]
    if processes:
        process_bytes, process = max(processes, key=lambda pair: pair[0])
        rows.append(
            ["most used, this process", f"{format_bytes(process_bytes)} at step {process.step} ({process.stage})"]
        )
        if process.reserved_bytes is not None:
            rows.append(["  of which outside the allocator", format_bytes(process_bytes - process.reserved_bytes)])
    return "memkit device memory (NVML)\n" + format_table(["measure", "value"], rows)


def read_layout(run_dir: str) -> dict[str, dict[str, list[Any]]] | None:
    """The custom-scalars layout TensorBoard shows for the run in ``run_dir`` (its last one), or ``None``.

    Read with TensorBoard's own event reader, in the form :func:`~lightning_memkit.tensorboard.layout.dashboard_layout`
    returns (``{category: {chart: ["Multiline", [regex, ...]]}}``).
    """
    # deferred: TensorBoard's event reader is heavy (~150 modules), only reading a run back needs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2  # deferred: as EventAccumulator

    accumulator = EventAccumulator(run_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    if "custom_scalars__config__" not in accumulator.Tags()["tensors"]:
        return None
    events = accumulator.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(events[-1].tensor_proto.string_val[0])
    return {c.title: {ch.title: ["Multiline", list(ch.multiline.tag)] for ch in c.chart} for c in layout.category}


def write_layout(
    run_dir: str, layout: dict[str, dict[str, list[Any]]], lines: dict[str, list[tuple[int, float]]] | None = None
) -> str:
    """Give the run in ``run_dir`` this layout: a new event file beside its own, holding only the
    layout and the lines it draws that the run does not have yet (``lines``: ``{tag: [(step,
    value), ...]}``, the rebased lines of :func:`~lightning_memkit.tensorboard.readable.readable_layout`).

    TensorBoard then shows this layout for the run instead of the one written at fit start: the
    Custom Scalars tab reads a run's last layout event, and the new file sorts after the run's
    own (its name starts with a later timestamp). Returns the new file's path.
    """
    from torch.utils.tensorboard import SummaryWriter  # deferred: imports TensorBoard (heavy), only this needs it

    before = set(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    writer = SummaryWriter(run_dir, filename_suffix=".memkit-layout")
    try:
        for tag, points in (lines or {}).items():
            for step, value in points:
                writer.add_scalar(tag, value, global_step=step)
        writer.add_custom_scalars(layout)
    finally:
        writer.close()
    [path] = set(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))) - before
    return path


def update_dashboards(logdir: str, prefix: str = DEFAULT_PREFIX) -> dict[str, dict[str, dict[str, list[Any]]]]:
    """Give every memkit run under ``logdir`` today's dashboard, built from the tags it logged.

    For logs written by an older memkit: each run directory whose event files hold
    ``<prefix>/train/...`` scalars gets :func:`~lightning_memkit.tensorboard.layout.layout_from_tags`
    of its own tags (a run beside a ``compare.json`` is a mode of ``memkit compare``), made readable
    for its values by :func:`~lightning_memkit.tensorboard.readable.readable_layout` (with the rebased
    lines it draws), written by :func:`write_layout` unless it shows that layout already. Nothing else in the run is
    touched.
    Returns ``{run_dir: layout}`` of the runs it updated.
    """
    updated = {}
    events = glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)
    run_dirs = sorted({os.path.dirname(p) for p in events})
    groups: dict[str, dict[str, dict]] = {}  # the runs drawn together: a compare root's modes, else each run alone
    for run_dir in run_dirs:
        scalars = read_run_scalars(run_dir, prefix)
        if not any(tag.startswith(f"{prefix}/train/") for tag in scalars):
            continue
        compare = os.path.exists(os.path.join(os.path.dirname(run_dir), "compare.json"))
        groups.setdefault(os.path.dirname(run_dir) if compare else run_dir, {})[run_dir] = scalars
    for group, runs in groups.items():
        compare = group not in runs
        first = next(iter(runs.values()))
        steps = {tag: len({step for step, _ in points}) for tag, points in first.items()}
        layout, derived = readable_layout(layout_from_tags(steps, prefix=prefix, compare=compare), runs, prefix=prefix)
        for run_dir in runs:
            if read_layout(run_dir) == layout:  # already today's: a second call adds nothing
                continue
            write_layout(run_dir, layout, _new_lines(run_dir, derived.get(run_dir, {}), prefix))
            updated[run_dir] = layout
    return updated
