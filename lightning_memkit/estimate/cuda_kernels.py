"""The CUDA target's kernels: what the kernels a GPU would run allocate, simulated on CPU fake tensors.

A CUDA-target estimate runs its fake step on CPU fakes (a CPU-only torch cannot make fake CUDA
tensors). Where a CUDA kernel allocates differently from the CPU (or fake) one, this module makes
the fake step allocate what the CUDA kernel does. Every such choice is one row of :data:`KERNEL_TABLE`,
and each row is pinned by tests/test_gpu_truth.py against allocator traces recorded on an H100
(tests/data/gpu_truth, torch 2.11, cuDNN 9).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_memkit.estimate.allocator import CUDA_CONTEXT_BYTES, AllocatorConfig, AllocatorView, CudaAllocatorModel
from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.fake_tensors import NOT_ANSWERED, fake_device_query, fake_tensor_type
from lightning_memkit.units import KiB, MiB

__all__ = [
    "GPU_GENERATIONS",
    "GpuTarget",
    "KERNEL_TABLE",
    "KernelRow",
    "CudaKernels",
    "attention_backend",
    "conv_workspace_bytes",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "cuda_target",
]

#: GPU names -> compute capability (major, minor). ``sm90``, ``9.0`` or ``(9, 0)`` are accepted too.
GPU_GENERATIONS: dict[str, tuple[int, int]] = {
    "v100": (7, 0), "t4": (7, 5), "a100": (8, 0), "a30": (8, 0), "a10": (8, 6), "a10g": (8, 6), "a40": (8, 6),
    "rtx3090": (8, 6), "l4": (8, 9), "l40": (8, 9), "l40s": (8, 9), "rtx4090": (8, 9), "h100": (9, 0),
    "h200": (9, 0), "gh200": (9, 0), "b200": (10, 0), "gb200": (10, 0),
}


@dataclass(frozen=True)
class GpuTarget:
    """The GPU an estimate is for: its name and compute capability (``(9, 0)`` for an H100).

    The generation changes kernel choices (flash attention needs sm80+, bf16 memory-efficient
    attention sm80+) and the cuBLAS workspace (32 MiB on sm90+, 8 MiB + 128 KiB before).
    """

    name: str
    capability: tuple[int, int]

    @classmethod
    def parse(cls, gpu: Any = None) -> "GpuTarget":
        """``"h100"``, ``"a100"``, ``"sm90"``, ``"8.0"``, ``(8, 0)`` or a ``GpuTarget``; ``None`` is this
        machine's GPU when CUDA is available, else an H100 (the generation the recorded truth comes from)."""
        if isinstance(gpu, GpuTarget):
            return gpu
        if gpu is None:
            if torch.cuda.is_available():
                return cls(torch.cuda.get_device_name().lower(), tuple(torch.cuda.get_device_capability()))
            return cls("h100", GPU_GENERATIONS["h100"])
        if isinstance(gpu, tuple) and len(gpu) == 2 and all(isinstance(v, int) for v in gpu):
            return cls(f"sm{gpu[0]}{gpu[1]}", gpu)
        text = str(gpu).strip().lower().replace("nvidia", "").replace(" ", "").replace("-", "")
        if text in GPU_GENERATIONS:
            return cls(text, GPU_GENERATIONS[text])
        match = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", text)
        if match and (match.group(2) is not None or text.startswith("sm")):
            digits = match.group(1)
            if match.group(2) is not None:
                return cls(f"sm{digits}{match.group(2)}", (int(digits), int(match.group(2))))
            if len(digits) >= 2:
                return cls(f"sm{digits}", (int(digits[:-1]), int(digits[-1])))
        raise ValueError(f"unknown GPU {gpu!r}: give a name ({', '.join(sorted(GPU_GENERATIONS))}), "
                         "a compute capability such as 'sm90' or '8.0', or a (major, minor) tuple")

    @property
    def sm(self) -> int:
        """The capability as one number: 90 for (9, 0)."""
        return self.capability[0] * 10 + self.capability[1]


def _workspace_config_bytes(text: str) -> int:
    """Bytes of a ``CUBLAS_WORKSPACE_CONFIG`` such as ``":4096:8"`` (pairs of KiB size and count)."""
    numbers = [int(n) for n in re.findall(r":(\d+)", text)]
    return sum(numbers[i] * KiB * numbers[i + 1] for i in range(0, len(numbers) - 1, 2))


