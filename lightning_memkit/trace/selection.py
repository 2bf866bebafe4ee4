"""Which modules a layer trace hooks: by depth, name pattern or class, under the names the user's model gives them.

Code inside ``torch.compile`` is never hooked (a hook there would be compiled into it); a wrapped module is traced once.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_memkit.compiled import is_compiled_wrapper
from lightning_memkit.trace._torch_compat import user_class, user_name, wrapped_module

__all__ = ["TracedModule", "select_modules", "compiled_hidden"]


class TracedModule:
    """A module the tracer hooks: its qualified name in the user's model, class name and depth (root 0)."""

    __slots__ = ("name", "cls", "depth", "module")

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.cls = user_class(module).__name__
        self.depth = 0 if not name else name.count(".") + 1
        self.module = module


def _inside(qualified_name: str, hidden: str) -> bool:
    """Whether a module named ``qualified_name`` runs inside compiled code that starts at ``hidden``: ``"x."`` is
    the inside of ``torch.compile``'s wrapper ``x``, ``"x"`` a module compiled in place (``x`` itself too), ``""``
    everything (a compiled ``training_step``), ``"."`` every submodule (a compiled root ``forward``)."""
    if hidden == "":
        return True
    if hidden == ".":
        return qualified_name != ""
    if hidden.endswith("."):
        return qualified_name.startswith(hidden)
    return qualified_name == hidden or qualified_name.startswith(hidden + ".")


def compiled_hidden(regions: Sequence[tuple[str, nn.Module]], methods: Sequence[str]) -> list[str]:
    """Where compiled code starts (see :func:`_inside`) for a model whose compiled ``regions`` and compiled
    ``methods`` (``forward``, ``training_step``) run as they are: torch.compile's wrappers keep their own hooks
    (they run around the compiled call), the modules inside them get none."""
    if "training_step" in methods:
        return [""]
    if "forward" in methods:
        return ["."]  # the root's own hooks run around its compiled forward; every submodule is inside
    return [name + "." if is_compiled_wrapper(module) else name for name, module in regions]


def _filters(modules: Any) -> tuple[list[str], list[type]]:
    """``modules=`` as (qualified-name patterns, nn.Module classes)."""
    patterns: list[str] = []
    classes: list[type] = []
    if modules is None:
        return patterns, classes
    for item in [modules] if isinstance(modules, (str, type)) else list(modules):
        if isinstance(item, str):
            patterns.append(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        else:
            raise TypeError(
                f"modules=: give qualified-name patterns (e.g. 'features.*') or nn.Module classes, not {item!r}"
            )
    return patterns, classes


def select_modules(
    model: nn.Module, max_depth: int | None, modules: Any, hidden: Sequence[str] = ()
) -> dict[int, TracedModule]:
    """The modules of ``model`` to hook, by ``id``: at most ``max_depth`` deep, matching ``modules`` (``fnmatch``
    patterns of qualified names, ``""`` the root, or classes), outside the compiled code ``hidden`` names.

    Raises:
        TypeError: ``modules`` holds something neither a pattern nor an nn.Module class.
        ValueError: nothing is selected (and no compiled code hides the modules).
    """
    patterns, classes = _filters(modules)
    # keyed by identity: a module's hash may be its own (torchmetrics' Metric hashes its state, which changes)
    infos: dict[int, TracedModule] = {}
    named: set[str] = set()
    for qualified_name, module in model.named_modules():
        if any(_inside(qualified_name, h) for h in hidden):
            continue  # inside compiled code
        # Names and classes are the user's: a module inside torch's wrappers (FSDP1, checkpoint_wrapper,
        # torch.compile) is traced once, as its outermost wrapper, under the name it has in the user's model
        # (the wrapper's hooks also see what it does around the module: FSDP1's all-gather, say).
        name = user_name(qualified_name)
        if name in named:
            continue
        named.add(name)
        info = TracedModule(name, module)
        if max_depth is not None and info.depth > max_depth:
            continue
        if modules is not None and not (
            any(fnmatch.fnmatchcase(name, p) for p in patterns) or isinstance(wrapped_module(module), tuple(classes))
        ):
            continue
        infos[id(module)] = info
    if not infos and not hidden:
        names = list(dict.fromkeys(user_name(n) or "(root)" for n, _ in model.named_modules()))[:12]
        raise ValueError(
            f"modules={modules!r} with max_depth={max_depth!r} selects no module of "
            f"{type(model).__name__}; its modules include: {', '.join(names)}"
        )
    return infos
