"""Per-module memory events of a training step, and what the bytes are (no Lightning import).

``LayerTracer``/``trace_step`` record; ``LayerTraceResult`` holds; trace/render.py shows.
"""

from lightning_memkit.trace.trace_records import (
    MODULE_PHASES,
    STEP_PHASES,
    TRACE_FORMAT,
    LayerTraceResult,
    TraceEvent,
    read_trace,
    trace_filename,
)
from lightning_memkit.trace.tracer import LayerTracer, trace_step

__all__ = [
    "LayerTracer",
    "trace_step",
    "TraceEvent",
    "LayerTraceResult",
    "read_trace",
    "trace_filename",
    "TRACE_FORMAT",
    "MODULE_PHASES",
    "STEP_PHASES",
]
