"""Who keeps a leaked tensor alive: the path of references from an object the user knows to it.

Owns :func:`find_holders` (a breadth-first walk *down* the garbage collector's referents, from known
roots to the leaked tensors' storages, bounded in time), :func:`user_roots` (the LightningModule as
``model``, each callback as ``trainer.callbacks[i]``, the Trainer, the datamodule, the globals of the
user's modules), :func:`attach_holders` (the doctor's use: one search per leak report, for all its
groups) and :class:`HolderPath` (the path printed as code you can paste: ``model.outputs[17]``,
``trainer.callbacks[2].saved[3]``, ``model.encoder[1]._forward_hooks``).

Cost: the walk visits what the roots reach, never entering modules, classes, code, frames, functions'
globals or memkit's own objects; it stops as soon as each leaked group has a holder. What the roots
reach is small next to the process (hundreds to thousands of objects for a Lightning run, against
hundreds of thousands the collector tracks), so a tensor no root reaches (a local variable, torch's
global hooks) costs a few milliseconds, not a pass over the whole heap per level as a search up
``gc.get_referrers`` would. Core code, no Lightning import.
"""

from __future__ import annotations

import collections
import gc
import keyword
import os
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from lightning_memkit.doctor import _torch_compat
from lightning_memkit.doctor.keepers import keeping_frame
from lightning_memkit.doctor.recorder import _LIBRARY_ROOTS

__all__ = ["HolderPath", "HolderSearch", "find_holders", "user_roots", "attach_holders", "path_names", "HOOK_DICTS"]

#: ``nn.Module`` attributes that hold hooks, keyed by handle id
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_full_backward_hooks", "_full_backward_pre_hooks" , "_state_dict_hooks", "_state_dict_pre_hooks",
              "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
#: ``nn.Module`` attributes whose keys are attribute names (``model._modules["encoder"]`` is ``model.encoder``)
_NAMED_DICTS = ("_modules", "_parameters", "_buffers")
#: root kinds, best first: when two roots reach a tensor in as many steps, the first kind names it
ROOT_KINDS = ("model", "callback", "datamodule", "trainer", "global")
_DEAD_ENDS = (types.FrameType, types.ModuleType, type, types.CodeType, types.BuiltinFunctionType)


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


@dataclass
class HolderSearch:
    """What one :func:`find_holders` call found and what it cost.

    Attributes:
        paths: ``{id(tensor): HolderPath}`` for each tensor a root reaches.
        levels: referrer levels climbed (each is one pass over the collector's objects).
        objects: objects visited.
        seconds: wall time spent (``time.perf_counter``).
        stopped: why it stopped: ``"all found"``, ``"no more referrers"`` (nothing left that could
            lead to a root), ``"time limit"``, ``"depth limit"``.
    """

    paths: dict = field(default_factory=dict)
    levels: int = 0
    objects: int = 0
    seconds: float = 0.0
    stopped: str = ""


def user_roots(trainer: Any = None, module: Any = None, extra: dict | None = None, globals_of_user_modules: bool = True) -> dict:
    """The objects a user knows, as ``{id(obj): (obj, name, kind)}``: ``module`` as ``model``, each of
    ``trainer.callbacks`` as ``trainer.callbacks[i]``, the datamodule as ``trainer.datamodule``, the
    trainer, and (``globals_of_user_modules``) the globals of every imported module that is the user's
    code (not torch, Lightning, memkit or the standard library) as the module's name. ``extra``:
    more ``{name: obj}`` roots (kind ``"global"``)."""
    roots: dict[int, tuple] = {}

    def add(obj: Any, name: str, kind: str) -> None:
        if obj is not None and id(obj) not in roots:
            roots[id(obj)] = (obj, name, kind)

    add(module, "model", "model")
    if trainer is not None:
        for index, callback in enumerate(getattr(trainer, "callbacks", None) or []):
            add(callback, f"trainer.callbacks[{index}]", "callback")
        try:
            add(getattr(trainer, "datamodule", None), "trainer.datamodule", "datamodule")
        except Exception:  # noqa: BLE001 - a property of a half-set-up trainer
            pass
        add(trainer, "trainer", "trainer")
    for name, obj in (extra or {}).items():
        add(obj, name, "global")
    if globals_of_user_modules:
        for name, loaded in list(sys.modules.items()):
            path = getattr(loaded, "__file__", None)
            if not path or name.startswith("lightning_memkit") or _library_file(path):
                continue
            namespace = getattr(loaded, "__dict__", None)
            if isinstance(namespace, dict):
                add(namespace, "__main__" if name == "__main__" else name, "global")
    return roots