def cublas_workspace_bytes(gpu: GpuTarget) -> int:
    """The cuBLAS workspace torch allocates (through the caching allocator) at the first matmul on a
    stream: ``CUBLAS_WORKSPACE_CONFIG`` if set, else ``":4096:8"`` (32 MiB) on sm90+ and
    ``":4096:2:16:8"`` (8 MiB + 128 KiB) before (CublasHandlePool.cpp)."""
    configured = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if configured and _workspace_config_bytes(configured):
        return _workspace_config_bytes(configured)
    return 32 * MiB if gpu.capability >= (9, 0) else 8 * MiB + 128 * KiB


def cublaslt_workspace_bytes(gpu: GpuTarget) -> int:
    """The cuBLASLt workspace (addmm with a bias epilogue): ``CUBLASLT_WORKSPACE_SIZE`` KiB if set, else 1 MiB."""
    configured = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    return int(configured) * KiB if configured and configured.isdigit() else 1 * MiB


def conv_workspace_bytes(input: torch.Tensor, weight: torch.Tensor, output: torch.Tensor) -> int:
    """cuDNN's workspace for one convolution (forward, or each of backward-data and backward-weight):
    the bytes of input + output + weight (+16). On the H100 trace most convolutions' workspaces are
    exactly that (cuDNN 9's engines transpose NCHW operands into NHWC in the workspace); the
    algorithm, and so the size, is cuDNN's choice per shape, so this is a model, not a rule."""
    return _nbytes(input) + _nbytes(output) + _nbytes(weight) + 16


#: backward-weight workspaces on the H100 trace are 1.0-1.5x the forward's (median about 1.25x, fp32 and bf16)
CONV_WEIGHT_GRAD_WORKSPACE_FACTOR = 1.25


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


#: capabilities where flash attention refuses training with head dims in (192, 224], or above 224 with dropout
_FLASH_LIMITED_HEAD_DIMS = ((8, 6), (8, 9), (12, 0), (12, 1))


def attention_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
                      gpu: GpuTarget, enable_gqa: bool = False, is_causal: bool = False) -> str:
    """The ``scaled_dot_product_attention`` kernel CUDA picks: ``"flash"``, ``"efficient"`` or ``"math"``.

    torch's order is flash, then memory-efficient, then math (``select_sdp_backend`` in sdp_utils.cpp). Recent
    sdp_utils.cpp put cuDNN attention first on sm90/sm100 with cuDNN >= 9.9 unless ``TORCH_CUDNN_SDPA_PREFERRED=0``;
    it is not modelled as its own backend (its forward keeps the same (B,H,L) fp32 logsumexp as flash). All need 4-D
    inputs of one dtype and the same batch. Flash: sm80 to sm121, fp16 or bf16, no attention mask, equal
    head dims of at most 256 (torch pads them to a multiple of 8), ``is_causal`` only with equal query and
    key lengths, grouped-query heads allowed (``enable_gqa``); on sm86/89/120 no training with head dims in
    (192, 224], or above 224 with dropout. Memory-efficient: sm50 to sm121, fp32 or fp16 (and bf16 on
    sm80+), equal query and key head dims aligned to ``minimum_gemm_alignment`` (8 elements for fp16/bf16
    on tensor cores, 4 for fp32 on sm80+, 1 for fp32 before), the same number of heads in query, key and
    value. Anything else runs the math path.
    """
    tensors = (query, key, value)
    if any(t.dim() != 4 for t in tensors) or len({t.dtype for t in tensors}) != 1 or len({t.shape[0] for t in tensors}) != 1:
        return "math"
    dtype, capability = query.dtype, gpu.capability
    q_heads, k_heads, v_heads = query.shape[1], key.shape[1], value.shape[1]
    same_heads = q_heads == k_heads == v_heads
    grouped = enable_gqa and k_heads == v_heads and k_heads > 0 and q_heads % k_heads == 0
    q_dim, k_dim, v_dim = query.shape[-1], key.shape[-1], value.shape[-1]
    half = dtype in (torch.float16, torch.bfloat16)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    limited = capability in _FLASH_LIMITED_HEAD_DIMS and needs_grad and (192 < q_dim <= 224 or (q_dim > 224 and dropout_p > 0.0))
    if ((8, 0) <= capability <= (12, 1) and half and attn_mask is None and (same_heads or grouped)
            and q_dim == k_dim == v_dim and 0 < q_dim <= 256 and not limited
            and not (is_causal and query.shape[-2] != key.shape[-2])
            and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in tensors)):
        return "flash"
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = 4 if capability >= (8, 0) else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability >= (8, 0) else (torch.float16, torch.float32)
    if ((5, 0) <= capability <= (12, 1) and same_heads and dtype in dtypes and q_dim == k_dim
            and q_dim > 0 and q_dim % alignment == 0 and v_dim > 0 and v_dim % alignment == 0
            and all(t.stride(-1) == 1 for t in tensors)):
        return "efficient"
    return "math"


