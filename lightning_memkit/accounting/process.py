"""The whole process's live tensor storages, found without a dispatch mode, fed to a TensorAccountant.

It owns what makes the CPU reading mean what CUDA's ``allocated`` means: every live tensor of the
process, whoever made it and whenever (a callback, the steps between measured ones, set-up).

How it finds them, and why this way (torch keeps no count of live CPU memory; ``gc.get_objects()``
over a training process is 100+ ms, far too slow per step):

* **Once, at start**: every object the garbage collector tracks is looked at (a full sweep).
* **From then on, only young objects.** Every Python tensor object is created in the collector's
  youngest generation and can leave it only through a collection. A ``gc.callbacks`` hook looks at
  the youngest generation at the start of every collection, and :meth:`ProcessTensors.sweep` looks
  at it again when asked (a step window opening or closing): together they see every tensor object
  that lives long enough to matter, at a cost of the few hundred young objects per look.
* **Tensors with no Python object** are reached from ones that have one: a leaf tensor's ``.grad``,
  and the tensors an autograd graph saved for backward (walked from every live tensor with a
  ``grad_fn``, read through :func:`saved_tensor_data`, which never runs an unpack hook, so a
  checkpointed graph is never recomputed). Each such tensor's graph is walked once (again only
  after an in-place op gave it a new ``grad_fn``): a graph never gains saved tensors later, and
  the leaves a walk reached are read again at every sweep for a new ``.grad``. Graphs that live
  for the whole run (dynamo keeps FakeTensors with a ``grad_fn`` as long as the compiled code)
  are therefore walked once, not at every step.
* Storages are adopted into the accountant (label ``"process"``), which counts each once and sees
  its free through a weak reference, as for every other storage.

Limits: memory held only by C++ with no tensor reachable from Python (DDP's gradient buckets,
oneDNN caches, a TorchScript module's internals until accessed) and objects moved out of the
collector by ``gc.freeze()`` are not seen.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_memkit._torch_compat import disable_torch_function_subclass
from lightning_memkit.accounting import _torch_compat
from lightning_memkit.accounting.accountant import TensorAccountant, storages_of
from lightning_memkit.errors import MemkitError

__all__ = ["PROCESS_LABEL", "ProcessTensors", "keep_out_of_readings", "saved_tensor_data"]

#: the accountant label of storages adopted because they were found alive in the process.
PROCESS_LABEL = "process"

# Per-type answers to "is this a tensor type", so a sweep classifies each type once, in C.
_TENSOR_TYPES: set[type] = {torch.Tensor, torch.nn.Parameter}
_OTHER_TYPES: set[type] = set()
# Tensor types whose memory is their one strided storage (storage_of's answer without its checks).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# Per autograd-node type: the names of its saved-tensor attributes (``_raw_saved_*``).
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}
# memkit's own buffers (keep_out_of_readings): storage id -> weak reference, dropped when the storage is freed.
_KEPT_OUT: dict[int, weakref.ref] = {}


def keep_out_of_readings(*tensors: torch.Tensor) -> None:
    """Never count these tensors' storages in a whole-process reading: memkit's own buffers (the
    cross-rank reducer's, a few hundred bytes), which are not the training's memory. Each stays left out
    for as long as its storage lives. A storage some accountant counts already stays counted until freed."""
    for tensor in tensors:
        for storage in storages_of(tensor):
            key = id(storage)
            _KEPT_OUT[key] = weakref.ref(storage, functools.partial(_forget_kept_out, key))


def _forget_kept_out(key: int, _ref: object) -> None:
    """The storage ``key`` names was freed: its id may be reused by a storage that counts."""
    _KEPT_OUT.pop(key, None)


def _kept_out(storage: torch.UntypedStorage) -> bool:
    ref = _KEPT_OUT.get(id(storage))
    return ref is not None and ref() is storage


def _tensors_among(objects: list[Any]) -> list[torch.Tensor]:
    """The tensors in ``objects``, found with C-level filtering (a Python loop over hundreds of
    thousands of objects would cost tens of milliseconds)."""
    types = set(map(type, objects))
    for kind in types - _TENSOR_TYPES - _OTHER_TYPES:
        try:
            is_tensor = issubclass(kind, torch.Tensor)
        except TypeError:
            is_tensor = False
        (_TENSOR_TYPES if is_tensor else _OTHER_TYPES).add(kind)
    present = types & _TENSOR_TYPES
    if not present:
        return []
    return list(itertools.compress(objects, map(present.__contains__, map(type, objects))))


def saved_tensor_data(node: Any) -> list[Any]:
    """What an autograd node saved for backward, without unpacking it.

    Reads the private ``_raw_saved_*`` attributes of the node and ``SavedTensor.data`` (torch's
    bindings): a tensor saved plainly comes back as a tensor sharing its storage; one packed by a
    ``saved_tensors_hooks`` pack hook comes back as whatever the hook returned (activation
    checkpointing's placeholders), and no unpack hook runs. A saved value already freed by
    backward (``data`` is ``None``) is skipped. Through accounting/_torch_compat.py; pinned by
    tests/accounting/test_accountant.py and tests/compat/test_torch_compat.py.
    """
    kind = type(node)
    names = _SAVED_NAMES.get(kind)
    if names is None:
        try:
            names = _torch_compat.saved_tensor_attributes(node)
        except Exception:  # noqa: BLE001 - an exotic node: nothing to read
            names = ()
        _SAVED_NAMES[kind] = names
    found: list[Any] = []
    for name in names:
        try:
            raw = getattr(node, name)
        except Exception:  # noqa: BLE001 - freed by backward ("backward through the graph a second time")
            continue
        for saved in raw if isinstance(raw, (list, tuple)) else (raw,):
            data = _torch_compat.saved_value(saved)
            if data is not None:  # None once backward has freed it
                found.append(data)
    return found


class ProcessTensors:
    """Keep ``accountant`` counting every live tensor storage of the process on one device type.

    Usage::

        acc = TensorAccountant()
        process = ProcessTensors(acc, "cpu").start()   # full sweep once, then young objects only
        ...                                            # anything, anywhere, allocates
        process.sweep()                                # before reading: adopt what is new
        acc.current_bytes                              # every live CPU tensor storage, in bytes
        process.stop()

    Cost: the start's full sweep (measured: 237 ms over 376,591 objects after importing Lightning, loaded 2-core
    machine), then a look at the young generation at each collection and each :meth:`sweep` (tens of microseconds), a
    walk of each autograd graph made since the last sweep (none between training steps, normally), and a read of the
    ``.grad`` of the leaves earlier walks reached (:attr:`nodes_walked` counts the nodes walked).
    """

    def __init__(self, accountant: TensorAccountant, device_type: str = "cpu") -> None:
        self.accountant = accountant
        self.device_type = torch.device(device_type).type
        # Tensors are kept by id, never in a WeakSet: a WeakSet compares a tensor it already holds with
        # ``==`` (an elementwise comparison: compute and a new tensor, an error for more than one element, a
        # millisecond through a FakeTensor's dispatch).
        # Live tensors with a grad_fn found since the last walk: graphs to walk at the next sweep.
        self._roots: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Roots already walked (id -> (weak reference, version)), walked again only after an in-place op on
        # them (their version counter moved: the one way a tensor gets a new grad_fn). Below a grad_fn the
        # graph never gains a saved tensor (backward only frees them, and the accountant sees frees through
        # its weak references), so a second walk could find only what changed on the leaves it reaches:
        # those leaves are kept (weakly) in ``_leaves``, whose storages and ``.grad`` every sweep reads.
        # Walking every live graph at every sweep cost ~30 ms a step in a process holding dynamo's compiled
        # code (its FakeTensors with a grad_fn live as long as the compiled code).
        self._walked: dict[int, tuple[weakref.ref, int | None]] = {}
        self._leaves: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        #: autograd nodes visited by graph walks since :meth:`start` (a count; what a sweep's walk costs)
        self.nodes_walked = 0
        self._callback: Callable[[str, dict], None] | None = None
        self._pid = os.getpid()
        self.errors = 0

    @property
    def running(self) -> bool:
        """Whether the collector hook is installed."""
        return self._callback is not None

    def start(self) -> ProcessTensors:
        """Adopt every live tensor of the process (a full sweep) and follow new ones from now on."""
        if self._callback is None:
            self._pid = os.getpid()
            self._adopt(_tensors_among(gc.get_objects()))
            self._walk_graphs()
            reference = weakref.ref(self)

            def on_collection(phase: str, info: dict, reference=reference) -> None:
                tracker = reference()
                if tracker is not None and phase == "start":
                    tracker._on_collection()

            self._callback = on_collection
            gc.callbacks.append(on_collection)
            # if this object is dropped without stop(), the hook goes with it
            weakref.finalize(self, _remove_callback, on_collection)
        return self

    def stop(self) -> None:
        """Stop following new tensors (what is counted stays counted until freed)."""
        if self._callback is not None:
            _remove_callback(self._callback)
            self._callback = None
        self._roots = weakref.WeakValueDictionary()
        self._walked = {}
        self._leaves = weakref.WeakValueDictionary()

    def sweep(self) -> None:
        """Adopt the tensors made since the last look, and what live autograd graphs saved."""
        if self._callback is None:
            return
        self._adopt(_tensors_among(gc.get_objects(0)))
        self._walk_graphs()

    # ------------------------------------------------------------------ internals
    def _on_collection(self) -> None:
        # Runs at the start of every collection, in whatever thread triggered it: never raise,
        # and do nothing in a forked child (a DataLoader worker inherits the hook and the lock).
        if os.getpid() != self._pid:
            return
        try:
            self._adopt(_tensors_among(gc.get_objects(0)))
        except Exception:  # noqa: BLE001 - a measurement must never break the program
            self.errors += 1

    def _adopt(self, tensors: Iterable[torch.Tensor], leaves: weakref.WeakValueDictionary | None = None) -> None:
        """Adopt the storages of ``tensors`` on the measured device, and the ``.grad`` of those that are
        leaves; a tensor with a ``grad_fn`` not walked yet (at its version) becomes a root to walk.
        ``leaves``: where to keep the leaves (requiring grad) met, for later sweeps to read again."""
        roots, walked = self._roots, self._walked
        # a tensor subclass's __torch_function__ must not run (or recurse) for these reads
        with disable_torch_function_subclass():
            for tensor in tensors:
                try:
                    on_device = self._adopt_storages(tensor)
                    if tensor.grad_fn is not None:
                        key = id(tensor)
                        entry = walked.get(key)
                        if (
                            entry is None
                            or entry[0]() is not tensor
                            or entry[1] is None
                            or entry[1] != _torch_compat.version_of(tensor)
                        ) and roots.get(key) is not tensor:
                            roots[key] = tensor
                    elif tensor.requires_grad:
                        # kept: a plain tensor (its storage may be replaced: ``param.data = ...``), or one
                        # holding memory here; not a subclass holding none here (dynamo's FakeTensors, on meta)
                        if (
                            leaves is not None
                            and (on_device or type(tensor) in _PLAIN_TYPES)
                            and leaves.get(id(tensor)) is not tensor
                        ):
                            leaves[id(tensor)] = tensor
                        grad = tensor.grad  # a leaf's gradient has no Python object until read
                        if grad is not None:
                            self._adopt_storages(grad)
                except _AccountantError as error:
                    self._record(error)
                except Exception:  # noqa: BLE001 - half-built or exotic tensors are skipped
                    self.errors += 1

    def _adopt_storages(self, tensor: torch.Tensor) -> bool:
        """Adopt ``tensor``'s storages on the measured device; whether it has one there (or one counted)."""
        accountant, device_type = self.accountant, self.device_type
        if type(tensor) in _PLAIN_TYPES and tensor.layout is torch.strided:
            # the common case, cheaply: one storage, most often counted already (no device object made)
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                return False
            if accountant.tracks_storage(storage):
                return True
            storages = [storage]
        else:
            # a wrapper subclass (DTensor) counts by its inner tensors: its own storage holds no memory
            storages = storages_of(tensor)
        on_device = False
        for storage in storages:
            if storage.device.type == device_type and not (_KEPT_OUT and _kept_out(storage)):
                on_device = True
                try:
                    accountant.adopt_storage(storage, PROCESS_LABEL)
                except Exception as error:  # noqa: BLE001 - the accountant's own failure (a listener's): reported
                    raise _AccountantError(error) from error
        return on_device

    def _record(self, error: _AccountantError) -> None:
        # An error of the accountant (a peak or storage listener that raised) is the accountant's, as when it
        # happens in its dispatch mode: kept in its ``errors``, so that its probe reports it and steps aside,
        # whether the collector hook or the accountant's own dispatch adopted the storage first.
        cause = error.__cause__ or error
        self.accountant._record_error(f"adopting a live tensor: {type(cause).__name__}: {cause}")

    def _adopt_leaves(self) -> None:
        """Adopt again the leaves earlier walks reached: their storage (``.data`` may have been
        replaced) and their gradient, made or replaced since."""
        leaves = list(self._leaves.values())
        if leaves:
            self._adopt(leaves)

    def _remember_walked(self, root: torch.Tensor) -> None:
        key, table = id(root), self._walked

        def forget(reference: weakref.ref, key: int = key, table: dict = table) -> None:  # the root was freed
            entry = table.get(key)
            if entry is not None and entry[0] is reference:
                del table[key]

        table[key] = (weakref.ref(root, forget), _torch_compat.version_of(root))

    def _walk_graphs(self) -> None:
        self._adopt_leaves()
        roots = list(self._roots.values())
        if not roots:
            return
        for root in roots:
            self._remember_walked(root)
        self._roots = weakref.WeakValueDictionary()
        seen: dict[int, Any] = {}  # holds the nodes during the walk, so ids stay unique
        stack = [t.grad_fn for t in roots]
        found: list[torch.Tensor] = []
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            self.nodes_walked += 1
            variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf itself
            if isinstance(variable, torch.Tensor):
                found.append(variable)
            found.extend(t for t in saved_tensor_data(node) if isinstance(t, torch.Tensor))
            try:
                stack.extend(n for n, _ in node.next_functions)
            except Exception:  # noqa: BLE001 - an exotic node without readable edges: the walk goes on elsewhere
                continue
        self._adopt(found, leaves=self._leaves)


class _AccountantError(MemkitError):
    """An exception the accountant raised while adopting a storage (not a tensor that could not be read)."""


def _remove_callback(callback) -> None:
    with contextlib.suppress(ValueError):
        gc.callbacks.remove(callback)
