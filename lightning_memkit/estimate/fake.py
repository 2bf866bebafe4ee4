"""Fake tensors behind memkit's own small interface: a fake copy of a module, fake batches, placeholder scalars.

torch's FakeTensorMode is private (``torch._subclasses.fake_tensor``); every use of it in memkit goes
through this module (its private attributes through estimate/_torch_compat.py), and tests/test_estimate.py (test_fake_session_pins_the_private_fake_tensor_api,
test_fake_step_ops_answer_what_the_three_modes_answer, test_fake_parameter_is_what_nn_parameter_makes_of_a_fake)
pins the behaviour memkit relies on.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from lightning_memkit.accounting.accountant import _tensors_in  # the op-argument walk the accountant runs per op
from lightning_memkit.estimate import _torch_compat

__all__ = ["FakeSession", "is_fake", "fake_parameter", "ScalarPlaceholders", "LossBuffers", "FakeStepOps", "REAL_VALUES_NUMEL",
           "keeps_real_values", "KnownValues", "known_value"]

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
    boolean masks) cannot be answered this way and raise a clear error from the estimate.
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
    ``transpose`` around every matmul).
    Use inside :meth:`FakeSession.fake_mode_only`::

        ops = FakeStepOps()
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            answer = ops.answer(func, args, kwargs)
            if answer is not NOT_ANSWERED:
                return answer
            return ops.adjust(func, args, kwargs, func(*args, **(kwargs or {})))
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

    def answer(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        """The result of ``func(*args, **kwargs)`` when it needs no kernel (a fake tensor's device, a fake
        scalar's placeholder value, ``None`` for an in-place ``_foreach_*_`` op on fakes), else :data:`NOT_ANSWERED`."""
        if func is self._device:
            return fake_device_query(args, self._fake_type)
        if func is self._item:
            if not isinstance(args[0], self._fake_type):
                return NOT_ANSWERED
            known = known_value(args[0])
            return _placeholder(args[0]) if known is None else known
        is_view = self._is_view.get(func)
        if is_view is None:
            is_view = self._is_view[func] = _is_plain_view(func)
        if is_view:
            out = fake_view(func, args, kwargs, self._fake_type)
            if self.known.count and out is not NOT_ANSWERED:
                self.known.after(func, args, kwargs, out)
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
            return func(*args, **(kwargs or {}))


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
