"""Who keeps a leaked tensor alive: a walk down the references from the objects a user knows to the tensor.

Owns :func:`find_holders` (a breadth-first walk *down* the garbage collector's referents, from known
roots to the leaked tensors' storages, bounded in time), :func:`user_roots` (the LightningModule as
``model``, each callback as ``trainer.callbacks[i]``, the Trainer, the datamodule, the globals of the
user's modules) and :func:`attach_holders` (the doctor's use: one search per leak report, for all its
groups); the path found is a :class:`~lightning_memkit.doctor.holder_paths.HolderPath`.

Cost: the walk visits what the roots reach, never entering modules, classes, code, frames, functions'
globals or memkit's own objects; it stops as soon as each leaked group has a holder. What the roots
reach is small next to the process (hundreds to thousands of objects for a Lightning run, against
hundreds of thousands the collector tracks), so a tensor no root reaches (a local variable, torch's
global hooks) costs a few milliseconds, not a pass over the whole heap per level as a search up
``gc.get_referrers`` would. Core code, no Lightning import.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import gc
import sys
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memkit._user_code import is_user_file
from lightning_memkit.accounting.accountant import storage_of
from lightning_memkit.doctor import _torch_compat
from lightning_memkit.doctor.holder_paths import (
    ROOT_KINDS,
    HolderPath,
    annotate,
    edge_between,
    is_identifier,
    merge_attributes,
    path_names,
)
from lightning_memkit.doctor.keepers import keeping_frame
from lightning_memkit.doctor.leaks import group_key

__all__ = ["HolderSearch", "SearchStop", "find_holders", "user_roots", "attach_holders"]

_DEAD_ENDS = (types.FrameType, types.ModuleType, type, types.CodeType, types.BuiltinFunctionType)


class SearchStop(str, enum.Enum):
    """Why a :func:`find_holders` walk stopped (a string, as it is printed and written)."""

    ALL_FOUND = "all found"  #: every tensor asked for was reached (or ``enough`` said so)
    NO_MORE = "no more referents"  #: nothing the roots reach is left to visit
    OBJECT_LIMIT = "object limit"  #: ``max_objects`` objects were visited
    TIME_LIMIT = "time limit"  #: ``time_limit_s`` passed

    def __str__(self) -> str:
        return self.value


@dataclass
class HolderSearch:
    """What one :func:`find_holders` call found and what it cost.

    Attributes:
        paths: ``{storage key: HolderPath}`` for each tensor a root reaches.
        levels: references the walk followed to the farthest tensor found (0 when none was found).
        objects: objects visited.
        seconds: wall time spent (``time.perf_counter``).
        stopped: why the walk stopped (:class:`SearchStop`): ``"all found"``, ``"no more referents"``
            (nothing the roots reach is left), ``"object limit"``, ``"time limit"``.
    """

    paths: dict = field(default_factory=dict)
    levels: int = 0
    objects: int = 0
    seconds: float = 0.0
    stopped: str = ""


def user_roots(
    trainer: Any = None, module: Any = None, extra: dict | None = None, globals_of_user_modules: bool = True
) -> dict:
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
        with contextlib.suppress(Exception):  # a property of a half-set-up trainer may raise anything
            add(getattr(trainer, "datamodule", None), "trainer.datamodule", "datamodule")
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
    return not is_user_file(path)


def _own_object(obj: Any) -> bool:
    """memkit's own objects: never a holder a user would delete (they keep no tensor strongly)."""
    module = getattr(type(obj), "__module__", "") or ""
    return module.startswith("lightning_memkit")