@dataclass(frozen=True)
class KernelRow:
    """One choice the CUDA target makes: where CUDA's kernel allocates differently from the fake CPU step.

    Attributes:
        op: the op (as the user calls it).
        when: the condition under which CUDA runs this kernel.
        cuda_allocates: what the CUDA kernel allocates (sizes in terms of the op's shapes).
        fake_cpu_allocates: what the CPU fake step would allocate without this row.
        evidence: where the recorded H100 traces show it (tests/test_gpu_truth.py pins it).
    """

    op: str
    when: str
    cuda_allocates: str
    fake_cpu_allocates: str
    evidence: str


#: The CUDA target's kernel choices, one row each (printed by ``memkit estimate`` on a CUDA target).
KERNEL_TABLE: tuple[KernelRow, ...] = (
    KernelRow("scaled_dot_product_attention", "fp16/bf16, no mask, equal head dims <= 256 (padded to a multiple of 8), "
              "grouped-query heads allowed, is_causal only with equal lengths, sm80+ (attention_backend has all the rules)",
              "flash: output, logsumexp (B,H,L) fp32, philox seed+offset (2 x 8 B); backward: dq/dk/dv and a "
              "transient fp32 dq accumulator + softmax_d (B,L,H,D + B,H,L floats)",
              "math path: L x L weights, softmax, a float dropout mask", "trace_BertLike_b8_bf16-mixed: 196608-byte lse, two 8-byte seeds, 12779776-byte backward buffer"),
    KernelRow("scaled_dot_product_attention", "no flash: fp32, fp16 (bf16 on sm80+), a mask allowed, the same heads in q, k, v, "
              "head dims aligned (8 elements for fp16/bf16, 4 for fp32 on sm80+, 1 for fp32 before)",
              "memory-efficient: output, logsumexp (B,H,ceil32(L)) fp32 (seed and offset on the host), a bool mask made additive "
              "and padded to 8 columns when its strides are not; backward: dq/dk/dv, delta (B,H,L floats) and a transient fp32 dq accumulator",
              "math path: L x L weights, softmax, a float dropout mask", "trace_BertLike_b8_32-true: 196608-byte lse per layer, 12595200-byte backward buffer"),
    KernelRow("scaled_dot_product_attention", "neither (grouped heads in fp32, bf16 before sm80, unaligned head dims...)",
              "math: fp16/bf16 q, k, v copied to fp32, q and k each scaled, grouped k/v heads repeated, (B,H,L,S) fp32 weights "
              "(the mask added in place), _safe_softmax, fused dropout (bool mask), the weights cast back as a second output",
              "the CPU kernels (CPU flash attention without dropout; with dropout a float mask)",
              "not in the traces: tests/test_estimate_unseen.py pins it against torch's _scaled_dot_product_attention_math"),
    KernelRow("dropout (F.dropout, nn.Dropout)", "training, 0 < p < 1",
              "fused native_dropout: output and a bool (1 byte/element) mask", "output and a float mask (input's dtype)",
              "trace_BertLike_b8_32-true: 3145728-byte masks beside 12582912-byte fp32 outputs"),
    KernelRow("linear", "input of 3+ dims, not contiguous, with bias",
              "matmul then bias added in place (one output)", "fake tensors take the out-of-place add (a second output)",
              "trace_BertLike_b8_32-true: three allocations per in-projection"),
    KernelRow("cross_entropy under autocast", "fp16/bf16 logits, class-index targets",
              "log_softmax in the logits' dtype, then nll_loss on an fp32 copy (autocast's fp32 list); with label smoothing "
              "the class sum of the log-probabilities reduced in fp32 (one float per position)",
              "CPU autocast casts the whole loss to fp32 (an fp32 copy and fp32 log-probabilities)",
              "trace_BertLike_b8_bf16-mixed: 250036224-byte bf16 log-probs and a 500072448-byte fp32 copy"),
    KernelRow("autocast's op lists (bf16/fp16 modes)", "ops CUDA's autocast lists differently from CPU's (_autocast_policies)",
              "layer_norm, group_norm, rms_norm, exp, log, pow, norms, distance and embedding losses: fp16/bf16 arguments cast to "
              "fp32 (an fp32 copy and an fp32 result); softmax, log_softmax, sum, cumsum, prod: an fp32 result; einsum, mv, addmv, "
              "addr, multi_dot: fp32 arguments cast down; 3-D poolings and reflect/replicate padding: left as they come",
              "CPU autocast's lists: those ops in the low-precision dtype (and the 3-D poolings and paddings cast to fp32)",
              "not in the traces (no such op in their models): tests/test_estimate_unseen.py checks torch's own CUDA autocast test "
              "lists (torch/testing/_internal/autocast_test_lists.py)"),
    KernelRow("matmul family (mm, addmm, bmm...)", "first call on the stream",
              "the cuBLAS workspace, kept, one for the forward's thread and one for autograd's backward thread: 32 MiB on sm90+, 8 MiB + 128 KiB before (CUBLAS_WORKSPACE_CONFIG); "
              "the first addmm also the cuBLASLt workspace (1 MiB, CUBLASLT_WORKSPACE_SIZE)", "nothing",
              "all traces: a 33554432-byte and a 1048576-byte block at the first linear layer, another 33554432-byte block in the first backward, never freed"),
    KernelRow("convolution (forward, backward)", "cuDNN",
              "a transient workspace per call, modelled as input + output + weight bytes (forward, backward-data) "
              "and 1.25x that (backward-weight)", "nothing",
              "trace_ResNetish_b32_32-true: 25837584-byte workspaces beside 25690112-byte outputs"),
    KernelRow("batch_norm (training)", "cuDNN",
              "output, save_mean and save_invstd (C floats each); cuDNN's reserve space is empty", "the same bytes",
              "trace_ResNetish_b32_32-true: 256-byte statistics for 64 channels"),
    KernelRow("optimizer step (Adam, AdamW, SGD...)", "parameters on CUDA, foreach not chosen",
              "the multi-tensor (foreach) implementation and its temporaries", "the single-tensor loop",
              "both traces: _multi_tensor_adam frames"),
    KernelRow("16-mixed (GradScaler)", "precision 16-mixed",
              "the scale (4 B) and growth tracker (4 B), kept; the loss scaling's per-step scalars are 512-byte blocks",
              "nothing", "not recorded in the traces (16-mixed rows are in truth.json only)"),
)


