"""The CUDA target's kernels: what the kernels a GPU would run allocate, simulated on CPU fake tensors.

A CUDA-target estimate runs its fake step on CPU fakes (a CPU-only torch cannot make fake CUDA
tensors). Where a CUDA kernel allocates differently from the CPU (or fake) one, the fake step is made to
allocate what the CUDA kernel does: the calls are rewritten (estimate/cuda/functions.py, with
estimate/cuda/attention.py and estimate/cuda/autocast.py) and the libraries' workspaces allocated
(estimate/cuda/workspaces.py) for the GPU of estimate/cuda/gpu_target.py. Every such choice is one row of
:data:`KERNEL_TABLE`, and each row is pinned by tests/estimate/cuda/test_gpu_truth.py against allocator traces recorded
on an H100 (tests/data/gpu_truth, torch 2.11, cuDNN 9).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit.estimate.cuda.caching_allocator import (
    CUDA_CONTEXT_BYTES,
    AllocatorConfig,
    AllocatorView,
    CudaAllocatorModel,
)
from lightning_memkit.estimate.cuda.functions import CudaFunctions
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget, cublas_workspace_bytes
from lightning_memkit.estimate.cuda.workspaces import CudaWorkspaces
from lightning_memkit.units import KiB

__all__ = ["KERNEL_TABLE", "KernelRow", "CudaKernels", "cuda_target"]


@dataclass(frozen=True)
class KernelRow:
    """One choice the CUDA target makes: where CUDA's kernel allocates differently from the fake CPU step.

    Attributes:
        op: the op (as the user calls it).
        when: the condition under which CUDA runs this kernel.
        cuda_allocates: what the CUDA kernel allocates (sizes in terms of the op's shapes).
        fake_cpu_allocates: what the CPU fake step would allocate without this row.
        evidence: where the recorded H100 traces show it (tests/estimate/cuda/test_gpu_truth.py pins it).
    """

    op: str
    when: str
    cuda_allocates: str
    fake_cpu_allocates: str
    evidence: str


#: The CUDA target's kernel choices, one row each (printed by ``memkit estimate`` on a CUDA target).
KERNEL_TABLE: tuple[KernelRow, ...] = (
    KernelRow(
        op="scaled_dot_product_attention",
        when=(
            "fp16/bf16, no mask, equal head dims <= 256 (padded to a multiple of 8), grouped-query heads allowed, "
            "is_causal only with equal lengths, sm80+ (attention_backend has all the rules)"
        ),
        cuda_allocates=(
            "flash: output, logsumexp (B,H,L) fp32, philox seed+offset (2 x 8 B); backward: dq/dk/dv and "
            "a transient fp32 dq accumulator + softmax_d (B,L,H,D + B,H,L floats)"
        ),
        fake_cpu_allocates="math path: L x L weights, softmax, a float dropout mask",
        evidence="trace_BertLike_b8_bf16-mixed: 196608-byte lse, two 8-byte seeds, 12779776-byte backward buffer",
    ),
    KernelRow(
        op="scaled_dot_product_attention",
        when=(
            "no flash: fp32, fp16 (bf16 on sm80+), a mask allowed, the same heads in q, k, v, head dims aligned (8 "
            "elements for fp16/bf16, 4 for fp32 on sm80+, 1 for fp32 before)"
        ),
        cuda_allocates=(
            "memory-efficient: output, logsumexp (B,H,ceil32(L)) fp32 (seed and offset on the host), a "
            "bool mask made additive and padded to 8 columns when its strides are not; backward: "
            "dq/dk/dv, delta (B,H,L floats) and a transient fp32 dq accumulator"
        ),
        fake_cpu_allocates="math path: L x L weights, softmax, a float dropout mask",
        evidence="trace_BertLike_b8_32-true: 196608-byte lse per layer, 12595200-byte backward buffer",
    ),
    KernelRow(
        op="scaled_dot_product_attention",
        when="neither (grouped heads in fp32, bf16 before sm80, unaligned head dims...)",
        cuda_allocates=(
            "math: fp16/bf16 q, k, v copied to fp32, q and k each scaled, grouped k/v heads repeated, "
            "(B,H,L,S) fp32 weights (the mask added in place), _safe_softmax, fused dropout (bool mask), "
            "the weights cast back as a second output"
        ),
        fake_cpu_allocates="the CPU kernels (CPU flash attention without dropout; with dropout a float mask)",
        evidence=(
            "not in the traces: tests/estimate/test_estimate_unseen.py pins it against torch's "
            "_scaled_dot_product_attention_math"
        ),
    ),
    KernelRow(
        op="dropout (F.dropout, nn.Dropout)",
        when="training, 0 < p < 1",
        cuda_allocates="fused native_dropout: output and a bool (1 byte/element) mask",
        fake_cpu_allocates="output and a float mask (input's dtype)",
        evidence="trace_BertLike_b8_32-true: 3145728-byte masks beside 12582912-byte fp32 outputs",
    ),
    KernelRow(
        op="linear",
        when="input of 3+ dims, not contiguous, with bias",
        cuda_allocates="matmul then bias added in place (one output)",
        fake_cpu_allocates="fake tensors take the out-of-place add (a second output)",
        evidence="trace_BertLike_b8_32-true: three allocations per in-projection",
    ),
    KernelRow(
        op="cross_entropy under autocast",
        when="fp16/bf16 logits, class-index targets",
        cuda_allocates=(
            "log_softmax in the logits' dtype, then nll_loss on an fp32 copy (autocast's fp32 list); "
            "with label smoothing the class sum of the log-probabilities reduced in fp32 (one float per "
            "position)"
        ),
        fake_cpu_allocates="CPU autocast casts the whole loss to fp32 (an fp32 copy and fp32 log-probabilities)",
        evidence="trace_BertLike_b8_bf16-mixed: 250036224-byte bf16 log-probs and a 500072448-byte fp32 copy",
    ),
    KernelRow(
        op="autocast's op lists (bf16/fp16 modes)",
        when="ops CUDA's autocast lists differently from CPU's (autocast_policies)",
        cuda_allocates=(
            "layer_norm, group_norm, rms_norm, exp, log, pow, norms, distance and embedding losses: "
            "fp16/bf16 arguments cast to fp32 (an fp32 copy and an fp32 result); softmax, log_softmax, "
            "sum, cumsum, prod: an fp32 result; einsum, mv, addmv, addr, multi_dot: fp32 arguments cast "
            "down; 3-D poolings and reflect/replicate padding: left as they come"
        ),
        fake_cpu_allocates=(
            "CPU autocast's lists: those ops in the low-precision dtype (and the 3-D poolings and "
            "paddings cast to fp32)"
        ),
        evidence=(
            "not in the traces (no such op in their models): tests/estimate/test_estimate_unseen.py checks torch's own "
            "CUDA autocast test lists (torch/testing/_internal/autocast_test_lists.py)"
        ),
    ),
    KernelRow(
        op="matmul family (mm, addmm, bmm...)",
        when="first call on the stream",
        cuda_allocates=(
            "the cuBLAS workspace, kept, one for the forward's thread and one for autograd's backward "
            "thread: 32 MiB on sm90+, 8 MiB + 128 KiB before (CUBLAS_WORKSPACE_CONFIG); the first addmm "
            "also the cuBLASLt workspace (1 MiB, CUBLASLT_WORKSPACE_SIZE)"
        ),
        fake_cpu_allocates="nothing",
        evidence=(
            "all traces: a 33554432-byte and a 1048576-byte block at the first linear layer, another "
            "33554432-byte block in the first backward, never freed"
        ),
    ),
    KernelRow(
        op="convolution (forward, backward)",
        when="cuDNN",
        cuda_allocates=(
            "a transient workspace per call, modelled as input + output + weight bytes (forward, "
            "backward-data) and 1.25x that (backward-weight)"
        ),
        fake_cpu_allocates="nothing",
        evidence="trace_ResNetish_b32_32-true: 25837584-byte workspaces beside 25690112-byte outputs",
    ),
    KernelRow(
        op="batch_norm (training)",
        when="cuDNN",
        cuda_allocates="output, save_mean and save_invstd (C floats each); cuDNN's reserve space is empty",
        fake_cpu_allocates="the same bytes",
        evidence="trace_ResNetish_b32_32-true: 256-byte statistics for 64 channels",
    ),
    KernelRow(
        op="optimizer step (Adam, AdamW, SGD...)",
        when="parameters on CUDA, foreach not chosen",
        cuda_allocates="the multi-tensor (foreach) implementation and its temporaries",
        fake_cpu_allocates="the single-tensor loop",
        evidence="both traces: _multi_tensor_adam frames",
    ),
    KernelRow(
        op="16-mixed (GradScaler)",
        when="precision 16-mixed",
        cuda_allocates=(
            "the scale (4 B) and growth tracker (4 B), kept; the loss scaling's per-step scalars are 512-byte blocks"
        ),
        fake_cpu_allocates="nothing",
        evidence="not recorded in the traces (16-mixed rows are in truth.json only)",
    ),
)


class CudaKernels:
    """The CUDA target's kernels for one fake step: enter :meth:`active` around the step (inside the fake
    world and the accountant), then :meth:`view` replays what the step allocated through the allocator model.

    Attributes:
        gpu: the target :class:`GpuTarget`.
        precision: the step's Lightning precision (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``).
        config: the :class:`~lightning_memkit.estimate.cuda.caching_allocator.AllocatorConfig` replayed with.
        used: the kernel choices the step made (``"attention:flash"``, ``"dropout:fused"``...).
    """

    def __init__(self, gpu: Any = None, precision: str | None = None, config: AllocatorConfig | None = None) -> None:
        self.gpu = GpuTarget.parse(gpu)
        self.precision = precision or "32-true"
        self.config = config if config is not None else AllocatorConfig.from_env()
        self.used: set[str] = set()
        self.cublas: dict[str, torch.Tensor] = {}
        self.cublaslt: torch.Tensor | None = None
        self._scaler: list[torch.Tensor] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[CudaKernels]:
        """Inside: calls run as the CUDA kernels would allocate. Workspaces kept by the libraries live
        until the block ends (then everything made here is freed)."""
        try:
            if self.precision == "16-mixed":  # GradScaler's scale and growth tracker, made with the first step
                self._scaler = [torch.empty(1, dtype=torch.float32), torch.empty(1, dtype=torch.int32)]
                self.used.add("16-mixed:grad-scaler")
            functions = CudaFunctions(self)
            with functions, CudaWorkspaces(self), functions.patched():
                yield self
        finally:
            self.cublas, self.cublaslt = {}, None
            self._scaler = []

    def assumed(self) -> list[str]:
        """The kernel choices made, in words, one per line (for ``memkit estimate``)."""
        words = {
            "attention:flash": "attention: flash (fp16/bf16, sm80+)",
            "attention:efficient": "attention: memory-efficient",
            "attention:math": "attention: math (CUDA's fallback)",
            "dropout:fused": "dropout: fused, bool mask",
            "cross_entropy:autocast": "cross_entropy: CUDA autocast (log_softmax in low precision, nll_loss in fp32)",
            "cublas:workspace": f"cuBLAS workspace {cublas_workspace_bytes(self.gpu) // KiB} KiB",
            "conv:cudnn-workspace": "cuDNN workspaces: input + output + weight per call",
            "16-mixed:grad-scaler": "GradScaler state",
            "autocast:cuda-policy": "CUDA autocast's op lists (fp32 norms, softmax and sums; einsum in low precision)",
        }
        return [f"GPU {self.gpu.name} (sm{self.gpu.sm})"] + [words.get(name, name) for name in sorted(self.used)]

    def view(self, events: Iterable[tuple[str, object, int]]) -> AllocatorView:
        """The step's allocation events replayed through :class:`CudaAllocatorModel` (with this target's
        allocator settings); workspaces are inside the step, so only the context allowance is added."""
        model = CudaAllocatorModel(self.config).replay(events)
        return model.view(CUDA_CONTEXT_BYTES, 0)


def cuda_target(device: torch.device, fake: bool, mode: Any = None, gpu: Any = None) -> CudaKernels | None:
    """The :class:`CudaKernels` for an estimate's target, or ``None`` when the target is not CUDA or the
    step is real (a measured step runs the real kernels)."""
    if device.type != "cuda" or not fake:
        return None
    precision = None
    if mode is not None and getattr(mode, "precision", None) is not None:
        precision = "16-mixed" if mode.precision == "amp" else mode.precision
    return CudaKernels(gpu, "32-true" if precision is None else precision)
