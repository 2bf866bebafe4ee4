"""Checkpoint policies and the choice of regions: which blocks of a module a policy names, before any measuring.

Owns the policy forms (``"auto"``, module classes, a callable, :class:`CheckpointBudget`), their
parsing and validation (budget units included), the finding of repeated blocks and the candidate
regions a budget chooses among.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_memkit._class_paths import resolve_class_path
from lightning_memkit.units import format_bytes, parse_bytes

__all__ = [
    "CheckpointBudget",
    "CheckpointPolicy",
    "normalize_policy",
    "describe_policy",
    "find_repeated_blocks",
    "repeated_block_classes",
    "BUDGET_UNITS_HINT",
]

#: how to write a budget; every budget error ends with it.
BUDGET_UNITS_HINT = (
    "write a fraction in (0, 1] of the baseline activation memory, e.g. budget=0.5, "
    "or a size with a unit, e.g. budget='512MiB' (CheckpointBudget(bytes=...) takes an int of bytes)"
)


# ---------------------------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class CheckpointBudget:
    """A budget for the activation memory a forward pass leaves for backward.

    Give exactly one of:
        fraction: a fraction (0 < f <= 1) of the *baseline* activation bytes (measured without
            checkpointing on a sample batch).
        bytes: an absolute size: an int of bytes, or a string with a unit such as ``"512MiB"``.
    And optionally:
        within: a class or callable policy (a set of module classes, or ``(qualified_name, module) ->
            bool``): the budget then chooses only among the modules it matches (outermost matches),
            instead of the model's repeated blocks.

    "Activation bytes" are the bytes of the distinct tensor storages a forward saves for backward
    plus its output, parameters, buffers and the inputs excluded, counted exactly by a
    ``saved_tensors_hooks`` pack hook (see :func:`~lightning_memkit.modes.checkpoint_measure.measure_activation_bytes`).
    """

    fraction: float | None = None
    bytes: int | None = None
    within: Any = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError("CheckpointBudget: give exactly one of fraction=0.5 or bytes='512MiB'")
        if self.fraction is not None:
            if (
                isinstance(self.fraction, bool)
                or not isinstance(self.fraction, (int, float))
                or not 0 < float(self.fraction) <= 1
            ):
                raise ValueError(
                    f"CheckpointBudget(fraction={self.fraction!r}): give a fraction in (0, 1], e.g. 0.5; "
                    "for a size use bytes='512MiB'"
                )
            object.__setattr__(self, "fraction", float(self.fraction))
        if self.bytes is not None:
            if isinstance(self.bytes, float):
                raise ValueError(
                    f"CheckpointBudget(bytes={self.bytes!r}): give an int of bytes or a size with a unit, e.g. '512MiB'"
                )
            object.__setattr__(self, "bytes", parse_bytes(self.bytes))
            if self.bytes <= 0:
                raise ValueError(f"CheckpointBudget(bytes={self.bytes!r}): give a positive size, e.g. '512MiB'")
        if self.within is not None:
            within = normalize_policy(self.within)
            if within == "auto" or isinstance(within, CheckpointBudget):
                raise ValueError(
                    "CheckpointBudget(within=...): give a set of module classes or a callable (name, module) -> bool; "
                    "without within= the budget already chooses among the repeated blocks"
                )
            object.__setattr__(self, "within", within)

    def target_bytes(self, baseline_activation_bytes: int) -> int:
        """The budget in bytes, given ``baseline_activation_bytes`` (the activation bytes measured without
        checkpointing)."""
        if self.fraction is not None:
            return int(self.fraction * baseline_activation_bytes)
        if self.bytes is None:  # __post_init__ refuses it: one of the two is given
            raise ValueError("CheckpointBudget: give exactly one of fraction=0.5 or bytes='512MiB'")
        return int(self.bytes)

    def describe(self) -> str:
        """``budget=0.5``, ``budget=512.00 MiB`` or ``budget=0.5 within {MLP}``."""
        text = f"budget={self.fraction:g}" if self.fraction is not None else f"budget={format_bytes(self.bytes)}"
        return text if self.within is None else f"{text} within {describe_policy(self.within)}"


def parse_budget(value: Any, within: Any = None) -> CheckpointBudget:
    """A :class:`CheckpointBudget` from what a user wrote: a fraction in (0, 1] (a number, or a numeric
    string) or a size string with a unit (``"512MiB"``, ``"2GB"``, ``"4096B"``).

    A bare number above 1 (``2``, ``1.5``, ``"1e9"``) is refused: it could mean a fraction or bytes.

    Raises:
        ValueError: saying to write a fraction or a size with a unit.
    """
    if isinstance(value, CheckpointBudget):
        return value if within is None else CheckpointBudget(value.fraction, value.bytes, within)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"budget {value!r} is not understood; {BUDGET_UNITS_HINT}")
    number: float | None
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is None:
            try:
                return CheckpointBudget(bytes=parse_bytes(text), within=within)
            except ValueError:
                raise ValueError(f"budget {value!r} is not understood; {BUDGET_UNITS_HINT}") from None
    else:
        number = float(value)
    if not 0 < number <= 1:
        raise ValueError(
            f"budget {value!r} is ambiguous: a bare number must be a fraction in (0, 1]; {BUDGET_UNITS_HINT}"
        )
    return CheckpointBudget(fraction=number, within=within)


#: a checkpointing policy: ``"auto"`` (or ``"budget=0.5"``), a set of module classes (or their class paths), a module
#: class, a callable ``(qualified_name, module) -> bool``, or a :class:`CheckpointBudget`
CheckpointPolicy = (
    str | Iterable[str | type[nn.Module]] | type[nn.Module] | CheckpointBudget | Callable[[str, nn.Module], bool]
)


def normalize_policy(policy: Any) -> Any:
    """Validate a checkpoint policy and return its canonical form.

    Accepted: ``"auto"``; a module class or an iterable of module classes (returned as a
    frozenset), each also as its class path (``"torch.nn.TransformerEncoderLayer"``, imported: what a
    YAML config gives); a callable ``(qualified_name, module) -> bool``; a :class:`CheckpointBudget`; a string
    ``"budget=0.5"`` (a fraction in (0, 1]) / ``"budget=512MiB"`` (a size with a unit).

    Raises:
        ValueError: saying which forms are accepted (for budgets: how to write the unit).
    """
    if isinstance(policy, CheckpointBudget):
        return policy
    if isinstance(policy, str):
        text = policy.strip()
        if text.lower() == "auto":
            return "auto"
        if text.lower().startswith("budget="):
            return parse_budget(text[len("budget=") :])
        policy = {_policy_class(policy)}
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        # class paths as strings (a YAML config's `policy: [torch.nn.TransformerEncoderLayer]`) are imported
        classes = frozenset(_policy_class(c) if isinstance(c, str) else c for c in policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise ValueError(
                f"checkpoint policy {policy!r}: a set of policy classes must hold nn.Module subclasses, "
                "e.g. {nn.TransformerEncoderLayer}"
            )
        return classes
    if callable(policy):
        return policy
    raise ValueError(
        f"checkpoint policy {policy!r} is not understood; use 'auto', CheckpointBudget(fraction=0.5), "
        "a set of module classes, or a callable (name, module) -> bool"
    )


def _policy_class(text: str) -> type:
    """The module class a policy string names by its class path (``"torch.nn.TransformerEncoderLayer"``)."""
    found = resolve_class_path(text, strict=True)
    if found is None:
        raise ValueError(
            f"unknown checkpoint policy {text!r}; use 'auto', 'budget=0.5', 'budget=512MiB', a class path "
            "such as 'torch.nn.TransformerEncoderLayer' (or a list of them), a set of module classes, or a "
            "callable (name, module) -> bool"
        )
    return found


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


# ---------------------------------------------------------------------------------------------- finding blocks
@dataclass
class _BlockRun:
    container_name: str
    container: nn.Module
    indices: list[int]  # child positions in the container
    names: list[str]  # qualified names of the blocks

    @property
    def sequential(self) -> nn.Sequential | None:
        """The container when it is a plain ``nn.Sequential``, which runs its children in order, else ``None``."""
        # A subclass that overrides forward may call children in any order: treat it like a ModuleList.
        container = self.container
        if isinstance(container, nn.Sequential) and type(container).forward is nn.Sequential.forward:
            return container
        return None


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


def repeated_block_classes(module: nn.Module) -> frozenset[type]:
    """The classes of ``module``'s repeated blocks (:func:`find_repeated_blocks`): what FSDP wraps as its units
    (``auto_wrap_policy={LlamaDecoderLayer}``)."""
    return frozenset(type(module.get_submodule(name)) for run in find_repeated_blocks(module) for name in run.names)


def _plain_sequential_chains(module: nn.Module) -> list[_BlockRun]:
    """Fallback for ``"auto"`` when no block repeats: the outermost plain ``nn.Sequential`` chains of
    three or more layers, two or more of them with parameters (an MLP's Linear/ReLU stack, a CNN's
    feature extractor; not a Flatten/Dropout/Linear head), each to be cut into about sqrt(n)
    segments, as torch's ``checkpoint_sequential`` does."""
    runs: list[_BlockRun] = []
    for name, container in module.named_modules():
        if (
            type(container).forward is not nn.Sequential.forward
            or not isinstance(container, nn.Sequential)
            or len(container) < 3
            or sum(_has_parameters(child) for child in container) < 2
        ):
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


