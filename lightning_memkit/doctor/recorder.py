"""Who made each live tensor, and when it was last used: the memory doctor's recording.

Owns :class:`CreationRecorder`, a TorchDispatchMode that keeps, for every storage created while it
is active, a :class:`Creation` (aten op, module path, forward/backward, shape, dtype, the user's
Python line) and, when asked, each storage's last use (the last op that read it, backward included).

How it works, and why:

* New storages are found as the tensor accountant finds them: an op's output whose storage is not an
  input's and not yet known. A ``weakref`` on the storage tells when torch frees it.
* The module path comes from torch's *global* forward hooks (``register_module_forward_pre_hook``),
  installed only while recording; names from :meth:`CreationRecorder.name_modules`.
* The user's line is the innermost Python frame outside torch, Lightning, memkit and the standard
  library (:func:`~lightning_memkit.doctor.frames.user_frame`; a few microseconds per op).
* Uses: every op's tensor inputs, forward and backward (a saved tensor is read by the backward op
  that needs it, so saved-for-backward uses count); recorded only between :meth:`begin_liveness`
  and :meth:`end_liveness`, because that is the costly part.

The op side (an op's outputs tracked, its inputs' uses noted) is
:class:`~lightning_memkit.doctor.op_tracking.OpTracking`, the recorder's base class.
"""

from __future__ import annotations

import gc
import types
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.modules import module as module_hooks

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.accounting.accountant import storage_of
from lightning_memkit.compiled import COMPILED_CHOICES, AllocatorBalance
from lightning_memkit.compiled._torch_compat import force_eager
from lightning_memkit.doctor import _torch_compat
from lightning_memkit.doctor.creation import STATE_ROLES, Creation
from lightning_memkit.doctor.op_tracking import OpTracking

__all__ = ["CreationRecorder", "active_recorders", "creation_of"]

_ACTIVE: weakref.WeakSet[CreationRecorder] = weakref.WeakSet()
_ALL: weakref.WeakSet[CreationRecorder] = weakref.WeakSet()  # every recorder alive: they know live storages


