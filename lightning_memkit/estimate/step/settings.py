"""What a ``with`` block sets for every estimate run inside it (gradient accumulation, an op listener, a change to the
step's copy, the reuse of fake copies), read once per estimate into :class:`EstimateSettings`.

Each is a context variable, so concurrent estimates (threads, asyncio tasks) never see another's block.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_memkit.estimate.fake.copies import ReuseCache

__all__ = ["EstimateSettings", "accumulating", "observing_ops", "reusing_fake_copies", "preparing_copies"]

_REUSE: contextvars.ContextVar[ReuseCache | None] = contextvars.ContextVar("memkit_fake_copies", default=None)
_MICRO_BATCHES: contextvars.ContextVar[int] = contextvars.ContextVar("memkit_micro_batches", default=1)
_OP_LISTENER: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar(
    "memkit_op_listener", default=None
)
_PREPARE_COPY: contextvars.ContextVar[Callable[[nn.Module, Any], None] | None] = contextvars.ContextVar(
    "memkit_prepare_copy", default=None
)
_WRAP_COPY: contextvars.ContextVar[Callable[[nn.Module, Any], None] | None] = contextvars.ContextVar(
    "memkit_wrap_copy", default=None
)


@dataclass(frozen=True)
class EstimateSettings:
    """The settings of the blocks an estimate runs in.

    Attributes:
        micro_batches: micro-batches per optimizer step (gradient accumulation, as Lightning's
            ``accumulate_grad_batches``: ``zero_grad`` after the first micro-batch's forward only, the later
            backwards add to the gradients); set by :func:`accumulating`, 1 by default.
        op_listener: called as ``listener(func, args, kwargs, result, accountant)`` for every op of a fake step that
            runs a kernel (the accountant's ``step``, ``micro_batch`` and ``label`` say where it is); set by
            :func:`observing_ops`.
        prepare_copy: called as ``prepare(module_copy, accountant)`` inside the accountant before the mode's
            checkpointing wraps the copy's blocks, to change the step's copy (the distributed estimate runs its
            ``configure_model`` there, as the strategy would); set by :func:`preparing_copies`.
        wrap_copy: called as ``wrap(module_copy, accountant)`` inside the accountant after the checkpointing and before
            the steps (the distributed estimate wraps or shards the copy there, as the strategy would); set by
            :func:`preparing_copies`.
        reuse: the fake copies, batches and estimates shared inside :func:`reusing_fake_copies`, else ``None``.
    """

    micro_batches: int = 1
    op_listener: Callable[..., None] | None = None
    prepare_copy: Callable[[nn.Module, Any], None] | None = None
    wrap_copy: Callable[[nn.Module, Any], None] | None = None
    reuse: ReuseCache | None = None

    @classmethod
    def current(cls) -> EstimateSettings:
        """The settings of the blocks the caller is in."""
        return cls(
            micro_batches=_MICRO_BATCHES.get(),
            op_listener=_OP_LISTENER.get(),
            prepare_copy=_PREPARE_COPY.get(),
            wrap_copy=_WRAP_COPY.get(),
            reuse=_REUSE.get(),
        )


@contextlib.contextmanager
def _setting(variable: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


@contextlib.contextmanager
def accumulating(micro_batches: int) -> Iterator[None]:
    """Inside the block, every automatic-optimization step :func:`estimate_memory` runs has ``micro_batches``
    forward/backward passes before its optimizer step (gradient accumulation; ``micro_batches`` >= 1). Two are
    enough for the peak of any accumulation >= 2: the third and later micro-batches repeat the second."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r}: give a positive integer")
    with _setting(_MICRO_BATCHES, micro_batches):
        yield


@contextlib.contextmanager
def observing_ops(listener: Callable[..., None]) -> Iterator[None]:
    """Inside the block, :func:`estimate_memory`'s fake steps call ``listener(func, args, kwargs, result, accountant)``
    for every op that runs a kernel (the op's fake inputs and outputs: shapes, dtypes; no values). Estimates are
    not memoised inside the block (a memoised answer runs no op)."""
    with _setting(_OP_LISTENER, listener):
        yield


@contextlib.contextmanager
def reusing_fake_copies() -> Iterator[None]:
    """Inside the block, :func:`estimate_memory` makes one fake copy per module (and takes one sample
    batch per module and datamodule) and reuses them for every mode and batch size: the module must not
    change inside the block. Used by :func:`~lightning_memkit.estimate.predict_max_batch_size` and
    ``memkit estimate``; everything is dropped when the block ends."""
    if _REUSE.get() is not None:  # nested: the outer block's cache serves
        yield
        return
    cache = ReuseCache()
    try:
        with _setting(_REUSE, cache):
            yield
    finally:
        cache.close()


@contextlib.contextmanager
def preparing_copies(
    prepare: Callable[[nn.Module, Any], None], wrap: Callable[[nn.Module, Any], None] | None = None
) -> Iterator[None]:
    """Inside the block, every estimate calls ``prepare(module_copy, accountant)`` on the step's copy before the
    mode's checkpointing, and ``wrap(module_copy, accountant)`` after it, before the steps, both inside the
    accountant (a strategy builds the model in ``configure_model``, then wraps the checkpointed blocks). The reuse of
    fake copies is off for the block: a prepared (sharded) copy must not serve an estimate outside it."""
    with _setting(_REUSE, None), _setting(_PREPARE_COPY, prepare), _setting(_WRAP_COPY, wrap):
        yield
