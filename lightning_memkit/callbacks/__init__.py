"""Thin Lightning adapters over memkit's core: each wires measuring code to Trainer hooks."""

from lightning_memkit.callbacks.memory_tracker import MemoryTracker

__all__ = ["MemoryTracker"]