class CreationRecorder(OpTracking):
    """Record who made every storage created while active, and optionally each one's last use.

    Usage (plain PyTorch)::

        recorder = CreationRecorder()
        recorder.name_modules(model)                 # module paths in the records
        recorder.start(step=0, batch=x, module=model, optimizers=[opt])
        loss = model(x).sum(); loss.backward(); opt.step()
        recorder.stop()
        for creation in recorder.live_creations(): print(creation.describe(), creation.nbytes)

    :meth:`start` enters the mode *below* any other active dispatch mode, so it may span several
    Lightning hooks while other callbacks enter and exit their own modes inside it; :meth:`stop`
    exits it wherever it is. Frees are seen whether or not it is active. It never raises from an op:
    failures are kept in :attr:`errors`.

    Attributes:
        live_bytes: bytes of every live storage the recorder knows (made while recording, or adopted
            by :meth:`adopt` / :meth:`start`), exact.
        state_bytes: the part of ``live_bytes`` that is training state (:data:`STATE_ROLES`).
        before_run_bytes: the part of ``live_bytes`` alive before the run (:meth:`know_existing`).
        errors: distinct error messages from recording (at most 20).
    """

    def __init__(self) -> None:
        super().__init__()  # OpTracking: the records, the op clock, the byte counts, the errors
        self._hooks: list[Any] = []
        self._window_start = 0
        self._before: dict[int, weakref.ref] = {}  # storage key -> storage, of tensors alive before the run
        self._compiled: str | None = None
        self._balance: Any = None  # AllocatorBalance on a compiled model kept compiled
        self._eager: Any = None  # force_eager() while recording a compiled model eagerly
        _ALL.add(self)

    # ------------------------------------------------------------------ compiled models
    @property
    def compiled(self) -> str | None:
        """How a compiled model is recorded. ``None`` (default): the dispatch mode sees every op. ``"keep"``: no
        dispatch mode (under one dynamo runs nothing compiled); the live bytes come from the allocator's own
        events (:class:`~lightning_memkit.compiled.AllocatorBalance`) and who made a tensor is only what a walk of
        the collector's objects finds between steps (op ``"found between steps"``, its ``grad_fn``; no module, no
        line). ``"eager"``: the dispatch mode as usual, with compiled code run eagerly while recording."""
        return self._compiled

    @compiled.setter
    def compiled(self, value: str | None) -> None:
        if value is not None and value not in COMPILED_CHOICES:
            raise ValueError(f"CreationRecorder.compiled={value!r}: choose one of {COMPILED_CHOICES} or None")
        self.stop()
        self._compiled = value

    def catch_up(self) -> None:
        """Know the tensors made since the last look that the recorder could not see made (``compiled="keep"``):
        a walk of the collector's objects, each new storage recorded as made in the step before. Nothing otherwise."""
        if self._compiled != "keep":
            return
        with warnings.catch_warnings():  # isinstance on some module attributes warns (torch.distributed.reduce_op)
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            tensors = []
            for obj in objects:
                try:
                    if (
                        isinstance(obj, torch.Tensor)
                        and type(obj).__name__ != "FakeTensor"
                        and obj.device.type != "meta"
                    ):
                        tensors.append(obj)
                except Exception:  # noqa: BLE001 - dead weakref proxies and the like raise on isinstance
                    continue
            del objects
        for obj in tensors:
            storage = storage_of(obj)
            if storage is None or id(storage) in self._live:
                continue
            grad_fn = obj.grad_fn
            op = "found between steps" + (f" ({type(grad_fn).__name__})" if grad_fn is not None else "")
            creation = self._track(storage, obj, op, "", "other", None)
            creation.step = self.step

    def live_bytes_now(self) -> int:
        """The live bytes to compare between steps: :attr:`live_bytes`, or with ``compiled="keep"`` the
        allocator's live bytes (what compiled code holds without a Python object counted too)."""
        if self._balance is not None and self._balance.active:
            return self._balance.live_bytes()
        return self.live_bytes

    # ------------------------------------------------------------------ set-up
    def name_modules(self, root: torch.nn.Module) -> None:
        """Name ``root``'s submodules by their path (``root.named_modules()``) in the records; the root
        itself by its class name. Modules never named here show as their class name."""
        for name, module in root.named_modules():
            self._names.setdefault(id(module), name or type(root).__name__)

    @property
    def clock(self) -> int:
        """The op clock: the number of ops seen so far."""
        return self._clock

    @property
    def is_active(self) -> bool:
        """Whether the recorder is on the dispatch-mode stack now."""
        return _torch_compat.mode_is_active(self)

    def start(
        self,
        step: int | None = None,
        *,
        batch: Any = None,
        module: torch.nn.Module | None = None,
        optimizers: Iterable[Any] = (),
    ) -> None:
        """Begin (or continue) recording for ``step``: adopt the training state of ``module`` and
        ``optimizers`` and the ``batch`` (role ``"inputs"``, of this step), then enter the mode."""
        self.step = step
        self.assign_roles(module, optimizers, batch)
        if self._compiled == "keep":
            if self._balance is None or not self._balance.active:
                self.catch_up()
                self._balance = AllocatorBalance("cpu")
                if not self._balance.start(self.live_bytes):
                    self.error_count += 1
                    self.errors.append(
                        "another profiler records: the allocator's live bytes are not read (compiled "
                        "model); only the tensors found between steps are compared"
                    )
            return
        if self._compiled == "eager" and self._eager is None:
            self._eager = force_eager()
            self._eager.__enter__()
        if not self.is_active:
            _torch_compat.enter_mode_at_bottom(self)
            self._hooks = [
                module_hooks.register_module_forward_pre_hook(self._pre_forward),
                module_hooks.register_module_forward_hook(self._post_forward, always_call=True),
            ]
            _ACTIVE.add(self)
        self._module_stack.clear()

    def stop(self) -> None:
        """Stop recording (frees are still seen). Safe to call when not active."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._module_stack.clear()
        if self._balance is not None:
            self._balance.stop()
            self._balance = None
        if self._eager is not None:
            eager, self._eager = self._eager, None
            eager.__exit__(None, None, None)
        _torch_compat.exit_mode_anywhere(self)
        _ACTIVE.discard(self)

    def assign_roles(
        self, module: torch.nn.Module | None = None, optimizers: Iterable[Any] = (), batch: Any = None
    ) -> None:
        """Give storages their lifetime role by identity (adopting those not seen yet): the module's
        parameters, buffers and gradients, the optimizers' state, and the batch (``"inputs"`` of the
        current step). A role, once given, stays."""
        if module is not None:
            parameters = list(module.parameters())
            self._assign(parameters, "parameters")
            self._assign(list(module.buffers()), "buffers")
            self._assign([p.grad for p in parameters if p.grad is not None], "gradients")
        for optimizer in optimizers:
            for state in getattr(optimizer, "state", {}).values():
                if isinstance(state, dict):
                    self._assign([v for v in state.values() if isinstance(v, torch.Tensor)], "optimizer_state")
        if batch is not None:
            leaves = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor)]
            self._assign(leaves, "inputs", step=self.step)

    def adopt(self, tensors: Iterable[Any], role: str | None = None) -> int:
        """Know existing tensors (op ``"existing"``); returns the bytes newly adopted. ``role``: the lifetime
        role to give those without one (see :attr:`Creation.role`: ``"parameters"``, ``"gradients"``, ...), or
        ``None``."""
        before = self.live_bytes
        self._assign(list(tensors), role)
        return self.live_bytes - before

    def know_existing(self, roots: Iterable[Any], max_objects: int = 200_000, stop_at: Iterable[Any] = ()) -> int:
        """Note the tensors reachable from ``roots`` (a dataloader, a datamodule: what feeds the run) as
        alive before the run: adopted later (a pre-built batch the loader yields), they are marked
        :attr:`Creation.before_run` and counted in :attr:`before_run_bytes`, never as memory a step
        added. Follows ``gc.get_referents`` from the roots, at most ``max_objects`` objects, never into
        modules, classes, functions, ``nn.Module`` objects or ``stop_at`` (the trainer, say). Returns how
        many storages were noted."""
        stop = (type, types.ModuleType, types.FunctionType, types.FrameType, types.CodeType, torch.nn.Module)
        seen: set[int] = {id(obj) for obj in stop_at}
        stack = [root for root in roots if root is not None]
        count = 0
        while stack and len(seen) < max_objects:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                storage = storage_of(obj)
                if storage is not None and id(storage) not in self._before:
                    try:
                        self._before[id(storage)] = weakref.ref(storage)
                        count += 1
                    except TypeError:
                        pass
                continue
            if isinstance(obj, stop):
                continue
            stack.extend(gc.get_referents(obj))
        return count

    def _assign(self, tensors: list, role: str | None, step: int | None = None) -> None:
        for tensor in tensors:
            storage = storage_of(tensor)
            if storage is None:
                continue
            creation = self._live.get(id(storage))
            if creation is None:
                creation = self._track(storage, tensor, "existing", "", "other", None, adopted=True)
                creation.step = step
                before = self._before.get(id(storage))
                if before is not None and before() is storage:
                    creation.before_run = True
                    self.before_run_bytes += creation.nbytes
            if creation.role is None and role is not None:
                creation.role = role
                if role in STATE_ROLES:
                    self.state_bytes += creation.nbytes
                if role == "inputs" and step is not None:
                    creation.step = step  # a prefetched batch belongs to the step it feeds

    # ------------------------------------------------------------------ reading
    def live_creations(self) -> list[Creation]:
        """The records of every live storage the recorder knows (a snapshot)."""
        with self._lock:
            return list(self._live.values())

    def live_items(self) -> list[tuple[int, Creation]]:
        """``[(storage key, record), ...]`` of every live storage the recorder knows (a snapshot)."""
        with self._lock:
            return list(self._live.items())

    def tensor_of(self, key: int) -> torch.Tensor | None:
        """The tensor first seen on the storage ``key`` (its creating op's output), while it is alive."""
        ref = self._made.get(key)
        tensor = ref() if ref is not None else None
        return tensor if tensor is not None and id(storage_of(tensor)) == key else None

    def tensors_with_graph(self) -> list[torch.Tensor]:
        """The tensors the recorder saw made (each storage's first tensor) that are alive and attached to
        an autograd graph (``grad_fn`` set): where a graph kept across steps hangs. No ``gc`` pass."""
        with self._lock:
            refs = list(self._made.values())
        found = []
        for ref in refs:
            tensor = ref()
            if tensor is not None and tensor.grad_fn is not None:
                found.append(tensor)
        return found

    def creation_of(self, tensor: torch.Tensor) -> Creation | None:
        """The record of ``tensor``'s storage, or ``None`` when the recorder never saw it made."""
        storage = storage_of(tensor)
        return None if storage is None else self._live.get(id(storage))

    def record_of_storage(self, key: int) -> Creation | None:
        """The record of the live storage ``key`` (``id`` of an untyped storage), or ``None`` when unknown."""
        return self._live.get(key)

    def made_since(self, clock: int) -> list[Creation]:
        """The records of the live storages made by an op after op clock ``clock`` (see :attr:`clock`), newest
        first. Walks back from the newest record, so it costs what was made since, not what is alive."""
        found: list[Creation] = []
        try:
            for creation in reversed(self._live.values()):
                if creation.created_at == -1:
                    continue  # adopted (a batch, state): recorded whenever it was first seen, in no clock order
                if creation.created_at <= clock:
                    break
                found.append(creation)
        except RuntimeError:  # a storage freed while walking (its weakref callback changed the dict): what was found
            pass
        return found

    def watched_bytes_of(self, storages: Iterable[Any]) -> int:
        """Bytes of the distinct untyped ``storages`` that :attr:`live_bytes` counts, less training state and
        less what was alive before the run (:meth:`know_existing`): their part of what the leak rule watches
        (see :meth:`~lightning_memkit.doctor.verdict.DoctorSession.watched_bytes`). A storage the recorder does not know
        counts 0 bytes."""
        seen: set[int] = set()
        total = 0
        for storage in storages:
            key = id(storage)
            creation = self._live.get(key)
            if key in seen or creation is None or creation.before_run or creation.role in STATE_ROLES:
                continue
            seen.add(key)
            total += creation.nbytes
        return total

    # ------------------------------------------------------------------ liveness
    def begin_liveness(self) -> None:
        """From now, record each storage's uses (and every storage made) until :meth:`end_liveness`."""
        with self._lock:
            self._window = list(self._live.values())
        for creation in self._window:
            creation.last_use_at = -1  # uses before the window are not this window's
        self._window_start = self._clock
        self._liveness = True

    def end_liveness(self) -> tuple[list[Creation], int, int]:
        """Stop recording uses; returns ``(creations, start_clock, end_clock)``: every storage live at
        the window's start or made in it, with the op clock of the window's ends."""
        self._liveness = False
        window, self._window = self._window or [], None
        return window, self._window_start, self._clock


def active_recorders() -> list[CreationRecorder]:
    """The recorders recording now (for the out-of-memory report)."""
    return list(_ACTIVE)


def creation_of(tensor: torch.Tensor) -> Creation | None:
    """Who made ``tensor``'s storage, according to any live recorder that knows it, or ``None``."""
    for recorder in list(_ALL):
        found = recorder.creation_of(tensor)
        if found is not None:
            return found
    return None
