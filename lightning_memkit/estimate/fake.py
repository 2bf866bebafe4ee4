"""Fake tensors behind memkit's own small interface: a fake copy of a module, fake batches, placeholder scalars.

torch's FakeTensorMode is private (``torch._subclasses.fake_tensor``); every use of it in memkit goes
through this module (its private attributes through estimate/_torch_compat.py), and tests/test_estimate.py (test_fake_session_pins_the_private_fake_tensor_api,
test_fake_step_ops_answer_what_the_three_modes_answer, test_fake_parameter_is_what_nn_parameter_makes_of_a_fake)
pins the behaviour memkit relies on.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import Counter
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from lightning_memkit.accounting.accountant import _tensors_in  # the op-argument walk the accountant runs per op
from lightning_memkit.estimate import _torch_compat

__all__ = ["FakeSession", "is_fake", "fake_parameter", "ScalarPlaceholders", "LossBuffers", "FakeStepOps", "REAL_VALUES_NUMEL",
           "keeps_real_values", "KnownValues", "known_value", "ValueSets", "VALUE_SET_LIMIT", "DataDependentOps",
           "FakeStepMode"]

#: The most elements a tensor of integers or booleans may have to keep its real values in a fake step (2**21:
#: 16 MiB of int64). See :func:`keeps_real_values`.
REAL_VALUES_NUMEL = 1 << 21


def keeps_real_values(tensor: Any) -> bool:
    """Whether ``tensor`` stays a real tensor in a fake step: a real (not fake) CPU tensor of integers or booleans
    with at most :data:`REAL_VALUES_NUMEL` elements (token ids, attention masks, labels, positions, counters).

    Libraries decide what to run by looking at such tensors: transformers drops an all-ones attention mask
    unless the mask "is tracing" (``isinstance(mask, FakeTensor)``), reads ``mask.all()``, takes ``nonzero`` of
    labels. A fake answers none of those as the real tensor does, so the fake step would build what the real
    step never builds. Kept real, they answer exactly; the ops whose tensor inputs are all such tensors run
    for real (:meth:`FakeStepOps.run_real`), and a real tensor that meets a fake becomes a fake (FakeTensorMode's
    ``allow_non_fake_inputs``). Their memory is counted as any other output: a real step allocates the same
    bytes. Floating-point tensors (activations, parameters) always stay fake.
    """
    return (isinstance(tensor, torch.Tensor) and not is_fake(tensor) and tensor.layout is torch.strided
            and tensor.device.type == "cpu" and not (tensor.is_floating_point() or tensor.is_complex())
            and tensor.numel() <= REAL_VALUES_NUMEL and not torch.nn.parameter.is_lazy(tensor))

def _fake_tensor_module():
    return _torch_compat.fake_tensor_module()


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (shape, dtype and storage size, no data)."""
    return isinstance(tensor, _fake_tensor_module().FakeTensor)


