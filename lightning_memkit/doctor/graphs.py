"""Autograd graphs kept alive between steps: the leak that holds no tensor bytes after backward.

``total_loss += loss`` keeps every step's graph *nodes* reachable from ``total_loss``; backward already
freed the tensors they saved, so the live tensor bytes barely move while host memory creeps up. Owns
:func:`count_kept_graph_nodes` (a ``gc`` walk over live tensors with a ``grad_fn``) and :class:`GraphHolder`.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_memkit.doctor import _torch_compat
from lightning_memkit.doctor.frames import format_frame
from lightning_memkit.doctor.keepers import keeping_frame
from lightning_memkit.doctor.recorder import CreationRecorder

__all__ = ["GraphHolder", "GraphLeakReport", "count_kept_graph_nodes", "saved_in_nodes"]


@dataclass
class GraphHolder:
    """A live tensor that holds an autograd graph.

    Attributes:
        grad_fn: the name of its graph's root node, e.g. ``"AddBackward0"``.
        nodes: how many autograd nodes are reachable from it and from no tensor listed before it.
        shape, dtype, nbytes: of the tensor's storage (bytes).
        made_by: who made it (a :class:`~lightning_memkit.doctor.creation.Creation` description), or ``""``.
        where: the user's line that made it, or ``""``.
        count: how many such tensors (same root node type, shape, dtype and maker); ``nodes`` is theirs together.
        holder: where a program reaches one of them, as code you can paste (``"model.total"``), or ``""``
            (see :func:`~lightning_memkit.doctor.holders.find_holders`).
        kept_where: the user's line that stored it where it is held (``self.kept.append(loss)``), or ``""``
            (see :class:`~lightning_memkit.doctor.keepers.KeepTracer`).
    """

    grad_fn: str
    nodes: int
    shape: list
    dtype: str
    nbytes: int
    made_by: str = ""
    where: str = ""
    count: int = 1
    holder: str = ""
    kept_where: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass
class GraphLeakReport:
    """Autograd nodes kept alive at step start grow steadily: a graph is kept across steps.

    Attributes:
        nodes_per_step: the median step-to-step growth of the live autograd nodes.
        first_step, last_step: the steps whose starts were compared.
        nodes_at_start: ``[[step, nodes], ...]``.
        holders: the tensors holding graphs, largest graph first.
        saved_tensors, saved_bytes: tensors (distinct storages, and their bytes) the kept nodes still save:
            backward never ran on them (or ran with ``retain_graph=True``); 0 when backward freed them.
        unseen_saved_tensors, unseen_saved_bytes: the part of those the recorder never saw made (Python
            numbers turned into tensors by an op, tensors from before the recording): not in the leak's
            tensor bytes, though whole-process counts (MemoryTracker) see them.
        saved_constants: numbers and sizes the kept nodes save that are not tensors (host memory).
    """

    nodes_per_step: int
    first_step: int
    last_step: int
    nodes_at_start: list
    holders: list
    saved_tensors: int = 0
    saved_bytes: int = 0
    unseen_saved_tensors: int = 0
    unseen_saved_bytes: int = 0
    saved_constants: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "nodes_per_step": self.nodes_per_step,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "nodes_at_start": [list(p) for p in self.nodes_at_start],
            "holders": [h.to_dict() if isinstance(h, GraphHolder) else h for h in self.holders],
            "saved_tensors": self.saved_tensors,
            "saved_bytes": self.saved_bytes,
            "unseen_saved_tensors": self.unseen_saved_tensors,
            "unseen_saved_bytes": self.unseen_saved_bytes,
            "saved_constants": self.saved_constants,
        }

    def format(self, limit: int = 5) -> str:
        """The report as text: the growth in graph nodes per step and at most ``limit`` holders."""
        constants = f" and {self.saved_constants} saved numbers" if self.saved_constants else ""
        if self.saved_tensors:
            unseen = (
                f", of which {self.unseen_saved_tensors} ({self.unseen_saved_bytes} B) were not made in a "
                f"watched step, e.g. Python numbers an op turned into tensors"
                if self.unseen_saved_tensors
                else ""
            )
            kept = (
                f"backward never ran on them (or ran with retain_graph=True): their nodes keep "
                f"{self.saved_tensors} saved tensors ({self.saved_bytes} B{unseen}){constants}"
            )
        else:
            kept = f"backward freed their saved tensors; the nodes{constants} stay in host memory"
        lines = [
            f"autograd graph kept across steps: {self.nodes_per_step} more graph nodes alive at each step's "
            f"start, steps {self.first_step}..{self.last_step} ({kept})"
        ]
        for holder in self.holders[:limit]:
            holder = holder if isinstance(holder, GraphHolder) else GraphHolder(**holder)
            made = f", made by {holder.made_by}" if holder.made_by else ""
            dtype = holder.dtype.replace("torch.", "")
            lines.append(
                f"  {holder.nodes} nodes held by {holder.count} {holder.shape} {dtype} "
                f"tensor(s) whose grad_fn is {holder.grad_fn}{made}"
            )
            if holder.kept_where:
                lines.append(f"    kept at {holder.kept_where}")
            if holder.holder:
                lines.append(f"    held by {holder.holder}  <- delete here (keep .detach() or .item() of it)")
        return "\n".join(lines)


def saved_in_nodes(nodes: Iterable[Any], recorder: CreationRecorder | None = None) -> dict[str, int]:
    """What autograd ``nodes`` still save: ``{"tensors", "bytes", "unseen_tensors", "unseen_bytes", "constants"}``
    (distinct storages and their bytes; those ``recorder`` never saw made; saved numbers and sizes). Reads each
    node's ``_saved_*`` attributes (a value backward freed raises, and is not counted)."""
    storages: dict[int, tuple[int, bool]] = {}
    constants = 0
    for node in nodes:
        for _, value in _torch_compat.saved_values(node):
            values = value if isinstance(value, (tuple, list)) else (value,)
            for item in values:
                if isinstance(item, torch.Tensor):
                    try:
                        storage = item.untyped_storage()
                    except (RuntimeError, NotImplementedError):
                        continue
                    if id(storage) not in storages:
                        seen = recorder is not None and recorder.creation_of(item) is not None
                        storages[id(storage)] = (int(storage.nbytes()), seen)
                elif item is not None:
                    constants += 1
    return {
        "tensors": len(storages),
        "bytes": sum(n for n, _ in storages.values()),
        "unseen_tensors": sum(1 for _, seen in storages.values() if not seen),
        "unseen_bytes": sum(n for n, seen in storages.values() if not seen),
        "constants": constants,
    }


