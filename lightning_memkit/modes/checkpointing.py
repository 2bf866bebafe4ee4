"""Activation checkpointing for any nn.Module: policies, the choice of blocks, wrapping and exact unwrapping.

Checkpointing here is always torch's *non-reentrant* ``torch.utils.checkpoint.checkpoint``: every
parameter gets its gradient whatever ``requires_grad`` the inputs have, and the RNG state is replayed,
so dropout masks match. Two things are added on top of torch:

* BatchNorm-like layers (any module with ``track_running_stats`` and running buffers) would update
  their running statistics a second time during the recomputation; torch does not prevent that.
  While a region is recomputed their ``momentum`` is 0 (the update is then exact identity) and
  ``num_batches_tracked`` is put back, so running statistics match an unchecked run bit for bit.
* Wrapping sets an instance ``forward`` on the chosen modules (the module tree, parameter names and
  ``state_dict`` keys do not change); :meth:`CheckpointHandle.remove` restores the module exactly.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from lightning_memkit.accounting.accountant import TensorAccountant, storage_of
from lightning_memkit.units import format_bytes, parse_bytes

__all__ = [
    "CheckpointBudget",
    "CheckpointSegment",
    "CheckpointPlan",
    "CheckpointHandle",
    "apply_checkpointing",
    "plan_checkpointing",
    "find_repeated_blocks",
    "measure_activation_bytes",
    "profile_blocks",
    "BlockProfile",
    "normalize_policy",
    "describe_policy",
    "checkpointed_call",
    "frozen_running_stats",
]

_STATE_ATTR = "_memkit_checkpoint_state"


# ---------------------------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class CheckpointBudget:
    """A budget for the activation memory a forward pass leaves for backward.

    Give exactly one of:
        fraction: a fraction (0 < f <= 1) of the *baseline* activation bytes (measured without
            checkpointing on a sample batch).
        bytes: an absolute number of bytes (an int, or a string such as ``"512MiB"``).

    "Activation bytes" are the bytes of tensor storages still alive after the forward pass that were
    allocated during it (what autograd saved for backward, plus the output), counted exactly by the
    :class:`~lightning_memkit.TensorAccountant`.
    """

    fraction: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError("CheckpointBudget: give exactly one of fraction=0.5 or bytes='512MiB'")
        if self.fraction is not None and not 0 < float(self.fraction) <= 1:
            raise ValueError(f"CheckpointBudget(fraction={self.fraction!r}): give a fraction in (0, 1], e.g. 0.5")
        if self.bytes is not None:
            object.__setattr__(self, "bytes", parse_bytes(self.bytes))
            if self.bytes <= 0:
                raise ValueError(f"CheckpointBudget(bytes={self.bytes!r}): give a positive size, e.g. '512MiB'")

    def target_bytes(self, baseline_activation_bytes: int) -> int:
        """The budget in bytes, given the baseline activation bytes."""
        if self.fraction is not None:
            return int(self.fraction * baseline_activation_bytes)
        return int(self.bytes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """``budget=0.5`` or ``budget=512.00 MiB``."""
        return f"budget={self.fraction:g}" if self.fraction is not None else f"budget={format_bytes(self.bytes)}"


def normalize_policy(policy: Any) -> Any:
    """Validate a checkpoint policy and return its canonical form.

    Accepted: ``"auto"``; a module class or an iterable of module classes (returned as a
    frozenset); a callable ``(qualified_name, module) -> bool``; a :class:`CheckpointBudget`; a string
    ``"budget=0.5"`` / ``"budget=512MiB"``.

    Raises:
        ValueError: saying which forms are accepted.
    """
    if isinstance(policy, CheckpointBudget):
        return policy
    if isinstance(policy, str):
        text = policy.strip().lower()
        if text == "auto":
            return "auto"
        if text.startswith("budget="):
            value = text[len("budget="):]
            try:
                number = float(value)
            except ValueError:
                return CheckpointBudget(bytes=parse_bytes(value))
            return CheckpointBudget(fraction=number) if number <= 1 else CheckpointBudget(bytes=int(number))
        raise ValueError(f"unknown checkpoint policy {policy!r}; use 'auto', 'budget=0.5', 'budget=512MiB', "
                         "a set of module classes, or a callable (name, module) -> bool")
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = frozenset(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise ValueError(f"checkpoint policy {policy!r}: a set of policy classes must hold nn.Module subclasses, "
                             "e.g. {nn.TransformerEncoderLayer}")
        return classes
    if callable(policy):
        return policy
    raise ValueError(f"checkpoint policy {policy!r} is not understood; use 'auto', CheckpointBudget(fraction=0.5), "
                     "a set of module classes, or a callable (name, module) -> bool")


def describe_policy(policy: Any) -> str:
    """A short text for a policy: ``auto``, ``budget=0.5``, ``{TransformerEncoderLayer}``, ``callable``."""
    policy = normalize_policy(policy)
    if policy == "auto":
        return "auto"
    if isinstance(policy, CheckpointBudget):
        return policy.describe()
    if isinstance(policy, frozenset):
        return "{" + ",".join(sorted(c.__name__ for c in policy)) + "}"
    return getattr(policy, "__name__", "callable")


# ---------------------------------------------------------------------------------------------- records
@dataclass
class CheckpointSegment:
    """One checkpointed region.

    Attributes:
        name: the region's name: a module's qualified name (``"blocks.3"``) or, for a run of
            children of an ``nn.Sequential``, ``"features[0:4]"``.
        module_names: qualified names of the modules the region runs.
        saved_bytes: bytes of the storages the region's modules saved for backward without
            checkpointing (parameters excluded), when measured.
        predicted_saving_bytes: the part of ``saved_bytes`` that checkpointing frees (storages
            not also kept by the region's inputs or by code outside the region), when measured.
        recompute_flops: FLOPs of one forward of the region (the recompute cost), when measured.
        forward_seconds: wall time of one forward of the region on the sample, when measured.
    """

    name: str
    module_names: tuple[str, ...]
    saved_bytes: int | None = None
    predicted_saving_bytes: int | None = None
    recompute_flops: int | None = None
    forward_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        data = asdict(self)
        data["module_names"] = list(self.module_names)
        return data


@dataclass
class CheckpointPlan:
    """What a policy checkpointed and what it was predicted or measured to save (bytes).

    Attributes:
        policy: the policy's description (``describe_policy``).
        segments: the checkpointed regions.
        baseline_activation_bytes: activation bytes without checkpointing (exact, accountant), when measured.
        measured_activation_bytes: activation bytes with these segments checkpointed (exact), when measured.
        budget_bytes: the budget in bytes, for budget policies.
        note: why the plan is what it is (e.g. how segments were grouped).
    """

    policy: str
    segments: list[CheckpointSegment] = field(default_factory=list)
    baseline_activation_bytes: int | None = None
    measured_activation_bytes: int | None = None
    budget_bytes: int | None = None
    note: str = ""

    @property
    def count(self) -> int:
        """Number of checkpointed regions."""
        return len(self.segments)

    @property
    def names(self) -> list[str]:
        """Names of the checkpointed regions."""
        return [s.name for s in self.segments]

    @property
    def predicted_saving_bytes(self) -> int | None:
        """Sum of the segments' predicted savings, or ``None`` when not measured."""
        values = [s.predicted_saving_bytes for s in self.segments]
        return None if not values or any(v is None for v in values) else int(sum(values))  # type: ignore[arg-type]

    @property
    def measured_saving_bytes(self) -> int | None:
        """Baseline minus checkpointed activation bytes, when both were measured."""
        if self.baseline_activation_bytes is None or self.measured_activation_bytes is None:
            return None
        return self.baseline_activation_bytes - self.measured_activation_bytes

    def summary(self) -> str:
        """One paragraph for logs: count, names, predicted and measured saving."""
        names = ", ".join(self.names[:8]) + (f", ... ({self.count - 8} more)" if self.count > 8 else "")
        text = f"memkit checkpointing ({self.policy}): {self.count} region(s): {names or 'none'}"
        if self.predicted_saving_bytes is not None:
            text += f"; predicted saving {format_bytes(self.predicted_saving_bytes)}"
        if self.measured_saving_bytes is not None:
            text += (f"; activation memory {format_bytes(self.baseline_activation_bytes)} -> "
                     f"{format_bytes(self.measured_activation_bytes)} (measured)")
        if self.budget_bytes is not None:
            text += f"; budget {format_bytes(self.budget_bytes)}"
        if self.note:
            text += f". {self.note}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (segments included, plus the derived totals)."""
        return {
            "policy": self.policy,
            "count": self.count,
            "segments": [s.to_dict() for s in self.segments],
            "baseline_activation_bytes": self.baseline_activation_bytes,
            "measured_activation_bytes": self.measured_activation_bytes,
            "predicted_saving_bytes": self.predicted_saving_bytes,
            "budget_bytes": self.budget_bytes,
            "note": self.note,
        }


# ---------------------------------------------------------------------------------------------- the checkpointed call
def _has_running_stats(module: nn.Module) -> bool:
    return bool(getattr(module, "track_running_stats", False)) and getattr(module, "running_mean", None) is not None and hasattr(module, "momentum")


@contextlib.contextmanager
def frozen_running_stats(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run a forward that must not move BatchNorm-like running statistics.

    Sets ``momentum = 0.0`` (the update ``(1 - m) * running + m * batch`` is then the identity) and
    restores ``num_batches_tracked`` afterwards. Unlike ``track_running_stats = False`` this keeps the
    same aten ops and saved tensors, which torch's checkpoint checks on recompute.
    """
    saved = []
    for module in modules:
        if _has_running_stats(module):
            counter = getattr(module, "num_batches_tracked", None)
            saved.append((module, module.momentum, None if counter is None else counter.clone()))
            module.momentum = 0.0
    try:
        yield
    finally:
        for module, momentum, counter in saved:
            module.momentum = momentum
            if counter is not None:
                with torch.no_grad():
                    module.num_batches_tracked.copy_(counter)


def checkpointed_call(function: Callable[..., Any], stat_modules: Iterable[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under torch's non-reentrant checkpoint, running stats frozen on recompute.

    With gradients disabled (validation, ``no_grad``) the function just runs.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    stat_modules = tuple(stat_modules)

    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), frozen_running_stats(stat_modules)

    return _torch_checkpoint(function, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=True, **kwargs)


@dataclass
class _WrapState:
    had_instance_forward: bool
    previous_forward: Any
    stat_modules: tuple[nn.Module, ...]
    ranges: tuple[tuple[int, int], ...] = ()  # for nn.Sequential segments: [start, end) child index ranges


def _inner_forward(module: nn.Module, state: _WrapState) -> Callable[..., Any]:
    if state.had_instance_forward:
        return state.previous_forward
    return functools.partial(type(module).forward, module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _WrapState = self.__dict__[_STATE_ATTR]
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
        raise ValueError(f"{type(module).__name__} is already checkpointed by memkit; call handle.remove() before applying another policy")
    had = "forward" in module.__dict__
    stats = tuple(m for m in module.modules() if _has_running_stats(m))
    module.__dict__[_STATE_ATTR] = _WrapState(had, module.__dict__.get("forward"), stats, ranges)
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

    def __enter__(self) -> "CheckpointHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CheckpointHandle({self.plan.count} regions, active={self.active})"


# ---------------------------------------------------------------------------------------------- finding blocks
@dataclass
class _BlockRun:
    container_name: str
    container: nn.Module
    indices: list[int]  # child positions in the container
    names: list[str]  # qualified names of the blocks

    @property
    def sequential(self) -> bool:
        # A subclass that overrides forward may call children in any order: treat it like a ModuleList.
        return isinstance(self.container, nn.Sequential) and type(self.container).forward is nn.Sequential.forward


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_repeated_blocks(module: nn.Module) -> list[_BlockRun]:
    """The repeated blocks of ``module``: same-class children (with parameters) of an ``nn.ModuleList``,
    ``nn.ModuleDict`` or ``nn.Sequential``, at least two of them; outermost containers first, nothing
    inside a block found.

    In a ModuleList or ModuleDict the most frequent class is taken; in a Sequential the longest run of consecutive
    same-class children (a Sequential's children are chained, so a run can be cut into segments).
    """
    runs: list[_BlockRun] = []
    taken: list[str] = []
    for name, container in module.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        children = list(container.named_children())
        best: list[int] = []
        if isinstance(container, nn.Sequential):
            start = 0
            for index in range(1, len(children) + 1):
                if index == len(children) or type(children[index][1]) is not type(children[start][1]):
                    if index - start > len(best):
                        best = list(range(start, index))
                    start = index
        else:
            by_class: dict[type, list[int]] = {}
            for index, (_, child) in enumerate(children):
                by_class.setdefault(type(child), []).append(index)
            best = max(by_class.values(), key=len, default=[])
        if len(best) < 2 or not _has_parameters(children[best[0]][1]):
            continue
        names = [_join(name, children[i][0]) for i in best]
        runs.append(_BlockRun(name, container, best, names))
        taken.extend(names)
    return runs


def _plain_sequential_chains(module: nn.Module) -> list[_BlockRun]:
    """Fallback for ``"auto"`` when no block repeats: the outermost plain ``nn.Sequential`` chains of
    three or more layers, two or more of them with parameters (an MLP's Linear/ReLU stack, a CNN's
    feature extractor; not a Flatten/Dropout/Linear head), each to be cut into about sqrt(n)
    segments, as torch's ``checkpoint_sequential`` does."""
    runs: list[_BlockRun] = []
    for name, container in module.named_modules():
        if (type(container).forward is not nn.Sequential.forward or not isinstance(container, nn.Sequential)
                or len(container) < 3 or sum(_has_parameters(child) for child in container) < 2):
            continue
        if any(name.startswith(run.container_name + ".") or not run.container_name for run in runs):
            continue
        children = list(container.named_children())
        runs.append(_BlockRun(name, container, list(range(len(children))), [_join(name, c) for c, _ in children]))
    return runs


def _sqrt_ranges(indices: list[int]) -> list[tuple[int, int]]:
    """Cut consecutive child indices into about sqrt(n) contiguous [start, end) ranges of near-equal size."""
    n = len(indices)
    count = max(1, round(math.sqrt(n)))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return [(indices[bounds[i]], indices[bounds[i + 1] - 1] + 1) for i in range(count)]


def _outermost(selected: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    kept: list[tuple[str, nn.Module]] = []
    for name, module in selected:
        if not any(name.startswith(k + ".") for k, _ in kept):
            kept.append((name, module))
    return kept


def _callable_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_modules():
        if name and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield name, child


# ---------------------------------------------------------------------------------------------- measuring
def _runner(module: nn.Module, sample: Any) -> Callable[[], Any]:
    if callable(sample) and not isinstance(sample, torch.Tensor):
        return sample
    if isinstance(sample, dict):
        return lambda: module(**sample)
    if isinstance(sample, (tuple, list)):
        return lambda: module(*sample)
    return lambda: module(sample)


@contextlib.contextmanager
def _side_effect_free(module: nn.Module) -> Iterator[None]:
    """A measuring forward must not change training: RNG streams and running statistics are restored."""
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), frozen_running_stats(list(module.modules())):
        yield


def measure_activation_bytes(module: nn.Module, sample: Any) -> int:
    """Exact bytes a forward pass leaves alive for backward (saved tensors plus the output), in bytes.

    Runs one forward with gradients on under a :class:`~lightning_memkit.TensorAccountant`; the
    parameters, buffers and the sample's tensors existed before and are not counted. ``sample`` is
    the forward's input (a tensor, a tuple of positional arguments or a dict of keyword arguments) or a
    zero-argument callable that runs the forward and returns its output (e.g. ``lambda:
    model.training_step(batch, 0)``). RNG state and running statistics are left as they were.
    """
    run = _runner(module, sample)
    accountant = TensorAccountant()
    accountant.adopt(module.parameters())
    accountant.adopt(module.buffers())
    if not callable(sample) or isinstance(sample, torch.Tensor):
        from torch.utils._pytree import tree_flatten

        accountant.adopt(t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor))
    with _side_effect_free(module), torch.enable_grad():
        before = accountant.current_bytes
        with accountant:
            output = run()
        retained = accountant.current_bytes - before
        del output
    return int(retained)


@dataclass
class BlockProfile:
    """A region's measured cost on one sample forward (see :class:`CheckpointSegment` for the fields)."""

    saved_bytes: int
    predicted_saving_bytes: int
    recompute_flops: int
    forward_seconds: float


def profile_blocks(module: nn.Module, sample: Any, regions: dict[str, list[nn.Module]]) -> dict[str, BlockProfile]:
    """Measure, on one forward of ``sample``, what each region saves for backward and what it costs.

    ``regions`` maps a name to the chained modules it runs (one module, or consecutive children of a
    Sequential). A ``saved_tensors_hooks`` pack hook attributes every saved storage to the regions
    running when it is saved; a storage is *freed by checkpointing* a region when it is not a
    parameter or buffer, not one of the region's inputs (checkpoint keeps those), and not also saved
    by code outside the region. FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    param_keys = {id(s) for s in map(storage_of, [*module.parameters(), *module.buffers()]) if s is not None}
    saved: dict[str, dict[int, int]] = {name: {} for name in regions}
    inputs: dict[str, set[int]] = {name: set() for name in regions}
    outside: set[int] = set()
    flops = {name: 0 for name in regions}
    seconds = {name: 0.0 for name in regions}
    active: list[str] = []
    starts: dict[str, tuple[int, float]] = {}
    counter = FlopCounterMode(display=False)
    keep_alive: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = storage_of(tensor)
        if storage is not None and id(storage) not in param_keys:
            keep_alive.append(tensor)  # ids must stay unique while we attribute
            if active:
                for name in active:
                    saved[name][id(storage)] = int(storage.nbytes())
            else:
                outside.add(id(storage))
        return tensor

    handles = []
    for name, chain in regions.items():
        def pre(_module: nn.Module, args: Any, kwargs: Any = None, name: str = name) -> None:
            from torch.utils._pytree import tree_flatten

            for leaf in tree_flatten((args, kwargs))[0]:
                storage = storage_of(leaf)
                if storage is not None:
                    inputs[name].add(id(storage))
            active.append(name)
            starts[name] = (counter.get_total_flops(), time.perf_counter())

        def post(_module: nn.Module, args: Any, *rest: Any, name: str = name) -> None:
            if name in active:
                active.remove(name)
                flops0, t0 = starts.pop(name)
                flops[name] += counter.get_total_flops() - flops0
                seconds[name] += time.perf_counter() - t0
                # A storage saved inside and also outside (e.g. the output, saved by the next op) stays.

        handles.append(chain[0].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(chain[-1].register_forward_hook(post))
    run = _runner(module, sample)
    try:
        with _side_effect_free(module), torch.enable_grad(), counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = run()
        del output
    finally:
        for handle in handles:
            handle.remove()
    result = {}
    for name in regions:
        total = sum(saved[name].values())
        freed = sum(n for key, n in saved[name].items() if key not in inputs[name] and key not in outside)
        result[name] = BlockProfile(total, freed, int(flops[name]), seconds[name])
    keep_alive.clear()
    return result


# ---------------------------------------------------------------------------------------------- planning and applying
@dataclass
class _Region:
    name: str
    modules: list[nn.Module]
    module_names: list[str]
    container: nn.Sequential | None = None  # set for a Sequential segment
    child_range: tuple[int, int] | None = None


def _regions_for(module: nn.Module, policy: Any) -> tuple[list[_Region], str]:
    if policy == "auto":
        runs = find_repeated_blocks(module) or _plain_sequential_chains(module)
        regions: list[_Region] = []
        notes = []
        for run in runs:
            if run.sequential:
                children = list(run.container.named_children())
                for start, end in _sqrt_ranges(run.indices):
                    names = [_join(run.container_name, children[i][0]) for i in range(start, end)]
                    regions.append(_Region(f"{run.container_name or '<root>'}[{start}:{end}]", [children[i][1] for i in range(start, end)],
                                           names, run.container, (start, end)))
                classes = {type(children[i][1]).__name__ for i in run.indices}
                what = f"{classes.pop()} blocks" if len(classes) == 1 else "layers"
                notes.append(f"{run.container_name or '<root>'}: {len(run.indices)} {what} "
                             f"in {len(_sqrt_ranges(run.indices))} segments (~sqrt(n))")
            else:
                for name in run.names:
                    regions.append(_Region(name, [module.get_submodule(name)], [name]))
                notes.append(f"{run.container_name}: {len(run.names)} blocks called from user code, one segment each "
                             "(a ModuleList's or ModuleDict's calls cannot be grouped without rewriting forward)")
        if len(regions) > 1:
            # Like torch's checkpoint_sequential, the last segment runs plain: backward starts by recomputing
            # it, so checkpointing it would cost a forward and save no peak memory.
            last = regions.pop()
            notes.append(f"the last segment ({last.name}) is not checkpointed: backward would recompute it at once")
        return regions, "; ".join(notes)
    if isinstance(policy, frozenset):
        chosen = [(n, m) for n, m in _callable_modules(module) if isinstance(m, tuple(policy))]
    elif callable(policy) and not isinstance(policy, CheckpointBudget):
        chosen = [(n, m) for n, m in _callable_modules(module) if policy(n, m)]
    else:
        raise ValueError(f"no regions for policy {policy!r}")
    return [_Region(n, [m], [n]) for n, m in _outermost(chosen)], ""


def _no_match_error(module: nn.Module, policy: Any) -> ValueError:
    classes = sorted({type(m).__name__ for _, m in _callable_modules(module)})
    hint = ", ".join(classes[:12]) + (", ..." if len(classes) > 12 else "")
    if policy == "auto":
        return ValueError(f"checkpoint policy 'auto' found no repeated blocks in {type(module).__name__} (same-class children "
                          f"with parameters of an nn.ModuleList, nn.ModuleDict or nn.Sequential) and no nn.Sequential chain of 3 or more "
                          f"layers; pass the block classes instead, "
                          f"e.g. policy={{nn.Conv2d}}. Module classes in this model: {hint}")
    return ValueError(f"checkpoint policy {describe_policy(policy)} matched no module of {type(module).__name__}; "
                      f"module classes in this model: {hint}")


def _wrap(regions: list[_Region]) -> list[nn.Module]:
    wrapped: list[nn.Module] = []
    by_container: dict[int, tuple[nn.Sequential, list[tuple[int, int]]]] = {}
    try:
        for region in regions:
            if region.container is not None:
                by_container.setdefault(id(region.container), (region.container, []))[1].append(region.child_range)  # type: ignore[arg-type]
            else:
                _install(region.modules[0], _checkpointed_forward)
                wrapped.append(region.modules[0])
        for container, ranges in by_container.values():
            _install(container, _segmented_sequential_forward, tuple(sorted(ranges)))
            wrapped.append(container)
    except Exception:
        for module in wrapped:
            _uninstall(module)
        raise
    return wrapped


def _segments(regions: list[_Region], profiles: dict[str, BlockProfile] | None) -> list[CheckpointSegment]:
    out = []
    for region in regions:
        p = (profiles or {}).get(region.name)
        out.append(CheckpointSegment(region.name, tuple(region.module_names), p and p.saved_bytes, p and p.predicted_saving_bytes,
                                     p and p.recompute_flops, p and p.forward_seconds))
    return out


def _budget_candidates(module: nn.Module) -> list[_Region]:
    runs = find_repeated_blocks(module)
    if runs:
        return [_Region(name, [module.get_submodule(name)], [name]) for run in runs for name in run.names]
    # No repeated blocks: the top-level layers are the candidates; a plain nn.Sequential is cut into
    # about sqrt(n) contiguous segments (one layer alone rarely frees anything: its neighbours keep
    # the same tensors), a ModuleList/ModuleDict is opened one level.
    regions = []
    for name, child in module.named_children():
        if isinstance(child, nn.Sequential) and type(child).forward is nn.Sequential.forward and len(child) > 1:
            children = list(child.named_children())
            for start, end in _sqrt_ranges(list(range(len(children)))):
                names = [_join(name, children[i][0]) for i in range(start, end)]
                regions.append(_Region(f"{name}[{start}:{end}]", [children[i][1] for i in range(start, end)], names, child, (start, end)))
        elif isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            for sub, grandchild in child.named_children():
                regions.append(_Region(_join(name, sub), [grandchild], [_join(name, sub)]))
        else:
            regions.append(_Region(name, [child], [name]))
    return regions


def _plan_budget(module: nn.Module, budget: CheckpointBudget, sample: Any) -> tuple[list[_Region], CheckpointPlan, list[nn.Module]]:
    if sample is None:
        raise ValueError("a budget policy measures activation memory on a sample: pass sample=(inputs,) "
                         "or sample=lambda: model.training_step(batch, 0)")
    baseline = measure_activation_bytes(module, sample)
    target = budget.target_bytes(baseline)
    plan = CheckpointPlan(describe_policy(budget), [], baseline, baseline, target)
    if baseline <= target:
        plan.note = "the baseline already meets the budget; nothing checkpointed"
        return [], plan, []
    candidates = _budget_candidates(module)
    profiles = profile_blocks(module, sample, {r.name: r.modules for r in candidates})
    useful = [r for r in candidates if profiles[r.name].predicted_saving_bytes > 0]
    if not useful:
        raise ValueError(f"budget {format_bytes(target)} cannot be met: no block of {type(module).__name__} holds activation memory "
                         "that checkpointing would free; use a larger budget or a set of module classes")

    def cost(region: _Region) -> float:
        p = profiles[region.name]
        return float(p.recompute_flops) if p.recompute_flops > 0 else p.forward_seconds * 1e12

    # Greedy knapsack: most bytes freed per unit of recompute first, until the prediction meets the budget.
    order = sorted(useful, key=lambda r: -profiles[r.name].predicted_saving_bytes / max(cost(r), 1e-9))
    need = baseline - target
    count = 0
    freed = 0
    while count < len(order) and freed < need:
        freed += profiles[order[count].name].predicted_saving_bytes
        count += 1
    # The prediction ignores interactions; measure and add blocks until the budget is met exactly.
    while True:
        chosen = order[:count]
        wrapped = _wrap(chosen)
        measured = measure_activation_bytes(module, sample)
        if measured <= target or count >= len(order):
            break
        for m in wrapped:
            _uninstall(m)
        count += 1
    plan.measured_activation_bytes = measured
    plan.segments = _segments(chosen, profiles)
    if measured > target:
        for m in wrapped:
            _uninstall(m)
        raise ValueError(f"budget {format_bytes(target)} cannot be met: checkpointing all {len(order)} candidate blocks leaves "
                         f"{format_bytes(measured)} of activation memory (baseline {format_bytes(baseline)}); "
                         f"choose a budget of at least {measured} bytes ({measured / baseline:.2f} of the baseline)")
    plan.note = f"{count} of {len(order)} candidate blocks, chosen by bytes freed per recompute FLOP"
    return chosen, plan, wrapped


def apply_checkpointing(module: nn.Module, policy: Any = "auto", sample: Any = None) -> CheckpointHandle:
    """Checkpoint submodules of ``module`` (non-reentrant) and return a handle that undoes it.

    Args:
        module: any ``nn.Module`` (a LightningModule included). It is changed in place: the chosen
            modules get an instance ``forward``; names, parameters and ``state_dict`` are untouched.
        policy: ``"auto"`` (repeated blocks: same-class children of a ModuleList/ModuleDict/Sequential; a
            Sequential run of n blocks is cut into about sqrt(n) segments, ModuleList blocks are one
            segment each), a set of module classes, a callable ``(qualified_name, module) -> bool``,
            or a :class:`CheckpointBudget` (``"budget=0.5"``), which measures activation memory on
            ``sample`` and checkpoints the blocks that meet the budget at the least recompute FLOPs.
            The outermost match wins when a match contains another.
        sample: input for one measuring forward (a tensor, tuple of args, dict of kwargs, or a
            zero-argument callable running the forward). Required for budgets; with other policies it
            fills in each region's saved bytes, predicted saving and FLOPs and the measured totals.

    Raises:
        ValueError: when the policy matches nothing (the message lists the model's module classes),
            or a budget cannot be met.

    Usage::

        handle = apply_checkpointing(model, {nn.TransformerEncoderLayer})
        print(handle.plan.summary())
        ...
        handle.remove()   # model is exactly as before
    """
    policy = normalize_policy(policy)
    if isinstance(policy, CheckpointBudget):
        _, plan, wrapped = _plan_budget(module, policy, sample)
        return CheckpointHandle(plan, wrapped)
    regions, note = _regions_for(module, policy)
    if not regions:
        raise _no_match_error(module, policy)
    plan = CheckpointPlan(describe_policy(policy), note=note)
    profiles = None
    if sample is not None:
        plan.baseline_activation_bytes = measure_activation_bytes(module, sample)
        profiles = profile_blocks(module, sample, {r.name: r.modules for r in regions})
    plan.segments = _segments(regions, profiles)
    wrapped = _wrap(regions)
    if sample is not None:
        plan.measured_activation_bytes = measure_activation_bytes(module, sample)
    return CheckpointHandle(plan, wrapped)


def plan_checkpointing(module: nn.Module, policy: Any = "auto") -> CheckpointPlan:
    """The regions ``policy`` would checkpoint, without wrapping or measuring (budgets need a sample: use
    :func:`apply_checkpointing`)."""
    policy = normalize_policy(policy)
    if isinstance(policy, CheckpointBudget):
        raise ValueError("a budget plan needs a measured sample: call apply_checkpointing(module, policy, sample=...)")
    regions, note = _regions_for(module, policy)
    if not regions:
        raise _no_match_error(module, policy)
    return CheckpointPlan(describe_policy(policy), _segments(regions, None), note=note)