class _CudaFunctions(TorchFunctionMode):
    """Rewrites calls whose CUDA kernel allocates differently (attention, dropout, linear, cross_entropy)."""

    def __init__(self, kernels: "CudaKernels") -> None:
        super().__init__()
        self.kernels = kernels
        self._sdpa = torch._C._nn.scaled_dot_product_attention
        self._handlers = {
            F.scaled_dot_product_attention: self._attention,
            self._sdpa: self._attention,
            F.dropout: self._dropout,
            torch.dropout: self._torch_dropout,
            F.linear: self._linear,
            torch._C._nn.linear: self._linear,
            F.cross_entropy: self._cross_entropy,
        }
        policy_handlers = {"fp32": self._autocast_fp32, "fp32_set_opt_dtype": self._autocast_fp32_dtype,
                           "lower_precision": self._autocast_lower, "untouched": self._autocast_untouched}
        # patched, not handled by the mode: torch-function modes are not active while autograd recomputes a
        # checkpointed region in the backward, and the recomputation must make the same dtypes as the forward
        self._patches = [(owner, name, policy_handlers[policy]) for owner, name, policy in _autocast_policies()]

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Route ``torch.nn.functional``'s own Python code (``multi_head_attention_forward`` calls
        ``scaled_dot_product_attention`` and ``linear`` from its module) through the handlers too: a
        torch-function mode does not see calls made inside a Python function it passed on."""
        names = {"scaled_dot_product_attention": self._attention, "dropout": self._dropout, "linear": self._linear,
                 "cross_entropy": self._cross_entropy}
        patches = [(F, name, handler) for name, handler in names.items()]
        patches += [patch for patch in self._patches if not (patch[0] is F and patch[1] in names)]
        # a class's own attribute is put back; an inherited one (torch.Tensor's methods from TensorBase) is deleted again
        saved = [(owner, name, owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)) for owner, name, _ in patches]

        # the patches are process-wide, the fake step runs on this thread: any other thread's calls (a data
        # loader's pin-memory thread, a user's own) go straight to the original function
        step_thread = threading.get_ident()

        def wrapper(name, handler, original):
            def call(*args, **kwargs):
                if threading.get_ident() != step_thread:
                    return original(*args, **kwargs)
                result = handler(original, args, kwargs)
                return original(*args, **kwargs) if result is NotImplemented else result

            call.__name__ = call.__qualname__ = name
            call.__wrapped__ = original
            return call

        try:
            for owner, name, handler in patches:
                setattr(owner, name, wrapper(name, handler, getattr(owner, name)))
            yield
        finally:
            for owner, name, original in saved:
                if original is _INHERITED:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        handler = self._handlers.get(func)
        if handler is not None:
            result = handler(func, args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ CUDA's autocast policy
    # The fake step runs CPU autocast; where CUDA's autocast lists an op differently (see _autocast_policies),
    # the call runs as CUDA's autocast would run it: its arguments cast, then the op with autocast off.
    def _autocast_fp32(self, func, args, kwargs):
        if _autocast_dtype() is None or not _any_tensor(args, kwargs, _is_low_precision):
            return NotImplemented
        if getattr(func, "__name__", "") == "interpolate" and _bound(("input", "size", "scale_factor", "mode"), args, kwargs).get("mode", "nearest") not in _UPSAMPLE_MODES:
            return NotImplemented  # 'area' pools: not on the list
        self.kernels.used.add("autocast:cuda-policy")
        args, kwargs = _cast_tensors(args, kwargs, _is_low_precision, torch.float32)
        with _no_autocast():
            return func(*args, **kwargs)

    def _autocast_fp32_dtype(self, func, args, kwargs):
        if _autocast_dtype() is None or kwargs.get("dtype") is not None or len(args) > _DTYPE_POSITION.get(getattr(func, "__name__", ""), 99):
            return NotImplemented
        first = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("input"))
        if not isinstance(first, torch.Tensor) or not _is_low_precision(first):
            return NotImplemented
        self.kernels.used.add("autocast:cuda-policy")
        with _no_autocast():
            return func(*args, **{**kwargs, "dtype": torch.float32})

    def _autocast_lower(self, func, args, kwargs):
        dtype = _autocast_dtype()
        if dtype is None:
            return NotImplemented
        self.kernels.used.add("autocast:cuda-policy")
        args, kwargs = _cast_tensors(args, kwargs, lambda t: t.is_floating_point() and t.dtype == torch.float32, dtype)
        with _no_autocast():
            return func(*args, **kwargs)

    def _autocast_untouched(self, func, args, kwargs):
        if _autocast_dtype() is None:
            return NotImplemented
        if getattr(func, "__name__", "") == "pad" and _bound(("input", "pad", "mode"), args, kwargs).get("mode", "constant") == "constant":
            return NotImplemented
        with _no_autocast():  # CPU autocast would cast these to fp32; CUDA's runs them as they come
            return func(*args, **kwargs)

    # ------------------------------------------------------------------ attention
    def _attention(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        query, key, value = bound["query"], bound["key"], bound["value"]
        attn_mask, dropout_p = bound.get("attn_mask"), float(bound.get("dropout_p", 0.0))
        is_causal, scale, enable_gqa = bool(bound.get("is_causal", False)), bound.get("scale"), bool(bound.get("enable_gqa", False))
        if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
            return NotImplemented
        dtype = _autocast_dtype()
        if dtype is not None:  # sdpa is on CUDA's lower-precision autocast list: every fp32 tensor argument is cast
            query, key, value = (t.to(dtype) if t.is_floating_point() and t.dtype == torch.float32 else t for t in (query, key, value))
            if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.float32:
                attn_mask = attn_mask.to(dtype)
        backend = attention_backend(query, key, value, attn_mask, dropout_p, self.kernels.gpu, enable_gqa, is_causal)
        self.kernels.used.add(f"attention:{backend}")
        with _no_autocast():
            if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
                attn_mask = _additive_mask(attn_mask, query.dtype)
            if backend == "flash":
                head_dim = query.shape[-1]
                if head_dim % 8:  # torch pads q, k, v to a multiple of 8 for flash and slices the output back
                    scale = scale if scale is not None else head_dim ** -0.5
                    query, key, value = (F.pad(t, (0, 8 - head_dim % 8)) for t in (query, key, value))
                output = _torch_compat.flash_attention(query, key, value, dropout_p, is_causal, scale)
                return output[..., :head_dim] if output.shape[-1] != head_dim else output
            if backend == "efficient":
                if attn_mask is not None:
                    attn_mask = _efficient_mask(attn_mask, query, key)
                compute_lse = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
                return _torch_compat.efficient_attention(query, key, value, attn_mask, compute_lse, dropout_p, is_causal, scale)
            return _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    # ------------------------------------------------------------------ dropout
    def _dropout(self, func, args, kwargs):
        names = ("input", "p", "training", "inplace")
        bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(names, args)), **kwargs}
        return self._fused_dropout(bound["input"], float(bound["p"]), bool(bound["training"]), bool(bound["inplace"]))

    def _torch_dropout(self, func, args, kwargs):
        names = ("input", "p", "train")
        bound = {**dict(zip(names, args)), **kwargs}
        return self._fused_dropout(bound["input"], float(bound["p"]), bool(bound["train"]), False)

    def _fused_dropout(self, input, p, training, inplace):
        if not isinstance(input, torch.Tensor) or not training or not 0.0 < p < 1.0 or input.numel() == 0:
            return NotImplemented
        self.kernels.used.add("dropout:fused")
        output = torch.native_dropout(input, p, True)[0]
        return input.copy_(output) if inplace else output

    # ------------------------------------------------------------------ linear
    def _linear(self, func, args, kwargs):
        names = ("input", "weight", "bias")
        bound = {"bias": None, **dict(zip(names, args)), **kwargs}
        input, weight, bias = bound["input"], bound["weight"], bound["bias"]
        if bias is None or not isinstance(input, torch.Tensor) or input.dim() <= 2 or input.is_contiguous():
            return NotImplemented
        output = F.linear(input, weight)
        return output.add_(bias)

    # ------------------------------------------------------------------ cross entropy
    def _cross_entropy(self, func, args, kwargs):
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        bound = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
                 "label_smoothing": 0.0, **dict(zip(names, args)), **kwargs}
        input, target = bound["input"], bound["target"]
        dtype = _autocast_dtype()
        if (dtype is None or not isinstance(input, torch.Tensor) or input.dtype not in (torch.float16, torch.bfloat16)
                or not isinstance(target, torch.Tensor) or target.is_floating_point()
                or bound["size_average"] is not None or bound["reduce"] is not None):
            return NotImplemented
        self.kernels.used.add("cross_entropy:autocast")
        weight, smoothing, reduction, ignore_index = bound["weight"], float(bound["label_smoothing"]), bound["reduction"], bound["ignore_index"]
        with _no_autocast():
            class_dim = 1 if input.dim() > 1 else 0
            log_probs = torch.log_softmax(input, class_dim, dtype=input.dtype)
            nll = F.nll_loss(log_probs.float(), target, None if weight is None else weight.float(),
                             ignore_index=ignore_index, reduction=reduction)
            if not smoothing:
                return nll
            return _label_smoothing_term(log_probs, nll, target, weight, class_dim, reduction, ignore_index, smoothing)


#: F.interpolate modes that reach an upsample op (on CUDA autocast's fp32 list)
_UPSAMPLE_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear")

#: where a positional ``dtype`` argument sits (after input, dim; F's after _stacklevel), by function name
_DTYPE_POSITION = {"softmax": 2, "log_softmax": 2}


def _autocast_policies() -> list[tuple[Any, str, str]]:
    """``(owner, name, policy)`` for the functions and Tensor methods whose CUDA autocast policy differs from CPU
    autocast's (torch's autocast_mode.cpp lists, also in torch/testing/_internal/autocast_test_lists.py):

    * ``fp32``: CUDA casts fp16/bf16 arguments to fp32 (CPU leaves them): layer_norm, group_norm, rms_norm,
      softplus, cosine_similarity, acos, asin, cosh, erfinv, sinh, tan, exp, log, log1p, expm1, log2, log10,
      rsqrt, reciprocal, pow, norm, renorm, logsumexp, dist, pdist, cdist, the embedding / margin / KL losses,
      the upsampling of ``interpolate``;
    * ``fp32_set_opt_dtype``: CUDA runs them with ``dtype=float32`` on fp16/bf16 inputs (an fp32 result, no
      input copy): softmax, log_softmax, sum, cumsum, prod, cumprod, vector_norm;
    * ``lower_precision``: CUDA casts fp32 arguments to the autocast dtype (CPU does not list them): einsum,
      mv, addmv, addr, chain_matmul, multi_dot;
    * ``untouched``: CPU casts them to fp32, CUDA does not list them: the 3-D poolings and reflect /
      replicate padding.
    """
    T = torch.Tensor
    table = {
        "fp32": [(F, "layer_norm"), (F, "group_norm"), (F, "rms_norm"), (F, "softplus"), (F, "cosine_similarity"), (F, "interpolate"),
                 (torch._C._nn, "softplus"), (T, "__pow__")]
                + [(torch, name) for name in ("layer_norm", "group_norm", "rms_norm", "cosine_similarity", "poisson_nll_loss",
                                              "cosine_embedding_loss", "hinge_embedding_loss", "kl_div", "margin_ranking_loss",
                                              "triplet_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist")]
                + [(owner, name) for name in ("acos", "asin", "cosh", "erfinv", "sinh", "tan", "exp", "log", "log1p", "expm1", "log2",
                                              "log10", "rsqrt", "reciprocal", "pow", "norm", "renorm", "logsumexp") for owner in (torch, T)],
        "fp32_set_opt_dtype": [(F, "softmax"), (F, "log_softmax"), (torch.linalg, "vector_norm")]
                              + [(owner, name) for name in ("softmax", "log_softmax", "sum", "cumsum", "prod", "cumprod") for owner in (torch, T)],
        "lower_precision": [(torch, "einsum"), (torch, "chain_matmul"), (torch.linalg, "multi_dot")]
                           + [(owner, name) for name in ("mv", "addmv", "addr") for owner in (torch, T)],
        "untouched": [(F, "avg_pool3d"), (F, "max_pool3d"), (F, "adaptive_avg_pool3d"), (F, "pad")],
    }
    return [(owner, name, policy) for policy, entries in table.items() for owner, name in entries if getattr(owner, name, None) is not None]


_INHERITED = object()  # marks a patched class attribute the class did not define itself


def _is_low_precision(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float16, torch.bfloat16)


def _any_tensor(args: Any, kwargs: Any, test) -> bool:
    return any(isinstance(leaf, torch.Tensor) and test(leaf) for leaf in tree_flatten((args, kwargs))[0])


def _cast_tensors(args: Any, kwargs: Any, test, dtype: torch.dtype) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with every tensor passing ``test`` cast to ``dtype`` (as autocast's cached_cast)."""
    return tree_map(lambda leaf: leaf.to(dtype) if isinstance(leaf, torch.Tensor) and test(leaf) else leaf, (args, kwargs))


