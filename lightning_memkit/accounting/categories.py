"""What the live bytes *are*: parameters, gradients, optimizer state, activations, temporaries.

Owns the category breakdown that the ZeRO paper uses (params, grads, optimizer state,
activations, temporary buffers, fragmentation), computed exactly from the tensor accountant.

How a live storage is classified, first match wins:

1. a *role* it plays for its whole life, assigned by object identity: a parameter or buffer of
   the model, a ``.grad`` of a parameter, a tensor in an optimizer's ``state``, the step's input;
2. its accountant label ``"autocast weight copy"`` (a low-precision copy of a parameter);
3. it was held by autograd for backward (``saved_tensors_hooks``) at that moment;
4. its accountant label ``"recompute"``: made while activation checkpointing recomputed a block
   in backward (checkpoint holds these itself, so no saved-tensor hook sees them);
5. it was allocated during the step and is none of the above: a temporary;
6. anything else the accountant was told about: other.

On CUDA two more numbers come from the allocator and NVML, not from tensors: memory the caching
allocator reserved but no tensor uses, and device memory of this process the allocator never sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.accounting.accountant import StorageRecord, TensorAccountant, is_wrapper_tensor
from lightning_memkit.probes.base import ProbeUnavailable
from lightning_memkit.probes.cuda import CudaAllocatorProbe
from lightning_memkit.probes.nvml import NvmlProbe

__all__ = [
    "CATEGORIES",
    "CATEGORY_DESCRIPTIONS",
    "AUTOCAST_COPY_LABEL",
    "RECOMPUTE_LABEL",
    "is_parameter_cast",
    "CategoryBreakdown",
    "CategoryAttributor",
    "category_breakdown",
    "cuda_memory_extras",
]

#: The categories, in display order.
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "autocast_weight_copies",
    "activations",
    "recomputed",
    "inputs",
    "temporaries",
    "other",
)

#: What each category holds (shown in docs and the trace table's legend).
CATEGORY_DESCRIPTIONS: dict[str, str] = {
    "parameters": "the model's parameters (nn.Parameter storages)",
    "buffers": "the model's buffers (e.g. BatchNorm running statistics)",
    "gradients": "the parameters' .grad tensors",
    "optimizer_state": "tensors in optimizer.state (Adam's exp_avg, exp_avg_sq and step counters)",
    "autocast_weight_copies": "low-precision copies of parameters made by autocast (cached until autocast exits)",
    "activations": "tensors autograd holds for backward (saved_tensors_hooks), that are none of the above",
    "recomputed": "activations recomputed during backward by activation checkpointing, held until their backward runs",
    "inputs": "the step's input batch",
    "temporaries": "everything else allocated during the step: outputs, the loss, workspace, in-flight gradients",
    "other": "tensors that existed before the step and play none of the roles above",
}

#: The accountant label the tracer gives to autocast's copies of parameters.
AUTOCAST_COPY_LABEL = "autocast weight copy"

_TO_COPY = torch.ops.aten._to_copy.default


def is_parameter_cast(func: Any, args: Any, kwargs: Any, is_parameter: Callable[[torch.Tensor], bool]) -> bool:
    """Whether the aten op ``func(*args, **kwargs)`` copies a parameter (``is_parameter(tensor)``) into another dtype:
    what autocast does to a matmul's weight, and what a storage labelled :data:`AUTOCAST_COPY_LABEL` (or given the
    role ``autocast_weight_copies``) holds. The copy lives as long as autocast's cache or autograd keeps it,
    whatever the batch size."""
    if func is not _TO_COPY or not args:
        return False
    source = args[0]
    dtype = (kwargs or {}).get("dtype")
    return isinstance(source, torch.Tensor) and dtype is not None and dtype != source.dtype and is_parameter(source)


#: The accountant label the tracer gives to allocations made while recomputing checkpointed
#: forward code during backward.
RECOMPUTE_LABEL = "recompute"


@dataclass
class CategoryBreakdown:
    """Live tensor bytes split by category at one moment (all values in bytes).

    Attributes:
        bytes_by_category: every name in :data:`CATEGORIES` -> bytes (0 where none).
        total_bytes: the sum, equal to the accountant's live bytes at that moment.
        reserved_minus_allocated_bytes: CUDA only: bytes the caching allocator holds from the
            driver that no tensor uses (cached blocks, fragmentation); ``None`` elsewhere.
        nvml_unseen_bytes: CUDA only: this process's device memory per NVML minus the allocator's
            reserved bytes (CUDA context, cuBLAS/cuDNN workspaces, NCCL); ``None`` where unread.
        allocator_allocated_bytes: CUDA only: the allocator's allocated bytes at that moment, which
            exceeds ``total_bytes`` by the allocator's 512-byte rounding (and untracked tensors).
    """

    bytes_by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    total_bytes: int = 0
    reserved_minus_allocated_bytes: int | None = None
    nvml_unseen_bytes: int | None = None
    allocator_allocated_bytes: int | None = None

    def __getitem__(self, category: str) -> int:
        if category not in self.bytes_by_category:
            raise KeyError(f"unknown memory category {category!r}; choose from: {', '.join(CATEGORIES)}")
        return self.bytes_by_category[category]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (bytes as ints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CategoryBreakdown:
        """Inverse of :meth:`to_dict`; categories missing from ``data`` read as 0."""
        by_category = dict.fromkeys(CATEGORIES, 0)
        by_category.update({k: int(v) for k, v in data.get("bytes_by_category", {}).items()})
        return cls(
            bytes_by_category=by_category,
            total_bytes=int(data.get("total_bytes", sum(by_category.values()))),
            reserved_minus_allocated_bytes=data.get("reserved_minus_allocated_bytes"),
            nvml_unseen_bytes=data.get("nvml_unseen_bytes"),
            allocator_allocated_bytes=data.get("allocator_allocated_bytes"),
        )


class _SavedHandle:
    """What autograd keeps instead of a saved tensor while the attributor watches.

    Holds a *detached* alias (same storage, no grad_fn) so saving an op's own output creates no
    reference cycle; its release tells the attributor the tensor is no longer saved.
    """

    __slots__ = ("tensor", "record", "attributor")

    def __init__(self, tensor: torch.Tensor, record: StorageRecord | None, attributor: CategoryAttributor) -> None:
        self.tensor = tensor
        self.record = record
        self.attributor = attributor

    def __del__(self) -> None:
        if self.record is not None:
            # try, not contextlib.suppress: a finalizer also runs at interpreter exit, when module globals may be gone
            try:  # noqa: SIM105
                self.attributor._release_saved(self.record)
            except Exception:  # noqa: BLE001, S110 - never raise from a finalizer
                pass


class CategoryAttributor:
    """Tell, for the storages a :class:`TensorAccountant` tracks, which category each is in.

    Usage (what the layer tracer does)::

        acc = TensorAccountant()
        cats = CategoryAttributor(acc)
        cats.assign_module(model); cats.assign_optimizers([opt]); cats.assign(batch, "inputs")
        with acc, cats.watch_saved_tensors():
            loss = model(batch).sum(); loss.backward(); opt.step()
        cats.assign_module(model); cats.assign_optimizers([opt])   # grads and lazily made state
        cats.breakdown().bytes_by_category["optimizer_state"]

    Roles are kept by storage record identity, so a freed storage whose address is reused is
    never confused with its successor. Saved-for-backward is time-resolved: :meth:`tick` orders
    saves and releases, so a breakdown taken at a peak (see :meth:`breakdown_of`) uses what was
    saved at that moment.
    """

    def __init__(self, accountant: TensorAccountant) -> None:
        self.accountant = accountant
        self._roles: dict[int, str] = {}
        self._kept: dict[int, StorageRecord] = {}  # keeps role/saved records alive so ids stay unique
        self._saved_count: dict[int, int] = {}
        # per record: (saved at, released at) ticks, ``None`` while still saved
        self._saved_intervals: dict[int, list[tuple[int, int | None]]] = {}
        self._tick = 0
        self._save_listeners: list = []

    # ------------------------------------------------------------------ roles
    @property
    def tick(self) -> int:
        """A counter that orders saves and releases; read it when taking a snapshot."""
        return self._tick

    def assign(self, tensors: Any, category: str) -> int:
        """Give every tensor in ``tensors`` (nested lists/dicts walked) the lifetime ``category``.

        Untracked tensors are adopted by the accountant first. Returns the bytes newly adopted.
        A storage keeps the first role it was given (a parameter that is also an input stays a
        parameter).
        """
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; choose from: {', '.join(CATEGORIES)}")
        adopted = 0
        if type(tensors) not in (list, tuple) or not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
            tensors = tree_flatten(tensors)[0]  # nested batches; flat lists skip pytree's cost
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            if is_wrapper_tensor(
                tensor
            ):  # a DTensor (FSDP2's parameters, gradients, state): its local tensor's storage
                adopted += self.accountant.adopt([tensor], label=category)
                for inner in self.accountant.records_of(tensor):
                    if id(inner) not in self._roles:
                        self._roles[id(inner)] = category
                        self._kept[id(inner)] = inner
                continue
            record = self.accountant.record_of(tensor)
            if record is None:
                adopted += self.accountant.adopt([tensor], label=category)
                record = self.accountant.record_of(tensor)
                if record is None:
                    continue
            key = id(record)
            if key not in self._roles:
                self._roles[key] = category
                self._kept[key] = record
        return adopted

    def role_of(self, tensor: torch.Tensor) -> str | None:
        """The lifetime role of ``tensor``'s storage, or ``None`` when it has none."""
        record = self.accountant.record_of(tensor)
        return None if record is None else self._roles.get(id(record))

    def assign_module(self, module: torch.nn.Module) -> int:
        """Parameters, buffers and the parameters' current ``.grad`` of ``module``."""
        parameters = list(module.parameters())
        adopted = self.assign(parameters, "parameters")
        adopted += self.assign(list(module.buffers()), "buffers")
        adopted += self.assign([p.grad for p in parameters if p.grad is not None], "gradients")
        return adopted

    def assign_optimizers(self, optimizers: Iterable[Any]) -> int:
        """Every tensor in each optimizer's ``state`` (Adam's moments and step counters)."""
        adopted = 0
        for optimizer in optimizers:
            for state in getattr(optimizer, "state", {}).values():
                if isinstance(state, dict):
                    adopted += self.assign(
                        [v for v in state.values() if isinstance(v, torch.Tensor)], "optimizer_state"
                    )
        return adopted

    # ------------------------------------------------------------------ saved for backward
    def add_save_listener(self, listener) -> None:
        """Call ``listener(record, first_time)`` when a tracked, role-less storage is saved for backward."""
        self._save_listeners.append(listener)

    def _pack(self, tensor: torch.Tensor) -> _SavedHandle:
        record = None
        try:
            record = self.accountant.record_of(tensor)
            if record is not None:
                key = id(record)
                count = self._saved_count.get(key, 0)
                self._saved_count[key] = count + 1
                if count == 0:
                    self._tick += 1
                    intervals = self._saved_intervals.setdefault(key, [])
                    first_time = not intervals
                    intervals.append((self._tick, None))
                    self._kept[key] = record
                    if key not in self._roles:
                        for listener in self._save_listeners:
                            listener(record, first_time)
            return _SavedHandle(tensor.detach(), record, self)
        except Exception:  # noqa: BLE001 - a pack hook never fails the user's backward: the tensor is saved uncounted
            return _SavedHandle(tensor.detach(), None, self)

    def _release_saved(self, record: StorageRecord) -> None:
        key = id(record)
        count = self._saved_count.get(key, 0) - 1
        if count > 0:
            self._saved_count[key] = count
            return
        self._saved_count.pop(key, None)
        self._tick += 1
        intervals = self._saved_intervals.get(key)
        if intervals and intervals[-1][1] is None:
            intervals[-1] = (intervals[-1][0], self._tick)

    @staticmethod
    def _unpack(handle: _SavedHandle) -> torch.Tensor:
        return handle.tensor

    @contextlib.contextmanager
    def watch_saved_tensors(self) -> Iterator[None]:
        """Inside the block, every tensor autograd saves for backward is seen (and still saved).

        Nested ``saved_tensors_hooks`` (activation checkpointing's, ``save_on_cpu``) take over
        inside their own blocks, which is what makes checkpointed activations disappear here.
        """
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _saved_at(self, key: int, tick: int) -> bool:
        return any(start <= tick and (end is None or end > tick) for start, end in self._saved_intervals.get(key, ()))

    # ------------------------------------------------------------------ breakdown
    def category_of(self, record: StorageRecord, tick: int | None = None) -> str:
        """The category of one accountant record at ``tick`` (default: now)."""
        key = id(record)
        role = self._roles.get(key)
        if role is not None:
            return role
        if record.label == AUTOCAST_COPY_LABEL:
            return "autocast_weight_copies"
        if self._saved_at(key, self._tick if tick is None else tick):
            return "activations"
        if record.label == RECOMPUTE_LABEL and not record.adopted:
            return "recomputed"
        if record.label in CATEGORIES and record.adopted:
            return record.label
        return "other" if record.adopted else "temporaries"

    def breakdown_of(self, records: Iterable[StorageRecord], tick: int | None = None) -> CategoryBreakdown:
        """The breakdown of a snapshot of records (e.g. taken at a peak), as of ``tick``."""
        by_category = dict.fromkeys(CATEGORIES, 0)
        total = 0
        for record in records:
            by_category[self.category_of(record, tick)] += record.nbytes
            total += record.nbytes
        return CategoryBreakdown(bytes_by_category=by_category, total_bytes=total)

    def breakdown(self) -> CategoryBreakdown:
        """The breakdown of every live, tracked storage now."""
        return self.breakdown_of(self.accountant.live_records())


