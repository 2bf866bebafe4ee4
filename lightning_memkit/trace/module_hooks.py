"""The hooks a layer trace puts on modules, parameters and optimizers, and the bookkeeping of each module call.

Forward events come from module hooks, backward events from gradient hooks on a call's outputs and inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.accounting.accountant import storage_of
from lightning_memkit.accounting.categories import CategoryAttributor
from lightning_memkit.compiled import is_compiled_wrapper
from lightning_memkit.trace._torch_compat import in_backward, queue_backward_end_callback
from lightning_memkit.trace.selection import TracedModule
from lightning_memkit.trace.timeline import StepTimeline, shapes_of

__all__ = ["ModuleCall", "ModuleHooks"]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in obj):
        return list(obj)  # the common case, without pytree's cost
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


class ModuleCall:
    """One call of a module: the open forward frame, then its backward bookkeeping."""

    __slots__ = (
        "info",
        "call",
        "recompute",
        "order",
        "saved_bytes",
        "needs_input_grads",
        "pre_backward_seen",
        "backward_seen",
        "input_grads",
        "live_before",
    )

    def __init__(self, info: TracedModule, call: int, recompute: bool, order: int) -> None:
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


class ModuleHooks:
    """The hooks of one traced step and what they share: the open calls, the calls per module, the phase.

    Backward events are graph based: ``register_multi_grad_hook`` on a call's outputs ("pre-backward": the first
    output gradient is ready) and inputs ("backward": every input gradient is ready); module "full" backward hooks
    would wrap outputs in a Function whose outputs may not be modified in place (``ReLU(inplace=True)``). A call none
    of whose inputs needs a gradient gets its backward event when backward ends, innermost first. A hook that fails
    reports to ``on_error`` and never interrupts the step; hooks do nothing until :attr:`active` is set.
    """

    def __init__(
        self,
        infos: dict[int, TracedModule],
        attributor: CategoryAttributor,
        timeline: StepTimeline,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.infos = infos
        self.attributor = attributor
        self.accountant = attributor.accountant
        self.timeline = timeline
        self.on_error = on_error
        self.active = False
        #: "forward" or "optimizer": the phase of host code outside backward (the accountant's label)
        self.host_phase = "forward"
        #: how many recomputed (checkpointed) forwards are open
        self.recompute_depth = 0
        #: the calls whose forward is open, innermost last
        self.stack: list[ModuleCall] = []
        self._handles: list[Any] = []
        self._calls: dict[int, int] = {}  # by id(module), as infos
        self._recompute_calls: dict[int, int] = {}
        self._order = 0
        self._forward_seen = False
        self._end_callback_queued = False
        self._pending_backward: list[ModuleCall] = []

    # ------------------------------------------------------------------ install and remove
    def install(self, model: nn.Module, optimizers: Sequence[Any]) -> None:
        """Hook every selected module, every trainable parameter of ``model`` and the optimizers' steps."""
        for info in self.infos.values():
            module = info.module
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._forward, with_kwargs=True, always_call=True))
        seen: set[int] = set()
        for parameter in model.parameters():
            # a lazy module's parameter before its first forward cannot take hooks (its gradient goes unmarked)
            if parameter.requires_grad and id(parameter) not in seen and not torch.nn.parameter.is_lazy(parameter):
                seen.add(id(parameter))
                self._handles.append(parameter.register_post_accumulate_grad_hook(self._grad_accumulated))
        for optimizer in optimizers:
            if hasattr(optimizer, "register_step_post_hook"):
                self._handles.append(optimizer.register_step_post_hook(self._optimizer_stepped))

    def remove(self) -> None:
        """Remove every hook (a hook that cannot be removed is left: the tracer is being torn down)."""
        for handle in self._handles:
            with contextlib.suppress(Exception):  # tearing down: one stuck hook must not keep the others
                handle.remove()
        self._handles.clear()

    def release(self) -> None:
        """Forget the modules, the calls and the accounting: they reach the model, its gradients and the batch."""
        self.infos = {}
        del self.attributor, self.accountant
        self._calls = {}
        self._recompute_calls = {}
        self.stack = []
        self._pending_backward = []

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        try:
            info = self.infos[id(module)]
            recompute = in_backward()
            tensors = _tensors(args) + (_tensors(kwargs) if kwargs else [])
            if recompute:
                counts = self._recompute_calls
            else:
                counts = self._calls
                self.host_phase = "forward"
                untracked = [t for t in tensors if not self.accountant.is_tracked(t)]
                if untracked:  # tensors from before the step: the batch, or other state
                    self.attributor.assign(untracked, "other" if self._forward_seen else "inputs")
                self._forward_seen = True
            call = counts.get(id(module), 0)
            counts[id(module)] = call + 1
            self.timeline.emit("pre-forward", info, call, recompute, tensors)
            frame = ModuleCall(info, call, recompute, self._order)
            frame.live_before = len(self.timeline.events) - 1  # the pre-forward (a compiled model's bytes come later)
            self._order += 1
            self.stack.append(frame)
            if recompute:
                self.recompute_depth += 1
            elif torch.is_grad_enabled():
                needs_grad = [t for t in tensors if t.requires_grad]
                if needs_grad:
                    frame.needs_input_grads = True
                    self._handles.append(
                        register_multi_grad_hook(
                            needs_grad, lambda grads, f=frame: self._backward(f, grads), mode="all"
                        )
                    )
        except Exception as error:  # noqa: BLE001 - a hook never breaks the user's step: on_error reports it
            self.on_error(f"pre-forward hook of {type(module).__name__}", error)

    def _close_call(self, module: nn.Module) -> ModuleCall | None:
        """Pop the open calls down to ``module``'s (a call whose forward raised leaves its frame open)."""
        while self.stack:
            candidate = self.stack.pop()
            if candidate.recompute:
                self.recompute_depth -= 1
            if candidate.info.module is module:
                return candidate
        return None

    def _forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self.active:
            return
        try:
            frame = self._close_call(module)
            if frame is None:
                return
            outputs = _tensors(output)
            if self.timeline.allocator is not None and is_compiled_wrapper(module):
                storages = {id(s): s.nbytes() for s in (storage_of(t) for t in outputs) if s is not None}
                self.timeline.region_forward(frame.live_before, sum(storages.values()))
            self.timeline.emit("forward", frame.info, frame.call, frame.recompute, outputs, frame.saved_bytes)
            if self.stack:
                self.stack[-1].saved_bytes += frame.saved_bytes
            if not frame.recompute and torch.is_grad_enabled():
                needs_grad = [t for t in outputs if t.requires_grad]
                if needs_grad:
                    self._handles.append(
                        register_multi_grad_hook(
                            needs_grad, lambda grad, f=frame: self._pre_backward(f, grad), mode="any"
                        )
                    )
        except Exception as error:  # noqa: BLE001 - a hook never breaks the user's step: on_error reports it
            self.on_error(f"forward hook of {type(module).__name__}", error)

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, frame: ModuleCall, grad: torch.Tensor | None) -> None:
        if not self.active:
            return
        try:
            self._ensure_backward_end_callback()
            if frame.pre_backward_seen:
                return
            frame.pre_backward_seen = True
            self.timeline.emit("pre-backward", frame.info, frame.call, False, [grad])
            if frame.input_grads is not None:  # an output that is also an input: its gradient hook ran first
                frame.backward_seen = True
                self.timeline.emit("backward", frame.info, frame.call, False, described=frame.input_grads)
            elif not frame.needs_input_grads:
                self._pending_backward.append(frame)
        except Exception as error:  # noqa: BLE001 - a hook never breaks the user's step: on_error reports it
            self.on_error("pre-backward hook", error)

    def _backward(self, frame: ModuleCall, grads: Sequence[torch.Tensor | None]) -> None:
        if not self.active:
            return
        try:
            self._ensure_backward_end_callback()
            if frame.backward_seen:
                return
            if not frame.pre_backward_seen:
                # No gradient reached this call's outputs (yet): its inputs' gradients come from elsewhere. A call
                # whose outputs take no part in the loss has no backward (a torchmetrics metric updated with the
                # loss); an output that is its input (nn.Identity) gets its gradient right after, see _pre_backward.
                frame.input_grads = shapes_of(list(grads))
                return
            frame.backward_seen = True
            self.timeline.emit("backward", frame.info, frame.call, False, list(grads))
        except Exception as error:  # noqa: BLE001 - a hook never breaks the user's step: on_error reports it
            self.on_error("backward hook", error)

    def _grad_accumulated(self, parameter: torch.Tensor) -> None:
        if not self.active:
            return
        try:
            self._ensure_backward_end_callback()
            if parameter.grad is not None:
                self.attributor.assign([parameter.grad], "gradients")
        except Exception as error:  # noqa: BLE001 - a hook never breaks the user's step: on_error reports it
            self.on_error("gradient hook", error)

    def _ensure_backward_end_callback(self) -> None:
        if not self._end_callback_queued:
            self._end_callback_queued = True
            queue_backward_end_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end_callback_queued = False
        if not self.active:
            return
        try:
            # calls whose inputs need no gradient finish when backward does, innermost first
            for frame in sorted(self._pending_backward, key=lambda f: -f.order):
                if not frame.backward_seen:
                    frame.backward_seen = True
                    self.timeline.emit("backward", frame.info, frame.call, False, ())
            self._pending_backward.clear()
            self.timeline.marker("backward-end")
            self.host_phase = "optimizer"
        except Exception as error:  # noqa: BLE001 - a hook never breaks the user's step: on_error reports it
            self.on_error("end of backward", error)

    # ------------------------------------------------------------------ optimizer
    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        try:
            self.attributor.assign_optimizers([optimizer])
            self.timeline.marker("optimizer-step")
        except Exception as error:  # noqa: BLE001 - a hook never breaks the user's step: on_error reports it
            self.on_error("optimizer step hook", error)
