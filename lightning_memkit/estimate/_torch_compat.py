"""The private torch internals the estimate uses, wrapped in one place.

Each function names the private API it reads and either takes the path this torch offers or raises an
error saying what is missing. Pinned by tests/test_torch_compat.py: if a torch release moves one, that
test says which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "fake_tensor_module",
    "carries_more_than_metadata",
    "wrap_fake",
    "register_fake_process_group",
    "fully_shard",
    "ddp_bucket_assignment",
    "ddp_first_bucket_bytes",
    "dtensor_local",
    "fsdp1_storage_checks_on_fakes",
    "safe_softmax",
    "flash_attention",
    "efficient_attention",
    "argument",
    "arguments",
    "FAKE_EXTRAS",
    "no_dispatch_modes",
    "is_op_overload",
    "has_composite_implicit_kernel",
    "nn_builtins",
    "nn_builtin",
    "in_backward",
    "compiled_original",
    "queued_cuda_seeds",
    "requeue_cuda_seeds",
]

#: What a ``FakeTensor`` may carry besides shape, strides, dtype, device and storage (attributes of
#: ``torch._subclasses.fake_tensor.FakeTensor``): a constant's value, the real tensor of a
#: ``propagate_real_tensors`` run, a subclass's Python type and dispatch keys (FakeTensorMode's wrapper-subclass
#: support). A torch whose ``FakeTensor`` lacks one cannot carry that thing, so a missing attribute reads as None.
FAKE_EXTRAS = ("constant", "real_tensor", "pytype", "dispatch_keys")


def fake_tensor_module() -> Any:
    """``torch._subclasses.fake_tensor`` (FakeTensor, FakeTensorMode, in_kernel_invocation_manager)."""
    try:
        from torch._subclasses import fake_tensor  # deferred: private torch API, a clear error where missing
    except ImportError as error:  # pragma: no cover - every supported torch has it
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no torch._subclasses.fake_tensor; "
            "memkit's estimate needs the torch range lightning_memkit declares"
        ) from error
    return fake_tensor


def carries_more_than_metadata(fake: Any) -> bool:
    """Whether the fake tensor ``fake`` carries anything in :data:`FAKE_EXTRAS` (then only FakeTensorMode
    itself may make its views)."""
    return any(getattr(fake, name, None) is not None for name in FAKE_EXTRAS)


def wrap_fake(fake_type: type, mode: Any, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` over the meta tensor ``meta`` on ``device``: ``FakeTensor(mode, elem, device)``,
    the constructor FakeTensorMode's own kernel invocation wraps its outputs with."""
    return fake_type(mode, meta, device)


def no_dispatch_modes() -> contextlib.AbstractContextManager[None]:
    """``torch.utils._python_dispatch._disable_current_modes()``: the block runs below every dispatch mode (no fake
    mode, no accountant), so what it makes is real (or meta) and values can be read from real tensors."""
    return _disable_current_modes()


def is_op_overload(func: Any) -> bool:
    """Whether ``func`` is an aten-style overload (``torch._ops.OpOverload``: ``aten.view.default``...)."""
    return isinstance(func, torch._ops.OpOverload)


def has_composite_implicit_kernel(func: Any) -> bool:
    """Whether the overload ``func`` is a ``CompositeImplicitAutograd`` op (a composite that decomposes, not an op
    with its own kernels), read from the dispatcher (``torch._C._dispatch_has_kernel_for_dispatch_key``)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def nn_builtins() -> Any:
    """``torch._C._nn``: the module of C++ functions ``torch.nn.functional`` calls (``linear``,
    ``scaled_dot_product_attention``, ``softplus``), which the CUDA target patches as it patches ``F``'s."""
    return torch._C._nn


def nn_builtin(name: str) -> Any:
    """``torch._C._nn.<name>``, or ``None`` when this torch has no such builtin."""
    return getattr(torch._C._nn, name, None)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward now: torch's private ``torch._C._current_graph_task_id()``
    is -1 outside one (a torch without it answers False)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() >= 0


