"""Activation offload: the tensors autograd saves for backward go to pinned host memory during the forward
and come back to the GPU, one at a time, in the backward.

torch's own :class:`torch.autograd.graph.save_on_cpu` does the work (``pin_memory=True``: each saved tensor is
copied into a fresh pinned host buffer; backward copies it back). Both copies run on the step's CUDA stream, between
its kernels (they do not overlap the compute), and before pytorch/pytorch#175421 the forward's copy (``copy_``
without ``non_blocking``) also made the host wait for it. This module only
decides where it applies: around a LightningModule's ``training_step`` (or a plain module's ``forward``), so
what the loss computation saves is offloaded and validation (no grad) is untouched. Plain PyTorch; the
Lightning callback is :class:`~lightning_memkit.callbacks.activation_offload.ActivationOffload`.

What it costs and saves (bytes):

- host: every tensor saved in one forward gets its own pinned copy of ``numel * element_size`` bytes (a tensor
  saved by two ops is copied twice; parameters saved by a ``Linear`` are copied too), freed as backward
  releases the graph. torch's caching host allocator rounds each block up (to a power of two), so the pinned
  memory reserved is at least that.
- device: a saved tensor's GPU memory is freed once nothing else holds it (activations: yes; parameters and
  the batch: no); backward allocates a GPU copy of each saved tensor while the op that needs it runs.

:func:`~lightning_memkit.estimate.api.estimate_memory` models both (``mode="offload"``, a CUDA target):
``MemoryEstimate.host_bytes`` and a device peak without the offloaded activations.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from lightning_memkit.modes.devices import device_type

__all__ = [
    "OFFLOAD_ON_CPU",
    "OffloadHandle",
    "apply_offload",
    "check_offload_device",
    "offload_suspended",
    "offloading",
]

#: why offload is refused anywhere but on a CUDA device
OFFLOAD_ON_CPU = "offload moves saved activations from a GPU to host memory; on CPU there is nothing to offload"


def check_offload_device(device: Any) -> None:
    """Raise ``ValueError`` (saying why) unless ``device`` (``"cuda"``, ``"gpu"``, a ``torch.device``, a Lightning
    accelerator) is a CUDA device: offload only moves memory from a GPU to the host."""
    kind = device_type(device)
    if kind != "cuda":
        raise ValueError(
            f"{OFFLOAD_ON_CPU} (the device here is {kind!r}); train on a CUDA GPU, or leave 'offload' out of the mode"
        )


@contextlib.contextmanager
def offloading(pin_memory: bool = True) -> Iterator[None]:
    """Inside the block, every tensor autograd saves goes to host memory (torch's ``save_on_cpu``; pinned when
    ``pin_memory`` and CUDA is available: the copies back need not block the host; they still run on the
    step's stream, between its kernels).

    Usage (plain PyTorch)::

        with offloading():
            loss = model(x).sum()        # saved activations now live on the host
        loss.backward()                  # each comes back to the GPU when its op's backward runs
    """
    if _SUSPENDED.get():
        yield
        return
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory and torch.cuda.is_available()):
        yield


#: set inside :func:`offload_suspended`
_SUSPENDED: contextvars.ContextVar[bool] = contextvars.ContextVar("memkit_offload_suspended", default=False)


@contextlib.contextmanager
def offload_suspended() -> Iterator[None]:
    """Inside the block :func:`offloading` offloads nothing, and so neither does a step :func:`apply_offload`
    wrapped, however it is called (a Lightning ``training_step``, a ``sample_fn`` that calls it, a plain module's
    ``forward``, another wrapper around it).

    A measuring forward (:func:`~lightning_memkit.modes.checkpoint_measure.measure_forward`: what checkpointing's
    budget chooses its blocks by) runs in it: under offload every saved activation is already in host memory, so no
    module would seem to hold any, and a budget could not be met. Checkpointing chooses by what the modules save;
    offload then moves what checkpointing leaves."""
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


class OffloadHandle:
    """What :func:`apply_offload` changed; :meth:`remove` restores the module (idempotent)."""

    def __init__(self, module: nn.Module, attribute: str, previous: Any) -> None:
        self.module: nn.Module | None = module
        self.attribute = attribute
        self._previous = previous

    @property
    def active(self) -> bool:
        """Whether the module's step still offloads."""
        return self.module is not None

    def remove(self) -> None:
        """Undo the wrapping: the module's own ``training_step`` / ``forward`` runs again."""
        module, self.module = self.module, None
        if module is None:
            return
        if self._previous is None:
            module.__dict__.pop(self.attribute, None)
        else:
            module.__dict__[self.attribute] = self._previous


def apply_offload(module: nn.Module, device: Any = "cuda", *, pin_memory: bool = True) -> OffloadHandle:
    """Offload what ``module``'s step saves for backward to pinned host memory.

    Wraps (on the instance, the class is untouched) a LightningModule's ``training_step``, else the module's
    ``forward``, in :func:`offloading`. ``device`` is where the module trains: anything but CUDA is refused.

    Returns:
        an :class:`OffloadHandle`; ``handle.remove()`` restores the module.

    Raises:
        ValueError: ``device`` is not a CUDA device (see :data:`OFFLOAD_ON_CPU`), or the module already offloads.
    """
    check_offload_device(device)
    attribute = "training_step" if _is_lightning_module(module) else "forward"
    current = module.__dict__.get(attribute)
    if getattr(current, "_memkit_offload", False):
        raise ValueError(f"{type(module).__name__}.{attribute} already offloads its saved tensors; apply offload once")
    original = getattr(module, attribute)
    function = getattr(original, "__func__", None)
    if function is not None and getattr(original, "__self__", None) is module:
        # the module's own method: an object bound to the module, which a deep copy (a plan's trials, an estimate's
        # copy) binds to the copy and a pickle keeps; a closure over the bound step would run the original's
        step: Any = _OffloadingStep(module, function, pin_memory)
    else:  # an instance attribute that is not one of its methods (a callable the user set): wrapped as it is

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            with offloading(pin_memory):
                return original(*args, **kwargs)

        step._memkit_offload = True
    module.__dict__[attribute] = step
    return OffloadHandle(module, attribute, current)


class _OffloadingStep:
    """``function`` (a method of ``module``'s class) called on ``module`` inside :func:`offloading`.

    ``__self__`` / ``__func__`` as a bound method has them; ``__wrapped__`` is the plain bound method, which
    Lightning's signature and override checks follow."""

    _memkit_offload = True

    def __init__(self, module: nn.Module, function: Any, pin_memory: bool) -> None:
        functools.update_wrapper(self, function)
        self.__self__ = module
        self.__func__ = function
        self.__wrapped__ = types.MethodType(function, module)
        self.pin_memory = pin_memory

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with offloading(self.pin_memory):
            return self.__func__(self.__self__, *args, **kwargs)


def _is_lightning_module(module: nn.Module) -> bool:
    try:
        from lightning.pytorch import LightningModule  # deferred: the core has no Lightning import
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, LightningModule)
