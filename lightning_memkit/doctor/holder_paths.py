"""A path of references from a root the user knows to a kept tensor, printed as code, and the holder on it.

``model.outputs[17]``, ``trainer.callbacks[2].saved[3]``, ``model.encoder[1]._forward_hooks``: what to delete, and why.
"""

from __future__ import annotations

import collections
import keyword
import os
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torchmetrics import Metric

__all__ = [
    "HolderPath",
    "HOOK_DICTS",
    "ROOT_KINDS",
    "edge_between",
    "is_identifier",
    "merge_attributes",
    "annotate",
    "path_names",
]

#: ``nn.Module`` attributes that hold hooks, keyed by handle id
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_full_backward_hooks",
    "_full_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
#: ``nn.Module`` attributes whose keys are attribute names (``model._modules["encoder"]`` is ``model.encoder``)
_NAMED_DICTS = ("_modules", "_parameters", "_buffers")
#: root kinds, best first: when two roots reach a tensor in as many steps, the first kind names it
ROOT_KINDS = ("model", "callback", "datamodule", "trainer", "global")


@dataclass
class HolderPath:
    """The references from a root the user knows to a kept tensor.

    Attributes:
        root: the root's name as code (``"model"``, ``"trainer.callbacks[2]"``, ``"train"`` for a module's globals).
        kind: one of :data:`ROOT_KINDS`.
        edges: ``[(kind, key), ...]`` each reference from the root down: ``("attr", name)``,
            ``("item", key)``, ``("index", i)``, ``("dict", None)`` (an object's ``__dict__``),
            ``("cell", None)`` (a closure cell's contents), ``("ref", type name)`` (a reference torch or
            Python keeps that has no name).
        text: the path as code (``"model.outputs[17]"``).
        holder: the part of the path to delete at: the path up to the container that grows (a list, a
            dict, a module's hooks, a metric's list state); ``text`` when none is found.
        note: what the holder is and the fix, when it says more than the path: hooks piled up on a
            module (how many, which function, where it is defined), a torchmetrics list state (bytes
            per update), Lightning's own objects.
        lightning: ``True`` when the path goes through the Trainer's own objects (Lightning keeps it).
        graph_owner: when the path goes through an autograd graph (``model.losses[11].grad_fn._saved_self``),
            the storage key (``id`` of the untyped storage) of the tensor the graph hangs from
            (``model.losses[11]``): what user code kept; else ``None``.
    """

    root: str
    kind: str
    edges: list = field(default_factory=list)
    text: str = ""
    holder: str = ""
    note: str = ""
    lightning: bool = False
    graph_owner: int | None = None


def edge_between(parent: Any, child: Any) -> tuple[str, Any]:
    """How ``parent`` refers to ``child``."""
    if isinstance(parent, dict):
        for key, value in parent.items():
            if value is child:
                return "item", key if isinstance(key, (str, int, float, bool, type(None))) else _Shown(repr(key))
        return "key", None
    if isinstance(parent, (list, tuple, collections.deque)):
        for index, value in enumerate(parent):
            if value is child:
                return "index", index
        return "ref", type(parent).__name__
    if isinstance(parent, types.CellType):
        return "cell", None
    if isinstance(parent, types.MethodType):
        return ("attr", "__self__") if parent.__self__ is child else ("attr", "__func__")
    if isinstance(parent, types.FunctionType):
        for name in ("__closure__", "__defaults__", "__kwdefaults__", "__dict__"):
            if getattr(parent, name, None) is child:
                return "attr", name
        return "ref", "function"
    return _attribute_edge(parent, child)


def _attribute_edge(parent: Any, child: Any) -> tuple[str, Any]:
    """How ``parent``, an object that is no container, function or cell, refers to ``child``: an attribute in its
    ``__dict__`` or its slots (read without running the object's own ``__getattribute__``)."""
    try:
        namespace = object.__getattribute__(parent, "__dict__")
    except (AttributeError, TypeError):
        namespace = None
    if isinstance(namespace, dict):
        if namespace is child:
            return "dict", None
        for key, value in namespace.items():
            if value is child:
                return "attr", key
    for klass in type(parent).__mro__:
        for name in getattr(klass, "__slots__", ()) or ():
            try:
                if getattr(parent, name) is child:
                    return "attr", name
            except AttributeError:
                continue
    if isinstance(parent, (set, frozenset)):
        return "member", None
    return "ref", type(parent).__name__


class _Shown(str):
    """A dict key that is no plain value, kept as its text (a path must not keep the key alive)."""

    def __repr__(self) -> str:
        return str(self)


def is_identifier(key: Any) -> bool:
    return type(key) is str and key.isidentifier() and not keyword.iskeyword(key)


def _render(root: str, edges: list) -> str:
    """The path as code: ``model.encoder[1]._forward_hooks``, ``trainer.callbacks[2].saved[3]``."""
    text = root
    previous = ("", None)
    for kind, key in edges:
        if kind == "item" and previous[0] == "attr" and previous[1] in _NAMED_DICTS and isinstance(key, str):
            text = text[: -len(f".{previous[1]}")]
            text += f"[{key}]" if key.isdigit() else f".{key}" if is_identifier(key) else f"[{key!r}]"
        elif kind == "item":
            text += f"[{key!r}]"
        elif kind == "index":
            text += f"[{key}]"
        elif kind == "attr":
            text += f".{key}" if is_identifier(key) else f".__dict__[{key!r}]"
        elif kind == "cell":
            text += ".cell_contents"
        elif kind == "graph":
            text += key
        elif kind == "dict":
            text += ".__dict__"
        else:
            text += f"<{kind}{' ' + str(key) if key is not None else ''}>"
        previous = (kind, key)
    return text


