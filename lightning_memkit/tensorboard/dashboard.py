"""memkit's TensorBoard extras for a Lightning run: the dashboard layout, the memory figure, the summary table.

Sinks only: everything here reads records (RunSummary, StepReading) and writes them to the
first TensorBoardLogger's ``SummaryWriter`` on global rank zero; without one it does nothing.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol, Sequence, runtime_checkable

from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.tensorboard.layout import dashboard_layout
from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX

__all__ = ["tensorboard_experiment", "register_dashboard", "log_memory_summary", "markdown_code", "SUMMARY_TEXT_TAG", "FIGURE_TAG",
           "DASHBOARD_OPTIONS_ATTRIBUTE", "LAYER_TRACE_ATTRIBUTE"]

#: the TensorBoard text tag of the run summary table (``<prefix>/`` + this).
SUMMARY_TEXT_TAG = "summary/table"
#: the TensorBoard image tag of the memory-per-step figure (``<prefix>/`` + this).
FIGURE_TAG = "summary/memory_per_step"


# the SummaryWriters that hold a memkit layout, so several callbacks of one run register it once;
# weak, so that a new logger on a recreated log dir (a notebook re-run) gets its layout again
_REGISTERED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOCK = threading.Lock()


def tensorboard_experiment(trainer: Any) -> Any | None:
    """The ``SummaryWriter`` of the first TensorBoardLogger among ``trainer.loggers``.

    ``None`` off global rank zero or when the trainer has no TensorBoardLogger: memkit's
    TensorBoard extras (layout, figures, tables) are skipped there, silently.
    """
    if not getattr(trainer, "is_global_zero", True):
        return None
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in getattr(trainer, "loggers", []):
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


#: a callback attribute: a dict of :func:`dashboard_layout` options the callback asks for
#: (e.g. ``{"compare": True}`` on the callback ``memkit compare`` adds to each mode's Trainer).
DASHBOARD_OPTIONS_ATTRIBUTE = "memkit_dashboard_options"


def _validates(trainer: Any) -> bool:
    """Whether this fit will run validation (else the validation chart would stay empty)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

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
    except Exception:
        cuda = False
    options: dict[str, Any] = dict(cuda=False, tensors=False, host=False, validation=False, ranks=False,
                                   trace=tracer is not None, prefix=getattr(tracer, "prefix", DEFAULT_PREFIX))
    if tracker is not None:  # the per-step charts need MemoryTracker's scalars
        accountant = tracker.tensor_accounting
        options.update(
            prefix=tracker.prefix,
            cuda=cuda,
            tensors=accountant is True or (accountant == "auto" and not cuda),
            host=tracker.host,
            validation=tracker.log_validation and _validates(trainer),
            ranks=tracker.per_rank and getattr(trainer, "world_size", 1) > 1,
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
    with _LOCK:
        if experiment in _REGISTERED:
            return False
        _REGISTERED.add(experiment)
    experiment.add_custom_scalars(_layout_for(trainer, layout_options))
    experiment.flush()
    return True


def markdown_code(text: str) -> str:
    """Fixed-width text as a Markdown code block (TensorBoard's text tab renders Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def log_memory_summary(trainer: Any, summary: RunSummary, history: Sequence[StepReading], step: int,
                       prefix: str = DEFAULT_PREFIX) -> bool:
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
    from lightning_memkit.summary_table import format_summary
    from lightning_memkit.tensorboard.figures import figure_rgb, memory_per_step_figure

    experiment.add_text(f"{prefix}/{SUMMARY_TEXT_TAG}", markdown_code(format_summary(summary, history)), global_step=step)
    if history:
        image = figure_rgb(memory_per_step_figure(summary, history))
        experiment.add_image(f"{prefix}/{FIGURE_TAG}", image, global_step=step, dataformats="HWC")
    experiment.flush()
    return True