def fake_parameter(fake: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    """``nn.Parameter(fake, requires_grad)`` for a fake tensor made for it (nothing else holds ``fake``).

    For a tensor subclass, ``nn.Parameter`` returns ``data.detach().requires_grad_(requires_grad)``
    flagged ``_is_param`` (so ``isinstance(p, nn.Parameter)`` holds); its ``detach()`` is an op through
    FakeTensorMode, one per parameter of a fake copy. A fresh fake needs no detached alias: it is
    flagged itself. Anything but a fake goes through ``nn.Parameter``.
    """
    if not is_fake(fake):
        return nn.Parameter(fake, requires_grad=requires_grad)
    fake.requires_grad_(requires_grad)
    fake._is_param = True
    return fake


def _placeholder(tensor: torch.Tensor) -> bool | float | int:
    """The value ``.item()`` of a fake tensor answers: True, 1.0 or 1 by dtype."""
    dtype = tensor.dtype
    if dtype is torch.bool:
        return True
    return 1.0 if (dtype.is_floating_point or dtype.is_complex) else 1


class ScalarPlaceholders(TorchDispatchMode):
    """Answer ``tensor.item()`` on fake tensors with a placeholder (1, 1.0 or True).

    A fake tensor has no values, so ``.item()`` would raise; optimizers read their step counter
    with it, and user code sometimes branches on a loss value. Memory does not depend on the
    value in either case, so 1 is as good as any. Data-dependent *shapes* (``nonzero``,
    boolean masks) are not answered here: :class:`DataDependentOps` sizes them in a fake step.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
            return _placeholder(args[0])
        return func(*args, **(kwargs or {}))


#: loss ops whose real kernels may return the reduced (0-dim) loss as a view of the unreduced,
#: input-sized buffer, keeping that buffer alive as long as the loss (checked once, see below)
_LOSS_OPS = ("mse_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss", "binary_cross_entropy", "l1_loss")


_KEPT_LOSS_OPS: frozenset | None = None


def losses_keeping_their_buffer() -> frozenset:
    """The aten loss ops whose reduced result, in this torch's real kernels, holds a storage the size
    of the unreduced loss (``mse_loss`` does in torch 2.13: a 0-dim loss of a (64, 1000) input keeps
    256000 bytes until it is freed). Found by running each op once on a small real CPU tensor
    (:class:`FakeSession` does it before entering its fake world)."""
    global _KEPT_LOSS_OPS
    if _KEPT_LOSS_OPS is not None:
        return _KEPT_LOSS_OPS
    kept = set()
    probe = torch.full((4, 3), 0.5, device="cpu")
    if is_fake(probe):  # called inside a fake world: real kernels cannot be asked now
        return frozenset()
    for name in _LOSS_OPS:
        packet = getattr(torch.ops.aten, name, None)
        op = getattr(packet, "default", None) if packet is not None else None
        if op is None:
            continue
        try:
            out = op(probe, probe)
        except Exception:  # noqa: BLE001 - an op this torch lacks or calls differently is simply not modelled
            continue
        if out.dim() == 0 and out.untyped_storage().nbytes() >= probe.numel() * probe.element_size():
            kept.add(op)
    _KEPT_LOSS_OPS = frozenset(kept)
    return _KEPT_LOSS_OPS


class LossBuffers(TorchDispatchMode):
    """Give a fake reduced loss the storage the real kernel gives it.

    torch's meta kernels return a fresh scalar for ``mse_loss`` and its kin, while the real
    kernels (see :func:`losses_keeping_their_buffer`) return a view of the unreduced buffer, which
    stays allocated from the forward until the loss is freed after backward. On fake tensors the
    result here is a 0-dim view of an input-sized fake buffer, so the accountant counts what the
    real step holds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops = losses_keeping_their_buffer()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            out = _with_loss_buffer(args, kwargs, out)
        return out


def _with_loss_buffer(args: Any, kwargs: Any, out: Any) -> Any:
    """``out`` (a kept-buffer loss op's result) as a 0-dim view of a fake buffer the unreduced loss's size."""
    if isinstance(out, torch.Tensor) and out.dim() == 0 and is_fake(out):
        reduction = (kwargs or {}).get("reduction", args[2] if len(args) > 2 else 1)
        if reduction != 0 and all(isinstance(a, torch.Tensor) for a in args[:2]):
            buffer = torch.empty(torch.broadcast_shapes(args[0].shape, args[1].shape), dtype=out.dtype, device=out.device)
            out = buffer.as_strided((), ())
    return out


#: returned by :meth:`FakeStepOps.answer` for an op it leaves to the kernels below
NOT_ANSWERED = object()

_UNKNOWN = object()
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
      ``amax``/``amin``/``max()``/``min()`` of known tensors (and Python or real 0-dim scalars) hold the op's result on the values,
      computed on real 0-dim tensors.

    ``tensor.item()`` (``bool(tensor)``) of a known fake answers the value. An in-place op on a known fake that
    is not one of these forgets it. The value is kept as an attribute of the fake tensor object.
    """

    _SEEDS = ("aten::isnan", "aten::isinf", "aten::isposinf", "aten::isneginf")
    _FILLS = {"aten::zeros": 0, "aten::zeros_like": 0, "aten::new_zeros": 0, "aten::ones": 1, "aten::ones_like": 1,
              "aten::new_ones": 1}
    _FILL_ARGUMENT = {"aten::full": 1, "aten::full_like": 1, "aten::new_full": 2, "aten::fill_": 1, "aten::fill": 1,
                      "aten::scalar_tensor": 0}
    _REDUCTIONS = ("aten::any", "aten::all", "aten::amax", "aten::amin")
    _COPIES = ("aten::_to_copy", "aten::clone", "aten::to", "aten::contiguous", "aten::lift_fresh_copy")

    def __init__(self) -> None:
        self._kind: dict[Any, str | None] = {}
        self.count = 0  # values made known so far: until one is, ops other than seeds and fills need no look

    def _kind_of(self, func: Any) -> str | None:
        kind = self._kind.get(func, _UNKNOWN)
        if kind is _UNKNOWN:
            schema = getattr(func, "_schema", None)
            name = schema.name if schema is not None else ""
            if name in self._SEEDS:
                kind = "seed"
            elif name in self._FILLS or name in self._FILL_ARGUMENT:
                kind = "fill"
            elif name in self._REDUCTIONS or (name in ("aten::max", "aten::min") and getattr(func, "_overloadname", "") == "default"):
                kind = "reduction"  # of the whole tensor (max.dim's values and indices are not looked at)
            elif name in self._COPIES or getattr(func, "is_view", False):
                kind = "copy"
            elif torch.Tag.pointwise in getattr(func, "tags", ()):
                kind = "pointwise"
            elif schema is not None and schema.is_mutable:
                kind = "mutates"  # writes an argument: what was known of it is forgotten
            else:
                kind = None
            self._kind[func] = kind
        return kind

    def after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Record what is known of ``out`` (the result of ``func(*args, **kwargs)`` in a fake step)."""
        kind = self._kind_of(func)
        if kind is None:
            return
        if kind == "mutates":
            if self.count:
                self._forget_mutated(func, args)
            return
        if kind != "seed" and kind != "fill" and not self.count:
            return
        if kind in ("pointwise", "copy", "reduction") and not self._may_know(args):
            value = _UNKNOWN  # a fake argument of unknown values (the common case): no need to compute
        else:
            from torch.utils._python_dispatch import _disable_current_modes

            try:
                with _disable_current_modes():  # values are computed on real tensors, below every mode
                    value = self._value(kind, func, args, kwargs or {})
            except Exception:  # noqa: BLE001 - an unforeseen argument form: nothing is known
                value = _UNKNOWN
        targets = [out] if isinstance(out, torch.Tensor) else []
        if getattr(func, "_schema", None) is not None and func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
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
        for argument, value in zip(schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write and is_fake(value) and hasattr(value, _KNOWN_ATTRIBUTE):
                delattr(value, _KNOWN_ATTRIBUTE)

    def _value(self, kind: str, func: Any, args: Any, kwargs: dict) -> Any:
        name = func._schema.name
        if kind == "fill":
            if name in self._FILLS:
                return self._FILLS[name]
            index = self._FILL_ARGUMENT[name]
            value = kwargs.get("fill_value", kwargs.get("value", args[index] if len(args) > index else _UNKNOWN))
            if isinstance(value, torch.Tensor):
                value = self._scalar(value)
            return value if isinstance(value, (bool, int, float)) else _UNKNOWN
        if kind == "seed":
            source = args[0]
            if not is_fake(source):
                return _UNKNOWN
            known = self._scalar(source)
            if known is _UNKNOWN:
                return False
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                return bool(func(torch.tensor(known)).item())
        source = args[0] if args else None
        if not isinstance(source, torch.Tensor):
            return _UNKNOWN
        if kind == "copy":
            return self._scalar(source)
        if kind == "reduction":
            known = self._scalar(source)
            if known is _UNKNOWN or source.numel() == 0:
                return _UNKNOWN
            return bool(known) if name in ("aten::any", "aten::all") else known
        # pointwise: every tensor argument known (or a real 0-dim tensor), computed on 0-dim real tensors
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
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


#: The most values memkit keeps track of for one integer or boolean fake (see :class:`ValueSets`): the argmax over
#: up to 4096 classes keeps its set; a larger one (a vocabulary's) is left unknown, and an op whose output size
#: depends on its values is then sized by its element count alone.
VALUE_SET_LIMIT = 4096

_VALUES_ATTRIBUTE = "_memkit_value_set"


class _ValueSet:
    """The values the elements of one integer or boolean fake may take: the element at a position holds
    ``values[d(position)]``, where ``d`` maps positions to the members of ``domain``; fakes with the same ``domain``
    (and ``shape``) share ``d``, so a fake made element by element from another stays tied to it:
    ``(u != 0) & (u != 1)`` of ``u`` in ``{0, 1}`` is all False, as on real data. ``pick`` says which member
    ``.item()`` answers (``"max"`` after a max reduction, ``"min"`` after a min, else ``None``)."""

    __slots__ = ("domain", "shape", "values", "pick")

    def __init__(self, domain: object, shape: tuple, values: torch.Tensor, pick: str | None = None) -> None:
        self.domain, self.shape, self.values, self.pick = domain, shape, values, pick


def _unique_values(tensor: torch.Tensor) -> torch.Tensor | None:
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

    _INDEX_OPS = {"aten::argmax": None, "aten::argmin": None, "aten::sort": 1, "aten::topk": 1, "aten::kthvalue": 1,
                  "aten::mode": 1, "aten::median": 1, "aten::nanmedian": 1, "aten::cummax": 1, "aten::cummin": 1,
                  "aten::max": 1, "aten::min": 1}  # the output that holds indices (None: the only one)
    _REDUCTIONS = {"aten::any": "any", "aten::all": "all", "aten::amax": "max", "aten::amin": "min", "aten::max": "max",
                   "aten::min": "min"}
    _COPIES = ("aten::_to_copy", "aten::clone", "aten::to", "aten::contiguous", "aten::lift_fresh_copy",
               "aten::_to_dtype")

    def __init__(self) -> None:
        self._kind: dict[Any, str | None] = {}
        self.count = 0  # sets attached so far: until one is, only seeds need a look

    def _kind_of(self, func: Any) -> str | None:
        kind = self._kind.get(func, _UNKNOWN)
        if kind is _UNKNOWN:
            schema = getattr(func, "_schema", None)
            name = schema.name if schema is not None else ""
            overload = getattr(func, "_overloadname", "")
            if schema is not None and schema.is_mutable:
                kind = "mutates"  # an in-place op (or an out= form): what was known of what it writes is forgotten
            elif name in ("aten::max", "aten::min"):  # over a dim: values and indices; whole: a reduction; else binary
                kind = {"dim": "indices", "default": "reduction"}.get(overload, None)
                if kind is None and torch.Tag.pointwise in getattr(func, "tags", ()):
                    kind = "pointwise"
            elif name in self._INDEX_OPS and not (name in ("aten::median", "aten::nanmedian")
                                                  and overload == "default"):
                kind = "indices"
            elif name in self._REDUCTIONS:
                kind = "reduction"
            elif name in self._COPIES:
                kind = "copy"
            elif getattr(func, "is_view", False):
                kind = "view"
            elif torch.Tag.pointwise in getattr(func, "tags", ()):
                kind = "pointwise"
            else:
                kind = None
            self._kind[func] = kind
        return kind

    # ------------------------------------------------------------------------------------------------ reading
    def members(self, tensor: Any) -> torch.Tensor | None:
        """The values the elements of ``tensor`` may take (a real sorted 1-D tensor of its dtype), ``None`` when
        unknown: floating-point tensors, fakes nothing is known of, sets over :data:`VALUE_SET_LIMIT`."""
        if not isinstance(tensor, torch.Tensor) or tensor.is_floating_point() or tensor.is_complex():
            return None
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            if not is_fake(tensor):
                if (tensor.device.type != "cpu" or tensor.layout is not torch.strided
                        or tensor.numel() > REAL_VALUES_NUMEL):
                    return None
                return _unique_values(tensor)
            found = getattr(tensor, _VALUES_ATTRIBUTE, None)
            if found is not None:
                return torch.unique(found.values)
            known = known_value(tensor)
            if known is not None:
                return torch.tensor([known], dtype=tensor.dtype)
            if tensor.dtype is torch.bool:
                return torch.tensor([False, True])
        return None

    def item(self, tensor: Any) -> Any:
        """What ``.item()`` of the fake ``tensor`` answers by its set: its one member; after a max (min) reduction its
        largest (smallest) member; else the usual placeholder when it is a member, or the largest member. ``None``
        when no set is known (the caller answers its placeholder)."""
        found = getattr(tensor, _VALUES_ATTRIBUTE, None)
        if found is None:
            return None
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            members = torch.unique(found.values)
            if members.numel() == 0:
                return None
            if members.numel() == 1 or found.pick == "min":
                return members[0].item()
            if found.pick == "max":
                return members[-1].item()
            placeholder = _placeholder(tensor)
            return placeholder if bool((members == placeholder).any()) else members[-1].item()

    # ------------------------------------------------------------------------------------------------ writing
    def attach(self, tensor: Any, values: torch.Tensor | None, domain: object | None = None,
               pick: str | None = None) -> None:
        """Give the fake ``tensor`` the set ``values`` (a real 1-D tensor, cast to its dtype) of ``domain`` (a new
        one when ``None``: untied to any other fake); ``values=None`` forgets what was known."""
        if not is_fake(tensor):
            return
        if (values is None or is_fake(values) or tensor.is_floating_point() or tensor.is_complex()
                or values.numel() > VALUE_SET_LIMIT):
            if hasattr(tensor, _VALUES_ATTRIBUTE):
                delattr(tensor, _VALUES_ATTRIBUTE)
            return
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            values = values.reshape(-1).to(tensor.dtype)
        setattr(tensor, _VALUES_ATTRIBUTE, _ValueSet(domain if domain is not None else object(), tuple(tensor.shape),
                                                     values, pick))
        self.count += 1

    def attach_range(self, tensor: Any, size: int) -> None:
        """Give the fake ``tensor`` the set ``0 .. size - 1`` (indices into a dim of ``size``), if small enough."""
        if 0 < size <= VALUE_SET_LIMIT and is_fake(tensor):
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                values = torch.arange(size)
            self.attach(tensor, values)

    def after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Record what set ``out`` (the result of ``func(*args, **kwargs)`` in a fake step) has."""
        kind = self._kind_of(func)
        if kind is None:
            return
        if kind == "mutates":
            if self.count:
                for value in args:
                    if is_fake(value) and hasattr(value, _VALUES_ATTRIBUTE):
                        delattr(value, _VALUES_ATTRIBUTE)
            return
        try:
            if kind == "indices":
                self._indices(func, args, kwargs, out)
            elif kind == "reduction":
                if self.count and args and is_fake(args[0]) and hasattr(args[0], _VALUES_ATTRIBUTE):
                    self._reduction(func, args, out)
            elif type(out) is not self._fake_type() or out.is_floating_point() or out.is_complex():
                return
            elif kind == "pointwise":
                if self.count or any(is_fake(value) and value.dtype is torch.bool for value in args
                                     if isinstance(value, torch.Tensor)):
                    self._pointwise(func, args, kwargs or {}, out)
            elif args and is_fake(args[0]) and (self.count or args[0].dtype is torch.bool):
                self._follow(kind, args[0], out)
        except Exception:  # noqa: BLE001 - an argument form not foreseen: nothing is known of the output
            self.attach(out if isinstance(out, torch.Tensor) else None, None)

    @staticmethod
    def _fake_type() -> type:
        return _fake_tensor_module().FakeTensor

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
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            truthy = members.bool()
            some, every = bool(truthy.any()), bool(truthy.all())
        # what any (all) may answer: a group holds at least one element when the input holds one
        if way == "any":
            answers = [False] if not some else ([True] if every and args[0].numel() else [False, True])
        else:
            answers = [True] if every else ([False] if not some and args[0].numel() else [False, True])
        with _disable_current_modes():
            self.attach(target, torch.tensor(answers))

    def _follow(self, kind: str, source: torch.Tensor, out: torch.Tensor) -> None:
        """A copy (or cast) keeps its source's positions: the same domain; a view that moves no element (``detach``,
        ``alias``, a view to the same shape and strides) too; another view: the source's set, untied."""
        found = getattr(source, _VALUES_ATTRIBUTE, None)
        if found is None:
            if source.dtype is not torch.bool:
                return
            found = self._implicit(source)
        same_places = tuple(out.shape) == tuple(source.shape) and (
            kind == "copy" or (out.stride() == source.stride() and out.storage_offset() == source.storage_offset()))
        if same_places:
            self.attach(out, found.values, found.domain, found.pick)
        else:
            self.attach(out, self.members(source), pick=found.pick)

    def _implicit(self, tensor: torch.Tensor) -> _ValueSet:
        """A boolean fake's set, ``{False, True}``, given a domain of its own so what is made from it stays tied."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            self.attach(tensor, torch.tensor([False, True]))
        return getattr(tensor, _VALUES_ATTRIBUTE)

    def _pointwise(self, func: Any, args: Any, kwargs: dict, out: torch.Tensor) -> None:
        """The op on the sets: each operand's values along an axis of its own (operands of one domain, shaped as the
        output, share one), so the result holds every value the real op can give."""
        from torch.utils._python_dispatch import _disable_current_modes

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
        with _disable_current_modes():
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
            with _disable_current_modes():
                self.attach(out, _unique_values(result))


def _largest(members: torch.Tensor) -> int:
    """The largest of the real ``members``, read below every dispatch mode (the fake mode would make it a fake)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
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
      ``unique_dim``: the size of that dim (inverse and counts always, as the CPU kernel gives them);
    * ``nonzero``: ``(numel, ndim)`` indices; indexing by a boolean mask and ``masked_select``: every element selected;
    * ``bincount``: the largest member plus one, at least ``minlength``; with no set but a ``minlength``, ``minlength``
      bins: the values are *assumed* below it (class ids counted into ``num_classes`` bins by torchmetrics' confusion
      matrices), which is not a bound;
    * ``repeat_interleave`` of repeats: the element count times the largest repeat.

    An op with no bound (a ``bincount`` of unknown values without ``minlength``) is left to FakeTensorMode, whose
    error the estimate reports. ``sized`` counts the answers per op, for the estimate's note (:meth:`note`).
    """

    _HANDLERS = {"aten._unique2.default": "_unique", "aten._unique.default": "_unique",
                 "aten.unique_dim.default": "_unique", "aten.unique_consecutive.default": "_unique",
                 "aten.nonzero.default": "_nonzero", "aten.index.Tensor": "_index",
                 "aten.masked_select.default": "_masked_select", "aten.bincount.default": "_bincount",
                 "aten.repeat_interleave.Tensor": "_repeat_interleave"}

    def __init__(self, values: ValueSets | None = None) -> None:
        self.values = values if values is not None else ValueSets()
        self._handler: dict[Any, Any] = {}
        self._tagged: dict[Any, bool] = {}
        #: per way an output was sized ("bound", "assumed", "exact", "real"): op name -> answers
        self.sized: dict[str, Counter] = {way: Counter() for way in ("bound", "assumed", "exact", "real")}

    def is_data_dependent(self, func: Any) -> bool:
        """Whether torch tags ``func`` as having a data-dependent output shape."""
        tagged = self._tagged.get(func)
        if tagged is None:
            tagged = self._tagged[func] = torch.Tag.dynamic_output_shape in getattr(func, "tags", ())
        return tagged

    def ran_real(self, func: Any) -> None:
        """Record that ``func`` ran on real tensors (:meth:`FakeStepOps.run_real`), if it is data-dependent."""
        if self.is_data_dependent(func):
            self.sized["real"][_op_name(func)] += 1

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
        if self.sized["bound"]:
            parts.append(f"{listing(self.sized['bound'])} on fakes sized at their largest output (an upper bound)")
        if self.sized["assumed"]:
            parts.append(f"{listing(self.sized['assumed'])} on fakes sized at their minlength "
                         "(values assumed below it)")
        if self.sized["exact"]:
            parts.append(f"{listing(self.sized['exact'])} on fakes sized exactly (by a real mask or known values)")
        if self.sized["real"]:
            parts.append(f"{listing(self.sized['real'])} ran on real values")
        return "data-dependent ops: " + "; ".join(parts) if parts else None

    def _sized(self, func: Any, way: str) -> None:
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
            if single or (members is not None and "consecutive" not in name):  # consecutive runs may repeat a value
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
            inverse = self._empty((size,), torch.int64, source)  # the CPU kernel gives both, asked for or not
            counts = self._empty((count,), torch.int64, source)
        self.values.attach(values, members)
        self.values.attach_range(inverse, count)
        self._sized(func, "exact" if exact else "bound")
        return (values, inverse) if name == "aten._unique.default" else (values, inverse, counts)

    def _nonzero(self, func: Any, a: dict) -> Any:
        source = a["self"]
        members = self.values.members(source)
        count, way = source.numel(), "bound"
        if members is not None:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                zero = members == 0
                if bool(zero.all()):
                    count, way = 0, "exact"
                elif not bool(zero.any()):
                    way = "exact"
        if count == 0:
            way = "exact"
        self._sized(func, way)
        return self._empty((count, source.dim()), torch.int64, source)

    def _selected(self, mask: torch.Tensor, shape: tuple) -> tuple[int, str]:
        """How many elements the boolean ``mask`` broadcast to ``shape`` selects: counted on a real mask, the count
        of ``shape`` (or 0) for a fake whose set is all true (all false), else the count of ``shape``, a bound."""
        from torch.utils._python_dispatch import _disable_current_modes

        total = math.prod(shape)
        if not is_fake(mask):
            with _disable_current_modes():
                return int(mask.expand(shape).count_nonzero()), "exact"
        members = self.values.members(mask)
        if members is not None:
            with _disable_current_modes():
                if not bool(members.bool().any()):
                    return 0, "exact"
                if bool(members.bool().all()):
                    return total, "exact"
        return total, ("exact" if total == 0 else "bound")

    def _index(self, func: Any, a: dict) -> Any:
        source, indices = a["self"], list(a["indices"])
        masks = [index for index in indices
                 if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)]
        if not masks or any(mask.dim() == 0 for mask in masks):  # x[True] adds a dim: left to the fake mode
            return NOT_ANSWERED
        from torch.utils._python_dispatch import _disable_current_modes

        way = "exact"
        replaced: list[Any] = []
        for index in indices:
            if not (isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)):
                replaced.append(index)
            elif not is_fake(index):  # a real mask: its real positions (as the kernel expands it, see IndexingUtils.h)
                with _disable_current_modes():
                    replaced.extend(index.nonzero().unbind(1))
            else:  # a fake mask: as many positions as it selects at most, one index tensor per dim it covers
                count, how = self._selected(index, tuple(index.shape))
                way = "bound" if how == "bound" else way
                replaced.extend(self._empty((count,), torch.int64, index) for _ in range(max(index.dim(), 1)))
        out = func(source, replaced)
        self.values.attach(out, self.values.members(source) if is_fake(source) and hasattr(source, _VALUES_ATTRIBUTE)
                           else None)
        self._sized(func, way)
        return out

    def _masked_select(self, func: Any, a: dict) -> Any:
        source, mask = a["self"], a["mask"]
        count, way = self._selected(mask, tuple(torch.broadcast_shapes(source.shape, mask.shape)))
        out = self._empty((count,), source.dtype, source if is_fake(source) else mask)
        if is_fake(source) and hasattr(source, _VALUES_ATTRIBUTE):
            self.values.attach(out, self.values.members(source))
        self._sized(func, way)
        return out

    def _bincount(self, func: Any, a: dict) -> Any:
        source, weights, minlength = a["self"], a.get("weights"), int(a.get("minlength") or 0)
        members = self.values.members(source)
        if members is not None:
            length = max(minlength, _largest(members) + 1) if source.numel() and members.numel() else minlength
            way = "exact" if not is_fake(source) or members.numel() == 1 else "bound"
        elif minlength > 0:
            length, way = minlength, "assumed"
        else:
            return NOT_ANSWERED
        if weights is None:
            dtype = torch.int64
        else:  # a real bincount sums float32/float64 weights in their dtype, any other dtype in float64
            dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
        self._sized(func, way)
        return self._empty((length,), dtype, source if is_fake(source) else weights)

    def _repeat_interleave(self, func: Any, a: dict) -> Any:
        repeats = a["repeats"]
        if a.get("output_size") is not None or not is_fake(repeats):
            return NOT_ANSWERED
        members = self.values.members(repeats)
        if members is None:
            return NOT_ANSWERED
        length = repeats.numel() * max(_largest(members), 0) if members.numel() else 0
        self._sized(func, "exact" if members.numel() == 1 else "bound")
        out = self._empty((length,), repeats.dtype, repeats)
        self.values.attach_range(out, repeats.numel())
        return out


class FakeStepOps:
    """:class:`ScalarPlaceholders` and :class:`LossBuffers` as two plain calls, for a dispatch mode that
    already sees every op of a fake step (the estimate's accountant), so the step has one Python mode
    layer above the fake mode instead of three.

    Each Python dispatch mode costs every op a trip through Python; on a fake step most ops are
    ``prim.device`` queries (the autograd engine and C++ argument checks ask each fake tensor its
    device), so :meth:`answer` also serves those from the fake tensor itself, as
    ``FakeTensorMode`` would, without going down to it. It also answers the in-place ``_foreach_*_``
    ops of an optimizer's update on fake tensors: they return nothing and allocate nothing (on the
    fakes, and in CUDA's multi-tensor kernels), and on fakes they would only cost FakeTensorMode a
    look at every tensor of their lists (its cache key); their argument checks are what is given up.
    And it answers view ops on a fake, ``detach`` included (see :func:`fake_view`): half of a fake
    step's ops (autograd's saved-tensor handles and gradient accumulation detach; ``t``, ``view``,
    ``transpose`` around every matmul). :meth:`run` runs the rest: on real values where its inputs keep them,
    sized by :class:`DataDependentOps` where the output shape depends on values, else by the kernels below.
    Use inside :meth:`FakeSession.fake_mode_only` (or as :class:`FakeStepMode`)::

        ops = FakeStepOps()
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            answer = ops.answer(func, args, kwargs)
            if answer is not NOT_ANSWERED:
                return answer
            return ops.run(func, args, kwargs)
    """

    def __init__(self) -> None:
        fake_tensor = _fake_tensor_module()
        self._fake_type = fake_tensor.FakeTensor
        self._device = torch.ops.prim.device.default
        self._item = torch.ops.aten._local_scalar_dense.default
        self._is_view: dict[Any, bool] = {}  # per op: a view FakeTensorMode would cache (see fake_view)
        self._returns_nothing_in_place: dict[Any, bool] = {}  # per op: an in-place _foreach_ op without outputs
        self.loss_ops = losses_keeping_their_buffer()
        self.known = KnownValues()
        self.values = ValueSets()
        self.data_dependent = DataDependentOps(self.values)

    def answer(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        """The result of ``func(*args, **kwargs)`` when it needs no kernel (a fake tensor's device, a fake
        scalar's placeholder value, ``None`` for an in-place ``_foreach_*_`` op on fakes), else :data:`NOT_ANSWERED`."""
        if func is self._device:
            return fake_device_query(args, self._fake_type)
        if func is self._item:
            if not isinstance(args[0], self._fake_type):
                return NOT_ANSWERED
            known = known_value(args[0])
            if known is None:
                known = self.values.item(args[0])  # a class id from its set: validation code then passes as on data
            return _placeholder(args[0]) if known is None else known
        is_view = self._is_view.get(func)
        if is_view is None:
            is_view = self._is_view[func] = _is_plain_view(func)
        if is_view:
            out = fake_view(func, args, kwargs, self._fake_type)
            if self.known.count and out is not NOT_ANSWERED:
                self.known.after(func, args, kwargs, out)
            if self.values.count and out is not NOT_ANSWERED:
                self.values.after(func, args, kwargs, out)
            return out
        in_place = self._returns_nothing_in_place.get(func)
        if in_place is None:
            in_place = self._returns_nothing_in_place[func] = _is_in_place_foreach(func)
        if in_place and self._only_fakes(args) and (not kwargs or self._only_fakes(kwargs.values())):
            return None
        return NOT_ANSWERED

    def _only_fakes(self, values: Any) -> bool:
        """Whether every tensor in ``values`` (and in its lists) is a fake (a real tensor is really updated)."""
        fake = self._fake_type
        for value in values:
            if isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor) and not isinstance(item, fake):
                        return False
            elif isinstance(value, torch.Tensor) and not isinstance(value, fake):
                return False
        return True

    def adjust(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """``out`` as the real kernel would leave it (a reduced loss holding its unreduced buffer; a norm's saved
        statistics in the dtype the real kernel gives them, see :func:`norm_statistics_dtypes`; a small integer
        or boolean tensor made from nothing, e.g. ``torch.arange(length)``, real as in :meth:`run_real`)."""
        self.known.after(func, args, kwargs, out)
        self.values.after(func, args, kwargs, out)
        if func in self.loss_ops:
            return _with_loss_buffer(args, kwargs, out)
        if isinstance(out, tuple) and _norm_kind(func) is not None:
            return _with_real_statistics_dtypes(func, args, kwargs, out)
        if (type(out) is self._fake_type and not (out.is_floating_point() or out.is_complex()) and out.device.type == "cpu"
                and out.numel() <= REAL_VALUES_NUMEL and not _tensors_in((args, kwargs))):
            return self.run_real(func, args, kwargs, factory=True)
        return out

    def run_real(self, func: Any, args: Any, kwargs: Any = None, factory: bool = False) -> Any:
        """``func(*args, **kwargs)`` run for real, below every dispatch mode, when its tensor arguments all keep real
        values (:func:`keeps_real_values`: masks, token ids, positions), else :data:`NOT_ANSWERED`. Its outputs are
        real tensors answering value queries (``mask.all()``, ``nonzero``, ``item``) as in the real step. With
        ``factory`` (an op with no tensor argument, whose fake result was small and integral) it runs regardless."""
        if not factory:
            fake = self._fake_type
            for value in args:  # the common case, cheaply: an op on a fake (this runs for every op of the step)
                if type(value) is fake:
                    return NOT_ANSWERED
            tensors = _tensors_in((args, kwargs))
            if not tensors or not all(keeps_real_values(tensor) for tensor in tensors):
                return NOT_ANSWERED
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            out = func(*args, **(kwargs or {}))
        if not factory:
            self.data_dependent.ran_real(func)
        return out

    def run(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        """``func(*args, **kwargs)`` in a fake step, for an op :meth:`answer` left: for real on real values
        (:meth:`run_real`), sized by :class:`DataDependentOps` when its output shape depends on values, else by the
        kernels below (the fake mode), its result :meth:`adjust`-ed."""
        out = self.run_real(func, args, kwargs)
        if out is NOT_ANSWERED:
            out = self.data_dependent.answer(func, args, kwargs)
        if out is NOT_ANSWERED:
            out = self.adjust(func, args, kwargs, func(*args, **(kwargs or {})))
        return out


class FakeStepMode(TorchDispatchMode):
    """:class:`FakeStepOps` as a dispatch mode of its own, for a fake step's code that runs outside the estimate's
    accountant (a checkpoint budget's measuring forward): the same answers (real values, placeholder scalars, sized
    data-dependent ops, kept loss buffers) as the step itself gets. Enter it inside
    :meth:`FakeSession.fake_mode_only`."""

    def __init__(self, ops: FakeStepOps | None = None) -> None:
        super().__init__()
        self.ops = ops if ops is not None else FakeStepOps()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        answer = self.ops.answer(func, args, kwargs)
        if answer is not NOT_ANSWERED:
            return answer
        return self.ops.run(func, args, kwargs)


#: aten norm ops whose saved statistics (mean, rstd / invstd) may be float32 on a reduced-precision input
_NORM_OPS = {"aten::native_layer_norm": "layer", "aten::native_batch_norm": "batch", "aten::_native_batch_norm_legit": "batch",
             "aten::_native_batch_norm_legit_functional": "batch", "aten::_native_batch_norm_legit_no_training": "batch",
             "aten::native_group_norm": "group"}
_NORM_KIND: dict[Any, str | None] = {}
_NORM_DTYPES: dict[tuple, tuple | None] = {}


def _norm_kind(func: Any) -> str | None:
    kind = _NORM_KIND.get(func, False)
    if kind is False:
        schema = getattr(func, "_schema", None)
        kind = _NORM_KIND[func] = _NORM_OPS.get(schema.name) if schema is not None else None
    return kind


def norm_statistics_dtypes(func: Any, args: Any, kwargs: Any = None) -> tuple[torch.dtype, ...] | None:
    """The dtypes of the outputs of the norm op ``func(*args, **kwargs)`` (``native_layer_norm``, the batch norms,
    ``native_group_norm``) as this torch's real CPU kernel gives them, asked once per op and argument dtypes by
    running it on a tiny real copy of the arguments; ``None`` for another op or when it cannot be asked.

    torch's meta kernels give every output the input's dtype; the real kernels save the statistics in float32
    for a bf16/fp16 input with float32 weights (CPU autocast leaves norms to their inputs: LayerNorm after a
    bf16 Linear), and the batch norms do for any bf16 input. The bytes differ by 2 per statistic."""
    kind = _norm_kind(func)
    if kind is None or not args or not isinstance(args[0], torch.Tensor) or kwargs:
        return None
    key = (func, tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args), tuple(type(a) for a in args))
    if key in _NORM_DTYPES:
        return _NORM_DTYPES[key]
    x = args[0]
    answer = None
    try:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            tiny = list(args)
            if kind == "layer":
                tiny[0] = torch.ones((1, *args[1]), dtype=x.dtype)
            elif kind == "batch":
                tiny[0] = torch.ones((2, x.shape[1]), dtype=x.dtype) if x.dim() > 1 else torch.ones(2, dtype=x.dtype)
            else:  # group: (input, weight, bias, N, C, HxW, group, eps)
                tiny[0] = torch.ones((1, x.shape[1], 1), dtype=x.dtype)
                tiny[3], tiny[5] = 1, 1
            for index in range(1, len(tiny)):
                value = args[index]
                if isinstance(value, torch.Tensor):
                    tiny[index] = torch.ones(tuple(value.shape), dtype=value.dtype)
            out = func(*tiny)
            answer = tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in out)
    except Exception:  # noqa: BLE001 - an argument form not foreseen: leave the meta kernel's dtypes
        answer = None
    _NORM_DTYPES[key] = answer
    return answer