def _describe_hooks(hooks: dict, path: str) -> str:
    functions = [getattr(hook, "__func__", hook) for hook in hooks.values()]
    makers: dict[str, int] = {}
    for function in functions:
        code = getattr(function, "__code__", None)
        where = f" (defined at {os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""
        name = getattr(function, "__qualname__", type(function).__name__) + where
        makers[name] = makers.get(name, 0) + 1
    made = ", ".join(f"{count} x {name}" for name, count in makers.items())
    return (
        f"{len(hooks)} hooks on {path}: {made}; each keeps what it closes over. Register the hook once "
        f"(not in every step), or keep its handle and call handle.remove()"
    )


def _metric_state_note(metric: Any, metric_path: str, attr: str, state: list) -> str:
    seen, total = set(), 0
    for item in state:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if id(storage) not in seen:
                seen.add(id(storage))
                total += int(storage.nbytes())
    updates = len(state)
    per_update = total // updates if updates else 0
    return (
        f"torchmetrics {type(metric).__name__} {metric_path}: list state '{attr}' has {updates} entries, "
        f"{total} B ({per_update} B per update); call {metric_path}.reset() when the epoch ends (Lightning does "
        f"it when you self.log the metric object itself), or create it with compute_on_cpu=True to keep the state "
        f"in host memory"
    )


def _hooks_or_metric_state(path: HolderPath, objects: list) -> bool:
    """A module's hook dict or a torchmetrics list state on the path is the holder: set it, with its note."""
    edges = path.edges
    for index, (kind, key) in enumerate(edges):
        parent = objects[index]
        if kind == "attr" and key in HOOK_DICTS and isinstance(parent, torch.nn.Module):
            holder = _render(path.root, edges[: index + 1])
            path.holder = path.text = holder
            path.note = _describe_hooks(objects[index + 1], holder)
            return True
        if (
            isinstance(parent, Metric)
            and kind in ("attr", "item")
            and isinstance(getattr(parent, "_defaults", {}).get(key), list)
        ):
            holder = _render(path.root, edges[: index + 1])
            path.holder = path.text = holder
            path.note = _metric_state_note(parent, _render(path.root, edges[:index]), key, objects[index + 1])
            return True
    return False


def _kept_graph(path: HolderPath) -> None:
    """A tensor kept with its autograd graph: the graph keeps what its nodes saved, the kept tensor is the holder."""
    for index, (kind, key) in enumerate(path.edges):
        if kind == "graph" and key == ".grad_fn":
            keeper = _render(path.root, path.edges[:index])
            path.holder = keeper
            path.note = (
                f"{keeper} keeps its autograd graph, and the graph keeps the tensors its nodes saved "
                f"(backward never ran on it, or ran with retain_graph=True): keep .detach() (or .item()) of "
                f"it, not the tensor with its graph"
            )
            return


def _largest_container(path: HolderPath, objects: list) -> None:
    """A plain container: the largest list, dict, set or deque on the way is where it grows."""
    edges = path.edges
    best = None
    for index, (kind, _) in enumerate(edges):
        parent = objects[index]
        named = index and edges[index - 1][0] == "attr" and edges[index - 1][1] in _NAMED_DICTS
        if (
            kind in ("index", "item", "member")
            and not named
            and hasattr(parent, "__len__")
            and not isinstance(parent, torch.Tensor)
        ):
            size = len(parent)
            if best is None or size > best[1]:
                best = (index, size, type(parent).__name__)
    if best is None:
        return
    index, size, type_name = best
    holder = _render(path.root, edges[:index])
    if not path.note:
        path.holder = holder
        path.note = (
            f"{holder} is a {type_name} of {size} entries that keeps them: delete them there "
            f"(clear it when done, bound it, or keep .item() / .detach().cpu() values)"
        )
    else:
        path.note += f"; {holder} is a {type_name} of {size} entries"


def annotate(path: HolderPath, objects: list) -> None:
    """Set the path's text, and find the holder inside it (the container that grows) and its note; ``objects``
    are the objects along the path, the root first."""
    edges = path.edges
    path.text = path.holder = _render(path.root, edges)
    path.lightning = path.kind == "trainer" and any(
        kind == "attr" and isinstance(key, str) and (key.startswith("_") or key.endswith("_loop") or key == "strategy")
        for kind, key in edges[:2]
    )
    if _hooks_or_metric_state(path, objects):
        return
    _kept_graph(path)
    _largest_container(path, objects)
    if path.lightning:
        path.note = "Lightning's own objects keep it (not your code)" + (f"; {path.note}" if path.note else "")


def merge_attributes(edges: list, objects: list) -> tuple[list, list]:
    """An object's ``__dict__`` then one of its items is one attribute: ``("attr", name)`` on the object."""
    out_edges, out_objects, index = [], [], 0
    while index < len(edges):
        if edges[index][0] == "dict" and index + 1 < len(edges) and edges[index + 1][0] == "item":
            out_edges.append(("attr", edges[index + 1][1]))
            out_objects.append(objects[index])
            index += 2
            continue
        out_edges.append(edges[index])
        out_objects.append(objects[index])
        index += 1
    out_objects.append(objects[-1])
    return out_edges, out_objects


def path_names(path: HolderPath) -> set[str]:
    """The names on a holder's path (``{"model", "kept"}`` for ``model.kept[27]``): attributes, string keys
    and the root's name, to match against what a keeping line stores into."""
    names = {part for part in path.root.replace("[", ".").split(".") if part.isidentifier()}
    names.update(key for kind, key in path.edges if kind in ("attr", "item") and isinstance(key, str))
    return names
