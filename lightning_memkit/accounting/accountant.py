"""The exact live-tensor accountant: a TorchDispatchMode that counts every tensor storage.

It owns the one number the rest of memkit trusts on any device (CPU, CUDA, meta, fake):
the bytes of live tensor storages, current and peak, with a label per storage.

How it counts, and why:

* Every aten op passes through ``__torch_dispatch__``. After the op runs, each output
  storage that was not an input storage and is not yet known is a *new allocation*;
  views and in-place results share an input's storage, so they are never counted twice.
  Ops whose schema declares no aliasing output (most of them) skip the input scan.
* A storage's Python object is preserved by torch for the storage's whole life, so a
  ``weakref`` callback on it fires exactly when the memory is released. That is how
  frees are seen, including frees that happen outside the mode.
* Tensors that existed before the accountant started (parameters, optimizer state,
  the batch) are not counted unless they are *adopted* with :meth:`TensorAccountant.adopt`;
  adoption is idempotent, so re-adopting the same parameters every step is cheap.
* A storage resized outside the dispatcher (``UntypedStorage.resize_``: FSDP2 frees and re-grows its
  all-gather buffers that way) is seen when it happens, through memkit's one wrap of that method
  (:mod:`lightning_memkit.accounting.storage_resize`), so the live bytes and the peak follow it.
* ``__torch_dispatch__`` must never raise: an exception while dispatching a view op can
  abort the interpreter. Every failure is caught and kept in :attr:`TensorAccountant.errors`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit._torch_compat import TorchDispatchMode
from lightning_memkit.accounting import _torch_compat
from lightning_memkit.accounting._torch_compat import is_traceable_wrapper_subclass_type
from lightning_memkit.accounting.storage_resize import watch_storage_resizes

__all__ = ["StorageRecord", "TensorAccountant", "is_wrapper_tensor", "returns_alias", "storage_of", "storages_of"]

#: at most this many distinct error messages are kept; later ones are only counted.
_MAX_ERRORS = 20


# Per tensor type: is it a wrapper subclass (DTensor, any ``__tensor_flatten__`` subclass)? Its own storage
# is sized like the whole logical tensor but holds no memory (no data pointer); its inner tensors hold it.
_WRAPPER_TYPES: dict[type, bool] = {torch.Tensor: False, torch.nn.Parameter: False}


def is_wrapper_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a wrapper subclass (``torch.distributed.tensor.DTensor``, or any tensor subclass
    with ``__tensor_flatten__``): its memory is in its inner tensors, not in its own storage. Cached per type."""
    kind = type(tensor)
    answer = _WRAPPER_TYPES.get(kind)
    if answer is None:
        answer = _WRAPPER_TYPES[kind] = is_traceable_wrapper_subclass_type(kind)
    return answer