# ---------------------------------------------------------------------------------------------- regions
@dataclass
class Region:
    """One region a policy names: a module, or a run of consecutive children of a plain ``nn.Sequential``.

    Attributes:
        name: ``"blocks.3"`` or ``"features[0:4]"``.
        modules: the chained modules the region runs.
        module_names: their qualified names.
        container: the ``nn.Sequential`` for a segment of its children (else ``None``).
        child_range: the segment's ``[start, end)`` child indices (else ``None``).
    """

    name: str
    modules: list[nn.Module]
    module_names: list[str]
    container: nn.Sequential | None = None
    child_range: tuple[int, int] | None = None


def _matching(module: nn.Module, policy: Any) -> list[Region]:
    """The outermost modules a class set or callable policy matches, one region each."""
    if isinstance(policy, frozenset):
        chosen = [(n, m) for n, m in _callable_modules(module) if isinstance(m, tuple(policy))]
    elif callable(policy) and not isinstance(policy, CheckpointBudget):
        chosen = [(n, m) for n, m in _callable_modules(module) if policy(n, m)]
    else:
        raise ValueError(f"no regions for policy {policy!r}")
    return [Region(n, [m], [n]) for n, m in _outermost(chosen)]


def regions_for(module: nn.Module, policy: Any) -> tuple[list[Region], str]:
    """The regions a non-budget policy (normalized) checkpoints, and a note on how they were grouped."""
    if policy != "auto":
        return _matching(module, policy), ""
    runs = find_repeated_blocks(module) or _plain_sequential_chains(module)
    regions: list[Region] = []
    notes = []
    for run in runs:
        sequential = run.sequential
        if sequential is not None:
            children = list(sequential.named_children())
            for start, end in _sqrt_ranges(run.indices):
                names = [_join(run.container_name, children[i][0]) for i in range(start, end)]
                regions.append(
                    Region(
                        f"{run.container_name or '<root>'}[{start}:{end}]",
                        [children[i][1] for i in range(start, end)],
                        names,
                        sequential,
                        (start, end),
                    )
                )
            classes = {type(children[i][1]).__name__ for i in run.indices}
            what = f"{classes.pop()} blocks" if len(classes) == 1 else "layers"
            notes.append(
                f"{run.container_name or '<root>'}: {len(run.indices)} {what} "
                f"in {len(_sqrt_ranges(run.indices))} segments (~sqrt(n))"
            )
        else:
            for name in run.names:
                regions.append(Region(name, [module.get_submodule(name)], [name]))
            notes.append(
                f"{run.container_name}: {len(run.names)} blocks called from user code, one segment each "
                "(a ModuleList's or ModuleDict's calls cannot be grouped without rewriting forward)"
            )
    if len(regions) > 1:
        # Like torch's checkpoint_sequential, the last segment runs plain: backward starts by recomputing
        # it, so checkpointing it would cost a forward and save no peak memory.
        last = regions.pop()
        notes.append(f"the last segment ({last.name}) is not checkpointed: backward would recompute it at once")
    return regions, "; ".join(notes)