def _with_real_statistics_dtypes(func: Any, args: Any, kwargs: Any, out: tuple) -> tuple:
    """``out`` with each fake output whose dtype the real kernel gives otherwise replaced by an empty fake of that dtype."""
    dtypes = norm_statistics_dtypes(func, args, kwargs)
    if dtypes is None or len(dtypes) != len(out):
        return out
    fixed = list(out)
    for index, (tensor, dtype) in enumerate(zip(out, dtypes)):
        if index and dtype is not None and is_fake(tensor) and tensor.dtype != dtype:
            fixed[index] = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=dtype, device=tensor.device)
    return tuple(fixed)


def fake_device_query(args: Any, fake_type: Any = None) -> Any:
    """The answer to ``prim.device(tensor)`` for a fake ``tensor`` (exactly what FakeTensorMode's device
    handler answers), else :data:`NOT_ANSWERED`. A dispatch mode above the fake mode answers these
    itself: they are most of a fake step's ops, and each Python mode layer they pass costs Python time."""
    tensor = args[0] if len(args) == 1 else None
    if type(tensor) is (fake_type or _fake_tensor_module().FakeTensor):
        return torch.device("meta") if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
    return NOT_ANSWERED


def _is_plain_view(func: Any) -> bool:
    """Whether ``func`` is an aten view op with its own kernels (not a composite that may or may not
    alias, which FakeTensorMode does not cache either)."""
    if not isinstance(func, torch._ops.OpOverload) or not func.is_view or func.namespace != "aten":
        return False
    return not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def fake_view(func: Any, args: Any, kwargs: Any = None, fake_type: Any = None) -> Any:
    """The result of the view op ``func(*args, **kwargs)`` (``detach``, ``view``, ``t``, ``transpose``...)
    on one plain fake tensor without a trip through FakeTensorMode, else :data:`NOT_ANSWERED`.

    A view allocates nothing. FakeTensorMode would hash the arguments for its cache and rebuild the
    alias from the cached metadata; here the op's meta kernel runs on the fake's meta storage, as
    FakeTensorMode's own kernel invocation does (so shape, strides and the shared storage and version
    counter are the kernel's), and its outputs are wrapped as fakes of the same device and mode,
    about 6x cheaper. Fakes that carry more than that (a constant, a real tensor, a subclass's type,
    symbolic shapes) and calls with more than one tensor go the normal way.
    """
    fake_type = fake_type or _fake_tensor_module().FakeTensor
    tensors = [value for value in args if isinstance(value, torch.Tensor)]
    if kwargs:
        tensors += [value for value in kwargs.values() if isinstance(value, torch.Tensor)]
    if len(tensors) != 1 or type(tensors[0]) is not fake_type:
        return NOT_ANSWERED
    base = tensors[0]
    mode = base.fake_mode
    if mode.in_kernel_invocation or mode.shape_env is not None or _torch_compat.carries_more_than_metadata(base):
        return NOT_ANSWERED
    with _fake_tensor_module().in_kernel_invocation_manager(mode):
        out = func(*args, **(kwargs or {}))
    device = base.fake_device
    if isinstance(out, torch.Tensor):
        return _torch_compat.wrap_fake(fake_type, mode, out, device)
    if isinstance(out, (list, tuple)) and all(isinstance(item, torch.Tensor) for item in out):
        return type(out)(_torch_compat.wrap_fake(fake_type, mode, item, device) for item in out)
    raise TypeError(f"{func} returned {type(out).__name__}, not a view")  # a view op always returns tensors