def count_kept_graph_nodes(
    recorder: CreationRecorder | None = None,
    max_nodes: int = 1_000_000,
    holders: bool = False,
    nodes_out: list | None = None,
    samples_out: dict | None = None,
) -> tuple[int, list[GraphHolder]]:
    """Count the distinct autograd nodes reachable from live tensors that have a ``grad_fn``.

    Call it between steps, when no graph should be alive. With a ``recorder``, the roots are the tensors
    it saw made (:meth:`CreationRecorder.tensors_with_graph`, cheap); without one, every tensor ``gc``
    can reach after a full collection (tens of milliseconds to seconds in a large process). Returns
    ``(nodes, holders)``; ``holders`` (only with ``holders=True``) lists the tensors holding graphs,
    grouped by maker, largest graph first. The walk stops at ``max_nodes``. ``nodes_out``: a list that gets
    the nodes counted (for :func:`saved_in_nodes`; drop it after, it keeps the graphs alive).
    ``samples_out``: a dict that gets, for each holder (by ``id``), one of its tensors (for the holder search; drop it
    after).
    """
    if recorder is not None:
        roots = recorder.tensors_with_graph()
    else:
        gc.collect()  # garbage (unreachable cycles not yet collected) holds no graph the program can reach
        roots = []
        with warnings.catch_warnings():  # isinstance on a deprecated module alias warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
                        roots.append(obj)
                except Exception:  # noqa: BLE001 - some proxies raise on isinstance
                    continue
    seen: dict[int, Any] = {}  # id -> node: the node objects stay alive, so ids are not reused mid-walk
    found: dict[tuple, GraphHolder] = {}
    for tensor in roots:
        before = len(seen)
        stack = [tensor.grad_fn]
        while stack and len(seen) < max_nodes:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
        if holders and len(seen) > before:
            creation = recorder.creation_of(tensor) if recorder is not None else None
            try:
                nbytes = int(tensor.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError):
                nbytes = 0
            holder = GraphHolder(
                type(tensor.grad_fn).__name__,
                len(seen) - before,
                list(tensor.shape),
                str(tensor.dtype),
                nbytes,
                creation.describe() if creation else "",
                format_frame(creation.frame) if creation else "",
            )
            if creation is not None:  # the line that stored it (self.losses.append(loss)), when the tracer saw it
                holder.kept_where = format_frame(keeping_frame([creation]))
            key = (holder.grad_fn, tuple(holder.shape), holder.dtype, holder.made_by)
            if key in found:
                found[key].count += 1
                found[key].nodes += holder.nodes
            else:
                found[key] = holder
                if samples_out is not None:
                    samples_out[id(holder)] = tensor
    if nodes_out is not None:
        nodes_out.extend(seen.values())
    return len(seen), sorted(found.values(), key=lambda h: -h.nodes)
