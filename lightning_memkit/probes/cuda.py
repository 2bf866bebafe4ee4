"""The CUDA caching allocator's counters, read without synchronizing the device."""

from __future__ import annotations

import torch

from lightning_memkit.probes.base import MemoryProbe, ProbeUnavailable

__all__ = ["CudaAllocatorProbe"]

# StepReading field <- key of torch.cuda.memory_stats()
_STAT_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "peak_allocated_bytes": "allocated_bytes.all.peak",
    "reserved_bytes": "reserved_bytes.all.current",
    "peak_reserved_bytes": "reserved_bytes.all.peak",
    "active_bytes": "active_bytes.all.current",
    "fragmentation_bytes": "inactive_split_bytes.all.current",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


class CudaAllocatorProbe(MemoryProbe):
    """Allocated, reserved, active, fragmentation, retries and OOMs of one CUDA device.

    ``reset_peak`` calls ``torch.cuda.reset_peak_memory_stats``, so the peaks it reads are
    per step. That resets the peaks ``torch.cuda.max_memory_allocated`` reports for the
    whole process too: code that wants a whole-run peak should read memkit's summary.
    Neither call synchronizes the device: they read host-side allocator counters.
    """

    name = "cuda"

    def __init__(self, device: torch.device | str | int) -> None:
        if not torch.cuda.is_available():
            raise ProbeUnavailable("CUDA is not available")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ProbeUnavailable(f"{self.device} is not a CUDA device")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(key, 0)) for name, key in _STAT_KEYS.items()}

    def capacity_bytes(self) -> int:
        """The device's total memory in bytes."""
        return int(torch.cuda.get_device_properties(self.device).total_memory)
