"""Memory probes: one small interface over every place memory can be read.

``build_probes`` picks the probes that make sense for a device; none of them imports Lightning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch

from lightning_memkit.probes.base import MemoryProbe, ProbeSet, ProbeUnavailable
from lightning_memkit.probes.cuda import CudaAllocatorProbe
from lightning_memkit.probes.host import HostProbe
from lightning_memkit.probes.nvml import NvmlProbe
from lightning_memkit.probes.tensor import TensorProbe

__all__ = ["build_probes"]


def build_probes(
    device: torch.device | str,
    *,
    tensor_accounting: bool,
    tensor_scope: str = "process",
    nvml: bool = True,
    host: bool = True,
    extra: Iterable[MemoryProbe] = (),
) -> ProbeSet:
    """The probes for ``device``: CUDA allocator and NVML on CUDA, host RSS, optionally
    the tensor accountant (``tensor_scope``: see :class:`TensorProbe`), then the caller's
    ``extra`` probes (user-defined sources).
    A probe whose source is missing warns once and is left out."""
    device = torch.device(device)
    probes: list[MemoryProbe] = []
    factories: list[Callable[[], MemoryProbe]] = []
    if device.type == "cuda":
        factories.append(lambda: CudaAllocatorProbe(device))
        if nvml:
            factories.append(lambda: NvmlProbe(device))
    if host:
        factories.append(HostProbe)
    if tensor_accounting:
        factories.append(lambda: TensorProbe(scope=tensor_scope, device=device))
    for factory in factories:
        try:
            probes.append(factory())
        except ProbeUnavailable as error:
            warnings.warn(
                f"memkit: a memory probe is unavailable ({error}); continuing without it.", RuntimeWarning, stacklevel=2
            )
    for probe in extra:
        if not isinstance(probe, MemoryProbe):
            raise TypeError(
                f"extra probes must be MemoryProbe instances, not {type(probe).__name__}; "
                "subclass lightning_memkit.probes.base.MemoryProbe"
            )
        probes.append(probe)
    return ProbeSet(probes)
