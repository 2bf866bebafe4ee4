"""What a CUDA trial of the planner needs besides the Trainer.

- **The budget's arithmetic.** A CUDA budget is in the device's bytes: what the caching allocator may reserve plus the
  CUDA context (:data:`~lightning_memkit.estimate.cuda.caching_allocator.CUDA_CONTEXT_BYTES`), as the estimate's
  ``required_bytes`` counts them and as a card of that size holds them. The default budget is this process's share
  of the device: what is free plus what its allocator holds (the model under plan included: the real fit trains it
  there), plus its context, which ``free`` already leaves out (:func:`device_budget_bytes`). A trial's figure is its
  peak reserved bytes plus the context, once (:func:`over_budget`).
- **The model once.** The module under plan may sit on the device already (AutoFit plans at fit start, after the
  strategy moved it there). Its trial trains a deep copy; left there, the original and the copy would both be in the
  trial's memory, where the real fit holds one model. :func:`off_device` moves it to host memory while the copy trains
  and back after (even on error).
- **The budget enforced.** While a trial runs, :func:`capped_allocator` caps the caching allocator at the budget less
  the context (``torch.cuda.set_per_process_memory_fraction``, never above a cap already set, restored after, even on
  error): the allocator frees its cache and retries, then runs out of memory, where a card of the budget's size
  would, and a trial on a larger card does not take memory its neighbours use. A budget that caps nothing (the
  device, or a cap already set, is smaller) leaves the allocator untouched; where no cap was set before, none is
  after (:data:`NO_CAP`), so a configured ``garbage_collection_threshold``, which acts only under a cap, stays off.
- **The plan's device.** :func:`cuda_device` is the device a plan's budget, trials and peaks are on, and
  :func:`release` frees what a run left there (the caching allocator's blocks, and the caching host allocator's pinned
  ones an offload trial leaves).
- **Offload's host memory.** An offload trial pins every saved activation in host memory: :func:`host_refusal` says
  why one whose predicted pinned bytes do not fit the host must not run.

The arithmetic is pure (tests/plan/test_plan.py); what touches a device is checked in tests/gpu/test_cuda.py.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections.abc import Iterator

import torch

from lightning_memkit.estimate.cuda.caching_allocator import CUDA_CONTEXT_BYTES
from lightning_memkit.oom import is_out_of_memory
from lightning_memkit.plan._torch_compat import empty_host_cache
from lightning_memkit.units import format_bytes

__all__ = [
    "HOST_PIN_SHARE",
    "NO_CAP",
    "allocator_bytes",
    "capped_allocator",
    "cuda_device",
    "device_budget_bytes",
    "host_refusal",
    "release",
    "memory_fraction",
    "off_device",
    "over_budget",
]

#: the share of the host memory available now that an offload trial's predicted pinned bytes may take: torch's
#: caching host allocator rounds each pinned block up to a power of two (up to twice the bytes asked), and pinned
#: pages cannot be swapped out, so a host short of them fails hard (the kernel's OOM killer), not with an error
HOST_PIN_SHARE = 0.5

#: the fraction ``torch.cuda.get_per_process_memory_fraction`` reads where no cap is set, and the one
#: ``set_per_process_memory_fraction`` takes to remove a cap: the caching allocator keeps no maximum for a fraction of
#: 1 (its ``setMemoryFraction`` leaves ``allowed_memory_maximum`` unset unless the fraction is below 1)
NO_CAP = 1.0


# ------------------------------------------------------------------------------------------ arithmetic (pure)
def device_budget_bytes(
    free: int, reserved: int, total: int, fraction: float | None = None, context: int = CUDA_CONTEXT_BYTES
) -> int:
    """The default budget of a CUDA plan, in the device's bytes: what this process's caching allocator can reach
    (``free`` device memory plus the ``reserved`` bytes it holds, the model under plan among them; at most
    ``fraction * total`` when a per-process fraction is set) plus its CUDA ``context``, which ``free`` already leaves
    out: the units of the estimate's ``required_bytes`` and of a card's size."""
    reachable = int(free) + int(reserved)
    if fraction is not None:
        reachable = min(reachable, int(fraction * total))
    return reachable + int(context)


def allocator_bytes(budget: int, context: int = CUDA_CONTEXT_BYTES) -> int:
    """What the caching allocator may reserve within a budget of ``budget`` device bytes: the rest is the context."""
    return max(int(budget) - int(context), 0)


def memory_fraction(budget: int, total: int, previous: float = NO_CAP, context: int = CUDA_CONTEXT_BYTES) -> float:
    """The ``set_per_process_memory_fraction`` share of a device of ``total`` bytes that caps a trial at
    ``budget`` device bytes: the allocator's part of the budget, never above a cap already set (``previous``)."""
    return max(0.0, min(1.0, float(previous), allocator_bytes(budget, context) / total))