def _is_module_namespace(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    name = obj.get("__name__")
    loaded = sys.modules.get(name) if isinstance(name, str) else None
    return loaded is not None and getattr(loaded, "__dict__", None) is obj


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
                found.extend(
                    (("graph", f".{name}[{i}]"), v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)
                )
        for index, (following, _) in enumerate(getattr(node, "next_functions", ()) or ()):
            if following is not None:
                found.append((("graph", f".next_functions[{index}][0]"), _GraphNode(following)))
        return found


@dataclass
class _Walk:
    """The breadth-first walk's state: every object visited (kept alive until the end, so ids stay unique), how
    each was reached and from which root, and the tensors found."""

    keep: dict[int, Any] = field(default_factory=dict)
    parent: dict[int, tuple] = field(default_factory=dict)  # id -> (id of the referrer, edge or None: worked out later)
    origin: dict[int, int] = field(default_factory=dict)  # id -> id of its root
    found: dict[int, int] = field(default_factory=dict)  # storage key -> id of the tensor object reached on it


def _targets(tensors: Iterable[Any]) -> set[int]:
    """Storage keys of ``tensors`` (tensors, or storage keys already)."""
    targets: set[int] = set()
    for item in tensors:
        if isinstance(item, torch.Tensor):
            storage = storage_of(item)
            if storage is not None:
                targets.add(id(storage))
        elif isinstance(item, int):
            targets.add(item)
    return targets


def _children(obj: Any, roots: dict, graphs: bool) -> list | None:
    """``[(edge or None, child)]`` the walk goes on to from ``obj``, or None at a dead end."""
    if isinstance(obj, torch.Tensor):
        # its __dict__, a parameter's attributes
        children: list[tuple[tuple[str, str] | None, Any]] = [(None, child) for child in gc.get_referents(obj)]
        node = obj.grad_fn if graphs else None
        if node is not None:
            children.append((("graph", ".grad_fn"), _GraphNode(node)))
        return children
    if isinstance(obj, _GraphNode):
        return obj.children()
    oid = id(obj)
    if (
        isinstance(obj, _DEAD_ENDS)
        or (_own_object(obj) and oid not in roots)
        or _is_module_namespace(obj)
        and oid not in roots
    ):
        return None
    return [(None, child) for child in gc.get_referents(obj)]


def _walk(
    targets: set[int],
    roots: dict,
    deadline: float,
    max_objects: int,
    graphs: bool,
    enough: Callable[[set], bool] | None,
) -> tuple[_Walk, SearchStop]:
    """Breadth-first down the referents from every root at once (the best kind first), until every target is
    reached, nothing is left, ``max_objects`` objects or the deadline (checked every 512 objects)."""
    walk = _Walk()
    ordered = sorted(
        roots.items(), key=lambda item: ROOT_KINDS.index(item[1][2]) if item[1][2] in ROOT_KINDS else len(ROOT_KINDS)
    )
    queue: collections.deque = collections.deque()
    for rid, (obj, _, _) in ordered:
        if rid not in walk.keep:
            walk.keep[rid] = obj
            walk.origin[rid] = rid
            queue.append(obj)
    visited = 0
    while queue:
        if visited >= max_objects:
            return walk, SearchStop.OBJECT_LIMIT
        visited += 1
        if visited % 512 == 0 and time.perf_counter() > deadline:
            return walk, SearchStop.TIME_LIMIT
        obj = queue.popleft()
        oid = id(obj)
        if isinstance(obj, torch.Tensor):
            storage = storage_of(obj)
            key = id(storage) if storage is not None else None
            if key in targets and key not in walk.found:
                walk.found[key] = oid
                if len(walk.found) == len(targets) or (enough is not None and enough(set(walk.found))):
                    return walk, SearchStop.ALL_FOUND
        children = _children(obj, roots, graphs)
        for edge, child in children or ():
            cid = id(child)
            if cid in walk.keep:
                continue
            if edge is None and not isinstance(child, torch.Tensor) and not gc.is_tracked(child):
                continue  # an int, a str: holds nothing
            walk.keep[cid] = child
            walk.parent[cid] = (oid, edge)
            walk.origin[cid] = walk.origin[oid]
            queue.append(child)
    return walk, SearchStop.NO_MORE


def _path_to(walk: _Walk, tid: int, roots: dict) -> tuple[HolderPath, int]:
    """The path from its root to the tensor object ``tid`` the walk reached, as code, with its holder; and how many
    references the walk followed on it."""
    edges, objects = [], [walk.keep[tid]]
    node = tid
    while node in walk.parent:
        up, edge = walk.parent[node]
        edges.append(edge if edge is not None else edge_between(walk.keep[up], walk.keep[node]))
        objects.append(walk.keep[up])
        node = up
    edges.reverse()
    objects.reverse()
    followed = len(edges)
    graph_owner = None
    for index, edge in enumerate(edges):
        if edge == ("graph", ".grad_fn"):  # objects[index] is the tensor whose graph keeps the target
            owner = storage_of(objects[index]) if isinstance(objects[index], torch.Tensor) else None
            graph_owner = id(owner) if owner is not None else None
            break
    edges, objects = merge_attributes(edges, objects)
    _, name, kind = roots[walk.origin[tid]]
    if (
        kind == "global"
        and isinstance(objects[0], dict)
        and edges
        and edges[0][0] == "item"
        and is_identifier(edges[0][1])
    ):
        edges[0] = ("attr", edges[0][1])  # a module's global: module.name
    path = HolderPath(root=name, kind=kind, edges=edges, graph_owner=graph_owner)
    annotate(path, objects)
    return path, followed


def find_holders(
    tensors: Iterable[Any],
    roots: dict,
    time_limit_s: float = 1.0,
    max_objects: int = 500_000,
    graphs: bool = True,
    enough: Callable[[set], bool] | None = None,
) -> HolderSearch:
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
    started = time.perf_counter()
    search = HolderSearch()
    targets = _targets(tensors)
    if not targets:
        search.stopped = SearchStop.ALL_FOUND
        return search
    walk, search.stopped = _walk(targets, roots, started + max(0.0, time_limit_s), max_objects, graphs, enough)
    for key, tid in walk.found.items():
        search.paths[key], followed = _path_to(walk, tid, roots)
        search.levels = max(search.levels, followed)
    search.objects = len(walk.keep)
    search.seconds = time.perf_counter() - started
    walk.keep.clear()
    return search


def attach_holders(
    report: Any, recorder: Any, roots: dict, time_limit_s: float = 1.0, per_group: int = 3, limit: int = 8
) -> HolderSearch:
    """Name the holder of each group a :class:`~lightning_memkit.doctor.leaks.LeakReport` lists (its ``growing``
    groups, else its first ``survivors``): one :func:`find_holders` search for them all, for up to
    ``per_group`` of each group's most recent storages, stopped once each group has one. Sets
    :attr:`CreatorGroup.holder` and :attr:`CreatorGroup.holder_note`; returns the search (its cost)."""
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


def group_key_of(group: Any) -> tuple:
    """The grouping key of a :class:`~lightning_memkit.doctor.leaks.CreatorGroup` (:func:`group_key` of its records)."""
    return (
        group.op,
        group.module,
        group.phase,
        tuple(group.shape),
        group.dtype,
        group.category,
        tuple(group.frame) if group.frame else None,
    )
