"""NVML's view of device memory: what the CUDA allocator cannot see.

The CUDA context, cuDNN/cuBLAS workspaces and other libraries' buffers are invisible to
``torch.cuda.memory_stats`` but count against the device's capacity; NVML sees them.
"""

from __future__ import annotations

import os

import torch

from lightning_memkit.probes.base import MemoryProbe, ProbeUnavailable

__all__ = ["NvmlProbe"]


class NvmlProbe(MemoryProbe):
    """Device memory used and total, and this process's device memory, from NVML.

    The NVML device is found by UUID, so ``CUDA_VISIBLE_DEVICES`` re-numbering is handled.
    Per-process memory is ``None`` where the driver does not report it (some containers).
    """

    name = "nvml"

    def __init__(self, device: torch.device | str | int) -> None:
        try:
            import pynvml
        except ImportError as error:  # nvidia-ml-py not installed
            raise ProbeUnavailable(f"pynvml cannot be imported ({error})") from error
        self._nvml = pynvml
        device = torch.device(device)
        if device.type != "cuda":
            raise ProbeUnavailable(f"NVML reads CUDA devices only, not {device}")
        # nvmlInit first: with no driver it fails with NVML's own reason, which is what the
        # user needs to see ("NVML Shared Library Not Found"), not a generic "no CUDA".
        try:
            pynvml.nvmlInit()
        except Exception as error:
            raise ProbeUnavailable(f"nvmlInit failed ({type(error).__name__}: {error})") from error
        if not torch.cuda.is_available():
            self.close()
            raise ProbeUnavailable("NVML works but torch sees no CUDA device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            if not uuid.startswith("GPU-"):
                uuid = "GPU-" + uuid
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._pid = os.getpid()

    def read(self) -> dict[str, int]:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        values = {"device_used_bytes": int(info.used), "device_total_bytes": int(info.total)}
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            processes = []
        for process in processes:
            if process.pid == self._pid and process.usedGpuMemory is not None:
                values["process_device_bytes"] = int(process.usedGpuMemory)
        return values

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass
