"""Fake results for the ops whose output shape depends on their input's values (``unique``, ``nonzero``, boolean
indexing, ``bincount``...), sized exactly where the values are real or known and at their largest otherwise.
"""

from __future__ import annotations

import math
from collections import Counter
from enum import Enum
from typing import Any

import torch

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.fake.tensors import NOT_ANSWERED, is_fake
from lightning_memkit.estimate.fake.value_sets import ValueSets

__all__ = ["DataDependentOps", "Sizing"]

_UNKNOWN = object()


class Sizing(Enum):
    """How a data-dependent op's output was sized (each named in the estimate's note)."""

    BOUND = "bound"  # at its largest output: an upper bound of the real step's
    ASSUMED = "assumed"  # at a bincount's minlength: its values assumed below it, not a bound
    EXACT = "exact"  # by a real mask or known values: the real size
    REAL = "real"  # the op ran on real values


def _largest(members: torch.Tensor) -> int:
    """The largest of the real ``members``, read below every dispatch mode (the fake mode would make it a fake)."""
    with _torch_compat.no_dispatch_modes():
        return int(members.max())


def _op_name(func: Any) -> str:
    """``aten._unique2`` for ``aten._unique2.default``: the op as a note names it."""
    return str(getattr(func, "overloadpacket", func))