def over_budget(peak_reserved: int, budget: int, context: int = CUDA_CONTEXT_BYTES) -> str | None:
    """Why a trial whose allocator reserved ``peak_reserved`` bytes at most does not fit ``budget`` device bytes (the
    reserved bytes plus the context, once), or ``None`` when it fits."""
    if peak_reserved + context <= budget:
        return None
    return (
        f"over the budget: {format_bytes(peak_reserved)} reserved + {format_bytes(context)} CUDA context > "
        f"{format_bytes(budget)}"
    )


def host_refusal(host_bytes: int, available: int, share: float = HOST_PIN_SHARE) -> str | None:
    """Why an offload trial that pins about ``host_bytes`` of host memory (``MemoryEstimate.host_bytes``) must not run
    on a host with ``available`` bytes free (more than ``share`` of them), or ``None`` when it may."""
    if host_bytes <= share * available:
        return None
    return (
        f"not run: offload pins about {format_bytes(host_bytes)} of host memory (the caching host allocator "
        f"rounds each block up to a power of two: up to twice that), more than {share:.0%} of the "
        f"{format_bytes(available)} the host has available; free host memory or leave offload out"
    )


# ------------------------------------------------------------------------------------------ on a device
@contextlib.contextmanager
def capped_allocator(device: torch.device, budget: int, context: int = CUDA_CONTEXT_BYTES) -> Iterator[int]:
    """Within the block the caching allocator of ``device`` reserves at most the budget less the context
    (:func:`memory_fraction`; a lower cap already set stays); the cap before is set back after, even on error, and
    where none was set, none is left (:data:`NO_CAP`). A budget that caps nothing leaves the allocator untouched.
    Yields the cap, bytes."""
    total = torch.cuda.get_device_properties(device).total_memory
    read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = min(float(read(device)), NO_CAP) if read is not None else NO_CAP
    fraction = memory_fraction(budget, total, previous, context)
    if fraction >= previous:  # the device, or the cap already set, is the smaller: nothing to cap, nothing to restore
        yield int(previous * total)
        return
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield int(fraction * total)
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers())


@contextlib.contextmanager
def off_device(module: torch.nn.Module, device: torch.device) -> Iterator[bool]:
    """Within the block ``module``'s parameters and buffers are in host memory when they were all on ``device``
    (yields whether it moved them); after it, back on ``device``, the same ``Parameter`` objects (``Module.to``
    swaps their data: an optimizer built on them still holds them), even on error. When moving back runs out of
    memory because the error that ended the block still holds the trial's copy (its traceback's frames), those
    frames' locals are cleared, the cache emptied, and the move tried again."""
    tensors = _tensors(module)
    if not tensors or any(tensor.device != device for tensor in tensors):
        yield False
        return
    module.to("cpu")
    try:
        yield True
    except BaseException as error:  # whatever ended the trial (an interrupt too): the module goes back first
        _move_back(module, device, error)
        raise
    _move_back(module, device, None)


def _move_back(module: torch.nn.Module, device: torch.device, error: BaseException | None) -> None:
    try:
        module.to(device)
    except BaseException as failed:  # noqa: BLE001 - only running out of memory is retried
        if error is None or not is_out_of_memory(failed):
            raise
        del failed
        traceback.clear_frames(error.__traceback__)  # what still holds the trial's copy on the device
        gc.collect()
        torch.cuda.empty_cache()
        module.to(device)


def cuda_device() -> torch.device:
    """The CUDA device a plan's budget, trials and peaks are on: the current one, which
    :func:`~lightning_memkit.plan.planner.plan_fit` sets to the plan's own for the plan."""
    return torch.device("cuda", torch.cuda.current_device())


def release(cuda: bool) -> None:
    """Free what the last run left: the garbage, and on CUDA the device's cached blocks and the caching host
    allocator's pinned ones (an offload trial's: kept for the rest of the process otherwise)."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        empty_host_cache()
