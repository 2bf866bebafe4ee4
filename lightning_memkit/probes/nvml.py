"""NVML's view of device memory: what the CUDA allocator cannot see.

The CUDA context, cuDNN/cuBLAS workspaces and other libraries' buffers are invisible to
``torch.cuda.memory_stats`` but count against the device's capacity; NVML sees them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Protocol

import torch

from lightning_memkit.probes.base import MemoryProbe, ProbeUnavailable

__all__ = ["NvmlProbe", "find_nvml_handle", "pci_bus_id_of"]


class NvmlProbe(MemoryProbe):
    """Device memory used and total, and this process's device memory, from NVML.

    The NVML device is found by its UUID (``GPU-...``), a MIG slice's UUID (``MIG-...``), then its PCI bus
    id, never by the CUDA ordinal (NVML numbers devices ignoring ``CUDA_VISIBLE_DEVICES``, so an ordinal
    can name another GPU); when none finds it, or NVML raises, the probe is unavailable (a warning, and
    the run goes on without NVML's readings). On a MIG slice found only by its PCI bus id the readings
    are the whole GPU's. Per-process memory is ``None`` where the driver does not report it (some containers).
    """

    name = "nvml"

    def __init__(self, device: torch.device | str | int) -> None:
        try:
            import pynvml  # deferred: may be missing or broken; the probe is then unavailable
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
        except Exception as error:  # NVMLError, or a broken binding's own: either way the probe is unavailable
            raise ProbeUnavailable(f"nvmlInit failed ({type(error).__name__}: {error})") from error
        if not torch.cuda.is_available():
            self.close()
            raise ProbeUnavailable("NVML works but torch sees no CUDA device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            properties = torch.cuda.get_device_properties(index)
            self._handle = find_nvml_handle(pynvml, str(getattr(properties, "uuid", "")), pci_bus_id_of(properties))
        except ProbeUnavailable:
            self.close()
            raise
        except Exception as error:  # reading the device's identity failed: no guess by ordinal
            self.close()
            raise ProbeUnavailable(f"cannot identify {device} for NVML ({type(error).__name__}: {error})") from error
        self._pid = os.getpid()

    def read(self) -> dict[str, int]:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        values = {"device_used_bytes": int(info.used), "device_total_bytes": int(info.total)}
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # noqa: BLE001 - some drivers and containers refuse the list: no per-process figure
            processes = []
        for process in processes:
            if process.pid == self._pid and process.usedGpuMemory is not None:
                values["process_device_bytes"] = int(process.usedGpuMemory)
        return values

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing must not fail training: NVML is released at exit anyway
            self._nvml.nvmlShutdown()


def pci_bus_id_of(properties: object) -> str | None:
    """NVML's PCI bus id (``"00000000:3B:00.0"``) of a CUDA device from torch's device properties
    (``pci_domain_id``, ``pci_bus_id``, ``pci_device_id``), or ``None`` where torch does not give them."""
    try:
        domain, bus, device = (
            int(getattr(properties, name)) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")
        )
    except (AttributeError, TypeError, ValueError):
        return None
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


class NvmlLookups(Protocol):
    """The two lookups of NVML's binding (``pynvml``) :func:`find_nvml_handle` uses."""

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object: ...

    def nvmlDeviceGetHandleByPciBusId(self, pci_bus_id: str) -> object: ...


def find_nvml_handle(nvml: NvmlLookups, uuid: str, pci_bus_id: str | None) -> object:
    """The NVML handle of the CUDA device with torch's ``uuid`` (with or without its ``GPU-``/``MIG-``
    prefix) and ``pci_bus_id``: by UUID as a GPU, then as a MIG slice, then by PCI bus id. Never by index.

    Raises:
        ProbeUnavailable: none of them found it (each attempt's NVML error in the message).
    """
    bare = uuid.strip()
    for prefix in ("GPU-", "MIG-"):
        if bare.startswith(prefix):
            bare = bare[len(prefix) :]
    attempts: list[tuple[str, str, Callable[[str], object]]] = []
    if bare:
        attempts += [
            ("UUID", f"GPU-{bare}", nvml.nvmlDeviceGetHandleByUUID),
            ("MIG UUID", f"MIG-{bare}", nvml.nvmlDeviceGetHandleByUUID),
        ]
    if pci_bus_id:
        attempts.append(("PCI bus id", pci_bus_id, nvml.nvmlDeviceGetHandleByPciBusId))
    failures = []
    for what, key, lookup in attempts:
        try:
            return lookup(key)
        except Exception as error:  # noqa: BLE001 - NVMLError (NotFound, ...) or a broken binding's: in the message
            failures.append(f"{what} {key}: {type(error).__name__}: {error}")
    raise ProbeUnavailable(
        "NVML does not know this CUDA device ("
        + ("; ".join(failures) or "torch gives no UUID or PCI bus id")
        + "); NVML readings are off"
    )
