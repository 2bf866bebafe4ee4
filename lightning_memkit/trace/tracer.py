"""The layer tracer: per-module memory events of one training step, on plain PyTorch.

No Lightning here: :class:`LayerTracer` (or :func:`trace_step`) wraps any forward/backward/
optimizer step; the LayerTrace callback is a few lines of wiring on top.

How it works, and why:

* Exact bytes come from a :class:`TensorAccountant` created for the step; parameters, buffers,
  gradients, optimizer state and the input batch are adopted with their roles
  (:class:`CategoryAttributor`), so the category breakdown at the peak and at the end is exact.
* Forward events come from ``register_forward_pre_hook`` / ``register_forward_hook`` (with
  ``always_call`` so a forward that raises, e.g. checkpoint's early stop, still closes).
* Backward events are *graph based*: ``register_multi_grad_hook`` on a call's outputs
  ("pre-backward": the first output gradient is ready) and inputs ("backward": every input
  gradient is ready). Module "full" backward hooks wrap outputs in a custom Function whose
  outputs may not be modified in place, which breaks ``ReLU(inplace=True)``; gradient hooks
  on tensors do not. A call none of whose inputs needs a gradient (the first layer) gets its
  backward event when backward ends, innermost first.
* Saved-for-backward bytes come from ``saved_tensors_hooks``: each call is credited with the
  storages it was the first to save. Checkpointing's own hooks take over inside a checkpointed
  block, so only the block's boundary tensors show as saved, and the block's forward events
  reappear during backward with ``recompute=True``.
* Everything (hooks, the dispatch mode, the saved-tensor hooks) is removed when the step ends.
"""

from __future__ import annotations

import contextlib
import fnmatch
import warnings
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from lightning_memkit.accounting.accountant import StorageRecord, TensorAccountant, storage_of
from lightning_memkit.accounting.categories import (
    AUTOCAST_COPY_LABEL,
    RECOMPUTE_LABEL,
    CategoryAttributor,
    CategoryBreakdown,
    cuda_memory_extras,
)
from lightning_memkit.compiled import COMPILED_CHOICES, AllocatorPeak, compiled_parts, compiled_regions, force_eager, is_compiled_wrapper
from lightning_memkit.trace._torch_compat import (
    in_backward,
    in_checkpoint_recomputation,
    queue_backward_end_callback,
    user_class,
    user_name,
    wrapped_module,
)
from lightning_memkit.trace.records import LayerTraceResult, TraceEvent

__all__ = ["LayerTracer", "trace_step", "PHASE_LABELS"]

#: The accountant labels the tracer gives allocations (the phase they happened in).
PHASE_LABELS = ("forward", "backward", RECOMPUTE_LABEL, "optimizer", AUTOCAST_COPY_LABEL)

_TO_COPY = torch.ops.aten._to_copy.default


class _ModuleInfo:
    __slots__ = ("name", "cls", "depth", "module")

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.cls = user_class(module).__name__
        self.depth = 0 if not name else name.count(".") + 1
        self.module = module


class _Call:
    """One call of a module: the open forward frame, then its backward bookkeeping."""

    __slots__ = ("info", "call", "recompute", "order", "saved_bytes", "needs_input_grads", "pre_backward_seen", "backward_seen",
                 "input_grads", "live_before")

    def __init__(self, info: _ModuleInfo, call: int, recompute: bool, order: int) -> None:
        self.info = info
        self.call = call
        self.recompute = recompute
        self.order = order
        self.saved_bytes = 0
        self.needs_input_grads = False
        self.pre_backward_seen = False
        self.backward_seen = False
        # the shapes and dtypes of its inputs' gradients when they came before its outputs' (an output that is an
        # input); never the gradients themselves, which the tracer must not keep alive
        self.input_grads: tuple[list[list[int]], list[str]] | None = None
        self.live_before = 0


class _TracingAccountant(TensorAccountant):
    """The accountant, labelling each allocation with the phase it happened in."""

    def __init__(self, tracer: "LayerTracer") -> None:
        super().__init__()
        self._tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        try:
            self.set_label(self._tracer._label_for(func, args, kwargs))
        except BaseException as error:  # never raise inside dispatch
            self._record_error(f"labelling {func}: {type(error).__name__}: {error}")
        return super().__torch_dispatch__(func, types, args, kwargs)


def _inside(qualified_name: str, hidden: str) -> bool:
    """Whether a module named ``qualified_name`` runs inside compiled code that starts at ``hidden``: ``"x."`` is
    the inside of ``torch.compile``'s wrapper ``x``, ``"x"`` a module compiled in place (``x`` itself too), ``""``
    everything (a compiled ``training_step``), ``"."`` every submodule (a compiled root ``forward``)."""
    if hidden == "":
        return True
    if hidden == ".":
        return qualified_name != ""
    if hidden.endswith("."):
        return qualified_name.startswith(hidden)
    return qualified_name == hidden or qualified_name.startswith(hidden + ".")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in obj):
        return list(obj)  # the common case, without pytree's cost
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _shapes(tensors: Sequence[torch.Tensor | None]) -> tuple[list[list[int]], list[str]]:
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    return [list(t.shape) for t in present], [str(t.dtype).replace("torch.", "") for t in present]


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
    :class:`~lightning_memkit.trace.records.LayerTraceResult`. A tracer traces one step; make a
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
        if compiled not in COMPILED_CHOICES:
            raise ValueError(f"compiled={compiled!r}: choose 'keep' (trace the compiled step as it runs) or 'eager' (run the traced step eagerly)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"LayerTracer traces an nn.Module, not {type(model).__name__}; pass your model (the LightningModule itself is fine)")
        if max_depth is not None and (not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 0):
            raise ValueError(f"max_depth={max_depth!r}: give None (every module) or an integer >= 0 (0 = the root only)")
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.model = model
        self.optimizers = list(optimizers)
        self.max_depth = max_depth
        self.step = step
        self.rank = rank
        regions = compiled_regions(model)
        methods = [m for m in ("forward", "training_step") if m in compiled_parts(model)]
        self.compiled = compiled if (regions or methods) else None
        self.notes: list[str] = []
        hidden: list[str] = []
        if self.compiled == "keep":
            # hooks inside compiled code would be compiled into it: only modules outside it, and torch.compile's
            # wrappers (their hooks run around the compiled call), get rows
            hidden = [name + "." if is_compiled_wrapper(module) else name for name, module in regions]
            if "training_step" in methods:
                hidden = [""]
            elif "forward" in methods:
                hidden = ["."]  # the root's own hooks run around its compiled forward; every submodule is inside
        self._hidden = hidden
        self._infos = self._select_modules(model, max_depth, modules, hidden)
        self.result: LayerTraceResult | None = None
        self._active = False
        self._stack_exit: contextlib.ExitStack | None = None

    # ------------------------------------------------------------------ selection
    @staticmethod
    def _select_modules(model: nn.Module, max_depth: int | None, modules: Any, hidden: Sequence[str] = ()) -> dict[int, _ModuleInfo]:
        patterns: list[str] = []
        classes: list[type] = []
        if modules is not None:
            for item in [modules] if isinstance(modules, (str, type)) else list(modules):
                if isinstance(item, str):
                    patterns.append(item)
                elif isinstance(item, type) and issubclass(item, nn.Module):
                    classes.append(item)
                else:
                    raise TypeError(f"modules=: give qualified-name patterns (e.g. 'features.*') or nn.Module classes, not {item!r}")
        # keyed by identity: a module's hash may be its own (torchmetrics' Metric hashes its state, which changes as it updates)
        infos: dict[int, _ModuleInfo] = {}
        named: set[str] = set()
        for qualified_name, module in model.named_modules():
            if any(_inside(qualified_name, h) for h in hidden):
                continue  # inside compiled code
            # Names and classes are the user's: a module inside torch's wrappers (FSDP1, checkpoint_wrapper,
            # torch.compile) is traced once, as its outermost wrapper, under the name it has in the user's model
            # (the wrapper's hooks also see what it does around the module: FSDP1's all-gather, say).
            name = user_name(qualified_name)
            if name in named:
                continue
            named.add(name)
            info = _ModuleInfo(name, module)
            if max_depth is not None and info.depth > max_depth:
                continue
            if modules is not None and not (
                any(fnmatch.fnmatchcase(name, p) for p in patterns) or isinstance(wrapped_module(module), tuple(classes))
            ):
                continue
            infos[id(module)] = info
        if not infos and not hidden:
            names = list(dict.fromkeys(user_name(n) or "(root)" for n, _ in model.named_modules()))[:12]
            raise ValueError(f"modules={modules!r} with max_depth={max_depth!r} selects no module of {type(model).__name__}; its modules include: {', '.join(names)}")
        return infos

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "LayerTracer":
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
        self.events: list[TraceEvent] = []
        self.errors: list[str] = []
        self._handles: list[Any] = []
        self._calls: dict[int, int] = {}  # by id(module), as _infos
        self._recompute_calls: dict[int, int] = {}
        self._stack: list[_Call] = []
        self._order = 0
        self._recompute_depth = 0
        self._host_phase = "forward"
        self._forward_seen = False
        self._end_callback_queued = False
        self._pending_backward: list[_Call] = []
        self._last_live = 0
        self._warned = False
        self._device = self._model_device()
        self.attributor.assign_module(self.model)
        self.attributor.assign_optimizers(self.optimizers)
        if inputs is not None:
            self.attributor.assign(inputs, "inputs")
        self._parameter_keys = {self.accountant.storage_key(p) for p in self.model.parameters()}
        self.attributor.add_save_listener(self._on_save)
        self.accountant.reset_peak()
        self._peak_records: list[StorageRecord] = self.accountant.live_records()
        self._peak_tick = self.attributor.tick
        self.accountant.add_peak_listener(self._on_peak)
        if self._device.type == "cuda":
            try:
                torch.cuda.reset_peak_memory_stats(self._device)
            except RuntimeError:
                pass
        self._install_hooks()
        self._last_live = self.accountant.current_bytes
        self._start_bytes = self.accountant.current_bytes
        self._allocator: AllocatorPeak | None = None
        self._region_forwards: list[tuple[int, int, int]] = []
        if self.compiled == "keep":
            self._allocator = AllocatorPeak(self._device if self._device.type == "cpu" else "cpu")
            if self._device.type != "cpu" or not self._allocator.start(self._start_bytes):
                self._allocator = None
                self.errors.append("compiled model: the allocator's events could not be read (another profiler records, "
                                   "or not a CPU model): bytes inside compiled code are not seen")
            self.notes = [f"compiled model ({', '.join(compiled_parts(self.model))}), traced as it runs: rows for modules outside "
                          "compiled code and for each compiled region as a whole (its saved bytes: what its graph kept for "
                          "backward); bytes from the allocator's events; no category split inside compiled code (the peak's "
                          "rise is 'other'); LayerTrace(compiled='eager') traces the eager program module by module"]
        elif self.compiled == "eager":
            self.notes = [f"compiled model ({', '.join(compiled_parts(self.model))}): this step ran EAGERLY (compiled='eager'); "
                          "its bytes are the eager program's"]
        self._marker("step-start")
        stack = contextlib.ExitStack()
        try:
            if self.compiled == "eager":
                stack.enter_context(force_eager())  # the accountant below would make dynamo skip compiled frames for good
            if self.compiled != "keep":
                stack.enter_context(self.attributor.watch_saved_tensors())
                stack.enter_context(self.accountant)
        except BaseException:
            stack.close()
            self._remove_hooks()
            raise
        self._stack_exit = stack
        self._active = True

    def stop(self) -> LayerTraceResult:
        """Remove every hook and mode and build :attr:`result` (idempotent)."""
        if not self._active:
            if self.result is None:
                raise RuntimeError("LayerTracer.stop() called before start()")
            return self.result
        self._active = False
        try:
            self._marker("step-end")
        finally:
            if self._allocator is not None:
                self._allocator.stop()
                self._fill_from_allocator()
            if self._stack_exit is not None:
                self._stack_exit.close()
                self._stack_exit = None
            self._remove_hooks()
        try:
            # roles made during the step: gradients set to None and back, lazily created optimizer state
            self.attributor.assign_module(self.model)
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
        self._calls = {}
        self._recompute_calls = {}
        self._stack = []
        self._pending_backward = []
        self._parameter_keys = set()
        self._peak_records = []
        self.accountant = None
        self.attributor = None

    def _model_device(self) -> torch.device:
        for tensor in self.model.parameters():
            return tensor.device
        for tensor in self.model.buffers():
            return tensor.device
        return torch.device("cpu")

    def _install_hooks(self) -> None:
        for info in self._infos.values():
            module = info.module
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._forward, with_kwargs=True, always_call=True))
        seen: set[int] = set()
        for parameter in self.model.parameters():
            # a lazy module's parameter before its first forward cannot take hooks (its gradient goes unmarked in that step)
            if parameter.requires_grad and id(parameter) not in seen and not torch.nn.parameter.is_lazy(parameter):
                seen.add(id(parameter))
                self._handles.append(parameter.register_post_accumulate_grad_hook(self._grad_accumulated))
        for optimizer in self.optimizers:
            if hasattr(optimizer, "register_step_post_hook"):
                self._handles.append(optimizer.register_step_post_hook(self._optimizer_stepped))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()

    # ------------------------------------------------------------------ failure handling
    def _error(self, where: str, error: BaseException) -> None:
        message = f"{where}: {type(error).__name__}: {error}"
        if message not in self.errors and len(self.errors) < 20:
            self.errors.append(message)
        if not self._warned:
            self._warned = True
            warnings.warn(f"memkit LayerTracer: {message}; the step continues, this trace may be incomplete", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ labels and peaks
    def _label_for(self, func, args, kwargs) -> str:
        if func is _TO_COPY and args:
            source = args[0]
            dtype = (kwargs or {}).get("dtype")
            if (
                isinstance(source, torch.Tensor) and dtype is not None and dtype != source.dtype
                and self.accountant.storage_key(source) in self._parameter_keys
            ):
                return AUTOCAST_COPY_LABEL
        if in_backward():
            if self._recompute_depth or in_checkpoint_recomputation():
                return RECOMPUTE_LABEL
            return "backward"
        return self._host_phase

    def _on_peak(self, peak_bytes: int) -> None:
        self._peak_records = self.accountant.live_records()
        self._peak_tick = self.attributor.tick

    def _on_save(self, record: StorageRecord, first_time: bool) -> None:
        if first_time and self._stack and record.label != AUTOCAST_COPY_LABEL:
            self._stack[-1].saved_bytes += record.nbytes

    # ------------------------------------------------------------------ events
    def _emit(self, phase: str, info: _ModuleInfo | None, call: int = 0, recompute: bool = False,
              tensors: Sequence[torch.Tensor | None] = (), saved_bytes: int = 0,
              described: tuple[list[list[int]], list[str]] | None = None) -> None:
        if self._allocator is not None:
            # bytes filled in after the step (_fill_from_allocator): the profiler cannot stop inside backward
            self._allocator.mark(str(len(self.events)))
            live = peak = 0
        else:
            live, peak = self.accountant.current_bytes, self.accountant.peak_bytes
        shapes, dtypes = _shapes(tensors) if described is None else described
        self.events.append(TraceEvent(
            index=len(self.events), phase=phase,
            module=info.name if info else "", module_class=info.cls if info else "",
            depth=info.depth if info else 0, call=call, recompute=recompute,
            live_bytes=live, delta_bytes=live - self._last_live, peak_bytes=peak,
            saved_bytes=saved_bytes, shapes=shapes, dtypes=dtypes,
        ))
        self._last_live = live

    def _fill_from_allocator(self) -> None:
        """A compiled model: each event's bytes from the allocator's events up to its mark, read after the step."""
        marks = self._allocator.marks
        last = self._start_bytes
        for event in self.events:
            live, peak = marks.get(str(event.index), (last, max(last, event.peak_bytes)))
            event.live_bytes, event.peak_bytes, event.delta_bytes = live, peak, live - last
            last = live
        for pre_index, forward_index, outputs_bytes in self._region_forwards:
            before = self.events[pre_index].live_bytes
            forward = self.events[forward_index]
            forward.saved_bytes = max(0, forward.live_bytes - before - outputs_bytes)

    def _marker(self, phase: str) -> None:
        self._emit(phase, None)

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        try:
            info = self._infos[id(module)]
            recompute = in_backward()
            tensors = _tensors(args) + (_tensors(kwargs) if kwargs else [])
            if recompute:
                counts = self._recompute_calls
            else:
                counts = self._calls
                self._host_phase = "forward"
                untracked = [t for t in tensors if not self.accountant.is_tracked(t)]
                if untracked:  # tensors from before the step: the batch, or other state
                    self.attributor.assign(untracked, "other" if self._forward_seen else "inputs")
                self._forward_seen = True
            call = counts.get(id(module), 0)
            counts[id(module)] = call + 1
            self._emit("pre-forward", info, call, recompute, tensors)
            frame = _Call(info, call, recompute, self._order)
            frame.live_before = len(self.events) - 1  # the pre-forward event (its bytes, on a compiled model, come later)
            self._order += 1
            self._stack.append(frame)
            if recompute:
                self._recompute_depth += 1
            elif torch.is_grad_enabled():
                needs_grad = [t for t in tensors if t.requires_grad]
                if needs_grad:
                    frame.needs_input_grads = True
                    self._handles.append(register_multi_grad_hook(needs_grad, lambda grads, f=frame: self._backward(f, grads), mode="all"))
        except Exception as error:
            self._error(f"pre-forward hook of {type(module).__name__}", error)

    def _forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._active:
            return
        try:
            frame = None
            while self._stack:
                candidate = self._stack.pop()
                if candidate.recompute:
                    self._recompute_depth -= 1
                if candidate.info.module is module:
                    frame = candidate
                    break
            if frame is None:
                return
            outputs = _tensors(output)
            if self._allocator is not None and is_compiled_wrapper(module):
                # what the compiled graph left alive for backward: its forward's growth less its outputs' storages
                outputs_bytes = sum({id(s): s.nbytes() for s in (storage_of(t) for t in outputs) if s is not None}.values())
                self._region_forwards.append((frame.live_before, len(self.events), outputs_bytes))
            self._emit("forward", frame.info, frame.call, frame.recompute, outputs, frame.saved_bytes)
            if self._stack:
                self._stack[-1].saved_bytes += frame.saved_bytes
            if not frame.recompute and torch.is_grad_enabled():
                needs_grad = [t for t in outputs if t.requires_grad]
                if needs_grad:
                    self._handles.append(register_multi_grad_hook(needs_grad, lambda grad, f=frame: self._pre_backward(f, grad), mode="any"))
        except Exception as error:
            self._error(f"forward hook of {type(module).__name__}", error)

    def _pre_backward(self, frame: _Call, grad: torch.Tensor | None) -> None:
        if not self._active:
            return
        try:
            self._ensure_backward_end_callback()
            if frame.pre_backward_seen:
                return
            frame.pre_backward_seen = True
            self._emit("pre-backward", frame.info, frame.call, False, [grad])
            if frame.input_grads is not None:  # an output that is also an input: its gradient hook ran first
                frame.backward_seen = True
                self._emit("backward", frame.info, frame.call, False, described=frame.input_grads)
            elif not frame.needs_input_grads:
                self._pending_backward.append(frame)
        except Exception as error:
            self._error("pre-backward hook", error)

    def _backward(self, frame: _Call, grads: Sequence[torch.Tensor | None]) -> None:
        if not self._active:
            return
        try:
            self._ensure_backward_end_callback()
            if frame.backward_seen:
                return
            if not frame.pre_backward_seen:
                # No gradient reached this call's outputs (yet): its inputs' gradients come from elsewhere. A call
                # whose outputs take no part in the loss has no backward (a torchmetrics metric updated with the
                # loss); an output that is its input (nn.Identity) gets its gradient right after, see _pre_backward.
                frame.input_grads = _shapes(list(grads))
                return
            frame.backward_seen = True
            self._emit("backward", frame.info, frame.call, False, list(grads))
        except Exception as error:
            self._error("backward hook", error)

    def _grad_accumulated(self, parameter: torch.Tensor) -> None:
        if not self._active:
            return
        try:
            self._ensure_backward_end_callback()
            if parameter.grad is not None:
                self.attributor.assign([parameter.grad], "gradients")
        except Exception as error:
            self._error("gradient hook", error)

    def _ensure_backward_end_callback(self) -> None:
        if not self._end_callback_queued:
            self._end_callback_queued = True
            queue_backward_end_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end_callback_queued = False
        if not self._active:
            return
        try:
            # calls whose inputs need no gradient finish when backward does, innermost first
            for frame in sorted(self._pending_backward, key=lambda f: -f.order):
                if not frame.backward_seen:
                    frame.backward_seen = True
                    self._emit("backward", frame.info, frame.call, False, ())
            self._pending_backward.clear()
            self._marker("backward-end")
            self._host_phase = "optimizer"
        except Exception as error:
            self._error("end of backward", error)

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        try:
            self.attributor.assign_optimizers([optimizer])
            self._marker("optimizer-step")
        except Exception as error:
            self._error("optimizer step hook", error)

    # ------------------------------------------------------------------ result
    def _build_result(self) -> LayerTraceResult:
        at_peak: CategoryBreakdown = self.attributor.breakdown_of(self._peak_records, self._peak_tick)
        at_end: CategoryBreakdown = self.attributor.breakdown()
        if self._device.type == "cuda":
            end_extras = cuda_memory_extras(self._device)
            peak_extras = cuda_memory_extras(self._device, peak=True)
            peak_extras["nvml_unseen_bytes"] = end_extras["nvml_unseen_bytes"]  # NVML has no peak; the unseen part barely moves
            for breakdown, extras in ((at_peak, peak_extras), (at_end, end_extras)):
                for key, value in extras.items():
                    setattr(breakdown, key, value)
        peak = self.accountant.peak_bytes
        end = self.accountant.current_bytes
        if self._allocator is not None:
            end, peak = self._allocator.now() if self._allocator.active else (self.events[-1].live_bytes, self._allocator.peak_bytes or 0)
            # inside compiled code nothing is attributed: the peak's rise above what the tracer knows is "other"
            at_peak = self.attributor.breakdown()
            unseen = max(0, peak - at_peak.total_bytes)
            at_peak.bytes_by_category["other"] = at_peak.bytes_by_category.get("other", 0) + unseen
            at_peak.total_bytes += unseen
        peak_index = next((e.index for e in self.events if e.peak_bytes >= peak), None)
        seen: set[int] = set()
        parameter_count = 0
        for parameter in self.model.parameters():
            if id(parameter) not in seen:
                seen.add(id(parameter))
                parameter_count += parameter.numel()
        errors = list(self.errors) + [f"accountant: {e}" for e in self.accountant.errors]
        return LayerTraceResult(
            step=self.step, rank=self.rank, device=str(self._device), model=user_class(self.model).__name__,
            parameter_count=parameter_count, events=list(self.events), start_bytes=self._start_bytes,
            end_bytes=end, peak_bytes=peak, peak_event_index=peak_index,
            at_peak=at_peak, at_end=at_end, errors=errors, notes=list(self.notes),
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
    tracer = LayerTracer(model, optimizers, max_depth=max_depth, modules=modules, step=step, rank=rank, compiled=compiled)
    tracer.start(inputs)
    try:
        yield tracer
    finally:
        tracer.stop()
