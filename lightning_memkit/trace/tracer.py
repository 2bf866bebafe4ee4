"""The layer tracer: per-module memory events of one training step, on plain PyTorch.

No Lightning here: :class:`LayerTracer` (or :func:`trace_step`) wraps any forward/backward/
optimizer step; the LayerTrace callback is a few lines of wiring on top.

How it works, and why:

* Exact bytes come from a :class:`TensorAccountant` created for the step; parameters, buffers,
  gradients, optimizer state and the input batch are adopted with their roles
  (:class:`CategoryAttributor`), so the category breakdown at the peak and at the end is exact.
* Which modules get rows: :mod:`~lightning_memkit.trace.selection`; the hooks that make the events
  (forward hooks, gradient hooks for backward): :mod:`~lightning_memkit.trace.module_hooks`; the events
  and their bytes: :mod:`~lightning_memkit.trace.timeline`.
* Saved-for-backward bytes come from ``saved_tensors_hooks``: each call is credited with the
  storages it was the first to save. Checkpointing's own hooks take over inside a checkpointed
  block, so only the block's boundary tensors show as saved, and the block's forward events
  reappear during backward with ``recompute=True``.
* Everything (hooks, the dispatch mode, the saved-tensor hooks) is removed when the step ends.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memkit.accounting.accountant import StorageRecord, TensorAccountant
from lightning_memkit.accounting.categories import (
    AUTOCAST_COPY_LABEL,
    RECOMPUTE_LABEL,
    CategoryAttributor,
    CategoryBreakdown,
    cuda_memory_extras,
    is_parameter_cast,
)
from lightning_memkit.compiled import COMPILED_CHOICES, AllocatorPeak, compiled_parts, compiled_regions
from lightning_memkit.compiled._torch_compat import force_eager
from lightning_memkit.trace._torch_compat import in_backward, in_checkpoint_recomputation, user_class
from lightning_memkit.trace.module_hooks import ModuleHooks
from lightning_memkit.trace.selection import compiled_hidden, select_modules
from lightning_memkit.trace.timeline import StepTimeline
from lightning_memkit.trace.trace_records import LayerTraceResult, TraceEvent

__all__ = ["LayerTracer", "trace_step", "PHASE_LABELS"]

#: The accountant labels the tracer gives allocations (the phase they happened in).
PHASE_LABELS = ("forward", "backward", RECOMPUTE_LABEL, "optimizer", AUTOCAST_COPY_LABEL)


class _TracingAccountant(TensorAccountant):
    """The accountant, labelling each allocation with the phase it happened in."""

    def __init__(self, tracer: LayerTracer) -> None:
        super().__init__()
        self._tracer = tracer

    def __torch_dispatch__(  # noqa: D105
        self, func: Any, types: tuple[type, ...], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        try:
            self.set_label(self._tracer._label_for(func, args, kwargs))
        except BaseException as error:  # noqa: BLE001 - never raise inside dispatch: recorded
            self._record_error(f"labelling {func}: {type(error).__name__}: {error}")
        return super().__torch_dispatch__(func, types, args, kwargs)


def _check_arguments(model: Any, max_depth: Any, compiled: str) -> None:
    if compiled not in COMPILED_CHOICES:
        raise ValueError(
            f"compiled={compiled!r}: choose 'keep' (trace the compiled step as it runs) or 'eager' "
            f"(run the traced step eagerly)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"LayerTracer traces an nn.Module, not {type(model).__name__}; pass your model (the "
            f"LightningModule itself is fine)"
        )
    if max_depth is not None and (not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 0):
        raise ValueError(f"max_depth={max_depth!r}: give None (every module) or an integer >= 0 (0 = the root only)")


def _parameter_count(model: nn.Module) -> int:
    """Parameter elements, a parameter shared by two modules once."""
    seen: set[int] = set()
    count = 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            count += parameter.numel()
    return count


def _model_device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


class LayerTracer:
    """Record a memory event per module per phase for one training step, with exact bytes.

    Plain PyTorch::

        tracer = LayerTracer(model, [optimizer])
        with tracer:
            loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
        print(tracer.result.format_table())
        tracer.result.to_json("trace.json")

    Args:
        model: the root module; every submodule (filtered by ``max_depth``/``modules``) is traced.
        optimizers: the step's optimizers, so their state is counted as optimizer state.
        max_depth: trace modules at most this deep (root 0, its children 1, ...); ``None``: all.
            Deeper modules' bytes show in their parent's events.
        modules: only trace modules whose qualified name matches one of these ``fnmatch`` patterns
            (``"features.*"``; ``""`` is the root) or that are instances of one of these classes.
        step: the training step number written into the result.
        rank: the process's global rank written into the result.
        compiled: what to do when ``model`` has ``torch.compile``d parts. ``"keep"`` (default): the step runs
            compiled; no dispatch mode is entered (dynamo would run nothing compiled under one); bytes come from
            the allocator's own events (:class:`~lightning_memkit.compiled.AllocatorPeak`); only modules outside
            compiled code and each compiled region as a whole get rows (a hook inside compiled code would be
            compiled into it), and a compiled region's forward ``saved_bytes`` is the bytes its graph left alive
            for backward (its forward's growth less its outputs). No category split inside compiled code: the
            peak's rise is ``other``. ``"eager"``: the traced step runs eagerly, traced module by module as
            an eager model (the eager program's bytes). :attr:`LayerTraceResult.notes` says which.

    After the ``with`` block (or :meth:`stop`), :attr:`result` holds the
    :class:`~lightning_memkit.trace.trace_records.LayerTraceResult`. A tracer traces one step; make a
    new one (cheap) for the next. Once stopped it holds only that record: every hook is removed,
    no autograd graph is kept, and it lets go of the model, the optimizers and the batch (its
    ``model`` is ``None`` then), so keeping the tracer keeps no tensor alive. Failures inside
    hooks never interrupt the step: they are kept in ``result.errors`` and warned about once.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Iterable[Any] | Any = (),
        *,
        max_depth: int | None = None,
        modules: Iterable[str | type] | str | type | None = None,
        step: int | None = None,
        rank: int = 0,
        compiled: str = "keep",
    ) -> None:
        _check_arguments(model, max_depth, compiled)
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        #: the traced model; ``None`` once the step's result is built (the tracer must not keep it alive)
        self.model: nn.Module | None = model
        self.optimizers = list(optimizers)
        self.max_depth = max_depth
        self.step = step
        self.rank = rank
        regions = compiled_regions(model)
        methods = [m for m in ("forward", "training_step") if m in compiled_parts(model)]
        self.compiled = compiled if (regions or methods) else None
        self.notes: list[str] = []
        # hooks inside compiled code would be compiled into it: only modules outside it get rows
        self._hidden = compiled_hidden(regions, methods) if self.compiled == "keep" else []
        self._infos = select_modules(model, max_depth, modules, self._hidden)
        self.result: LayerTraceResult | None = None
        self._active = False
        self._stack_exit: contextlib.ExitStack | None = None

    @property
    def _traced(self) -> nn.Module:
        """The model, while its step is traced."""
        if self.model is None:
            raise RuntimeError("a LayerTracer traces one step; create a new LayerTracer for the next step")
        return self.model

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LayerTracer:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def start(self, inputs: Any = None) -> None:
        """Adopt the training state (and ``inputs``, the batch, if given), install hooks and modes."""
        if self._active:
            raise RuntimeError("this LayerTracer is already tracing a step; call stop() first")
        if self.result is not None or self.model is None:
            raise RuntimeError("a LayerTracer traces one step; create a new LayerTracer for the next step")
        self.accountant = _TracingAccountant(self)
        self.attributor = CategoryAttributor(self.accountant)
        self.errors: list[str] = []
        self._warned = False
        self._device = _model_device(self._traced)
        self._adopt_state(inputs)
        self._start_bytes = self.accountant.current_bytes
        self._allocator = self._start_allocator() if self.compiled == "keep" else None
        self.notes = self._compiled_notes()
        self._timeline = StepTimeline(self.accountant, self._start_bytes, self._allocator)
        self.events: list[TraceEvent] = self._timeline.events
        self._hooks = ModuleHooks(self._infos, self.attributor, self._timeline, self._error)
        self._hooks.install(self._traced, self.optimizers)
        self._timeline.marker("step-start")
        stack = contextlib.ExitStack()
        try:
            if self.compiled == "eager":
                stack.enter_context(force_eager())  # the accountant below would make dynamo skip compiled frames
            if self.compiled != "keep":
                stack.enter_context(self.attributor.watch_saved_tensors())
                stack.enter_context(self.accountant)
        except BaseException:  # whatever stopped the start (an interrupt too): undo it, then raise
            stack.close()
            self._hooks.remove()
            raise
        self._stack_exit = stack
        self._active = self._hooks.active = True

    def _adopt_state(self, inputs: Any) -> None:
        """The model's, the optimizers' and the batch's tensors, with their roles; the peak from here."""
        self.attributor.assign_module(self._traced)
        self.attributor.assign_optimizers(self.optimizers)
        if inputs is not None:
            self.attributor.assign(inputs, "inputs")
        self._parameter_keys = {self.accountant.storage_key(p) for p in self._traced.parameters()}
        self.attributor.add_save_listener(self._on_save)
        self.accountant.reset_peak()
        self._peak_records: list[StorageRecord] = self.accountant.live_records()
        self._peak_tick = self.attributor.tick
        self.accountant.add_peak_listener(self._on_peak)
        if self._device.type == "cuda":
            with contextlib.suppress(RuntimeError):
                torch.cuda.reset_peak_memory_stats(self._device)

    def _start_allocator(self) -> AllocatorPeak | None:
        """A compiled model traced as it runs: the allocator's events, or None (said in :attr:`errors`)."""
        allocator = AllocatorPeak(self._device if self._device.type == "cpu" else "cpu")
        if self._device.type != "cpu" or not allocator.start(self._start_bytes):
            self.errors.append(
                "compiled model: the allocator's events could not be read (another profiler records, "
                "or not a CPU model): bytes inside compiled code are not seen"
            )
            return None
        return allocator

    def _compiled_notes(self) -> list[str]:
        """What a trace of a compiled model can see, said once in the result."""
        if self.compiled == "keep":
            return [
                f"compiled model ({', '.join(compiled_parts(self._traced))}), traced as it runs: rows for modules "
                "outside compiled code and for each compiled region as a whole (its saved bytes: what its graph "
                "kept for backward); bytes from the allocator's events; no category split inside compiled code "
                "(the peak's rise is 'other'); LayerTrace(compiled='eager') traces the eager program module by "
                "module"
            ]
        if self.compiled == "eager":
            return [
                f"compiled model ({', '.join(compiled_parts(self._traced))}): this step ran EAGERLY "
                "(compiled='eager'); its bytes are the eager program's"
            ]
        return []

    def stop(self) -> LayerTraceResult:
        """Remove every hook and mode and build :attr:`result` (idempotent)."""
        if not self._active:
            if self.result is None:
                raise RuntimeError("LayerTracer.stop() called before start()")
            return self.result
        self._active = self._hooks.active = False
        try:
            self._timeline.marker("step-end")
        finally:
            if self._allocator is not None:
                self._allocator.stop()
                self._timeline.fill_from_allocator()
            if self._stack_exit is not None:
                self._stack_exit.close()
                self._stack_exit = None
            self._hooks.remove()
        try:
            # roles made during the step: gradients set to None and back, lazily created optimizer state
            self.attributor.assign_module(self._traced)
            self.attributor.assign_optimizers(self.optimizers)
            self.result = self._build_result()
        finally:
            self._release()
        return self.result

    def _release(self) -> None:
        """Keep only the records: a tracer kept after its step (``tracer.result`` is read from it) must not keep
        the model, its gradients, the optimizer's state or the batch alive (the accountant's records, the module
        tables and the attribution all reach them)."""
        self.model = None
        self.optimizers = []
        self._infos = {}
        self._hooks.release()
        self._parameter_keys = set()
        self._peak_records = []
        self._timeline.release()
        del self.accountant, self.attributor

    # ------------------------------------------------------------------ failure handling
    def _error(self, where: str, error: BaseException) -> None:
        message = f"{where}: {type(error).__name__}: {error}"
        if message not in self.errors and len(self.errors) < 20:
            self.errors.append(message)
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"memkit LayerTracer: {message}; the step continues, this trace may be incomplete",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ labels and peaks
    def _label_for(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> str:
        if is_parameter_cast(func, args, kwargs, self._is_parameter):
            return AUTOCAST_COPY_LABEL
        if in_backward():
            if self._hooks.recompute_depth or in_checkpoint_recomputation():
                return RECOMPUTE_LABEL
            return "backward"
        return self._hooks.host_phase

    def _is_parameter(self, tensor: torch.Tensor) -> bool:
        return self.accountant.storage_key(tensor) in self._parameter_keys

    def _on_peak(self, peak_bytes: int) -> None:
        self._peak_records = self.accountant.live_records()
        self._peak_tick = self.attributor.tick

    def _on_save(self, record: StorageRecord, first_time: bool) -> None:
        stack = self._hooks.stack
        if first_time and stack and record.label != AUTOCAST_COPY_LABEL:
            stack[-1].saved_bytes += record.nbytes

    # ------------------------------------------------------------------ result
    def _breakdowns(self) -> tuple[CategoryBreakdown, CategoryBreakdown, int, int]:
        """(at the peak, at the end, peak bytes, end bytes), with CUDA's extras where the model is on CUDA."""
        at_peak: CategoryBreakdown = self.attributor.breakdown_of(self._peak_records, self._peak_tick)
        at_end: CategoryBreakdown = self.attributor.breakdown()
        if self._device.type == "cuda":
            end_extras = cuda_memory_extras(self._device)
            peak_extras = cuda_memory_extras(self._device, peak=True)
            # NVML has no peak; the unseen part barely moves
            peak_extras["nvml_unseen_bytes"] = end_extras["nvml_unseen_bytes"]
            for breakdown, extras in ((at_peak, peak_extras), (at_end, end_extras)):
                for key, value in extras.items():
                    setattr(breakdown, key, value)
        peak = self.accountant.peak_bytes
        end = self.accountant.current_bytes
        if self._allocator is not None:
            allocator = self._allocator
            end, peak = allocator.now() if allocator.active else (self.events[-1].live_bytes, allocator.peak_bytes or 0)
            # inside compiled code nothing is attributed: the peak's rise above what the tracer knows is "other"
            at_peak = self.attributor.breakdown()
            unseen = max(0, peak - at_peak.total_bytes)
            at_peak.bytes_by_category["other"] = at_peak.bytes_by_category.get("other", 0) + unseen
            at_peak.total_bytes += unseen
        return at_peak, at_end, peak, end

    def _build_result(self) -> LayerTraceResult:
        at_peak, at_end, peak, end = self._breakdowns()
        peak_index = next((e.index for e in self.events if e.peak_bytes >= peak), None)
        errors = list(self.errors) + [f"accountant: {e}" for e in self.accountant.errors]
        return LayerTraceResult(
            step=self.step,
            rank=self.rank,
            device=str(self._device),
            model=user_class(self._traced).__name__,
            parameter_count=_parameter_count(self._traced),
            events=list(self.events),
            start_bytes=self._start_bytes,
            end_bytes=end,
            peak_bytes=peak,
            peak_event_index=peak_index,
            at_peak=at_peak,
            at_end=at_end,
            errors=errors,
            notes=list(self.notes),
        )


@contextlib.contextmanager
def trace_step(
    model: nn.Module,
    optimizers: Iterable[Any] | Any = (),
    inputs: Any = None,
    *,
    max_depth: int | None = None,
    modules: Iterable[str | type] | str | type | None = None,
    step: int | None = None,
    rank: int = 0,
    compiled: str = "keep",
) -> Iterator[LayerTracer]:
    """Trace the training step run inside the ``with`` block; the result is ``tracer.result``.

    ::

        with trace_step(model, optimizer, inputs=(x, y)) as tracer:
            loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
        print(tracer.result.format_table())

    ``inputs`` (the batch, any nesting) is counted as the ``inputs`` category; without it, the
    tensors passed to the first traced module that existed before the step are. ``optimizers``,
    ``max_depth``, ``modules``, ``step``, ``rank`` and ``compiled`` are :class:`LayerTracer`'s. Bytes are exact.
    """
    tracer = LayerTracer(
        model, optimizers, max_depth=max_depth, modules=modules, step=step, rank=rank, compiled=compiled
    )
    tracer.start(inputs)
    try:
        yield tracer
    finally:
        tracer.stop()