def budget_candidates(module: nn.Module, budget: CheckpointBudget) -> list[Region]:
    """The regions a budget chooses among: the modules ``budget.within`` matches when given, else the
    repeated blocks, else the top-level layers (a plain Sequential cut into about sqrt(n) segments)."""
    if budget.within is not None:
        return _matching(module, budget.within)
    runs = find_repeated_blocks(module)
    if runs:
        return [Region(name, [module.get_submodule(name)], [name]) for run in runs for name in run.names]
    # No repeated blocks: the top-level layers are the candidates; a plain nn.Sequential is cut into
    # about sqrt(n) contiguous segments (one layer alone rarely frees anything: its neighbours keep
    # the same tensors), a ModuleList/ModuleDict is opened one level.
    regions = []
    for name, child in module.named_children():
        if isinstance(child, nn.Sequential) and type(child).forward is nn.Sequential.forward and len(child) > 1:
            children = list(child.named_children())
            for start, end in _sqrt_ranges(list(range(len(children)))):
                names = [_join(name, children[i][0]) for i in range(start, end)]
                regions.append(
                    Region(
                        f"{name}[{start}:{end}]",
                        [children[i][1] for i in range(start, end)],
                        names,
                        child,
                        (start, end),
                    )
                )
        elif isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            for sub, grandchild in child.named_children():
                regions.append(Region(_join(name, sub), [grandchild], [_join(name, sub)]))
        else:
            regions.append(Region(name, [child], [name]))
    return regions


def no_match_error(module: nn.Module, policy: Any) -> ValueError:
    """The error for a policy that names no region of ``module``, listing the model's module classes."""
    classes = sorted({type(m).__name__ for _, m in _callable_modules(module)})
    hint = ", ".join(classes[:12]) + (", ..." if len(classes) > 12 else "")
    if policy == "auto":
        return ValueError(
            f"checkpoint policy 'auto' found no repeated blocks in {type(module).__name__} (same-class children "
            "with parameters of an nn.ModuleList, nn.ModuleDict or nn.Sequential) and no nn.Sequential chain of 3 or "
            "more layers; pass the block classes instead, e.g. "
            f"policy={{nn.Conv2d}}. Module classes in this model: {hint}"
        )
    if isinstance(policy, CheckpointBudget):
        policy = policy.within
    return ValueError(
        f"checkpoint policy {describe_policy(policy)} matched no module of {type(module).__name__}; "
        f"module classes in this model: {hint}"
    )