def category_breakdown(
    module: torch.nn.Module, optimizers: Iterable[Any] = (), inputs: Any = None
) -> CategoryBreakdown:
    """The persistent training state of ``module`` right now, by category, in bytes.

    No step is run: parameters, buffers, gradients, optimizer state and (optionally) ``inputs``
    are counted once per storage (tied weights count once). After one Adam step on an fp32 model
    with Ψ parameters this gives the ZeRO paper's 4Ψ parameters, 4Ψ gradients and 8Ψ optimizer
    state (plus 4 bytes of step counter per parameter tensor).
    """
    accountant = TensorAccountant()
    attributor = CategoryAttributor(accountant)
    attributor.assign_module(module)
    attributor.assign_optimizers(optimizers)
    if inputs is not None:
        attributor.assign(inputs, "inputs")
    return attributor.breakdown()


def cuda_memory_extras(device: torch.device | str, *, peak: bool = False, nvml: bool = True) -> dict[str, int | None]:
    """CUDA-only numbers no tensor shows, in bytes: ``reserved_minus_allocated_bytes``,
    ``nvml_unseen_bytes`` and ``allocator_allocated_bytes``.

    With ``peak=True`` the allocator's per-window peaks are used (peak reserved minus peak
    allocated: an upper bound of the cache at the allocated peak). Every value is ``None`` on a
    device that is not CUDA or where the source cannot be read.
    """
    empty: dict[str, int | None] = {
        "reserved_minus_allocated_bytes": None,
        "nvml_unseen_bytes": None,
        "allocator_allocated_bytes": None,
    }
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return empty
    try:
        reading = CudaAllocatorProbe(device).read()
    except (ProbeUnavailable, RuntimeError):
        return empty
    allocated = reading["peak_allocated_bytes" if peak else "allocated_bytes"]
    reserved = reading["peak_reserved_bytes" if peak else "reserved_bytes"]
    extras = dict(empty, reserved_minus_allocated_bytes=reserved - allocated, allocator_allocated_bytes=allocated)
    if nvml and not peak:
        try:
            probe = NvmlProbe(device)
            try:
                process = probe.read().get("process_device_bytes")
            finally:
                probe.close()
            if process is not None:
                extras["nvml_unseen_bytes"] = max(0, process - reading["reserved_bytes"])
        except Exception:  # noqa: BLE001 - NVML is optional: unavailable or failing, this figure is left out
            pass
    return extras
