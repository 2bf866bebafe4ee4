"""How a creation recorder sees ops: each op's new storages get a :class:`Creation`, kept until torch frees the
storage, and, while a liveness window is open, each input storage's last use.

:class:`OpTracking` is the dispatch-mode half of :class:`~lightning_memkit.doctor.recorder.CreationRecorder`,
which enters and leaves the mode, installs the module hooks, gives roles and answers what it knows; recorder.py's
docstring says how each part is found, and why.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

from lightning_memkit._torch_compat import TorchDispatchMode
from lightning_memkit.accounting.accountant import _tensors_in, returns_alias, storage_keys, storage_of
from lightning_memkit.doctor.creation import STATE_ROLES, Creation
from lightning_memkit.doctor.frames import user_frame
from lightning_memkit.trace._torch_compat import in_backward

__all__ = ["OpTracking"]

#: at most this many distinct error messages are kept; later ones are only counted.
_MAX_ERRORS = 20

_OP_NAMES: dict[Any, str] = {}


def _op_name(func: Any) -> str:
    name = _OP_NAMES.get(func)
    if name is None:
        try:
            name = str(func.overloadpacket)
        except AttributeError:
            name = str(func)
        _OP_NAMES[func] = name
    return name


class OpTracking(TorchDispatchMode):
    """The records of the storages ops make while the mode is active, and (with ``_liveness`` on) their uses.

    A subclass names the modules (``_names``), enters and leaves the mode, and opens the liveness window
    (``_liveness``, ``_window``); see :class:`~lightning_memkit.doctor.recorder.CreationRecorder`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, Creation] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._made: dict[int, weakref.ref] = {}  # storage key -> the tensor its op returned (for kept graphs)
        self._lock = threading.RLock()
        self._names: dict[int, str] = {}
        self._module_stack: list[str] = []
        self._clock = 0
        self.step: int | None = None
        self.live_bytes = 0
        self._liveness = False
        self._window: list[Creation] | None = None
        self.errors: list[str] = []
        self.error_count = 0
        self.before_run_bytes = 0
        self.state_bytes = 0  # live bytes of training state (parameters, buffers, gradients, optimizer state)

    def _track(
        self, storage: Any, tensor: torch.Tensor, op: str, module: str, phase: str, frame: Any, adopted: bool = False
    ) -> Creation:
        key = id(storage)
        creation = Creation(
            int(storage.nbytes()),
            str(storage.device),
            tuple(tensor.shape),
            str(tensor.dtype),
            op,
            module,
            phase,
            frame,
            self.step,
            created_at=-1 if adopted else self._clock,
        )
        creation.last_use_at = creation.created_at
        ref = weakref.ref(storage, lambda _ref: self._release(key))
        with self._lock:
            self._live[key] = creation
            self._refs[key] = ref
            self.live_bytes += creation.nbytes
        # the tensor first seen on it: where a kept graph hangs, and where the holder search starts (a tensor
        # subclass without weak references has none)
        with contextlib.suppress(TypeError):
            self._made[key] = weakref.ref(tensor)
        if self._window is not None:
            self._window.append(creation)
        return creation

    def _release(self, key: int) -> None:
        with self._lock:
            creation = self._live.pop(key, None)
            self._refs.pop(key, None)
            self._made.pop(key, None)
            if creation is None:
                return
            creation.freed_at = self._clock
            self.live_bytes -= creation.nbytes
            if creation.before_run:
                self.before_run_bytes -= creation.nbytes
            if creation.role in STATE_ROLES:
                self.state_bytes -= creation.nbytes

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._module_stack.append(self._names.get(id(module)) or type(module).__name__)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._module_stack:
            self._module_stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self._clock += 1
        result = func(*args, **(kwargs or {}))
        try:
            self._observe(func, args, kwargs, result)
        except BaseException as error:  # noqa: BLE001 - never raise from dispatch (it can abort the interpreter): counted
            self.error_count += 1
            message = f"{func}: {type(error).__name__}: {error}"
            if len(self.errors) < _MAX_ERRORS and message not in self.errors:
                self.errors.append(message)
        return result

    def _observe(self, func: Any, args: Any, kwargs: Any, result: Any) -> None:
        outputs = _tensors_in(result)
        liveness = self._liveness
        if not outputs and not liveness:
            return
        name = _op_name(func)
        if in_backward():
            module, phase = "", "backward"
        elif self._module_stack:
            module, phase = self._module_stack[-1], "forward"
        else:
            module, phase = "", "other"
        frame: Any = False  # computed at most once per op, and only when needed
        input_keys: set[int] | None = None
        if liveness:
            frame = user_frame()
            input_keys = set()
            clock = self._clock
            for tensor in _tensors_in((args, kwargs)):
                storage = storage_of(tensor)
                if storage is None:
                    continue
                key = id(storage)
                input_keys.add(key)
                creation = self._live.get(key)
                if creation is not None:
                    creation.last_use_at = clock
                    creation.last_use_op = name
                    creation.last_use_module = module
                    creation.last_use_phase = phase
                    creation.last_use_frame = frame
        alias = returns_alias(func)
        if alias and input_keys is None:
            input_keys = storage_keys((args, kwargs))
        for output in outputs:
            storage = storage_of(output)
            if storage is None:
                continue
            key = id(storage)
            if key in self._live or (input_keys is not None and alias and key in input_keys):
                continue
            if frame is False:
                frame = user_frame()
            self._track(storage, output, name, module, phase, frame)
