"""Per-module memory events of a training step, and what the bytes are (no Lightning import).

``LayerTracer``/``trace_step`` record (tracer); ``LayerTraceResult`` holds (trace_records); render shows.

Import each name from the module that defines it."""
