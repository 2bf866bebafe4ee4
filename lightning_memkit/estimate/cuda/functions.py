"""The calls whose CUDA kernel allocates differently from the CPU fake one (attention, dropout, linear, cross-entropy,
CUDA autocast's op lists), rewritten in the fake step so it allocates what CUDA does (:class:`CudaFunctions`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.cuda.attention import additive_mask, attention_backend, efficient_mask, math_attention
from lightning_memkit.estimate.cuda.autocast import (
    DTYPE_POSITION,
    UPSAMPLE_MODES,
    AutocastPolicy,
    any_tensor,
    autocast_dtype,
    autocast_policies,
    bind_arguments,
    cast_tensors,
    is_low_precision,
    label_smoothing_term,
    no_autocast,
)

if TYPE_CHECKING:
    from lightning_memkit.estimate.cuda.kernels import CudaKernels

__all__ = ["CudaFunctions"]

#: marks a patched class attribute the class did not define itself
_INHERITED = object()


class CudaFunctions(TorchFunctionMode):
    """Rewrites calls whose CUDA kernel allocates differently (attention, dropout, linear, cross_entropy)."""

    def __init__(self, kernels: CudaKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self._sdpa = _torch_compat.nn_builtin("scaled_dot_product_attention")
        self._handlers = {
            F.scaled_dot_product_attention: self._attention,
            self._sdpa: self._attention,
            F.dropout: self._dropout,
            torch.dropout: self._torch_dropout,
            F.linear: self._linear,
            _torch_compat.nn_builtin("linear"): self._linear,
            F.cross_entropy: self._cross_entropy,
        }
        policy_handlers = {
            AutocastPolicy.FP32: self._autocast_fp32,
            AutocastPolicy.FP32_SET_OPT_DTYPE: self._autocast_fp32_dtype,
            AutocastPolicy.LOWER_PRECISION: self._autocast_lower,
            AutocastPolicy.UNTOUCHED: self._autocast_untouched,
        }
        # patched, not handled by the mode: torch-function modes are not active while autograd recomputes a
        # checkpointed region in the backward, and the recomputation must make the same dtypes as the forward
        self._patches = [(owner, name, policy_handlers[policy]) for owner, name, policy in autocast_policies()]

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Route ``torch.nn.functional``'s own Python code (``multi_head_attention_forward`` calls
        ``scaled_dot_product_attention`` and ``linear`` from its module) through the handlers too: a
        torch-function mode does not see calls made inside a Python function it passed on."""
        names = {
            "scaled_dot_product_attention": self._attention,
            "dropout": self._dropout,
            "linear": self._linear,
            "cross_entropy": self._cross_entropy,
        }
        patches = [(F, name, handler) for name, handler in names.items()]
        patches += [patch for patch in self._patches if not (patch[0] is F and patch[1] in names)]
        # a class's own attribute is put back; an inherited one (torch.Tensor's methods from TensorBase) is deleted
        # again
        saved = [
            (owner, name, owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name))
            for owner, name, _ in patches
        ]

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
            functools.update_wrapper(call, original, assigned=(), updated=())  # __wrapped__ only: the name is ours
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
    # The fake step runs CPU autocast; where CUDA's autocast lists an op differently (see autocast_policies),
    # the call runs as CUDA's autocast would run it: its arguments cast, then the op with autocast off.
    def _autocast_fp32(self, func, args, kwargs):
        if autocast_dtype() is None or not any_tensor(args, kwargs, is_low_precision):
            return NotImplemented
        if getattr(func, "__name__", "") == "interpolate":
            mode = bind_arguments(("input", "size", "scale_factor", "mode"), args, kwargs).get("mode", "nearest")
            if mode not in UPSAMPLE_MODES:
                return NotImplemented  # 'area' pools: not on the list
        self.kernels.used.add("autocast:cuda-policy")
        args, kwargs = cast_tensors(args, kwargs, is_low_precision, torch.float32)
        with no_autocast():
            return func(*args, **kwargs)

    def _autocast_fp32_dtype(self, func, args, kwargs):
        dtype_position = DTYPE_POSITION.get(getattr(func, "__name__", ""), 99)
        if autocast_dtype() is None or kwargs.get("dtype") is not None or len(args) > dtype_position:
            return NotImplemented
        first = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("input"))
        if not isinstance(first, torch.Tensor) or not is_low_precision(first):
            return NotImplemented
        self.kernels.used.add("autocast:cuda-policy")
        with no_autocast():
            return func(*args, **{**kwargs, "dtype": torch.float32})

    def _autocast_lower(self, func, args, kwargs):
        dtype = autocast_dtype()
        if dtype is None:
            return NotImplemented
        self.kernels.used.add("autocast:cuda-policy")
        args, kwargs = cast_tensors(args, kwargs, lambda t: t.is_floating_point() and t.dtype == torch.float32, dtype)
        with no_autocast():
            return func(*args, **kwargs)

    def _autocast_untouched(self, func, args, kwargs):
        if autocast_dtype() is None:
            return NotImplemented
        if (
            getattr(func, "__name__", "") == "pad"
            and bind_arguments(("input", "pad", "mode"), args, kwargs).get("mode", "constant") == "constant"
        ):
            return NotImplemented
        with no_autocast():  # CPU autocast would cast these to fp32; CUDA's runs them as they come
            return func(*args, **kwargs)

    # ------------------------------------------------------------------ attention
    def _attention(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = bind_arguments(names, args, kwargs)
        query, key, value = bound["query"], bound["key"], bound["value"]
        attn_mask, dropout_p = bound.get("attn_mask"), float(bound.get("dropout_p", 0.0))
        is_causal, scale = bool(bound.get("is_causal", False)), bound.get("scale")
        enable_gqa = bool(bound.get("enable_gqa", False))
        if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
            return NotImplemented
        dtype = autocast_dtype()
        if dtype is not None:  # sdpa is on CUDA's lower-precision autocast list: every fp32 tensor argument is cast
            query, key, value = (
                t.to(dtype) if t.is_floating_point() and t.dtype == torch.float32 else t for t in (query, key, value)
            )
            if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.float32:
                attn_mask = attn_mask.to(dtype)
        backend = attention_backend(query, key, value, attn_mask, dropout_p, self.kernels.gpu, enable_gqa, is_causal)
        self.kernels.used.add(f"attention:{backend}")
        with no_autocast():
            if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
                attn_mask = additive_mask(attn_mask, query.dtype)
            if backend == "flash":
                head_dim = query.shape[-1]
                if head_dim % 8:  # torch pads q, k, v to a multiple of 8 for flash and slices the output back
                    scale = scale if scale is not None else head_dim**-0.5
                    query, key, value = (F.pad(t, (0, 8 - head_dim % 8)) for t in (query, key, value))
                output = _torch_compat.flash_attention(query, key, value, dropout_p, is_causal, scale)
                return output[..., :head_dim] if output.shape[-1] != head_dim else output
            if backend == "efficient":
                if attn_mask is not None:
                    attn_mask = efficient_mask(attn_mask, query, key)
                compute_lse = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
                return _torch_compat.efficient_attention(
                    query, key, value, attn_mask, compute_lse, dropout_p, is_causal, scale
                )
            return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    # ------------------------------------------------------------------ dropout
    def _dropout(self, func, args, kwargs):
        names = ("input", "p", "training", "inplace")
        bound = {"p": 0.5, "training": True, "inplace": False, **bind_arguments(names, args, kwargs)}
        return self._fused_dropout(bound["input"], float(bound["p"]), bool(bound["training"]), bool(bound["inplace"]))

    def _torch_dropout(self, func, args, kwargs):
        names = ("input", "p", "train")
        bound = bind_arguments(names, args, kwargs)
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
        bound = {"bias": None, **bind_arguments(names, args, kwargs)}
        input, weight, bias = bound["input"], bound["weight"], bound["bias"]
        if bias is None or not isinstance(input, torch.Tensor) or input.dim() <= 2 or input.is_contiguous():
            return NotImplemented
        output = F.linear(input, weight)
        return output.add_(bias)

    # ------------------------------------------------------------------ cross entropy
    def _cross_entropy(self, func, args, kwargs):
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        bound = {
            "weight": None,
            "size_average": None,
            "ignore_index": -100,
            "reduce": None,
            "reduction": "mean",
            "label_smoothing": 0.0,
            **bind_arguments(names, args, kwargs),
        }
        input, target = bound["input"], bound["target"]
        dtype = autocast_dtype()
        if (
            dtype is None
            or not isinstance(input, torch.Tensor)
            or input.dtype not in (torch.float16, torch.bfloat16)
            or not isinstance(target, torch.Tensor)
            or target.is_floating_point()
            or bound["size_average"] is not None
            or bound["reduce"] is not None
        ):
            return NotImplemented
        self.kernels.used.add("cross_entropy:autocast")
        weight, smoothing = bound["weight"], float(bound["label_smoothing"])
        reduction, ignore_index = bound["reduction"], bound["ignore_index"]
        with no_autocast():
            class_dim = 1 if input.dim() > 1 else 0
            log_probs = torch.log_softmax(input, class_dim, dtype=input.dtype)
            nll = F.nll_loss(
                log_probs.float(),
                target,
                None if weight is None else weight.float(),
                ignore_index=ignore_index,
                reduction=reduction,
            )
            if not smoothing:
                return nll
            return label_smoothing_term(log_probs, nll, target, weight, class_dim, reduction, ignore_index, smoothing)
