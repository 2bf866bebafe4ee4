"""The torch internals memkit reads about ``torch.compile``, wrapped in one place.

Pinned by tests/compiled/test_compile.py (``test_compile_compat_pins_the_torch_internals``): if a torch release moves
one, that test says which.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "MARK_PREFIX",
    "OPTIMIZED_MODULE",
    "allocator_events",
    "mark",
    "track_cpu_allocation_sizes",
    "compiled_call_impl",
    "compiled_function",
    "dynamo_counters",
    "force_eager",
    "is_compiling",
    "profiler_active",
    "reset_compiled",
]


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule  # deferred: private torch API, may be missing
    except ImportError:  # a torch without dynamo
        return None
    return OptimizedModule


#: ``torch.compile(module)``'s wrapper class (``torch._dynamo.eval_frame.OptimizedModule``), or None.
OPTIMIZED_MODULE = _optimized_module_type()


def compiled_call_impl(module: torch.nn.Module) -> Any:
    """What ``module.compile()`` (in-place) installed: ``module._compiled_call_impl`` (None when not compiled)."""
    return module.__dict__.get("_compiled_call_impl")


def compiled_function(function: Any) -> bool:
    """Whether ``function`` is the output of ``torch.compile(function)`` (dynamo keeps the original on
    ``_torchdynamo_orig_callable``; Lightning's ``from_compiled`` puts such functions on a LightningModule)."""
    return getattr(function, "_torchdynamo_orig_callable", None) is not None


def is_compiling() -> bool:
    """Whether dynamo is tracing the calling frame (``torch.compiler.is_compiling``)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if check is not None else False


@contextlib.contextmanager
def force_eager() -> Iterator[None]:
    """Run compiled code eagerly in this block, without touching dynamo's caches
    (``torch.compiler.set_stance("force_eager")``).

    Why: the first call of a compiled frame while a non-infra TorchDispatchMode (memkit's accountant) is
    active makes dynamo skip that code *for the rest of the process*; under ``force_eager`` dynamo does not
    look at the frame at all, so it compiles at its next call outside the block.
    """
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield


def reset_compiled() -> None:
    """Clear every compiled code cache and CUDA-graph tree, as in a fresh process (``torch.compiler.reset``, which
    is ``torch._dynamo.reset``): the planner's trials each compile at their own micro-batch, as the real fit will,
    instead of recompiling the last trial's code for a new shape (dynamic shapes, then the recompile limit), and the
    CUDA-graph pools of ``mode="reduce-overhead"`` (which ``empty_cache`` does not free) go with the trees."""
    torch.compiler.reset()


def dynamo_counters() -> dict[str, dict[str, int]]:
    """A copy of dynamo's counters (``torch._dynamo.utils.counters``): ``{"stats": {"unique_graphs": n, ...}, ...}``."""
    try:
        from torch._dynamo.utils import counters  # deferred: private torch API, may be missing
    except ImportError:  # a torch without dynamo counts nothing
        return {}
    return {group: dict(values) for group, values in counters.items()}


def profiler_active() -> bool:
    """Whether a torch profiler (the user's, Lightning's ``profiler="pytorch"``) is recording on this process."""
    check = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(check()) if check is not None else False


#: the name prefix of memkit's marks in a profile (see :func:`mark`)
MARK_PREFIX = "memkit::mark::"


def allocator_events(
    profile: Any, device_type: str = "cpu", marks: bool = False
) -> list[tuple[int, int] | tuple[int, int, str]]:
    """The allocator's events a finished ``torch.profiler.profile(profile_memory=True)`` recorded on
    ``device_type``: ``(time ns, signed bytes)`` in time order (an allocation positive, a free negative).
    ``marks=True``: memkit's marks (:func:`mark`) too, as ``(time ns, 0, name)``, in the same order.

    Reads the kineto results' ``[memory]`` events (``profile.profiler.kineto_results.events()``).
    """
    wanted = getattr(torch._C._autograd.DeviceType, device_type.upper())
    events: list[Any] = []
    for event in profile.profiler.kineto_results.events():
        name = event.name()
        if name == "[memory]":
            if event.device_type() == wanted:
                events.append((event.start_ns(), event.nbytes()))
        elif marks and name.startswith(MARK_PREFIX):
            events.append((event.start_ns(), 0, name))
    events.sort(key=lambda item: item[0])  # stable: same-time events keep their order
    return events


def mark(name: str) -> None:
    """Put a mark named ``MARK_PREFIX + name`` into the recording profile, on the same clock as the allocator's
    events (an empty ``record_function``): where a moment of the step falls among them, read after the profile
    stops, for the profiler must not be stopped inside backward."""
    with torch.autograd.profiler.record_function(MARK_PREFIX + name):
        pass


_SIZES_TRACKED: bool | None = None


def track_cpu_allocation_sizes() -> bool:
    """Make the CPU allocator remember every block's size from now on, so a free recorded by the profiler is
    reported even for a block allocated while no profiler recorded (else it is dropped, with the warning
    "Memory block of unknown size was allocated before the profiling started"). Sets c10's
    ``FLAGS_caffe2_report_cpu_memory_usage`` in ``libc10`` (what ``ProfiledCPUMemoryReporter`` reads; a hash-table
    entry per CPU allocation). Returns whether it is set; False where the library or the flag is not found."""
    global _SIZES_TRACKED
    if _SIZES_TRACKED is not None:
        return _SIZES_TRACKED
    _SIZES_TRACKED = False
    try:
        lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
        candidates = sorted(glob.glob(os.path.join(lib_dir, "libc10.*"))) + sorted(
            glob.glob(os.path.join(lib_dir, "c10.dll"))
        )
        for path in candidates:
            try:
                flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
            except (OSError, ValueError):
                continue
            flag.value = True
            _SIZES_TRACKED = True
            break
    except Exception:  # noqa: BLE001 - a platform without ctypes access: frees of older blocks go unreported
        _SIZES_TRACKED = False
    return _SIZES_TRACKED
