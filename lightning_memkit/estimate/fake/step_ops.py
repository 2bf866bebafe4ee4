"""One fake step's op handling in plain calls (:class:`FakeStepOps`): device queries, views and placeholder scalars
answered without a kernel, real values run for real, data-dependent ops sized, and outputs matched to the real kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_memkit._torch_compat import TorchDispatchMode
from lightning_memkit.accounting.accountant import _tensors_in  # the op-argument walk the accountant runs per op
from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.fake.data_dependent_ops import DataDependentOps
from lightning_memkit.estimate.fake.known_values import KnownValues, known_value
from lightning_memkit.estimate.fake.outputs import (
    losses_keeping_their_buffer,
    norm_kind,
    placeholder,
    with_loss_buffer,
    with_real_statistics_dtypes,
)
from lightning_memkit.estimate.fake.tensors import (
    NOT_ANSWERED,
    REAL_VALUES_NUMEL,
    fake_device_query,
    fake_tensor_type,
    fake_view,
    is_plain_view,
    keeps_real_values,
)
from lightning_memkit.estimate.fake.value_sets import ValueSets

__all__ = ["FakeStepOps", "FakeStepMode"]


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

    def __init__(self, cuda: bool = False) -> None:
        self._fake_type = fake_tensor_type()
        self._device = torch.ops.prim.device.default
        self._item = torch.ops.aten._local_scalar_dense.default
        self._is_view: dict[Any, bool] = {}  # per op: a view FakeTensorMode would cache (see fake_view)
        self._returns_nothing_in_place: dict[Any, bool] = {}  # per op: an in-place _foreach_ op without outputs
        self.loss_ops = losses_keeping_their_buffer()
        self.known = KnownValues()
        self.values = ValueSets()
        self.data_dependent = DataDependentOps(self.values, cuda=cuda)

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
            return placeholder(args[0]) if known is None else known
        is_view = self._is_view.get(func)
        if is_view is None:
            is_view = self._is_view[func] = is_plain_view(func)
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
        """Whether every tensor in ``values`` (and in its lists) is a fake, or a DTensor over a fake (FSDP2's
        parameters and optimizer state: an in-place op on its shards allocates nothing); a real tensor is really
        updated."""
        for value in values:
            if isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor) and not self._is_fake_shard(item):
                        return False
            elif isinstance(value, torch.Tensor) and not self._is_fake_shard(value):
                return False
        return True

    def _is_fake_shard(self, tensor: torch.Tensor) -> bool:
        fake = self._fake_type
        if isinstance(tensor, fake):
            return True
        local = _torch_compat.dtensor_local(tensor)
        return local is not None and isinstance(local, fake)

    def adjust(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """``out`` as the real kernel would leave it (a reduced loss holding its unreduced buffer; a norm's saved
        statistics in the dtype the real kernel gives them, see :func:`norm_statistics_dtypes`; a small integer
        or boolean tensor made from nothing, e.g. ``torch.arange(length)``, real as in :meth:`run_real`)."""
        self.known.after(func, args, kwargs, out)
        self.values.after(func, args, kwargs, out)
        if func in self.loss_ops:
            return with_loss_buffer(args, kwargs, out)
        if isinstance(out, tuple) and norm_kind(func) is not None:
            return with_real_statistics_dtypes(func, args, kwargs, out)
        if (
            type(out) is self._fake_type
            and not (out.is_floating_point() or out.is_complex())
            and out.device.type == "cpu"
            and out.numel() <= REAL_VALUES_NUMEL
            and not _tensors_in((args, kwargs))
        ):
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
        with _torch_compat.no_dispatch_modes():
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


def _is_in_place_foreach(func: Any) -> bool:
    """Whether ``func`` is an in-place ``_foreach_*_`` aten op that returns nothing (by its schema)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    name = schema.name
    return name.startswith("aten::_foreach_") and name.endswith("_") and not schema.returns
