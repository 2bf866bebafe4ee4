"""Wrapping: torch's non-reentrant checkpoint installed on chosen modules, and undone exactly.

Checkpointing here is always torch's *non-reentrant* ``torch.utils.checkpoint.checkpoint``: every
parameter gets its gradient whatever ``requires_grad`` the inputs have, and the RNG state is replayed,
so dropout masks match. Two things are added on top of torch:

* BatchNorm-like layers (any module with ``track_running_stats`` and running buffers) would update
  their running statistics a second time during the recomputation; torch does not prevent that.
  While a region is recomputed their ``momentum`` is 0 (the update is then exact identity) and
  ``num_batches_tracked`` is put back, so running statistics match an unchecked run bit for bit.
* A region must not change state outside itself: its recompute would change it again. The one such state
  that models pass to their blocks is a key/value cache (Hugging Face's ``use_cache=True``, GPT-2's default):
  each forward appends to it, so a recompute would attend to the keys twice over (``2 * T`` of them, against
  the ``T``-wide mask the first forward made). While a checkpointed module runs with gradients, its
  ``use_cache`` argument is ``False`` and its ``cache``, ``past_key_value(s)`` and ``layer_past`` arguments are
  ``None`` (positional or keyword, read from its ``forward``'s signature), as in transformers' own gradient
  checkpointing (``GradientCheckpointingLayer``; a module whose ``_can_checkpoint_with_cache`` is true, one
  that only reads its cache, keeps the cache). Without gradients (validation, generation) it runs as given.
* Wrapping sets an instance ``forward`` on the chosen modules (the module tree, parameter names and
  ``state_dict`` keys do not change); :meth:`CheckpointHandle.remove` restores the module exactly.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from lightning_memkit.modes.checkpoint_plan import CheckpointPlan

if TYPE_CHECKING:
    from lightning_memkit.modes.checkpoint_policy import Region

__all__ = [
    "CheckpointHandle",
    "checkpointed_call",
    "frozen_running_stats",
    "in_checkpointed_region",
    "is_checkpointed",
    "unwrap_modules",
    "wrap_regions",
]

_STATE_ATTR = "_memkit_checkpoint_state"


class _RunningStats(Protocol):
    """What a BatchNorm-like module with running statistics has (:func:`_has_running_stats`)."""

    momentum: float | None
    num_batches_tracked: torch.Tensor | None


def _has_running_stats(module: nn.Module) -> bool:
    return (
        bool(getattr(module, "track_running_stats", False))
        and getattr(module, "running_mean", None) is not None
        and hasattr(module, "momentum")
    )


@contextlib.contextmanager
def frozen_running_stats(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run a forward that must not move BatchNorm-like running statistics.

    Sets ``momentum = 0.0`` (the update ``(1 - m) * running + m * batch`` is then the identity) and
    restores ``num_batches_tracked`` afterwards. Unlike ``track_running_stats = False`` this keeps the
    same aten ops and saved tensors, which torch's checkpoint checks on recompute.
    """
    saved: list[tuple[_RunningStats, float | None, torch.Tensor | None]] = []
    for module in modules:
        if _has_running_stats(module):
            stats = cast(_RunningStats, module)
            counter = getattr(stats, "num_batches_tracked", None)
            saved.append((stats, stats.momentum, None if counter is None else counter.clone()))
            stats.momentum = 0.0
    try:
        yield
    finally:
        for stats, momentum, counter in saved:
            stats.momentum = momentum
            if counter is not None and stats.num_batches_tracked is not None:
                with torch.no_grad():
                    stats.num_batches_tracked.copy_(counter)


#: whether the running code is a checkpointed region's recompute (its forward run again inside the backward)
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("memkit_recomputing", default=False)


def in_checkpointed_region() -> bool:
    """Whether the calling code runs as the recompute of a :func:`checkpointed_call` (its forward again, inside the
    backward): the planner's time model counts those ops as the recompute's cost."""
    return _RECOMPUTING.get()


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


@contextlib.contextmanager
def _recompute_context(stat_modules: tuple[nn.Module, ...]) -> Iterator[None]:
    with frozen_running_stats(stat_modules), _recomputing():
        yield


