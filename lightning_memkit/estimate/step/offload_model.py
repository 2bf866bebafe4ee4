"""Activation offload as the step's accountant must see it (:class:`OffloadModel`): each saved tensor copied to pinned
host memory the device ledger does not count, and copied back to the device in the backward.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_memkit.estimate.step.step_accountant import StepAccountant

__all__ = ["OffloadModel"]


class _HostCopy:
    """One offloaded saved tensor: its host copy, counted in :class:`OffloadModel` while it lives."""

    __slots__ = ("tensor", "nbytes", "owner")

    def __init__(self, tensor: torch.Tensor, nbytes: int, owner: OffloadModel) -> None:
        self.tensor, self.nbytes, self.owner = tensor, nbytes, owner

    def __del__(self) -> None:
        self.owner.current_bytes -= self.nbytes


class OffloadModel:
    """torch's ``save_on_cpu(pin_memory=True)`` as the step's accountant must see it: each saved tensor is copied to
    a host buffer of ``numel * element_size`` bytes that the device ledger does not count (the host ledger here
    does), so the device tensor is freed when the forward drops it; each unpack in backward allocates a
    device copy (counted), as ``packed.to(device)`` does."""

    def __init__(self, acc: StepAccountant) -> None:
        self.acc = acc
        self.current_bytes = 0
        self.peak_bytes = 0

    def pack(self, tensor: torch.Tensor) -> _HostCopy:
        nbytes = tensor.numel() * tensor.element_size()
        self.acc.host_copy = True
        try:
            host = tensor.detach().clone(memory_format=torch.contiguous_format)
        finally:
            self.acc.host_copy = False
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return _HostCopy(host, nbytes, self)

    @staticmethod
    def unpack(packed: _HostCopy) -> torch.Tensor:
        return packed.tensor.clone()

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
