"""The torch internals the modes read, in one place (pinned by tests/modes/test_checkpointing.py).

- ``torch.autograd.graph.Node._sequence_nr()``: the order in which this thread made autograd's nodes (a counter
  that only grows), so a measuring forward can tell the nodes it made from those of a graph its inputs carried in.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["node_sequence_number", "next_node_sequence_number"]


def node_sequence_number(node: Any) -> int | None:
    """The order number of an autograd node (``grad_fn``) on the thread that made it, or ``None`` where torch does
    not say."""
    read = getattr(node, "_sequence_nr", None)
    try:
        return int(read()) if callable(read) else None
    except Exception:  # noqa: BLE001 - a node type without one
        return None


def next_node_sequence_number() -> int | None:
    """The order number the next autograd node made on this thread gets, at least (a throwaway node is made and
    freed to read it), or ``None`` where torch does not say."""
    with torch.enable_grad():
        probe = torch.zeros((), requires_grad=True) * 1
    number = node_sequence_number(probe.grad_fn)
    del probe
    return None if number is None else number + 1
