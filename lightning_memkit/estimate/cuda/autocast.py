"""CUDA's autocast where it differs from the CPU autocast the fake step runs: the functions whose CUDA policy is another
(:func:`autocast_policies`), cross-entropy's label smoothing as CUDA autocast reduces it, and the casting helpers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F

from lightning_memkit._torch_compat import tree_flatten, tree_map
from lightning_memkit.estimate import _torch_compat

__all__ = [
    "AutocastPolicy",
    "autocast_policies",
    "autocast_dtype",
    "no_autocast",
    "cast_tensors",
    "any_tensor",
    "is_low_precision",
    "bind_arguments",
    "label_smoothing_term",
    "UPSAMPLE_MODES",
    "DTYPE_POSITION",
]

#: F.interpolate modes that reach an upsample op (on CUDA autocast's fp32 list)
UPSAMPLE_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear")

#: where a positional ``dtype`` argument sits (after input, dim; F's after _stacklevel), by function name
DTYPE_POSITION = {"softmax": 2, "log_softmax": 2}


class AutocastPolicy(Enum):
    """How CUDA's autocast runs an op that CPU autocast runs otherwise (torch's autocast_mode.cpp policies)."""

    FP32 = "fp32"  # fp16/bf16 arguments cast to fp32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # run with dtype=float32 on fp16/bf16 inputs
    LOWER_PRECISION = "lower_precision"  # fp32 arguments cast to the autocast dtype
    UNTOUCHED = "untouched"  # run as the arguments come (CPU autocast casts them to fp32)


def autocast_policies() -> list[tuple[Any, str, AutocastPolicy]]:
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
    both = (torch, T)
    fp32_functions = (
        "layer_norm",
        "group_norm",
        "rms_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "hinge_embedding_loss",
        "kl_div",
        "margin_ranking_loss",
        "triplet_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
    )
    fp32_both = (
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "sinh",
        "tan",
        "exp",
        "log",
        "log1p",
        "expm1",
        "log2",
        "log10",
        "rsqrt",
        "reciprocal",
        "pow",
        "norm",
        "renorm",
        "logsumexp",
    )
    table: dict[AutocastPolicy, list[tuple[object, str]]] = {
        AutocastPolicy.FP32: [
            (F, "layer_norm"),
            (F, "group_norm"),
            (F, "rms_norm"),
            (F, "softplus"),
            (F, "cosine_similarity"),
            (F, "interpolate"),
            (_torch_compat.nn_builtins(), "softplus"),
            (T, "__pow__"),
        ]
        + [(torch, name) for name in fp32_functions]
        + [(owner, name) for name in fp32_both for owner in both],
        AutocastPolicy.FP32_SET_OPT_DTYPE: [(F, "softmax"), (F, "log_softmax"), (torch.linalg, "vector_norm")]
        + [(owner, name) for name in ("softmax", "log_softmax", "sum", "cumsum", "prod", "cumprod") for owner in both],
        AutocastPolicy.LOWER_PRECISION: [(torch, "einsum"), (torch, "chain_matmul"), (torch.linalg, "multi_dot")]
        + [(owner, name) for name in ("mv", "addmv", "addr") for owner in both],
        AutocastPolicy.UNTOUCHED: [(F, "avg_pool3d"), (F, "max_pool3d"), (F, "adaptive_avg_pool3d"), (F, "pad")],
    }
    return [
        (owner, name, policy)
        for policy, entries in table.items()
        for owner, name in entries
        if getattr(owner, name, None) is not None
    ]


def is_low_precision(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float16, torch.bfloat16)


def any_tensor(args: Any, kwargs: Any, test) -> bool:
    return any(isinstance(leaf, torch.Tensor) and test(leaf) for leaf in tree_flatten((args, kwargs))[0])


def cast_tensors(args: Any, kwargs: Any, test, dtype: torch.dtype) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with every tensor passing ``test`` cast to ``dtype`` (as autocast's cached_cast)."""
    return tree_map(
        lambda leaf: leaf.to(dtype) if isinstance(leaf, torch.Tensor) and test(leaf) else leaf, (args, kwargs)
    )


def bind_arguments(names: tuple[str, ...], args: Any, kwargs: Any) -> dict[str, Any]:
    """A call's ``args`` and ``kwargs`` by parameter name (``names`` in order)."""
    # not strict: a call passes fewer positional arguments than the signature names (the rest by keyword or default)
    return {**dict(zip(names, args, strict=False)), **kwargs}


def label_smoothing_term(log_probs, nll, target, weight, class_dim, reduction, ignore_index, smoothing):
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


def autocast_dtype() -> torch.dtype | None:
    """The fake step's autocast dtype (it runs CPU autocast on CPU fakes), or None."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            yield
    else:
        yield