class DataDependentOps:
    """Results for the ops whose output shape depends on their input's values (torch tags them
    ``dynamic_output_shape``: ``unique`` and its kin, ``nonzero``, indexing by a boolean mask, ``masked_select``,
    ``bincount``, ``repeat_interleave``), which FakeTensorMode refuses without symbolic shapes.

    Every size is the real one where the values that decide it are real (:func:`keeps_real_values`: a mask or labels
    from the loader; an op on real tensors alone runs for real, see :meth:`FakeStepOps.run_real`) or known
    (:class:`ValueSets`: a mask of one known value). Otherwise it is the largest output the op can have, so the
    memory counted is an upper bound of the real step's:

    * ``unique`` (``_unique2``, ``_unique``): as many values as the input has elements, or as its set has members
      if fewer (the argmax over 4 classes has at most 4 distinct values, as torchmetrics checks); the inverse and the
      counts shaped accordingly (each only when asked for); ``unique_consecutive``: the element count;
      ``unique_dim``: the size of that dim (inverse and counts always on a CPU target, as the CPU kernel gives them;
      on a CUDA target only when asked for, as CUDA's ``compute_unique`` makes them);
    * ``nonzero``: ``(numel, ndim)`` indices; indexing by a boolean mask and ``masked_select``: every element selected;
    * ``bincount``: the largest member plus one, at least ``minlength``; with no set but a ``minlength``, ``minlength``
      bins: the values are *assumed* below it (class ids counted into ``num_classes`` bins by torchmetrics' confusion
      matrices), which is not a bound;
    * ``repeat_interleave`` of repeats: the element count times the largest repeat.

    An op with no bound (a ``bincount`` of unknown values without ``minlength``) is left to FakeTensorMode, whose
    error the estimate reports. ``sized`` counts the answers per op, for the estimate's note (:meth:`note`).
    """

    _HANDLERS = {
        "aten._unique2.default": "_unique",
        "aten._unique.default": "_unique",
        "aten.unique_dim.default": "_unique",
        "aten.unique_consecutive.default": "_unique",
        "aten.nonzero.default": "_nonzero",
        "aten.index.Tensor": "_index",
        "aten.masked_select.default": "_masked_select",
        "aten.bincount.default": "_bincount",
        "aten.repeat_interleave.Tensor": "_repeat_interleave",
    }

    def __init__(self, values: ValueSets | None = None, cuda: bool = False) -> None:
        self.values = values if values is not None else ValueSets()
        #: the step's target is a CUDA device: its kernels' outputs, not the CPU kernels'
        self.cuda = cuda
        self._handler: dict[Any, Any] = {}
        self._tagged: dict[Any, bool] = {}
        #: per way an output was sized: op name -> answers
        self.sized: dict[Sizing, Counter] = {way: Counter() for way in Sizing}

    def is_data_dependent(self, func: Any) -> bool:
        """Whether torch tags ``func`` as having a data-dependent output shape."""
        tagged = self._tagged.get(func)
        if tagged is None:
            tagged = self._tagged[func] = torch.Tag.dynamic_output_shape in getattr(func, "tags", ())
        return tagged

    def ran_real(self, func: Any) -> None:
        """Record that ``func`` ran on real tensors (:meth:`FakeStepOps.run_real`), if it is data-dependent."""
        if self.is_data_dependent(func):
            self.sized[Sizing.REAL][_op_name(func)] += 1

    def answer(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        """The result of the data-dependent ``func(*args, **kwargs)`` on fakes, else :data:`NOT_ANSWERED`."""
        handler = self._handler.get(func, _UNKNOWN)
        if handler is _UNKNOWN:
            name = self._HANDLERS.get(str(func))
            handler = self._handler[func] = getattr(self, name) if name is not None else None
        if handler is None:
            return NOT_ANSWERED
        return handler(func, _torch_compat.arguments(func, args, kwargs))

    def note(self) -> str | None:
        """One line for the estimate's notes: which ops were sized how, ``None`` when none ran."""

        def listing(counts: Counter) -> str:
            return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))

        parts = []
        if self.sized[Sizing.BOUND]:
            parts.append(f"{listing(self.sized[Sizing.BOUND])} on fakes sized at their largest output (an upper bound)")
        if self.sized[Sizing.ASSUMED]:
            parts.append(
                f"{listing(self.sized[Sizing.ASSUMED])} on fakes sized at their minlength (values assumed below it)"
            )
        if self.sized[Sizing.EXACT]:
            parts.append(f"{listing(self.sized[Sizing.EXACT])} on fakes sized exactly (by a real mask or known values)")
        if self.sized[Sizing.REAL]:
            parts.append(f"{listing(self.sized[Sizing.REAL])} ran on real values")
        return "data-dependent ops: " + "; ".join(parts) if parts else None

    def _sized(self, func: Any, way: Sizing) -> None:
        self.sized[way][_op_name(func)] += 1

    @staticmethod
    def _empty(shape: Any, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        """A new tensor (a fake, made through the fake mode below) of ``shape`` on ``like``'s device."""
        return torch.empty(shape, dtype=dtype, device=like.device)

    def _unique(self, func: Any, a: dict) -> Any:
        source = a["self"]
        name = str(func)
        dim = a.get("dim")
        if dim is not None and source.dim() == 0:
            return NOT_ANSWERED
        members = self.values.members(source)  # a real tensor here is one too large to keep real: its elements bound it
        single = members is not None and members.numel() == 1
        if dim is None:
            count = source.numel()
            if members is not None and (single or "consecutive" not in name):  # consecutive runs may repeat a value
                count = min(count, members.numel())
            exact = count == 0 or single
            values = self._empty((count,), source.dtype, source)
            inverse = self._empty(tuple(source.shape) if a.get("return_inverse") else (0,), torch.int64, source)
            counts = self._empty((count,) if a.get("return_counts") else (0,), torch.int64, source)
        else:
            dim = dim % source.dim()
            size = source.shape[dim]
            count = min(size, 1) if single else size
            exact = count == 0 or single
            shape = list(source.shape)
            shape[dim] = count
            values = self._empty(tuple(shape), source.dtype, source)
            # the CPU kernel gives both, asked for or not; CUDA's only what is asked for
            inverse = self._empty((size,) if a.get("return_inverse") or not self.cuda else (0,), torch.int64, source)
            counts = self._empty((count,) if a.get("return_counts") or not self.cuda else (0,), torch.int64, source)
        self.values.attach(values, members)
        self.values.attach_range(inverse, count)
        self._sized(func, Sizing.EXACT if exact else Sizing.BOUND)
        return (values, inverse) if name == "aten._unique.default" else (values, inverse, counts)

    def _nonzero(self, func: Any, a: dict) -> Any:
        source = a["self"]
        members = self.values.members(source)
        count, way = source.numel(), Sizing.BOUND
        if members is not None:
            with _torch_compat.no_dispatch_modes():
                zero = members == 0
                if bool(zero.all()):
                    count, way = 0, Sizing.EXACT
                elif not bool(zero.any()):
                    way = Sizing.EXACT
        if count == 0:
            way = Sizing.EXACT
        self._sized(func, way)
        return self._empty((count, source.dim()), torch.int64, source)

    def _selected(self, mask: torch.Tensor, shape: tuple) -> tuple[int, Sizing]:
        """How many elements the boolean ``mask`` broadcast to ``shape`` selects: counted on a real mask, the count
        of ``shape`` (or 0) for a fake whose set is all true (all false), else the count of ``shape``, a bound."""
        total = math.prod(shape)
        if not is_fake(mask):
            with _torch_compat.no_dispatch_modes():
                return int(mask.expand(shape).count_nonzero()), Sizing.EXACT
        members = self.values.members(mask)
        if members is not None:
            with _torch_compat.no_dispatch_modes():
                if not bool(members.bool().any()):
                    return 0, Sizing.EXACT
                if bool(members.bool().all()):
                    return total, Sizing.EXACT
        return total, (Sizing.EXACT if total == 0 else Sizing.BOUND)

    def _index(self, func: Any, a: dict) -> Any:
        source, indices = a["self"], list(a["indices"])
        masks = [
            index for index in indices if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        ]
        if not masks or any(mask.dim() == 0 for mask in masks):  # x[True] adds a dim: left to the fake mode
            return NOT_ANSWERED
        way = Sizing.EXACT
        replaced: list[Any] = []
        for index in indices:
            if not (isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)):
                replaced.append(index)
            elif not is_fake(index):  # a real mask: its real positions (as the kernel expands it, see IndexingUtils.h)
                with _torch_compat.no_dispatch_modes():
                    replaced.extend(index.nonzero().unbind(1))
            else:  # a fake mask: as many positions as it selects at most, one index tensor per dim it covers
                count, how = self._selected(index, tuple(index.shape))
                way = Sizing.BOUND if how is Sizing.BOUND else way
                replaced.extend(self._empty((count,), torch.int64, index) for _ in range(max(index.dim(), 1)))
        out = func(source, replaced)
        self.values.attach(
            out, self.values.members(source) if is_fake(source) and self.values.has_set(source) else None
        )
        self._sized(func, way)
        return out

    def _masked_select(self, func: Any, a: dict) -> Any:
        source, mask = a["self"], a["mask"]
        count, way = self._selected(mask, tuple(torch.broadcast_shapes(source.shape, mask.shape)))
        out = self._empty((count,), source.dtype, source if is_fake(source) else mask)
        if is_fake(source) and self.values.has_set(source):
            self.values.attach(out, self.values.members(source))
        self._sized(func, way)
        return out

    def _bincount(self, func: Any, a: dict) -> Any:
        source, weights, minlength = a["self"], a.get("weights"), int(a.get("minlength") or 0)
        members = self.values.members(source)
        if members is not None:
            length = max(minlength, _largest(members) + 1) if source.numel() and members.numel() else minlength
            way = Sizing.EXACT if not is_fake(source) or members.numel() == 1 else Sizing.BOUND
        elif minlength > 0:
            length, way = minlength, Sizing.ASSUMED
        else:
            return NOT_ANSWERED
        if weights is None:
            dtype = torch.int64
        else:  # a real bincount sums float32/float64 weights in their dtype, any other dtype in float64
            dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
        self._sized(func, way)
        return self._empty((length,), dtype, source if is_fake(source) or weights is None else weights)

    def _repeat_interleave(self, func: Any, a: dict) -> Any:
        repeats = a["repeats"]
        if a.get("output_size") is not None or not is_fake(repeats):
            return NOT_ANSWERED
        members = self.values.members(repeats)
        if members is None:
            return NOT_ANSWERED
        length = repeats.numel() * max(_largest(members), 0) if members.numel() else 0
        self._sized(func, Sizing.EXACT if members.numel() == 1 else Sizing.BOUND)
        out = self._empty((length,), repeats.dtype, repeats)
        self.values.attach_range(out, repeats.numel())
        return out
