"""Fake outputs made to match the real kernels' where the fake (meta) ones differ: ``.item()`` placeholders,
reduced losses that keep their unreduced buffer, and norm statistics in the dtype the real kernel saves them in.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_memkit._torch_compat import TorchDispatchMode
from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.fake.tensors import is_fake

__all__ = [
    "placeholder",
    "ScalarPlaceholders",
    "losses_keeping_their_buffer",
    "LossBuffers",
    "with_loss_buffer",
    "norm_kind",
    "norm_statistics_dtypes",
    "with_real_statistics_dtypes",
]


def placeholder(tensor: torch.Tensor) -> bool | float | int:
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
            return placeholder(args[0])
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
            out = with_loss_buffer(args, kwargs, out)
        return out


def with_loss_buffer(args: Any, kwargs: Any, out: Any) -> Any:
    """``out`` (a kept-buffer loss op's result) as a 0-dim view of a fake buffer the unreduced loss's size."""
    if isinstance(out, torch.Tensor) and out.dim() == 0 and is_fake(out):
        reduction = (kwargs or {}).get("reduction", args[2] if len(args) > 2 else 1)
        if reduction != 0 and all(isinstance(a, torch.Tensor) for a in args[:2]):
            shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
            buffer = torch.empty(shape, dtype=out.dtype, device=out.device)
            out = buffer.as_strided((), ())
    return out


#: aten norm ops whose saved statistics (mean, rstd / invstd) may be float32 on a reduced-precision input
_NORM_OPS = {
    "aten::native_layer_norm": "layer",
    "aten::native_batch_norm": "batch",
    "aten::_native_batch_norm_legit": "batch",
    "aten::_native_batch_norm_legit_functional": "batch",
    "aten::_native_batch_norm_legit_no_training": "batch",
    "aten::native_group_norm": "group",
}
_NORM_KIND: dict[Any, str | None] = {}
_NORM_DTYPES: dict[tuple, tuple | None] = {}


def norm_kind(func: Any) -> str | None:
    try:
        return _NORM_KIND[func]
    except KeyError:  # not looked at yet
        schema = getattr(func, "_schema", None)
        kind = _NORM_KIND[func] = _NORM_OPS.get(schema.name) if schema is not None else None
        return kind


def norm_statistics_dtypes(func: Any, args: Any, kwargs: Any = None) -> tuple[torch.dtype | None, ...] | None:
    """The dtypes of the outputs of the norm op ``func(*args, **kwargs)`` (``native_layer_norm``, the batch norms,
    ``native_group_norm``) as this torch's real CPU kernel gives them, asked once per op and argument dtypes by
    running it on a tiny real copy of the arguments; ``None`` for another op or when it cannot be asked.

    torch's meta kernels give every output the input's dtype; the real kernels save the statistics in float32
    for a bf16/fp16 input with float32 weights (CPU autocast leaves norms to their inputs: LayerNorm after a
    bf16 Linear), and the batch norms do for any bf16 input. The bytes differ by 2 per statistic."""
    kind = norm_kind(func)
    if kind is None or not args or not isinstance(args[0], torch.Tensor) or kwargs:
        return None
    key = (func, tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args), tuple(type(a) for a in args))
    if key in _NORM_DTYPES:
        return _NORM_DTYPES[key]
    x = args[0]
    answer = None
    try:
        with _torch_compat.no_dispatch_modes():
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


def with_real_statistics_dtypes(func: Any, args: Any, kwargs: Any, out: tuple) -> tuple:
    """``out`` with each fake output whose dtype the real kernel gives otherwise replaced by an empty fake of that
    dtype."""
    dtypes = norm_statistics_dtypes(func, args, kwargs)
    if dtypes is None or len(dtypes) != len(out):
        return out
    fixed = list(out)
    for index, (tensor, dtype) in enumerate(zip(out, dtypes, strict=True)):
        if index and dtype is not None and is_fake(tensor) and tensor.dtype != dtype:
            fixed[index] = torch.empty_strided(
                tuple(tensor.shape), tuple(tensor.stride()), dtype=dtype, device=tensor.device
            )
    return tuple(fixed)
