"""torch.cuda.memory's private allocator-history API (``_record_memory_history``, ``_dump_snapshot``), wrapped so
that a torch without it (or without a GPU) makes these return ``False`` instead of failing, and so that
tests/probes/test_probes.py pins its behaviour: what MemoryTracker's OOM snapshot is made of."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["dump_memory_snapshot", "start_memory_history", "stop_memory_history"]


def start_memory_history(max_entries: int, stacks: str = "python") -> bool:
    """Start recording allocator history (for an OOM snapshot), ``max_entries`` events at most, with
    ``stacks`` (``"python"``: Python frames only, which the snapshot writes in seconds; ``"all"``: C++
    frames too, torch's default, whose symbolization can take minutes); ``False`` if unsupported."""
    try:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
        return True
    except (AttributeError, RuntimeError, TypeError):
        return False


def stop_memory_history() -> None:
    """Stop recording allocator history."""
    with contextlib.suppress(AttributeError, RuntimeError, TypeError):
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> bool:
    """Write the allocator snapshot (viewable at pytorch.org/memory_viz); ``False`` on failure, and without a
    CUDA device (a CUDA build of torch on a machine without a GPU would write an empty snapshot)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.memory._dump_snapshot(path)
        return True
    except (AttributeError, RuntimeError, TypeError, OSError):
        return False