def _library_file(path: str) -> bool:
    return path.startswith("<") or path.startswith(_LIBRARY_ROOTS) or os.path.abspath(path).startswith(_LIBRARY_ROOTS) \
        or os.sep + "site-packages" + os.sep in path


def _own_object(obj: Any) -> bool:
    """memkit's own objects: never a holder a user would delete (they keep no tensor strongly)."""
    module = getattr(type(obj), "__module__", "") or ""
    return module.startswith("lightning_memkit")


def _edge(parent: Any, child: Any) -> tuple[str, Any]:
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


def _identifier(key: Any) -> bool:
    return type(key) is str and key.isidentifier() and not keyword.iskeyword(key)


def _render(root: str, edges: list) -> str:
    """The path as code: ``model.encoder[1]._forward_hooks``, ``trainer.callbacks[2].saved[3]``."""
    text = root
    previous = ("", None)
    for kind, key in edges:
        if kind == "item" and previous[0] == "attr" and previous[1] in _NAMED_DICTS and isinstance(key, str):
            text = text[: -len(f".{previous[1]}")]
            text += f"[{key}]" if key.isdigit() else f".{key}" if _identifier(key) else f"[{key!r}]"
        elif kind == "item":
            text += f"[{key!r}]"
        elif kind == "index":
            text += f"[{key}]"
        elif kind == "attr":
            text += f".{key}" if _identifier(key) else f".__dict__[{key!r}]"
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
    return (f"{len(hooks)} hooks on {path}: {made}; each keeps what it closes over. Register the hook once "
            f"(not in every step), or keep its handle and call handle.remove()")


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
    return (f"torchmetrics {type(metric).__name__} {metric_path}: list state '{attr}' has {updates} entries, "
            f"{total} B ({per_update} B per update); call {metric_path}.reset() when the epoch ends (Lightning does it "
            f"when you self.log the metric object itself), or create it with compute_on_cpu=True to keep the state in host memory")


def _annotate(path: HolderPath, objects: list) -> None:
    """Find the holder inside the path (the container that grows) and its note."""
    edges = path.edges
    text = _render(path.root, edges)
    path.text = text
    path.holder = text
    path.lightning = path.kind == "trainer" and any(kind == "attr" and isinstance(key, str) and
                                                    (key.startswith("_") or key.endswith("_loop") or key in ("strategy",))
                                                    for kind, key in edges[:2])
    try:
        import torchmetrics
        metric_type = torchmetrics.Metric
    except ImportError:  # pragma: no cover - torchmetrics is a Lightning dependency
        metric_type = None
    for index, (kind, key) in enumerate(edges):
        parent = objects[index]
        # hooks: the module's hook dict is the holder
        if kind == "attr" and key in HOOK_DICTS and isinstance(parent, torch.nn.Module):
            holder = _render(path.root, edges[: index + 1])
            path.holder = path.text = holder
            path.note = _describe_hooks(objects[index + 1], holder)
            return
        if metric_type is not None and isinstance(parent, metric_type) and kind in ("attr", "item"):
            defaults = getattr(parent, "_defaults", {})
            if isinstance(defaults.get(key), list):
                holder = _render(path.root, edges[: index + 1])
                metric_path = _render(path.root, edges[:index])
                path.holder = path.text = holder
                path.note = _metric_state_note(parent, metric_path, key, objects[index + 1])
                return
    # a tensor kept with its autograd graph: the graph keeps what its nodes saved
    for index, (kind, key) in enumerate(edges):
        if kind == "graph" and key == ".grad_fn":
            keeper = _render(path.root, edges[:index])
            path.holder = keeper
            path.note = (f"{keeper} keeps its autograd graph, and the graph keeps the tensors its nodes saved (backward never "
                         f"ran on it, or ran with retain_graph=True): keep .detach() (or .item()) of it, not the tensor with its graph")
            break
    # a plain container: the largest list, dict, set or deque on the way is where it grows
    best = None
    for index, (kind, _) in enumerate(edges):
        parent = objects[index]
        if kind in ("index", "item", "member") and not (index and edges[index - 1][0] == "attr" and edges[index - 1][1] in _NAMED_DICTS) \
                and hasattr(parent, "__len__") and not isinstance(parent, torch.Tensor):
            size = len(parent)
            if best is None or size > best[1]:
                best = (index, size, type(parent).__name__)
    if best is not None and not path.note:
        index, size, type_name = best
        holder = _render(path.root, edges[:index])
        path.holder = holder
        path.note = (f"{holder} is a {type_name} of {size} entries that keeps them: delete them there "
                     f"(clear it when done, bound it, or keep .item() / .detach().cpu() values)")
    elif best is not None:
        index, size, type_name = best
        path.note += f"; {_render(path.root, edges[:index])} is a {type_name} of {size} entries"
    if path.lightning:
        path.note = ("Lightning's own objects keep it (not your code)" + (f"; {path.note}" if path.note else ""))


