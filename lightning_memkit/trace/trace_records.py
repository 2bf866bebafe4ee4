"""The records of a layer trace: one TraceEvent per module per phase, and the step's result.

Plain dataclasses that serialise to JSON (``format: "lightning-memkit/trace/1"``) and CSV;
the table, the figure and the TensorBoard sinks only read them.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_memkit.accounting.categories import CATEGORIES, CategoryBreakdown
from lightning_memkit.trace.render import format_category_table, format_trace_table, trace_figure, trace_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "TRACE_FORMAT",
    "MODULE_PHASES",
    "STEP_PHASES",
    "TraceEvent",
    "LayerTraceResult",
    "trace_filename",
    "write_new_file",
    "read_trace",
]

#: The ``format`` key of every trace JSON file; bump the number on an incompatible change.
TRACE_FORMAT = "lightning-memkit/trace/1"

#: Phases of module events, in the order one module call goes through them.
MODULE_PHASES = ("pre-forward", "forward", "pre-backward", "backward")

#: Phases of step markers (``module_class == ""``): not tied to a module.
STEP_PHASES = ("step-start", "backward-end", "optimizer-step", "step-end")


def trace_filename(step: int | None, rank: int = 0) -> str:
    """``memkit_trace_step{N}.json`` (rank 0) or ``memkit_trace_step{N}_rank{r}.json``."""
    stem = f"memkit_trace_step{step if step is not None else 'x'}"
    return f"{stem}.json" if not rank else f"{stem}_rank{rank}.json"


def write_new_file(directory: str | os.PathLike, filename: str, text: str, max_versions: int = 10_000) -> str:
    """Write ``text`` to ``directory/filename``, or, when that file exists, to the first free
    ``stem-v1.ext``, ``stem-v2.ext``, ... (Lightning's ModelCheckpoint naming): never over an existing
    file. Each name is created exclusively (``open(..., "x")``), so two writers never share one.

    Returns:
        the path written.

    Raises:
        OSError: the directory cannot be made or written, or ``max_versions`` names are taken.
    """
    os.makedirs(directory, exist_ok=True)
    stem, extension = os.path.splitext(filename)
    for version in range(max_versions + 1):
        path = os.path.join(os.fspath(directory), filename if not version else f"{stem}-v{version}{extension}")
        try:
            with open(path, "x", encoding="utf-8") as handle:
                handle.write(text)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(
        f"{filename} and its versions -v1 ... -v{max_versions} all exist in {directory}; remove old ones"
    )


@dataclass
class TraceEvent:
    """One moment of a traced step: a module hook or a step marker. Every ``*_bytes`` is in bytes.

    Attributes:
        index: position in the step, from 0 (the figure's x axis).
        phase: one of :data:`MODULE_PHASES` (``pre-forward``: before the module's forward;
            ``forward``: after it; ``pre-backward``: the gradient of its output is ready;
            ``backward``: the gradient of its input is ready, or its parameters' gradients are
            accumulated when no input needs a gradient) or of :data:`STEP_PHASES`.
        module: the module's qualified name (``""`` for the root module and for step markers).
        module_class: the module's class name (``""`` for step markers).
        depth: nesting depth of the module (root 0, ``features`` 1, ``features.0`` 2).
        call: which call of this module in the step, from 0 (a module used twice has calls 0 and 1).
        recompute: ``True`` for forward events that happen during backward: activation
            checkpointing recomputing a block.
        live_bytes: exact live tensor bytes at this event.
        delta_bytes: ``live_bytes`` minus the previous event's ``live_bytes``.
        peak_bytes: the running peak of live bytes since the step started.
        saved_bytes: ``forward`` events only: bytes of storages this call (itself or its children)
            was the first to save for backward; each storage is counted once per step, and storages
            with a role (parameters, buffers, gradients, optimizer state, the input batch) never:
            they are counted in their own category. 0 for other phases.
        shapes: shapes of the tensors of this event: inputs (pre-forward), outputs (forward),
            gradients of outputs (pre-backward), gradients of inputs (backward).
        dtypes: their dtypes, e.g. ``"float32"``, in the same order.
    """

    index: int
    phase: str
    module: str
    module_class: str
    depth: int
    call: int
    recompute: bool
    live_bytes: int
    delta_bytes: int
    peak_bytes: int
    saved_bytes: int = 0
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)

    @property
    def is_marker(self) -> bool:
        """Whether this is a step marker rather than a module event."""
        return self.module_class == ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceEvent:
        """Inverse of :meth:`to_dict` (unknown keys are ignored, for forward compatibility)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


#: CSV columns of :meth:`LayerTraceResult.to_csv`, in order.
CSV_COLUMNS = [f.name for f in dataclasses.fields(TraceEvent)]


@dataclass
class LayerTraceResult:
    """Everything one traced step recorded. Every ``*_bytes`` is in bytes.

    Attributes:
        format: :data:`TRACE_FORMAT`.
        step: the training step that was traced (``None`` when the caller gave none).
        rank: the process's global rank (each DDP rank traces its own step).
        device: the model's device, e.g. ``"cpu"``.
        model: the traced root module's class name.
        parameter_count: number of parameter elements (Ψ in the ZeRO paper), shared ones once.
        events: the events in the order they happened.
        start_bytes: live tensor bytes when the step started.
        end_bytes: live tensor bytes when the step ended.
        peak_bytes: the step's peak of live tensor bytes.
        peak_event_index: the first event whose running peak equals ``peak_bytes``: the peak
            happened between that event and the one before it.
        at_peak: the category breakdown at the peak.
        at_end: the category breakdown at step end.
        errors: problems the tracer stepped around (the step itself was never interrupted).
        notes: what the trace could not see and why (a compiled model traced as it runs), said once.
    """

    format: str = TRACE_FORMAT
    step: int | None = None
    rank: int = 0
    device: str = "cpu"
    model: str = ""
    parameter_count: int = 0
    events: list[TraceEvent] = field(default_factory=list)
    start_bytes: int = 0
    end_bytes: int = 0
    peak_bytes: int = 0
    peak_event_index: int | None = None
    at_peak: CategoryBreakdown = field(default_factory=CategoryBreakdown)
    at_end: CategoryBreakdown = field(default_factory=CategoryBreakdown)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ queries
    def module_events(self, phase: str | None = None, module: str | None = None) -> list[TraceEvent]:
        """Module events (no step markers), optionally of one ``phase`` and/or one ``module`` name."""
        return [
            e
            for e in self.events
            if not e.is_marker and (phase is None or e.phase == phase) and (module is None or e.module == module)
        ]

    def saved_bytes_by_module(self) -> dict[str, int]:
        """Bytes each module (qualified name) first saved for backward, summed over its calls."""
        totals: dict[str, int] = {}
        for event in self.module_events("forward"):
            if not event.recompute:
                totals[event.module] = totals.get(event.module, 0) + event.saved_bytes
        return totals

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; the schema is documented in docs/layer_trace.md."""
        data = dataclasses.asdict(self)
        data["categories"] = list(CATEGORIES)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerTraceResult:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: when ``data`` is not a memkit trace (no or another ``format`` key).
        """
        fmt = data.get("format")
        if not isinstance(fmt, str) or not fmt.startswith("lightning-memkit/trace/"):
            raise ValueError(
                f"not a memkit layer trace (format={fmt!r}); expected {TRACE_FORMAT!r}, as written by "
                f"LayerTrace or LayerTraceResult.to_json"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["events"] = [TraceEvent.from_dict(e) for e in data.get("events", [])]
        kwargs["at_peak"] = CategoryBreakdown.from_dict(data.get("at_peak", {}))
        kwargs["at_end"] = CategoryBreakdown.from_dict(data.get("at_end", {}))
        return cls(**kwargs)

    def to_json(self, path: str | os.PathLike | None = None, indent: int | None = 1) -> str:
        """The trace as JSON text (``indent`` spaces per level, ``None``: one line); also written to
        ``path`` when given (its directory is made)."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            directory = os.path.dirname(os.fspath(path))
            if directory:
                os.makedirs(directory, exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The raw events as CSV (one row per event, columns :data:`CSV_COLUMNS`; bytes as integers);
        shapes are written ``8x3x32x32`` and joined with ``;``. Also written to ``path`` when given."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for event in self.events:
            row = event.to_dict()
            row["shapes"] = ";".join("x".join(str(d) for d in shape) for shape in event.shapes)
            row["dtypes"] = ";".join(event.dtypes)
            writer.writerow(row)
        text = buffer.getvalue()
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as handle:
                handle.write(text)
        return text

    # ------------------------------------------------------------------ display (trace/render.py draws)
    def format_table(self, max_depth: int | None = None, markers: bool = True) -> str:
        """The indented module tree (name, phase, delta MiB, live MiB, saved MiB, shape; MiB = 2**20 bytes).

        ``max_depth``: leave out modules deeper than this (root 0); ``markers=False``: leave out the
        step markers (``[backward-end]``, ``[optimizer-step]``...).
        """
        return format_trace_table(self, max_depth=max_depth, markers=markers)

    def format_categories(self) -> str:
        """The category breakdown at the peak and at step end, as a table."""
        return format_category_table(self)

    def figure(self, title: str | None = None) -> Figure:
        """A matplotlib figure of live memory (MiB) against event index, the peak marked, under ``title``
        (default: the model's class and the step)."""
        return trace_figure(self, title=title)

    def metrics(self, prefix: str = "memory") -> dict[str, float]:
        """Per-category scalars in MiB, under ``{prefix}/trace/...`` (see docs/layer_trace.md)."""
        return trace_metrics(self, prefix=prefix)


def read_trace(path: str | os.PathLike) -> LayerTraceResult:
    """Read a ``memkit_trace_step{N}.json`` file written by :class:`LayerTrace` or :meth:`LayerTraceResult.to_json`."""
    with open(path, encoding="utf-8") as handle:
        return LayerTraceResult.from_dict(json.load(handle))
