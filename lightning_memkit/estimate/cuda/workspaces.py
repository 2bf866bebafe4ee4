"""What CUDA libraries and kernels allocate through the caching allocator beside their outputs, allocated in the fake
step (:class:`CudaWorkspaces`): the cuBLAS and cuBLASLt workspaces (kept), cuDNN convolution workspaces,
fused-attention backward buffers and ``masked_select``'s positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_memkit._torch_compat import TorchDispatchMode
from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.cuda.gpu_target import (
    CONV_WEIGHT_GRAD_WORKSPACE_FACTOR,
    conv_workspace_bytes,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
)
from lightning_memkit.estimate.fake.tensors import NOT_ANSWERED, fake_device_query, fake_tensor_type

if TYPE_CHECKING:
    from lightning_memkit.estimate.cuda.kernels import CudaKernels

__all__ = ["CudaWorkspaces"]


class CudaWorkspaces(TorchDispatchMode):
    """Allocates what CUDA libraries take through the caching allocator: cuBLAS/cuBLASLt workspaces
    (kept), cuDNN convolution workspaces and fused-attention backward buffers (transient), and what a kernel makes
    beside its output: ``masked_select`` indexes by the expanded mask (IndexKernel.cpp), whose ``nonzero`` gives an
    ``(N, ndim)`` int64 tensor of the selected positions (transient)."""

    _MATMULS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_addmm_activation")

    def __init__(self, kernels: CudaKernels) -> None:
        super().__init__()
        self.kernels = kernels
        aten = torch.ops.aten
        self._matmuls = {getattr(aten, name).default for name in self._MATMULS if hasattr(aten, name)}
        self._addmm = {aten.addmm.default}
        if hasattr(aten, "_addmm_activation"):
            self._addmm.add(aten._addmm_activation.default)
        self._conv = aten.convolution.default
        self._conv_backward = aten.convolution_backward.default
        self._flash_backward = aten._scaled_dot_product_flash_attention_backward.default
        self._efficient_backward = aten._scaled_dot_product_efficient_attention_backward.default
        self._masked_select = aten.masked_select.default
        self._device = torch.ops.prim.device.default
        self._fake_type = fake_tensor_type()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func is self._device:  # most of a fake step's ops: answered here, not by every mode below
            answer = fake_device_query(args, self._fake_type)
            if answer is not NOT_ANSWERED:
                return answer
        kwargs = kwargs or {}
        kernels = self.kernels
        if func in self._matmuls:
            # one cuBLAS handle, and workspace, per thread: the autograd engine's backward thread has its own
            thread = "backward" if _torch_compat.in_backward() else "main"
            if thread not in kernels.cublas:
                kernels.cublas[thread] = _block(cublas_workspace_bytes(kernels.gpu), args)
                kernels.used.add("cublas:workspace")
            if func in self._addmm and kernels.cublaslt is None:
                kernels.cublaslt = _block(cublaslt_workspace_bytes(kernels.gpu), args)
            return func(*args, **kwargs)
        if func is self._conv:
            output = func(*args, **kwargs)
            _transient(conv_workspace_bytes(args[0], args[1], output), args)
            kernels.used.add("conv:cudnn-workspace")
            return output
        if func is self._conv_backward:
            outputs = func(*args, **kwargs)
            grad_output, input, weight = args[0], args[1], args[2]
            mask = args[-1] if isinstance(args[-1], (list, tuple)) else kwargs.get("output_mask", (True, True, True))
            size = conv_workspace_bytes(input, weight, grad_output)
            if mask[0]:  # backward-data
                _transient(size, args)
            if mask[1]:  # backward-weight: its workspace is the larger one on the H100 trace
                _transient(int(size * CONV_WEIGHT_GRAD_WORKSPACE_FACTOR), args)
            return outputs
        if func is self._flash_backward:
            query = _torch_compat.argument(func, "query", args, kwargs)
            batch, heads, length, dim = query.shape
            rounded_length, rounded_dim = -(-length // 128) * 128, -(-dim // 32) * 32
            outputs = func(*args, **kwargs)
            _transient(4 * batch * heads * rounded_length * (rounded_dim + 1), args)
            return outputs
        if func is self._efficient_backward:
            query = _torch_compat.argument(func, "query", args, kwargs)
            batch, heads, length, dim = query.shape
            delta = _block(4 * batch * heads * length, args)
            outputs = func(*args, **kwargs)
            _transient(4 * batch * length * heads * dim + 4 * batch * heads * 32, args)
            del delta
            return outputs
        if func is self._masked_select:
            source = _torch_compat.argument(func, "self", args, kwargs)
            mask = _torch_compat.argument(func, "mask", args, kwargs)
            selected = func(*args, **kwargs)
            # made before the output by the real kernel, here after it: the same bytes alive at once
            dims = max(len(torch.broadcast_shapes(source.shape, mask.shape)), 1)
            _transient(selected.numel() * dims * torch.int64.itemsize, args)
            return selected
        return func(*args, **kwargs)


def _device_of(args: Any) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


def _block(nbytes: int, args: Any) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=_device_of(args))


def _transient(nbytes: int, args: Any) -> None:
    """Allocate and free ``nbytes`` at once (the accountant sees both: a workspace's effect on the peaks)."""
    workspace = _block(nbytes, args)
    del workspace