def find_holders(tensors: Iterable[Any], roots: dict, time_limit_s: float = 1.0, max_objects: int = 500_000,
                 graphs: bool = True, enough: Callable[[set], bool] | None = None) -> HolderSearch:
    """Search the shortest reference paths from ``roots`` (``{id(obj): (obj, name, kind)}``, see
    :func:`user_roots`) to ``tensors``: any tensor on the same storage counts (a ``.detach()`` or a
    view kept instead of the tensor made). ``tensors``: tensors, or storage keys (``id`` of an
    ``untyped_storage()``).

    Breadth-first *down* ``gc.get_referents`` from all roots at once (best kind first, so of two
    paths as short the better root names it); the walk never enters modules, classes, code, frames,
    functions' globals or memkit's own objects, and with ``graphs`` it also follows a tensor's
    autograd graph to the tensors its nodes saved (a loss kept with its graph). It stops when every
    storage is reached, when nothing is left, after ``max_objects`` objects or after
    ``time_limit_s`` seconds (checked every 512 objects), or when ``enough(found storage keys)`` says
    so. Its cost is the size of what the roots reach, not of the process. Returns a
    :class:`HolderSearch` whose ``paths`` are keyed by storage key.
    """
    from lightning_memkit.accounting.accountant import storage_of

    started = time.perf_counter()
    deadline = started + max(0.0, time_limit_s)
    search = HolderSearch()
    targets: set[int] = set()
    for item in tensors:
        if isinstance(item, torch.Tensor):
            storage = storage_of(item)
            if storage is not None:
                targets.add(id(storage))
        elif isinstance(item, int):
            targets.add(item)
    if not targets:
        search.stopped = "all found"
        return search
    ordered = sorted(roots.items(), key=lambda item: ROOT_KINDS.index(item[1][2]) if item[1][2] in ROOT_KINDS else len(ROOT_KINDS))
    keep: dict[int, Any] = {}  # visited objects, alive until the end: ids stay unique
    parent: dict[int, tuple] = {}  # id -> (id of the referrer, edge or None: worked out when a path is printed)
    origin: dict[int, int] = {}  # id -> id of its root
    found: dict[int, int] = {}  # storage key -> id of the tensor object reached on it
    queue: collections.deque = collections.deque()
    for rid, (obj, _, _) in ordered:
        if rid not in keep:
            keep[rid] = obj
            origin[rid] = rid
            queue.append(obj)
    stopped = "no more referents"
    visited = 0
    while queue:
        if visited >= max_objects:
            stopped = "object limit"
            break
        visited += 1
        if visited % 512 == 0 and time.perf_counter() > deadline:
            stopped = "time limit"
            break
        obj = queue.popleft()
        oid = id(obj)
        if isinstance(obj, torch.Tensor):
            storage = storage_of(obj)
            key = id(storage) if storage is not None else None
            if key in targets and key not in found:
                found[key] = oid
                if len(found) == len(targets) or (enough is not None and enough(set(found))):
                    stopped = "all found"
                    break
            children = [(None, child) for child in gc.get_referents(obj)]  # its __dict__, a parameter's attributes
            node = obj.grad_fn if graphs else None
            if node is not None:
                children.append((("graph", ".grad_fn"), _GraphNode(node)))
        elif isinstance(obj, _GraphNode):
            children = obj.children()
        else:
            if isinstance(obj, _DEAD_ENDS) or (_own_object(obj) and oid not in roots) or _is_module_namespace(obj) and oid not in roots:
                continue
            children = [(None, child) for child in gc.get_referents(obj)]
        root = origin[oid]
        for edge, child in children:
            cid = id(child)
            if cid in keep:
                continue
            if edge is None and not isinstance(child, torch.Tensor) and not gc.is_tracked(child):
                continue  # an int, a str: holds nothing
            keep[cid] = child
            parent[cid] = (oid, edge)
            origin[cid] = root
            queue.append(child)
    search.levels = 0
    paths = {}
    for key, tid in found.items():
        edges, objects = [], [keep[tid]]
        node = tid
        while node in parent:
            up, edge = parent[node]
            edges.append(edge if edge is not None else _edge(keep[up], keep[node]))
            objects.append(keep[up])
            node = up
        edges.reverse()
        objects.reverse()
        search.levels = max(search.levels, len(edges))
        graph_owner = None
        for index, edge in enumerate(edges):
            if edge == ("graph", ".grad_fn"):  # objects[index] is the tensor whose graph keeps the target
                owner = storage_of(objects[index]) if isinstance(objects[index], torch.Tensor) else None
                graph_owner = id(owner) if owner is not None else None
                break
        edges, objects = _attributes(edges, objects)
        _, name, kind = roots[origin[tid]]
        if kind == "global" and isinstance(objects[0], dict) and edges and edges[0][0] == "item" and _identifier(edges[0][1]):
            edges[0] = ("attr", edges[0][1])  # a module's global: module.name
        path = HolderPath(root=name, kind=kind, edges=edges, graph_owner=graph_owner)
        _annotate(path, objects)
        paths[key] = path
    search.paths = paths
    search.objects = len(keep)
    search.seconds = time.perf_counter() - started
    search.stopped = stopped
    keep.clear()
    return search