def _bound(names: tuple[str, ...], args: Any, kwargs: Any) -> dict[str, Any]:
    return {**dict(zip(names, args)), **kwargs}


def _label_smoothing_term(log_probs, nll, target, weight, class_dim, reduction, ignore_index, smoothing):
    """The rest of ``cross_entropy_loss_label_smoothing`` (LossNLL.cpp) as CUDA autocast runs it, given the
    low-precision log-probabilities and the nll loss: the class sum reduced in fp32 (``sum`` is on autocast's
    fp32-dtype list; with a class weight the product is fp32 by promotion), the ignored positions zeroed, the
    reduction (the weighted mean as torch takes it for tensor subclasses, without a data-dependent shape)."""
    if weight is not None:
        shape = [1] * log_probs.dim()
        shape[class_dim] = weight.shape[0]
        smooth = -(log_probs * weight.view(shape)).sum(class_dim)
    else:
        smooth = -log_probs.sum(class_dim, dtype=torch.float32)
    ignored = target == ignore_index
    smooth.masked_fill_(ignored, 0.0)
    if reduction == "mean":
        if weight is not None:
            kept_weights = weight.gather(0, target.masked_fill(ignored, 0).flatten()).masked_fill_(ignored.flatten(), 0)
            total = smooth.sum() / kept_weights.sum()
        else:
            total = smooth.sum() / (~ignored).sum()
    elif reduction == "sum":
        total = smooth.sum()
    else:
        total = smooth
    return (1 - smoothing) * nll + total * (smoothing / log_probs.shape[class_dim])


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: attend) as the additive mask torch's ``convert_boolean_attn_mask`` makes of it
    (``where`` between two scalar tensors: one mask-sized tensor of ``dtype``)."""
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device))


def _efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The additive mask as torch hands it to the memory-efficient kernel (``preprocess_mask``): a mask whose
    strides are not multiples of 8 (or whose last stride is not 1) is padded by ``8 - S % 8`` columns and
    sliced back, then expanded (a view) to (B, H, L, S)."""
    aligned = all(stride % 8 == 0 for stride in mask.stride()[:-1]) and (mask.dim() == 0 or mask.stride(-1) == 1)
    if not aligned:
        length = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - length % 8))[..., :length]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=False):
    """CUDA's math fallback, as torch's ``_scaled_dot_product_attention_math`` runs it on CUDA tensors: fp16/bf16
    inputs computed in fp32 (unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` was set), query and
    key each scaled by sqrt(scale), a causal mask made additive, the mask added in place (fake tensors would take
    the out-of-place add), grouped key/value heads repeated, ``_safe_softmax``, CUDA's fused dropout (bool mask),
    and both outputs (the result and the weights) cast back to the input dtype."""
    origin = query.dtype
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    reduce_in_half = bool(allowed()) if allowed is not None else False
    # the C++ function's locals (query_acc, key_acc, value_acc, the scaled query, the repeated key and value)
    # live until it returns: kept here the same way
    query_acc, key_acc, value_acc = (t.float() if not reduce_in_half and t.dtype in (torch.float16, torch.bfloat16) else t
                                     for t in (query, key, value))
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query_acc.shape[-1]))
    scaled_query = query_acc * factor
    if is_causal:
        length, source = scaled_query.shape[-2], key_acc.shape[-2]
        attn_mask = _additive_mask(torch.ones(length, source, dtype=torch.bool, device=query.device).tril(), scaled_query.dtype)
    key_expanded, value_expanded = key_acc, value_acc
    if enable_gqa and key_acc.shape[-3] != scaled_query.shape[-3]:
        key_expanded = key_acc.repeat_interleave(scaled_query.shape[-3] // key_acc.shape[-3], -3)
        value_expanded = value_acc.repeat_interleave(scaled_query.shape[-3] // value_acc.shape[-3], -3)
    weights = torch.matmul(scaled_query, key_expanded.transpose(-2, -1) * factor)
    if attn_mask is not None:
        weights.add_(attn_mask)
    weights = _torch_compat.safe_softmax(weights, -1)
    if dropout_p > 0.0:
        weights = torch.native_dropout(weights, dropout_p, True)[0]
    weights_out = weights.to(origin)  # the op's second output (C++ builds the returned tuple's last element first)
    output = torch.matmul(weights, value_expanded).to(origin)
    del weights_out, weights, query_acc, key_acc, value_acc, scaled_query, key_expanded, value_expanded  # sdpa keeps only the output
    return output


def _autocast_dtype() -> torch.dtype | None:
    """The fake step's autocast dtype (it runs CPU autocast on CPU fakes), or None."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            yield
    else:
        yield


class _CudaWorkspaces(TorchDispatchMode):
    """Allocates what CUDA libraries take through the caching allocator: cuBLAS/cuBLASLt workspaces
    (kept), cuDNN convolution workspaces and fused-attention backward buffers (transient)."""

    _MATMULS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_addmm_activation")

    def __init__(self, kernels: "CudaKernels") -> None:
        super().__init__()
        self.kernels = kernels
        aten = torch.ops.aten
        self._matmuls = {getattr(aten, name).default for name in self._MATMULS if hasattr(aten, name)}
        self._addmm = {aten.addmm.default, aten._addmm_activation.default} if hasattr(aten, "_addmm_activation") else {aten.addmm.default}
        self._conv = aten.convolution.default
        self._conv_backward = aten.convolution_backward.default
        self._flash_backward = aten._scaled_dot_product_flash_attention_backward.default
        self._efficient_backward = aten._scaled_dot_product_efficient_attention_backward.default
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
            thread = "backward" if _in_backward() else "main"
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
        return func(*args, **kwargs)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward now (torch's private graph-task id; -1 outside)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() >= 0


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


class CudaKernels:
    """The CUDA target's kernels for one fake step: enter :meth:`active` around the step (inside the fake
    world and the accountant), then :meth:`view` replays what the step allocated through the allocator model.

    Attributes:
        gpu: the target :class:`GpuTarget`.
        precision: the step's Lightning precision (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``).
        config: the :class:`~lightning_memkit.estimate.allocator.AllocatorConfig` replayed with.
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
    def active(self) -> Iterator["CudaKernels"]:
        """Inside: calls run as the CUDA kernels would allocate. Workspaces kept by the libraries live
        until the block ends (then everything made here is freed)."""
        try:
            if self.precision == "16-mixed":  # GradScaler's scale and growth tracker, made with the first step
                self._scaler = [torch.empty(1, dtype=torch.float32), torch.empty(1, dtype=torch.int32)]
                self.used.add("16-mixed:grad-scaler")
            functions = _CudaFunctions(self)
            with functions, _CudaWorkspaces(self), functions.patched():
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
    return CudaKernels(gpu, {None: "32-true"}.get(precision, precision))

