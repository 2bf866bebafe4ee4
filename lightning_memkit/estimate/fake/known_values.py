"""Values a fake step knows without data: every element of a fake tensor equal to one Python value (a fill, a
finite-data ``isnan``), carried through pointwise ops, copies, views and reductions (:class:`KnownValues`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.fake.tensors import is_fake

__all__ = ["KnownValues", "known_value"]

_UNKNOWN = object()


class _Kind(Enum):
    """What an op's result holds of its arguments' known values."""

    SEED = "seed"  # isnan and kin: False on a fake of unknown values (finite data)
    FILL = "fill"  # zeros, ones, full, fill_: the fill value
    REDUCTION = "reduction"  # any, all, amax, amin, max(), min() of the whole tensor
    COPY = "copy"  # a copy, a cast or a view: the source's value
    POINTWISE = "pointwise"  # the op on the arguments' values
    MUTATES = "mutates"  # writes an argument: what was known of it is forgotten


_KNOWN_ATTRIBUTE = "_memkit_every_element"


def _as_dtype(value: Any, dtype: torch.dtype) -> Any:
    """``value`` as an element of a tensor of ``dtype`` holds it (a Python bool, int or float), or unknown."""
    if dtype is torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    if dtype.is_complex:
        return _UNKNOWN
    return int(value)


def known_value(tensor: Any) -> Any:
    """The value every element of the fake ``tensor`` is known to hold (see :class:`KnownValues`), else ``None``."""
    value = getattr(tensor, _KNOWN_ATTRIBUTE, _UNKNOWN) if is_fake(tensor) else _UNKNOWN
    return None if value is _UNKNOWN else value


class KnownValues:
    """Values a fake step knows without data: every element of a fake tensor equal to one Python value.

    User code asks about values the memory does not depend on, and a fake answering a placeholder would take
    another path than the real step: torchmetrics' ``if torch.isnan(x).any(): warn(...); x = x[~nans]`` warned
    "Encountered nan values" on every estimate and indexed by a mask the real step never builds. What is known:

    * ``isnan``/``isinf``/``isposinf``/``isneginf`` of a fake whose values are unknown are all ``False``: the
      fake step models a step on finite data (a real step on NaN data answers otherwise, and is not estimated);
    * ``zeros``/``ones``/``full`` (and their ``_like``/``new_`` forms) and ``fill_`` hold their fill value;
    * a pointwise op (``torch.Tag.pointwise``: ``~``, ``|``, ``==``, casts), a view, a copy, and ``any``/``all``/
      ``amax``/``amin``/``max()``/``min()`` of known tensors (and Python or real 0-dim scalars) hold the op's result
      on the values, computed on real 0-dim tensors.

    ``tensor.item()`` (``bool(tensor)``) of a known fake answers the value. An in-place op on a known fake that
    is not one of these forgets it. The value is kept as an attribute of the fake tensor object.
    """

    _SEEDS = ("aten::isnan", "aten::isinf", "aten::isposinf", "aten::isneginf")
    _FILLS = {
        "aten::zeros": 0,
        "aten::zeros_like": 0,
        "aten::new_zeros": 0,
        "aten::ones": 1,
        "aten::ones_like": 1,
        "aten::new_ones": 1,
    }
    _FILL_ARGUMENT = {
        "aten::full": 1,
        "aten::full_like": 1,
        "aten::new_full": 2,
        "aten::fill_": 1,
        "aten::fill": 1,
        "aten::scalar_tensor": 0,
    }
    _REDUCTIONS = ("aten::any", "aten::all", "aten::amax", "aten::amin")
    _COPIES = ("aten::_to_copy", "aten::clone", "aten::to", "aten::contiguous", "aten::lift_fresh_copy")

    def __init__(self) -> None:
        self._kind: dict[Any, _Kind | None] = {}
        self.count = 0  # values made known so far: until one is, ops other than seeds and fills need no look

    def _kind_of(self, func: Any) -> _Kind | None:
        try:
            return self._kind[func]
        except KeyError:  # not looked at yet
            kind = self._kind[func] = self._classify(func)
            return kind

    def _classify(self, func: Any) -> _Kind | None:
        schema = getattr(func, "_schema", None)
        name = schema.name if schema is not None else ""
        if name in self._SEEDS:
            return _Kind.SEED
        if name in self._FILLS or name in self._FILL_ARGUMENT:
            return _Kind.FILL
        if name in self._REDUCTIONS or (
            name in ("aten::max", "aten::min") and getattr(func, "_overloadname", "") == "default"
        ):
            return _Kind.REDUCTION  # of the whole tensor (max.dim's values and indices are not looked at)
        if name in self._COPIES or getattr(func, "is_view", False):
            return _Kind.COPY
        if torch.Tag.pointwise in getattr(func, "tags", ()):
            return _Kind.POINTWISE
        if schema is not None and schema.is_mutable:
            return _Kind.MUTATES  # writes an argument: what was known of it is forgotten
        return None

    def after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Record what is known of ``out`` (the result of ``func(*args, **kwargs)`` in a fake step)."""
        kind = self._kind_of(func)
        if kind is None:
            return
        if kind is _Kind.MUTATES:
            if self.count:
                self._forget_mutated(func, args)
            return
        if kind is not _Kind.SEED and kind is not _Kind.FILL and not self.count:
            return
        if kind in (_Kind.POINTWISE, _Kind.COPY, _Kind.REDUCTION) and not self._may_know(args):
            value = _UNKNOWN  # a fake argument of unknown values (the common case): no need to compute
        else:
            try:
                with _torch_compat.no_dispatch_modes():  # values are computed on real tensors, below every mode
                    value = self._value(kind, func, args, kwargs or {})
            except Exception:  # noqa: BLE001 - an unforeseen argument form: nothing is known
                value = _UNKNOWN
        targets = [out] if isinstance(out, torch.Tensor) else []
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            targets.append(args[0])  # an in-place op: its first argument holds the result
        for target in targets:
            if not is_fake(target):
                continue
            if value is not _UNKNOWN:
                value = _as_dtype(value, target.dtype)
            if value is _UNKNOWN:
                if hasattr(target, _KNOWN_ATTRIBUTE):
                    delattr(target, _KNOWN_ATTRIBUTE)
            else:
                setattr(target, _KNOWN_ATTRIBUTE, value)
                self.count += 1

    @staticmethod
    def _may_know(args: Any) -> bool:
        """Whether the op's tensor arguments may all be known: no fake among them without a known value."""
        seen = False
        for value in args:
            if isinstance(value, torch.Tensor):
                if is_fake(value) and not hasattr(value, _KNOWN_ATTRIBUTE):
                    return False
                seen = True
        return seen

    def _forget_mutated(self, func: Any, args: Any) -> None:
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        # not strict: the call passes fewer positional arguments than the schema names (the rest by keyword)
        for argument, value in zip(schema.arguments, args, strict=False):
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and is_fake(value) and hasattr(value, _KNOWN_ATTRIBUTE):
                delattr(value, _KNOWN_ATTRIBUTE)

    def _value(self, kind: _Kind, func: Any, args: Any, kwargs: dict) -> Any:
        name = func._schema.name
        if kind is _Kind.FILL:
            if name in self._FILLS:
                return self._FILLS[name]
            index = self._FILL_ARGUMENT[name]
            value = kwargs.get("fill_value", kwargs.get("value", args[index] if len(args) > index else _UNKNOWN))
            if isinstance(value, torch.Tensor):
                value = self._scalar(value)
            return value if isinstance(value, (bool, int, float)) else _UNKNOWN
        if kind is _Kind.SEED:
            source = args[0]
            if not is_fake(source):
                return _UNKNOWN
            known = self._scalar(source)
            if known is _UNKNOWN:
                return False
            with _torch_compat.no_dispatch_modes():
                return bool(func(torch.tensor(known)).item())
        source = args[0] if args else None
        if not isinstance(source, torch.Tensor):
            return _UNKNOWN
        if kind is _Kind.COPY:
            return self._scalar(source)
        if kind is _Kind.REDUCTION:
            known = self._scalar(source)
            if known is _UNKNOWN or source.numel() == 0:
                return _UNKNOWN
            return bool(known) if name in ("aten::any", "aten::all") else known
        # pointwise: every tensor argument known (or a real 0-dim tensor), computed on 0-dim real tensors
        with _torch_compat.no_dispatch_modes():
            scalars = []
            for value in args:
                if isinstance(value, torch.Tensor):
                    known = self._scalar(value)
                    if known is _UNKNOWN:
                        return _UNKNOWN
                    value = torch.tensor(known, dtype=value.dtype)
                scalars.append(value)
            result = func(*scalars, **kwargs)
            return result.item() if isinstance(result, torch.Tensor) and result.numel() == 1 else _UNKNOWN

    @staticmethod
    def _scalar(tensor: torch.Tensor) -> Any:
        """The value every element of ``tensor`` holds: known for a fake, read for a real 0-dim CPU tensor."""
        if is_fake(tensor):
            return getattr(tensor, _KNOWN_ATTRIBUTE, _UNKNOWN)
        if tensor.dim() == 0 and tensor.device.type == "cpu":
            return tensor.item()
        return _UNKNOWN