def storage_of(tensor: Any) -> torch.UntypedStorage | None:
    """Return the untyped storage behind ``tensor``, or ``None`` when it has none that holds memory.

    Sparse, nested and most wrapper-subclass tensors have no single storage; they are
    skipped rather than guessed at, as are a lazy module's parameters before its first forward
    (``nn.LazyLinear``'s ``UninitializedParameter``: no storage yet; once materialized, counted).
    A wrapper subclass (DTensor: FSDP2's sharded parameters, their gradients and optimizer state)
    has a storage of its whole logical size with no memory behind it: ``None`` here, and
    :func:`storages_of` gives its inner tensors' storages, where its memory is.
    """
    if not isinstance(tensor, torch.Tensor) or torch.nn.parameter.is_lazy(tensor) or is_wrapper_tensor(tensor):
        return None
    if tensor.layout is not torch.strided:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storages_of(tensor: Any) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s memory: its own (:func:`storage_of`), or for a wrapper subclass
    (``is_wrapper_tensor``: DTensor...) those of its inner tensors, found with ``__tensor_flatten__``.
    Empty when there is none."""
    if isinstance(tensor, torch.Tensor) and is_wrapper_tensor(tensor):
        wrapper: Any = tensor  # a wrapper subclass has __tensor_flatten__, which torch.Tensor does not declare
        try:
            names, _ = wrapper.__tensor_flatten__()
        except Exception:  # noqa: BLE001 - an exotic subclass: nothing we can count
            return []
        found: list[torch.UntypedStorage] = []
        for name in names:
            found.extend(storages_of(getattr(tensor, name, None)))
        return found
    storage = storage_of(tensor)
    return [] if storage is None else [storage]


@dataclass
class StorageRecord:
    """What the accountant knows about one live storage.

    Attributes:
        nbytes: size of the storage in bytes (as allocated, before any allocator rounding); a resize in place
            updates it, so a record kept from earlier reads the storage's size now, not then.
        device: the storage's device, e.g. ``"cpu"`` or ``"cuda:0"``.
        label: the accountant's label when the storage was allocated or adopted
            (``"adopted"`` for adopted tensors unless a label was given).
        sequence: allocation order within this accountant, 0-based.
        adopted: ``True`` when the storage existed before and was adopted, not allocated.
    """

    nbytes: int
    device: str
    label: str
    sequence: int
    adopted: bool = False


class TensorAccountant(TorchDispatchMode):
    """Count the bytes of every live tensor storage, exactly, on any device.

    Usage::

        acc = TensorAccountant()
        acc.adopt(model.parameters())          # count what already exists, once
        with acc:
            loss = model(x).sum(); loss.backward(); opt.step()
        acc.peak_bytes, acc.current_bytes      # bytes, exact

    Counters (all in bytes): :attr:`current_bytes` live now, :attr:`peak_bytes` the maximum
    of ``current_bytes`` since the last :meth:`reset_peak`. :attr:`peak_bytes_by_label` is the
    per-label split at that peak. Labels are set with :meth:`labelled` and let callers tell
    forward from backward from optimizer allocations.

    The accountant can be entered and exited many times (once per training step, say); frees
    are seen whether or not it is active, so its counters stay right between steps.
    """

    def __init__(self) -> None:
        super().__init__()
        self._records: dict[int, StorageRecord] = {}
        self._refs: dict[int, weakref.ref] = {}
        # Re-entrant: a weakref callback (a free) can fire while the lock is held, when an
        # allocation inside the critical section triggers the cyclic garbage collector.
        self._lock = threading.RLock()
        self._sequence = 0
        self._label = "unlabelled"
        self.current_bytes = 0
        self.peak_bytes = 0
        self.current_bytes_by_label: dict[str, int] = {}
        self.peak_bytes_by_label: dict[str, int] = {}
        self.allocated_bytes_total = 0
        self.errors: list[str] = []
        self.error_count = 0
        self._peak_listeners: list[Callable[[int], None]] = []
        self._storage_listeners: list[
            tuple[Callable[[StorageRecord], None] | None, Callable[[StorageRecord], None] | None]
        ] = []
        self._resize_listeners: list[Callable[[StorageRecord], None]] = []
        watch_storage_resizes(self)  # resizes outside the dispatcher, for as long as this accountant lives

    # ------------------------------------------------------------------ labels
    @property
    def label(self) -> str:
        """The label given to storages allocated from now on."""
        return self._label

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Give ``label`` to every storage allocated inside the ``with`` block."""
        previous, self._label = self._label, label
        try:
            yield
        finally:
            self._label = previous

    def set_label(self, label: str) -> str:
        """Set the allocation label and return the previous one (for hook-style callers)."""
        previous, self._label = self._label, label
        return previous

    # ------------------------------------------------------------------ counting
    def reset_peak(self) -> None:
        """Start a new peak window: the peak becomes the current live bytes."""
        self.peak_bytes = self.current_bytes
        self.peak_bytes_by_label = dict(self.current_bytes_by_label)

    def add_peak_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(peak_bytes)`` each time a new peak is reached (keep it cheap)."""
        self._peak_listeners.append(listener)

    def add_storage_listener(
        self,
        on_track: Callable[[StorageRecord], None] | None = None,
        on_release: Callable[[StorageRecord], None] | None = None,
        on_resize: Callable[[StorageRecord], None] | None = None,
    ) -> None:
        """Call ``on_track(record)`` when a storage starts being counted (allocated or adopted),
        ``on_resize(record)`` when a counted storage is resized in place (``record.nbytes`` is its new size: FSDP
        frees and re-grows its gathered parameters so, and a device allocator frees and allocates with it) and
        ``on_release(record)`` when torch frees it, in the order they happen (an allocator model replays them).
        They run on the hot path and, for frees, possibly inside garbage collection: keep them cheap and never
        raise."""
        self._storage_listeners.append((on_track, on_release))
        if on_resize is not None:
            self._resize_listeners.append(on_resize)

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        """Whether the storage behind ``tensor`` is counted by this accountant."""
        storage = storage_of(tensor)
        return storage is not None and id(storage) in self._records

    def tracks_storage(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` (an untyped storage) is counted by this accountant: one dictionary lookup."""
        return id(storage) in self._records

    def record_of(self, tensor: torch.Tensor) -> StorageRecord | None:
        """The :class:`StorageRecord` of ``tensor``'s storage, or ``None`` if untracked."""
        storage = storage_of(tensor)
        return None if storage is None else self._records.get(id(storage))

    def records_of(self, tensor: torch.Tensor) -> list[StorageRecord]:
        """The records of the tracked storages holding ``tensor``'s memory (:func:`storages_of`: a wrapper
        subclass such as DTensor has its inner tensors'); empty when none is tracked."""
        records = (self._records.get(id(storage)) for storage in storages_of(tensor))
        return [record for record in records if record is not None]

    def live_records(self) -> list[StorageRecord]:
        """A snapshot of the records of every live, tracked storage."""
        with self._lock:
            return list(self._records.values())

    def storage_key(self, tensor: torch.Tensor) -> int | None:
        """A key that identifies ``tensor``'s storage while it lives (``None`` if it has none)."""
        storage = storage_of(tensor)
        return None if storage is None else id(storage)

    def live_keys(self) -> set[int]:
        """The keys (see :meth:`storage_key`) of every live, tracked storage."""
        with self._lock:
            return set(self._records)

    def adopt(self, tensors: Iterable[Any], label: str = "adopted") -> int:
        """Count tensors that already exist; return the bytes newly counted.

        Storages that are already tracked are skipped, so adopting the same tensors every
        step costs a dictionary lookup per tensor. Non-tensors and ``None`` are ignored.
        ``label`` names the new records (``StorageRecord.label``: what made them, shown in reports).
        """
        added = 0
        for tensor in tensors:
            for storage in storages_of(tensor):  # a DTensor's are its local tensor's
                if id(storage) not in self._records:
                    added += self._track(storage, label, adopted=True)
        return added

    def adopt_storage(self, storage: torch.UntypedStorage, label: str = "adopted") -> int:
        """Count one existing storage (not yet tracked), its record named ``label``; return the bytes newly counted."""
        if id(storage) in self._records:
            return 0
        return self._track(storage, label, adopted=True)

    def _track(self, storage: torch.UntypedStorage, label: str, adopted: bool) -> int:
        key = id(storage)
        nbytes = int(storage.nbytes())
        record = StorageRecord(nbytes, str(storage.device), label, self._sequence, adopted)
        self._sequence += 1
        # The callback holds no reference to the storage; it fires when torch frees it.
        ref = weakref.ref(storage, lambda _ref: self._release(key))
        with self._lock:
            if key in self._records:  # adopted meanwhile by another thread (a collector hook)
                return 0
            self._records[key] = record
            self._refs[key] = ref
            self.current_bytes += nbytes
            self.current_bytes_by_label[label] = self.current_bytes_by_label.get(label, 0) + nbytes
        if not adopted:
            self.allocated_bytes_total += nbytes
        for on_track, _ in self._storage_listeners:
            if on_track is not None:
                on_track(record)
        self._update_peak()
        return nbytes

    def _release(self, key: int) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            self._refs.pop(key, None)
            if record is None:
                return
            self.current_bytes -= record.nbytes
            remaining = self.current_bytes_by_label.get(record.label, 0) - record.nbytes
            if remaining:
                self.current_bytes_by_label[record.label] = remaining
            else:
                self.current_bytes_by_label.pop(record.label, None)
        for _, on_release in self._storage_listeners:
            if on_release is not None:
                on_release(record)

    def storage_resized(self, storage: torch.UntypedStorage) -> None:
        """Take a tracked storage's new size (``storage.nbytes()``) after it was resized in place: by an
        aten op (``resize_``, an ``out=`` argument, ``set_``) or outside the dispatcher
        (``UntypedStorage.resize_``, reported by :mod:`~lightning_memkit.accounting.storage_resize`).
        Untracked storages are ignored. A storage resized to 0 bytes stays tracked at 0 until freed."""
        self._resize(storage)

    def _resize(self, storage: torch.UntypedStorage) -> None:
        record = self._records.get(id(storage))
        if record is None:
            return
        nbytes = int(storage.nbytes())
        delta = nbytes - record.nbytes
        if delta:
            with self._lock:
                record.nbytes = nbytes
                self.current_bytes += delta
                self.current_bytes_by_label[record.label] = self.current_bytes_by_label.get(record.label, 0) + delta
            for on_resize in self._resize_listeners:
                on_resize(record)
            self._update_peak()

    def _update_peak(self) -> None:
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_bytes_by_label = dict(self.current_bytes_by_label)
            for listener in self._peak_listeners:
                listener(self.peak_bytes)

    def _record_error(self, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < _MAX_ERRORS and message not in self.errors:
            self.errors.append(message)

    # ------------------------------------------------------------------ dispatch
    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """Leave the dispatch-mode stack, removing exactly this accountant wherever it is on it.

        ``TorchDispatchMode.__exit__`` pops the top mode, which is another one when a mode was entered after
        this accountant and is still active (LayerTrace's, entered inside MemoryTracker's window and kept over
        several micro-batches): that mode would silently stop seeing the step. Exiting an accountant that is
        not on the stack does nothing."""
        parent_exit = super().__exit__
        _torch_compat.exit_mode_in_place(self, lambda: parent_exit(exc_type, exc_val, exc_tb))

    def __torch_dispatch__(  # noqa: D105
        self, func: Any, types: tuple[type, ...], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        try:
            self._account(func, args, kwargs, result)
        except BaseException as error:  # noqa: BLE001 - never raise inside dispatch (see the module docstring): recorded
            self._record_error(f"{func}: {type(error).__name__}: {error}")
        return result

    def _account(self, func: Any, args: Any, kwargs: Any, result: Any) -> None:
        outputs = _tensors_in(result)
        if not outputs:
            return
        if not returns_alias(func):
            # A functional op: by its schema every output is a fresh allocation, so the
            # inputs need not be looked at (the common case, and the cheap one).
            self._track_fresh(outputs)
            return
        if func in _LIFT_FRESH:
            # torch.tensor(data) builds its tensor in C++, outside the dispatcher, then hands it to lift_fresh (an
            # alias by its schema): that tensor is a new allocation no op made, so it is counted here.
            for output in outputs:
                for storage in storages_of(output):
                    if id(storage) not in self._records:
                        self._track(storage, self._label, adopted=False)
            return
        # A view, an in-place or an out= op: an output sharing an input's storage is not new,
        # but its size may have changed (resize_, out= resizing).
        input_keys = storage_keys((args, kwargs))
        for output in outputs:
            for storage in storages_of(output):
                key = id(storage)
                if key in input_keys:
                    self._resize(storage)
                elif key not in self._records:
                    self._track(storage, self._label, adopted=False)

    def _track_fresh(self, outputs: list[torch.Tensor]) -> None:
        """Track the storages of a functional op's outputs, each a fresh allocation."""
        for output in outputs:
            storage = storage_of(output)
            if storage is not None:
                if id(storage) not in self._records:
                    self._track(storage, self._label, adopted=False)
            elif is_wrapper_tensor(
                output
            ):  # a DTensor's memory is its local tensor's (storage_of first: no list per output on this hot path)
                for inner in storages_of(output):
                    if id(inner) not in self._records:
                        self._track(inner, self._label, adopted=False)


#: the ops torch.tensor() hands its freshly built tensor to (``lift_fresh(Tensor(a) self) -> Tensor(a)``)
_LIFT_FRESH = frozenset({torch.ops.aten.lift_fresh.default})


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (nested lists, tuples and dicts).

    A few times cheaper than ``torch.utils._pytree.tree_flatten``, which matters because it
    runs for every aten op while the accountant is active.
    """
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


_ALIAS_CACHE: dict[Any, bool] = {}


def storage_keys(tree: Any) -> set[int]:
    """The ids of the storages behind the tensors in ``tree`` (an op's arguments): the keys under
    which the accountant and the doctor's recorder know a storage."""
    return {id(s) for tensor in _tensors_in(tree) for s in storages_of(tensor)}


def returns_alias(func: Any) -> bool:
    """Whether an aten op's schema says an output may alias an input (views, in-place and
    ``out=`` ops), read from the private ``OpOverload._schema`` and cached per op.

    ``True`` when the schema cannot be read, which sends the op down the careful path.
    tests/accounting/test_accountant.py pins this against known ops.
    """
    cached = _ALIAS_CACHE.get(func)
    if cached is None:
        try:
            cached = any(ret.alias_info is not None for ret in func._schema.returns)
        except AttributeError:
            cached = True
        _ALIAS_CACHE[func] = cached
    return cached