def _is_in_place_foreach(func: Any) -> bool:
    """Whether ``func`` is an in-place ``_foreach_*_`` aten op that returns nothing (by its schema)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    name = schema.name
    return name.startswith("aten::_foreach_") and name.endswith("_") and not schema.returns


class FakeSession:
    """One fake-tensor world: convert tensors and modules into it, and run code inside it.

    Usage::

        session = FakeSession()
        fake_model = session.module_copy(model)        # parameters are fake; model is untouched
        fake_batch = session.tree(batch)
        with session.active():
            loss = fake_model(fake_batch).sum(); loss.backward()

    Real tensors that meet fake ones inside :meth:`active` (a constant held as a plain attribute,
    a metric's state) are converted on the fly rather than rejected.
    """

    def __init__(self) -> None:
        fake_tensor = _fake_tensor_module()
        self.mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        losses_keeping_their_buffer()  # ask the real kernels once, outside the fake world

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake tensor with ``tensor``'s shape, strides, dtype and device (a fake stays as it is)."""
        if is_fake(tensor):
            return tensor
        return self.mode.from_tensor(tensor, static_shapes=True)

    def tree(self, tree: Any) -> Any:
        """``tree`` (nested lists, tuples, dicts) with every tensor leaf made fake."""
        return tree_map(lambda leaf: self.tensor(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new fake tensor of ``shape`` (no memory is used)."""
        with self.mode:
            return torch.empty(shape, dtype=dtype, device=device)

    def module_copy(self, module: nn.Module, detach_from: tuple[Any, ...] = ()) -> nn.Module:
        """A deep copy of ``module`` whose parameters and buffers are fake; ``module`` is not touched.

        Parameters keep ``requires_grad``; other attributes are deep-copied as usual (real small
        tensors stay real). Objects in ``detach_from`` (a Trainer, say) become ``None`` in the copy
        rather than being copied.
        """
        memo: dict[int, Any] = {id(obj): None for obj in detach_from if obj is not None}
        for parameter in module.parameters():
            if id(parameter) not in memo:
                fake = self.tensor(parameter.detach())  # a new fake (or the new alias of a fake parameter)
                memo[id(parameter)] = fake_parameter(fake, requires_grad=parameter.requires_grad)
        for buffer in module.buffers():
            if id(buffer) not in memo:
                memo[id(buffer)] = self.tensor(buffer)
        return copy.deepcopy(module, memo)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the ``with`` body in the fake world (factory functions create fake tensors)."""
        with self.mode, ScalarPlaceholders(), LossBuffers():
            yield

    @contextlib.contextmanager
    def fake_mode_only(self) -> Iterator[None]:
        """The fake world without :class:`ScalarPlaceholders` and :class:`LossBuffers`: for a caller whose
        own dispatch mode, entered inside this block, does their work through :class:`FakeStepOps`."""
        with self.mode:
            yield
