"""What values the elements of an integer or boolean fake may take, known without data (:class:`ValueSets`): class
ids from an argmax, booleans, and what pointwise ops, views and reductions make of them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.fake.known_values import known_value
from lightning_memkit.estimate.fake.outputs import placeholder
from lightning_memkit.estimate.fake.tensors import REAL_VALUES_NUMEL, fake_tensor_type, is_fake

__all__ = ["ValueSets", "VALUE_SET_LIMIT", "unique_values"]

#: The most values memkit keeps track of for one integer or boolean fake (see :class:`ValueSets`): the argmax over
#: up to 4096 classes keeps its set; a larger one (a vocabulary's) is left unknown, and an op whose output size
#: depends on its values is then sized by its element count alone.
VALUE_SET_LIMIT = 4096

_VALUES_ATTRIBUTE = "_memkit_value_set"


class _Kind(Enum):
    """What an op's output holds of its inputs' value sets."""

    INDICES = "indices"  # argmax and the indices of sort, topk, max over a dim...: 0 .. size - 1
    REDUCTION = "reduction"  # any, all, amax, amin, max(), min(): what the members decide
    COPY = "copy"  # a copy or a cast: the source's set, tied to it
    VIEW = "view"  # the source's set (tied when no element moves)
    POINTWISE = "pointwise"  # the op on the sets
    MUTATES = "mutates"  # an in-place op (or an out= form): what was known of what it writes is forgotten


class _ValueSet:
    """The values the elements of one integer or boolean fake may take: the element at a position holds
    ``values[d(position)]``, where ``d`` maps positions to the members of ``domain``; fakes with the same ``domain``
    (and ``shape``) share ``d``, so a fake made element by element from another stays tied to it:
    ``(u != 0) & (u != 1)`` of ``u`` in ``{0, 1}`` is all False, as on real data. ``pick`` says which member
    ``.item()`` answers (``"max"`` after a max reduction, ``"min"`` after a min, else ``None``)."""

    __slots__ = ("domain", "shape", "values", "pick")

    def __init__(self, domain: object, shape: tuple, values: torch.Tensor, pick: str | None = None) -> None:
        self.domain, self.shape, self.values, self.pick = domain, shape, values, pick


def unique_values(tensor: torch.Tensor) -> torch.Tensor | None:
    """The distinct values of the real ``tensor`` (sorted, 1-D), or ``None`` beyond :data:`VALUE_SET_LIMIT` of them."""
    members = torch.unique(tensor.detach().reshape(-1))
    return members if members.numel() <= VALUE_SET_LIMIT else None


class ValueSets:
    """What values the elements of an integer or boolean fake may take, known without data.

    A fake step meets data-dependent code on fakes made from fakes: ``logits.argmax(-1)`` is a fake whose values are
    class ids, and torchmetrics asks ``len(torch.unique(preds)) <= num_classes`` of it, then ``any`` of comparisons on
    the unique values. The sets answer those as every real step answers them:

    * ``argmax``/``argmin``, and the indices of ``max``/``min`` over a dim, ``sort``, ``topk``, ``kthvalue``, ``mode``,
      ``median``, ``cummax``/``cummin``: ``0 .. size - 1`` (their values: the input's set, where known);
    * a boolean fake: ``{False, True}``; a fake :class:`KnownValues` knows: its one value; a real integer tensor: its
      values;
    * a pointwise op (``==``, ``&``, ``+``, ``where``, casts) of fakes with sets (and Python or real numbers, real
      integer tensors): the op on the sets, on real tensors of at most :data:`VALUE_SET_LIMIT` values; operands made
      element by element from the same fake stay tied (see :class:`_ValueSet`);
    * ``any``/``all``/``amax``/``amin``/``max()``/``min()``: what the members decide (``any`` of a set without a
      true member is False);
    * a view: the input's set; an in-place op on a fake forgets its set.

    :meth:`members` gives the set (what :class:`DataDependentOps` sizes outputs by) and :meth:`item` the answer of
    ``.item()``. The set is kept as an attribute of the fake tensor object.
    """

    _INDEX_OPS = {
        "aten::argmax": None,
        "aten::argmin": None,
        "aten::sort": 1,
        "aten::topk": 1,
        "aten::kthvalue": 1,
        "aten::mode": 1,
        "aten::median": 1,
        "aten::nanmedian": 1,
        "aten::cummax": 1,
        "aten::cummin": 1,
        "aten::max": 1,
        "aten::min": 1,
    }  # the output that holds indices (None: the only one)
    _REDUCTIONS = {
        "aten::any": "any",
        "aten::all": "all",
        "aten::amax": "max",
        "aten::amin": "min",
        "aten::max": "max",
        "aten::min": "min",
    }
    _COPIES = (
        "aten::_to_copy",
        "aten::clone",
        "aten::to",
        "aten::contiguous",
        "aten::lift_fresh_copy",
        "aten::_to_dtype",
    )

    def __init__(self) -> None:
        self._kind: dict[Any, _Kind | None] = {}
        self.count = 0  # sets attached so far: until one is, only seeds need a look

    def _kind_of(self, func: Any) -> _Kind | None:
        try:
            return self._kind[func]
        except KeyError:  # not looked at yet
            kind = self._kind[func] = self._classify(func)
            return kind

    def _classify(self, func: Any) -> _Kind | None:
        schema = getattr(func, "_schema", None)
        name = schema.name if schema is not None else ""
        overload = getattr(func, "_overloadname", "")
        if schema is not None and schema.is_mutable:
            return _Kind.MUTATES  # an in-place op (or an out= form): what was known of what it writes is forgotten
        if name in ("aten::max", "aten::min"):  # over a dim: values and indices; whole: a reduction; else binary
            kind = {"dim": _Kind.INDICES, "default": _Kind.REDUCTION}.get(overload)
            if kind is None and torch.Tag.pointwise in getattr(func, "tags", ()):
                kind = _Kind.POINTWISE
            return kind
        if name in self._INDEX_OPS and not (name in ("aten::median", "aten::nanmedian") and overload == "default"):
            return _Kind.INDICES
        if name in self._REDUCTIONS:
            return _Kind.REDUCTION
        if name in self._COPIES:
            return _Kind.COPY
        if getattr(func, "is_view", False):
            return _Kind.VIEW
        if torch.Tag.pointwise in getattr(func, "tags", ()):
            return _Kind.POINTWISE
        return None

    # ------------------------------------------------------------------------------------------------ reading
    def members(self, tensor: Any) -> torch.Tensor | None:
        """The values the elements of ``tensor`` may take (a real sorted 1-D tensor of its dtype), ``None`` when
        unknown: floating-point tensors, fakes nothing is known of, sets over :data:`VALUE_SET_LIMIT`."""
        if not isinstance(tensor, torch.Tensor) or tensor.is_floating_point() or tensor.is_complex():
            return None
        with _torch_compat.no_dispatch_modes():
            if not is_fake(tensor):
                if (
                    tensor.device.type != "cpu"
                    or tensor.layout is not torch.strided
                    or tensor.numel() > REAL_VALUES_NUMEL
                ):
                    return None
                return unique_values(tensor)
            found = getattr(tensor, _VALUES_ATTRIBUTE, None)
            if found is not None:
                return torch.unique(found.values)
            known = known_value(tensor)
            if known is not None:
                return torch.tensor([known], dtype=tensor.dtype)
            if tensor.dtype is torch.bool:
                return torch.tensor([False, True])
        return None

    @staticmethod
    def has_set(tensor: Any) -> bool:
        """Whether a set is attached to the fake ``tensor`` (not one only implied by its dtype)."""
        return hasattr(tensor, _VALUES_ATTRIBUTE)

    def item(self, tensor: Any) -> Any:
        """What ``.item()`` of the fake ``tensor`` answers by its set: its one member; after a max (min) reduction its
        largest (smallest) member; else the usual placeholder when it is a member, or the largest member. ``None``
        when no set is known (the caller answers its placeholder)."""
        found = getattr(tensor, _VALUES_ATTRIBUTE, None)
        if found is None:
            return None
        with _torch_compat.no_dispatch_modes():
            members = torch.unique(found.values)
            if members.numel() == 0:
                return None
            if members.numel() == 1 or found.pick == "min":
                return members[0].item()
            if found.pick == "max":
                return members[-1].item()
            usual = placeholder(tensor)
            return usual if bool((members == usual).any()) else members[-1].item()

    # ------------------------------------------------------------------------------------------------ writing
    def attach(
        self, tensor: Any, values: torch.Tensor | None, domain: object | None = None, pick: str | None = None
    ) -> None:
        """Give the fake ``tensor`` the set ``values`` (a real 1-D tensor, cast to its dtype) of ``domain`` (a new
        one when ``None``: untied to any other fake); ``values=None`` forgets what was known."""
        if not is_fake(tensor):
            return
        if (
            values is None
            or is_fake(values)
            or tensor.is_floating_point()
            or tensor.is_complex()
            or values.numel() > VALUE_SET_LIMIT
        ):
            if hasattr(tensor, _VALUES_ATTRIBUTE):
                delattr(tensor, _VALUES_ATTRIBUTE)
            return
        with _torch_compat.no_dispatch_modes():
            values = values.reshape(-1).to(tensor.dtype)
        setattr(
            tensor,
            _VALUES_ATTRIBUTE,
            _ValueSet(domain if domain is not None else object(), tuple(tensor.shape), values, pick),
        )
        self.count += 1

    def attach_range(self, tensor: Any, size: int) -> None:
        """Give the fake ``tensor`` the set ``0 .. size - 1`` (indices into a dim of ``size``), if small enough."""
        if 0 < size <= VALUE_SET_LIMIT and is_fake(tensor):
            with _torch_compat.no_dispatch_modes():
                values = torch.arange(size)
            self.attach(tensor, values)

    def after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Record what set ``out`` (the result of ``func(*args, **kwargs)`` in a fake step) has."""
        kind = self._kind_of(func)
        if kind is None:
            return
        if kind is _Kind.MUTATES:
            if self.count:
                for value in args:
                    if is_fake(value) and hasattr(value, _VALUES_ATTRIBUTE):
                        delattr(value, _VALUES_ATTRIBUTE)
            return
        try:
            if kind is _Kind.INDICES:
                self._indices(func, args, kwargs, out)
            elif kind is _Kind.REDUCTION:
                if self.count and args and is_fake(args[0]) and hasattr(args[0], _VALUES_ATTRIBUTE):
                    self._reduction(func, args, out)
            elif type(out) is not self._fake_type() or out.is_floating_point() or out.is_complex():
                return
            elif kind is _Kind.POINTWISE:
                if self.count or any(
                    is_fake(value) and value.dtype is torch.bool for value in args if isinstance(value, torch.Tensor)
                ):
                    self._pointwise(func, args, kwargs or {}, out)
            elif args and is_fake(args[0]) and (self.count or args[0].dtype is torch.bool):
                self._follow(kind, args[0], out)
        except Exception:  # noqa: BLE001 - an argument form not foreseen: nothing is known of the output
            self.attach(out if isinstance(out, torch.Tensor) else None, None)

    @staticmethod
    def _fake_type() -> type[torch.Tensor]:
        return fake_tensor_type()

    def _indices(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        bound = _torch_compat.arguments(func, args, kwargs)
        source = bound.get("self")
        if not isinstance(source, torch.Tensor):
            return
        dim = bound.get("dim")
        size = source.numel() if dim is None else (source.shape[dim] if source.dim() else 1)
        position = self._INDEX_OPS[func._schema.name]
        if position is None:
            self.attach_range(out, size)
            return
        if isinstance(out, (tuple, list)) and len(out) > position:
            self.attach_range(out[position], size)
            if self.count and hasattr(source, _VALUES_ATTRIBUTE):  # sorted, top or extreme values: the input's
                self.attach(out[0], self.members(source))

    def _reduction(self, func: Any, args: Any, out: Any) -> None:
        way = self._REDUCTIONS[func._schema.name]
        target = out[0] if isinstance(out, (tuple, list)) else out
        members = self.members(args[0])
        if members is None or not is_fake(target):
            return
        if way in ("max", "min"):
            self.attach(target, members, pick=way)
            return
        with _torch_compat.no_dispatch_modes():
            truthy = members.bool()
            some, every = bool(truthy.any()), bool(truthy.all())
        # what any (all) may answer: a group holds at least one element when the input holds one
        if way == "any":
            answers = [False] if not some else ([True] if every and args[0].numel() else [False, True])
        else:
            answers = [True] if every else ([False] if not some and args[0].numel() else [False, True])
        with _torch_compat.no_dispatch_modes():
            self.attach(target, torch.tensor(answers))

    def _follow(self, kind: _Kind, source: torch.Tensor, out: torch.Tensor) -> None:
        """A copy (or cast) keeps its source's positions: the same domain; a view that moves no element (``detach``,
        ``alias``, a view to the same shape and strides) too; another view: the source's set, untied."""
        found = getattr(source, _VALUES_ATTRIBUTE, None)
        if found is None:
            if source.dtype is not torch.bool:
                return
            found = self._implicit(source)
        same_places = tuple(out.shape) == tuple(source.shape) and (
            kind is _Kind.COPY or (out.stride() == source.stride() and out.storage_offset() == source.storage_offset())
        )
        if same_places:
            self.attach(out, found.values, found.domain, found.pick)
        else:
            self.attach(out, self.members(source), pick=found.pick)

    def _implicit(self, tensor: torch.Tensor) -> _ValueSet:
        """A boolean fake's set, ``{False, True}``, given a domain of its own so what is made from it stays tied."""
        with _torch_compat.no_dispatch_modes():
            self.attach(tensor, torch.tensor([False, True]))
        return getattr(tensor, _VALUES_ATTRIBUTE)

    def _pointwise(self, func: Any, args: Any, kwargs: dict, out: torch.Tensor) -> None:
        """The op on the sets: each operand's values along an axis of its own (operands of one domain, shaped as the
        output, share one), so the result holds every value the real op can give."""
        if any(isinstance(value, torch.Tensor) for value in kwargs.values()):
            self.attach(out, None)
            return
        shape = tuple(out.shape)
        axes: list[int] = []  # per axis: how many values run along it
        domains: dict[object, int] = {}
        # per argument: (its axis, its values along it), or (None, the argument itself: a number, a real 0-dim tensor)
        places: list[tuple[int | None, Any]] = []
        for value in args:
            if not isinstance(value, torch.Tensor) or (not is_fake(value) and value.dim() == 0):
                places.append((None, value))
                continue
            found = getattr(value, _VALUES_ATTRIBUTE, None) if is_fake(value) else None
            if found is None and is_fake(value) and value.dtype is torch.bool and tuple(value.shape) == shape:
                found = self._implicit(value)
            if found is not None and found.shape == tuple(value.shape) == shape:
                if found.domain not in domains:
                    domains[found.domain] = len(axes)
                    axes.append(found.values.numel())
                places.append((domains[found.domain], found.values))
                continue
            members = self.members(value)
            if members is None:
                self.attach(out, None)
                return
            places.append((len(axes), members))
            axes.append(members.numel())
        combinations = 1
        for length in axes:
            combinations *= max(length, 1)
        if not axes or combinations > VALUE_SET_LIMIT * 16:
            self.attach(out, None)
            return
        with _torch_compat.no_dispatch_modes():
            real_args = []
            for axis, value in places:
                if axis is None:
                    real_args.append(value)
                else:
                    shaped = [1] * len(axes)
                    shaped[axis] = -1
                    real_args.append(value.reshape(shaped))
            result = func(*real_args, **kwargs)
        if not isinstance(result, torch.Tensor):
            self.attach(out, None)
        elif len(axes) == 1 and len(domains) == 1:  # one domain alone: the result stays tied to it
            self.attach(out, result, next(iter(domains)))
        else:
            with _torch_compat.no_dispatch_modes():
                self.attach(out, unique_values(result))