def checkpointed_call(
    function: Callable[..., Any], stat_modules: Iterable[nn.Module], *args: Any, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` under torch's non-reentrant checkpoint, running stats frozen on recompute.

    With gradients disabled (validation, ``no_grad``) the function just runs.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if _compiling():
        # Under torch.compile dynamo traces the checkpoint as its own higher-order op and cannot trace a
        # nested ``context_fn``; it also recomputes inside the compiled backward graph, functionally, so a
        # BatchNorm's running statistics are updated once (by the forward) without memkit's freeze.
        return _torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    stat_modules = tuple(stat_modules)

    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), _recompute_context(stat_modules)

    return _torch_checkpoint(
        function, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=True, **kwargs
    )


def _compiling() -> bool:
    """Whether dynamo is tracing the calling frame (``torch.compiler.is_compiling``; False on a torch without it)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


@dataclass
class _WrapState:
    had_instance_forward: bool
    previous_forward: Any
    stat_modules: tuple[nn.Module, ...]
    ranges: tuple[tuple[int, int], ...] = ()  # for nn.Sequential segments: [start, end) child index ranges
    #: the forward's cache arguments, set while it is checkpointed: (name, positional index or None, value)
    cache_arguments: tuple[tuple[str, int | None, Any], ...] = ()


#: a key/value cache's arguments and their values in a checkpointed forward (transformers' own gradient
#: checkpointing sets the same: a recompute would append to the cache again)
_CACHE_OFF: tuple[tuple[str, Any], ...] = (
    ("use_cache", False),
    ("cache", None),
    ("past_key_value", None),
    ("past_key_values", None),
    ("layer_past", None),
)


def _inner_forward(module: nn.Module, state: _WrapState) -> Callable[..., Any]:
    if state.had_instance_forward:
        return state.previous_forward
    return functools.partial(type(module).forward, module)


def _cache_arguments(module: nn.Module, forward: Callable[..., Any]) -> tuple[tuple[str, int | None, Any], ...]:
    """The cache arguments of ``forward`` (``module``'s) that a checkpointed call sets: ``(name, index among the
    positional parameters or None, value)``, for the names of :data:`_CACHE_OFF` among its parameters (each of them
    when it takes ``**kwargs``). A module whose ``_can_checkpoint_with_cache`` is true (it only reads its cache,
    transformers' flag) keeps its cache; ``use_cache`` is still ``False``. Empty when the signature is unreadable."""
    keep_cache = bool(getattr(module, "_can_checkpoint_with_cache", False))
    wanted = {name: value for name, value in _CACHE_OFF if not (keep_cache and value is None)}
    try:
        parameters = inspect.signature(forward).parameters.values()  # follows functools.wraps' __wrapped__
    except (TypeError, ValueError):
        return ()
    found: dict[str, tuple[str, int | None, Any]] = {}
    index = 0
    var_keyword = False
    for parameter in parameters:
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            if parameter.name in wanted:
                found[parameter.name] = (parameter.name, index, wanted[parameter.name])
            index += 1
        elif parameter.kind is parameter.KEYWORD_ONLY and parameter.name in wanted:
            found[parameter.name] = (parameter.name, None, wanted[parameter.name])
        elif parameter.kind is parameter.VAR_KEYWORD:
            var_keyword = True
    if var_keyword:
        for name, value in wanted.items():
            found.setdefault(name, (name, None, value))
    return tuple(found.values())


def _caching_off(
    arguments: tuple[tuple[str, int | None, Any], ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every cache argument of ``arguments`` given its checkpointed value."""
    positional = list(args)
    for name, index, value in arguments:
        if name in kwargs:
            kwargs[name] = value
        elif index is not None and index < len(positional):
            positional[index] = value
    return tuple(positional), kwargs


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _WrapState = self.__dict__[_STATE_ATTR]
    if state.cache_arguments and torch.is_grad_enabled():
        args, kwargs = _caching_off(state.cache_arguments, args, kwargs)
    return checkpointed_call(_inner_forward(self, state), state.stat_modules, *args, **kwargs)


def _segmented_sequential_forward(self: nn.Sequential, input: Any) -> Any:  # noqa: A002 - nn.Sequential's own name
    state: _WrapState = self.__dict__[_STATE_ATTR]
    children = list(self._modules.values())
    starts = dict(state.ranges)
    index = 0
    while index < len(children):
        end = starts.get(index)
        if end is None:
            input = children[index](input)
            index += 1
            continue
        chain = children[index:end]

        def run(value: Any, chain: list[nn.Module] = chain) -> Any:
            for child in chain:
                value = child(value)
            return value

        stats = tuple(m for child in chain for m in child.modules() if _has_running_stats(m))
        input = checkpointed_call(run, stats, input)
        index = end
    return input


def _install(module: nn.Module, forward: Callable[..., Any], ranges: tuple[tuple[int, int], ...] = ()) -> None:
    if _STATE_ATTR in module.__dict__:
        raise ValueError(
            f"{type(module).__name__} is already checkpointed by memkit; "
            "call handle.remove() before applying another policy"
        )
    had = "forward" in module.__dict__
    stats = tuple(m for m in module.modules() if _has_running_stats(m))
    state = _WrapState(had, module.__dict__.get("forward"), stats, ranges)
    if forward is _checkpointed_forward:
        state.cache_arguments = _cache_arguments(module, _inner_forward(module, state))
    module.__dict__[_STATE_ATTR] = state
    # A bound method (not a closure): copy.deepcopy rebinds it to the copy.
    module.__dict__["forward"] = forward.__get__(module, type(module))


def _uninstall(module: nn.Module) -> None:
    state = module.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    if state.had_instance_forward:
        module.__dict__["forward"] = state.previous_forward
    else:
        module.__dict__.pop("forward", None)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether memkit checkpointing is installed on ``module`` itself."""
    return _STATE_ATTR in module.__dict__


class CheckpointHandle:
    """What :func:`apply_checkpointing` did, and how to undo it.

    Attributes:
        plan: the :class:`CheckpointPlan` (regions, predicted and measured saving).

    ``remove()`` (or leaving a ``with handle:`` block) restores every wrapped module exactly: the
    instance ``forward`` it had before (usually none) and nothing else left behind.
    """

    plan: CheckpointPlan

    def __init__(self, plan: CheckpointPlan, wrapped: list[nn.Module]) -> None:
        self.plan = plan
        self._wrapped = wrapped

    @property
    def active(self) -> bool:
        """Whether the checkpointing is still installed."""
        return bool(self._wrapped)

    def remove(self) -> None:
        """Unwrap every module (idempotent)."""
        for module in self._wrapped:
            _uninstall(module)
        self._wrapped = []

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CheckpointHandle({self.plan.count} regions, active={self.active})"


def wrap_regions(regions: list[Region]) -> list[nn.Module]:
    """Checkpoint every region (a module, or a segment of a plain ``nn.Sequential``'s children) and return
    the modules that got an instance ``forward`` (for :class:`CheckpointHandle`). All or nothing: on an
    error every module wrapped so far is restored."""
    wrapped: list[nn.Module] = []
    by_container: dict[int, tuple[nn.Sequential, list[tuple[int, int]]]] = {}
    try:
        for region in regions:
            if region.container is not None and region.child_range is not None:  # a segment: both are given
                by_container.setdefault(id(region.container), (region.container, []))[1].append(region.child_range)
            else:
                _install(region.modules[0], _checkpointed_forward)
                wrapped.append(region.modules[0])
        for container, ranges in by_container.values():
            _install(container, _segmented_sequential_forward, tuple(sorted(ranges)))
            wrapped.append(container)
    except Exception:  # whatever failed: no module is left half-wrapped, and the error goes on
        for module in wrapped:
            _uninstall(module)
        raise
    return wrapped


def unwrap_modules(modules: Iterable[nn.Module]) -> None:
    """Undo :func:`wrap_regions` on ``modules`` (each restored exactly; idempotent)."""
    for module in modules:
        _uninstall(module)