def compiled_original(module: Any) -> Any:
    """The module a ``torch.compile``'d ``module`` wraps (``torch._dynamo.eval_frame.OptimizedModule._orig_mod``),
    or ``None`` when ``module`` is not one (or this torch has no dynamo, so compiles nothing)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule  # deferred: importing dynamo takes about a second
    except Exception:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return None
    if isinstance(module, OptimizedModule):
        return getattr(module, "_orig_mod", None)
    return None


def register_fake_process_group() -> None:
    """Register torch's ``"fake"`` process-group backend (``torch.testing._internal.distributed.fake_pg``:
    collectives that move no data), which FSDP2's estimate runs ``fully_shard`` over."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    except ImportError as error:
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no fake process group "
            "(torch.testing._internal.distributed.fake_pg): FSDP2's estimate needs it; "
            "estimate strategy='ddp' instead, or use a torch in lightning_memkit's declared range"
        ) from error


def fully_shard() -> Any:
    """FSDP2's ``fully_shard`` (``torch.distributed.fsdp.fully_shard``), which FSDP2's estimate runs on the meta
    copy."""
    try:
        from torch.distributed.fsdp import fully_shard as found  # deferred: missing where torch has no FSDP2
    except ImportError as error:
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no torch.distributed.fsdp.fully_shard: "
            "estimate strategy='model_parallel' needs it"
        ) from error
    return found


def ddp_bucket_assignment(parameters: Sequence[torch.Tensor], limits_bytes: list[int]) -> list[list[int]]:
    """DDP's bucket assignment of ``parameters`` (indices into it, bucket by bucket, in the order the reducer allocates
    them) under the size limits ``limits_bytes`` (the first bucket's, then the rest's): torch's own
    ``torch.distributed._compute_bucket_assignment_by_size``, which DDP's constructor and its reducer's rebuild call
    (one bucket per dtype and device, dense gradients)."""
    import torch.distributed as dist  # only where torch.distributed is available

    indices, _ = dist._compute_bucket_assignment_by_size(list(parameters), limits_bytes, [False] * len(parameters))
    return [list(bucket) for bucket in indices]


def ddp_first_bucket_bytes() -> int:
    """DDP's first bucket's size limit at the default ``bucket_cap_mb``
    (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB): the first gradients ready are sent sooner."""
    import torch.distributed as dist  # only where torch.distributed is available

    return int(dist._DEFAULT_FIRST_BUCKET_BYTES)


def dtensor_local(tensor: torch.Tensor) -> torch.Tensor | None:
    """The local tensor of a DTensor (``DTensor._local_tensor``, without ``to_local()``'s dispatched view), or ``None``
    for any other tensor."""
    return getattr(tensor, "_local_tensor", None) if type(tensor).__name__ == "DTensor" else None


@contextlib.contextmanager
def fsdp1_storage_checks_on_fakes() -> Iterator[None]:
    """Inside the block, FSDP1's two storage checks (``torch.distributed.fsdp._flat_param._data_ptr_allocated`` and
    ``_same_storage``) read the storage itself instead of its data pointer, which a fake tensor has not (0 on every
    one): "allocated" is a storage of more than 0 bytes, "the same storage" the same storage object. For a real tensor
    both answer what FSDP's own do. Restored when the block ends."""
    from torch.distributed.fsdp import _flat_param  # only where torch.distributed is available

    saved = (_flat_param._data_ptr_allocated, _flat_param._same_storage)

    def allocated(tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().nbytes() > 0

    def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
        local_a, local_b = dtensor_local(a), dtensor_local(b)
        a, b = (a if local_a is None else local_a), (b if local_b is None else local_b)
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata

    _flat_param._data_ptr_allocated, _flat_param._same_storage = allocated, same_storage
    try:
        yield
    finally:
        _flat_param._data_ptr_allocated, _flat_param._same_storage = saved


def safe_softmax(weights: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.ops.aten._safe_softmax``: the softmax CUDA's math attention runs (rows that are all -inf give 0)."""
    op = getattr(torch.ops.aten, "_safe_softmax", None)
    if op is None:
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no aten._safe_softmax, which the CUDA math "
            "attention of lightning_memkit's declared torch range runs"
        )
    return op(weights, dim)


def flash_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """The output of ``aten._scaled_dot_product_flash_attention`` (no debug mask), its arguments passed by
    their schema names."""
    outputs = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p=dropout_p, is_causal=is_causal, return_debug_mask=False, scale=scale
    )
    return outputs[0]


def efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """The output of ``aten._scaled_dot_product_efficient_attention``, its arguments passed by their schema names."""
    outputs = torch.ops.aten._scaled_dot_product_efficient_attention(
        query,
        key,
        value,
        attn_bias=attn_bias,
        compute_log_sumexp=compute_log_sumexp,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
    )
    return outputs[0]


_ARGUMENT_INDEX: dict[tuple[Any, str], int] = {}


def argument(op: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """The argument ``name`` of a call to the aten overload ``op`` (read where the op's schema puts it,
    positional or keyword), so no code depends on an argument's position."""
    index = _ARGUMENT_INDEX.get((op, name))
    if index is None:
        names = [a.name for a in op._schema.arguments]
        if name not in names:
            raise RuntimeError(f"{op} in this torch ({torch.__version__}) has no argument {name!r} (it has {names})")
        index = _ARGUMENT_INDEX[(op, name)] = names.index(name)
    return args[index] if index < len(args) else kwargs[name]


_ARGUMENT_DEFAULTS: dict[Any, tuple[tuple[str, Any], ...]] = {}
_NO_DEFAULT = object()


def arguments(op: Any, args: tuple, kwargs: dict | None) -> dict[str, Any]:
    """Every argument of a call to the aten overload ``op`` by its schema name (``op._schema.arguments``), those the
    call left out at their schema defaults; one left out without a default is absent from the dict."""
    names = _ARGUMENT_DEFAULTS.get(op)
    if names is None:
        names = _ARGUMENT_DEFAULTS[op] = tuple(
            (a.name, a.default_value if a.has_default_value() else _NO_DEFAULT) for a in op._schema.arguments
        )
    bound = {}
    for index, (name, default) in enumerate(names):
        if index < len(args):
            bound[name] = args[index]
        elif kwargs and name in kwargs:
            bound[name] = kwargs[name]
        elif default is not _NO_DEFAULT:
            bound[name] = default
    return bound


def queued_cuda_seeds() -> Any:
    """The seeds torch gives the CUDA generators when CUDA initialises: ``torch.manual_seed`` (and
    ``torch.cuda.manual_seed``/``manual_seed_all``) called before then queue them, the latest of each kind, on
    ``torch.cuda._lazy_seed_tracker``. ``(seed_all call, seed call, their order)``, for :func:`requeue_cuda_seeds`;
    ``None`` in a torch that keeps no such queue."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None:
        return None
    return tracker.manual_seed_all_cb, tracker.manual_seed_cb, list(tracker.call_order)


def requeue_cuda_seeds(queued: Any) -> None:
    """Put back the CUDA seeds :func:`queued_cuda_seeds` read. Where CUDA initialised in between (applying whatever
    was queued then), the generators are seeded as the calls read would have seeded them, or, where none was queued,
    given a fresh generator's state (torch's default seed)."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None or queued is None:
        return
    seed_all, seed, order = queued
    if not torch.cuda.is_initialized():
        tracker.manual_seed_all_cb, tracker.manual_seed_cb, tracker.call_order = seed_all, seed, list(order)
        return
    calls = [call for call, _stack in (entry for entry in order if entry)]
    for call in calls:
        call()
    if not calls:
        for index, generator in enumerate(torch.cuda.default_generators):
            generator.set_state(torch.Generator(device=f"cuda:{index}").get_state())
