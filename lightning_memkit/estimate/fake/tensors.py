"""What a fake tensor is to memkit: telling fakes apart, the tensors that keep real values in a fake step,
fake parameters, and the views and device queries answered without a trip through FakeTensorMode.

torch's FakeTensorMode is private (``torch._subclasses.fake_tensor``): memkit reaches it through
estimate/_torch_compat.py only, and tests/estimate/test_estimate.py (test_fake_session_pins_the_private_fake_tensor_api,
test_fake_parameter_is_what_nn_parameter_makes_of_a_fake) pins the behaviour memkit relies on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate import _torch_compat

__all__ = [
    "REAL_VALUES_NUMEL",
    "NOT_ANSWERED",
    "keeps_real_values",
    "is_fake",
    "fake_parameter",
    "fake_device_query",
    "fake_view",
    "fake_tensor_type",
    "is_plain_view",
]

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
    return (
        isinstance(tensor, torch.Tensor)
        and not is_fake(tensor)
        and tensor.layout is torch.strided
        and tensor.device.type == "cpu"
        and not (tensor.is_floating_point() or tensor.is_complex())
        and tensor.numel() <= REAL_VALUES_NUMEL
        and not torch.nn.parameter.is_lazy(tensor)
    )


def fake_tensor_type() -> type[torch.Tensor]:
    """torch's ``FakeTensor`` class (through estimate/_torch_compat.py)."""
    return _torch_compat.fake_tensor_module().FakeTensor


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (shape, dtype and storage size, no data)."""
    return isinstance(tensor, fake_tensor_type())


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


#: returned by :meth:`FakeStepOps.answer` for an op it leaves to the kernels below
NOT_ANSWERED = object()


def fake_device_query(args: Any, fake_type: Any = None) -> Any:
    """The answer to ``prim.device(tensor)`` for a fake ``tensor`` (exactly what FakeTensorMode's device
    handler answers), else :data:`NOT_ANSWERED`. A dispatch mode above the fake mode answers these
    itself: they are most of a fake step's ops, and each Python mode layer they pass costs Python time."""
    tensor: Any = args[0] if len(args) == 1 else None
    if type(tensor) is (fake_type or fake_tensor_type()):
        return torch.device("meta") if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
    return NOT_ANSWERED


def is_plain_view(func: Any) -> bool:
    """Whether ``func`` is an aten view op with its own kernels (not a composite that may or may not
    alias, which FakeTensorMode does not cache either): the ops :func:`fake_view` answers."""
    if not _torch_compat.is_op_overload(func) or not func.is_view or func.namespace != "aten":
        return False
    return not _torch_compat.has_composite_implicit_kernel(func)


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
    fake_type = fake_type or fake_tensor_type()
    tensors = [value for value in args if isinstance(value, torch.Tensor)]
    if kwargs:
        tensors += [value for value in kwargs.values() if isinstance(value, torch.Tensor)]
    if len(tensors) != 1 or type(tensors[0]) is not fake_type:
        return NOT_ANSWERED
    base = tensors[0]
    mode = base.fake_mode
    if mode.in_kernel_invocation or mode.shape_env is not None or _torch_compat.carries_more_than_metadata(base):
        return NOT_ANSWERED
    with _torch_compat.fake_tensor_module().in_kernel_invocation_manager(mode):
        out = func(*args, **(kwargs or {}))
    device = base.fake_device
    if isinstance(out, torch.Tensor):
        return _torch_compat.wrap_fake(fake_type, mode, out, device)
    if isinstance(out, (list, tuple)) and all(isinstance(item, torch.Tensor) for item in out):
        return type(out)(_torch_compat.wrap_fake(fake_type, mode, item, device) for item in out)
    raise TypeError(f"{func} returned {type(out).__name__}, not a view")  # a view op always returns tensors
