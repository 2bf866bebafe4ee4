"""The device type a mode or a Trainer argument means: one function, below every mode module (no import cycle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator

__all__ = ["device_type", "DeviceLike"]

#: a device argument: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"gpu"``, ``"auto"`` (or ``None``: CUDA when available),
#: a ``torch.device``, or a Lightning ``Accelerator``
DeviceLike = Union[str, torch.device, "Accelerator", None]


def device_type(device: DeviceLike) -> str:
    """``"cpu"``, ``"cuda"``, ``"mps"``... from an accelerator name, a torch.device or a Lightning Accelerator."""
    if isinstance(device, torch.device):
        return device.type
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        name = device.split(":")[0].lower()
        return "cuda" if name == "gpu" else name
    # a Lightning Accelerator instance
    name = type(device).__name__.lower()
    for kind in ("cuda", "mps", "xla", "cpu"):
        if kind in name:
            return kind
    raise ValueError(f"cannot tell the device type of accelerator {device!r}; pass 'cpu', 'cuda' or a torch.device")