def _is_module_namespace(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    name = obj.get("__name__")
    loaded = sys.modules.get(name) if isinstance(name, str) else None
    return loaded is not None and getattr(loaded, "__dict__", None) is obj


def _attributes(edges: list, objects: list) -> tuple[list, list]:
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


class _GraphNode:
    """An autograd node met while searching (``tensor.grad_fn`` and the nodes after it)."""

    __slots__ = ("node", "__weakref__")

    def __init__(self, node: Any) -> None:
        self.node = node

    def children(self) -> list:
        """``[(edge, object)]``: the tensors the node saved (read back: new tensor objects on the same
        storages; none once backward freed them) and the next nodes."""
        node = self.node
        found: list = []
        for name, value in _torch_compat.saved_values(node):
            if isinstance(value, torch.Tensor):
                found.append((("graph", f".{name}"), value))
            elif isinstance(value, (tuple, list)):
                found.extend((("graph", f".{name}[{i}]"), v) for i, v in enumerate(value) if isinstance(v, torch.Tensor))
        for index, (following, _) in enumerate(getattr(node, "next_functions", ()) or ()):
            if following is not None:
                found.append((("graph", f".next_functions[{index}][0]"), _GraphNode(following)))
        return found


def attach_holders(report: Any, recorder: Any, roots: dict, time_limit_s: float = 1.0, per_group: int = 3,
                   limit: int = 8) -> HolderSearch:
    """Name the holder of each group a :class:`~lightning_memkit.doctor.LeakReport` lists (its ``growing``
    groups, else its first ``survivors``): one :func:`find_holders` search for them all, for up to
    ``per_group`` of each group's most recent storages, stopped once each group has one. Sets
    :attr:`CreatorGroup.holder` and :attr:`CreatorGroup.holder_note`; returns the search (its cost)."""
    from lightning_memkit.doctor.leaks import group_key

    groups = (report.growing or report.survivors)[:limit]
    wanted = {group_key_of(group): group for group in groups}
    members: dict[tuple, list] = {key: [] for key in wanted}
    for storage_key, creation in recorder.live_items():
        key = group_key(creation)
        if key in members:
            members[key].append((creation.created_at, creation.step if creation.step is not None else -1, storage_key))
    group_of: dict[int, tuple] = {}
    for key, found in members.items():
        found.sort(key=lambda item: (item[1], item[0]), reverse=True)  # the most recent first
        for _, _, storage_key in found[:per_group]:
            group_of[storage_key] = key

    def enough(found: set) -> bool:
        return {group_of[k] for k in found} >= set(members)

    search = find_holders(list(group_of), roots, time_limit_s, enough=enough)
    for key, group in wanted.items():
        for _, _, storage_key in members[key][:per_group]:
            path = search.paths.get(storage_key)
            if path is not None:
                group.holder = path.text
                group.holder_note = path.note
                # of the lines that stored the group's tensors, the one storing into what the path goes through;
                # a tensor an autograd graph saved was kept by the line that kept the tensor the graph hangs from
                keys = [path.graph_owner] if path.graph_owner is not None else [k for _, _, k in members[key]]
                creations = [recorder.record_of_storage(k) for k in keys]
                kept = keeping_frame([c for c in creations if c is not None], path_names(path))
                group.kept_at = kept or group.kept_at
                break
    return search


def path_names(path: HolderPath) -> set[str]:
    """The names on a holder's path (``{"model", "kept"}`` for ``model.kept[27]``): attributes, string keys
    and the root's name, to match against what a keeping line stores into."""
    names = {part for part in path.root.replace("[", ".").split(".") if part.isidentifier()}
    names.update(key for kind, key in path.edges if kind in ("attr", "item") and isinstance(key, str))
    return names


def group_key_of(group: Any) -> tuple:
    """The grouping key of a :class:`~lightning_memkit.doctor.CreatorGroup` (as :func:`group_key` of its records)."""
    return (group.op, group.module, group.phase, tuple(group.shape), group.dtype, group.category,
            tuple(group.frame) if group.frame else None)
