"""Attention as CUDA runs it: which ``scaled_dot_product_attention`` kernel CUDA picks for a GPU and inputs
(:func:`attention_backend`), and the masks and math fallback rewritten so CPU fakes allocate what CUDA's kernels do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget

__all__ = ["attention_backend", "additive_mask", "efficient_mask", "math_attention"]


#: capabilities where flash attention refuses training with head dims in (192, 224], or above 224 with dropout
_FLASH_LIMITED_HEAD_DIMS = ((8, 6), (8, 9), (12, 0), (12, 1))


def attention_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Any,
    dropout_p: float,
    gpu: GpuTarget,
    enable_gqa: bool = False,
    is_causal: bool = False,
) -> str:
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
    if (
        any(t.dim() != 4 for t in tensors)
        or len({t.dtype for t in tensors}) != 1
        or len({t.shape[0] for t in tensors}) != 1
    ):
        return "math"
    dtype, capability = query.dtype, gpu.capability
    q_heads, k_heads, v_heads = query.shape[1], key.shape[1], value.shape[1]
    same_heads = q_heads == k_heads == v_heads
    grouped = enable_gqa and k_heads == v_heads and k_heads > 0 and q_heads % k_heads == 0
    q_dim, k_dim, v_dim = query.shape[-1], key.shape[-1], value.shape[-1]
    half = dtype in (torch.float16, torch.bfloat16)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    limited = (
        capability in _FLASH_LIMITED_HEAD_DIMS
        and needs_grad
        and (192 < q_dim <= 224 or (q_dim > 224 and dropout_p > 0.0))
    )
    if (
        (8, 0) <= capability <= (12, 1)
        and half
        and attn_mask is None
        and (same_heads or grouped)
        and q_dim == k_dim == v_dim
        and 0 < q_dim <= 256
        and not limited
        and not (is_causal and query.shape[-2] != key.shape[-2])
        and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in tensors)
    ):
        return "flash"
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = 4 if capability >= (8, 0) else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability >= (8, 0) else (torch.float16, torch.float32)
    if (
        (5, 0) <= capability <= (12, 1)
        and same_heads
        and dtype in dtypes
        and q_dim == k_dim
        and q_dim > 0
        and q_dim % alignment == 0
        and v_dim > 0
        and v_dim % alignment == 0
        and all(t.stride(-1) == 1 for t in tensors)
    ):
        return "efficient"
    return "math"


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: attend) as the additive mask torch's ``convert_boolean_attn_mask`` makes of it
    (``where`` between two scalar tensors: one mask-sized tensor of ``dtype``)."""
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device))


def efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The additive mask as torch hands it to the memory-efficient kernel (``preprocess_mask``): a mask whose
    strides are not multiples of 8 (or whose last stride is not 1) is padded by ``8 - S % 8`` columns and
    sliced back, then expanded (a view) to (B, H, L, S)."""
    aligned = all(stride % 8 == 0 for stride in mask.stride()[:-1]) and (mask.dim() == 0 or mask.stride(-1) == 1)
    if not aligned:
        length = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - length % 8))[..., :length]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=False):
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
    half = (torch.float16, torch.bfloat16)
    query_acc, key_acc, value_acc = (
        t.float() if not reduce_in_half and t.dtype in half else t for t in (query, key, value)
    )
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query_acc.shape[-1]))
    scaled_query = query_acc * factor
    if is_causal:
        length, source = scaled_query.shape[-2], key_acc.shape[-2]
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        attn_mask = additive_mask(causal, scaled_query.dtype)
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
    # sdpa keeps only the output
    del weights_out, weights, query_acc, key_acc, value_acc, scaled_query, key_expanded, value_expanded
    return output
