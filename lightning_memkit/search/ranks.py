"""The search under DDP: each trial's outcome agreed over ranks, and trials that never wait for another rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.rank_reduction import release_group, side_group

__all__ = ["Outcomes", "step_communicates", "rank_local"]


class Outcomes:
    """Each trial's outcome agreed over ranks on a side gloo group with a timeout (lockstep, no deadlock).

    The group is memkit's own, never the one training communicates on, so its calls cannot interleave
    with the strategy's collectives; its timeout turns a rank that never arrives into an error.
    """

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.dist = dist
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group: dist.ProcessGroup | None = None
        #: the ranks whose trial failed, at the last :meth:`agree`
        self.failed_ranks: list[int] = []
        #: the slowest rank's ``seconds`` at the last :meth:`agree`
        self.slowest_seconds = 0.0
        if self.enabled:
            self.group = side_group(timeout_s)

    def close(self) -> None:
        """Destroy the side group (after the search): a job of many searches must not accumulate groups."""
        group, self.group = self.group, None
        release_group(group)

    def agree(self, fits: bool, peak: int | None, extra: int = 0, seconds: float = 0.0) -> tuple[bool, int | None, int]:
        """(all ranks fit, max peak over ranks, min of ``extra`` over ranks); :attr:`failed_ranks` names
        the ranks that did not fit, :attr:`slowest_seconds` is the largest ``seconds`` (a trial's time: the
        search's time limit must decide the same on every rank)."""
        if not self.enabled:
            self.failed_ranks = [] if fits else [0]
            self.slowest_seconds = seconds
            return fits, peak, extra
        vector = torch.tensor(
            [0 if fits else 1, -1 if peak is None else int(peak), int(extra), int(seconds * 1e6)], dtype=torch.int64
        )
        rows = self._gather(vector)
        self.failed_ranks = [rank for rank, failed in enumerate(rows[:, 0].tolist()) if failed]
        peak_max = int(rows[:, 1].max())
        self.slowest_seconds = int(rows[:, 3].max()) / 1e6
        return not self.failed_ranks, (None if peak_max < 0 else peak_max), int(rows[:, 2].min())

    def min(self, value: int) -> int:
        return self.agree(True, None, value)[2]

    def largest(self, seconds: float) -> float:
        """The largest of every rank's ``seconds`` (microsecond resolution): one figure every rank decides by."""
        self.agree(True, None, seconds=seconds)
        return self.slowest_seconds

    def prediction(self, growth: Any, predicted: int | None) -> tuple[Any, int | None]:
        """One prediction for every rank (each estimated its own batch, and an estimate may fail on one rank
        only): none if any rank has none, else the smallest predicted size with the growth it came with."""
        if not self.enabled:
            return growth, predicted
        vector = torch.tensor(
            [
                -1.0 if predicted is None or growth is None else float(predicted),
                0.0 if growth is None else float(growth.fixed_bytes),
                0.0 if growth is None else float(growth.per_sample_bytes),
            ],
            dtype=torch.float64,
        )
        rows = self._gather(vector)
        if bool((rows[:, 0] < 0).any()):
            return None, None
        chosen = int(rows[:, 0].argmin())
        if growth is not None:
            growth = type(growth)(float(rows[chosen, 1]), float(rows[chosen, 2]))
        return growth, int(rows[chosen, 0])

    def _gather(self, vector: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(vector) for _ in range(self.dist.get_world_size())]
        self.dist.all_gather(gathered, vector, group=self.group)
        return torch.stack(gathered)


def step_communicates(trainer: Any, module: Any) -> bool:
    """Whether a training step itself waits for the other ranks, beyond what a trial can switch off.

    DDP's gradient all-reduce and buffer broadcast can be switched off for a trial (each rank then steps
    alone); FSDP's and FSDP2's all-gathers and reduce-scatters, DeepSpeed's and SyncBatchNorm's cannot:
    a rank that stops mid-step leaves the others waiting in the step's next collective.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if not isinstance(getattr(trainer.strategy, "model", None), DistributedDataParallel):
        return True
    return any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())


def _no_barrier(*args: Any, **kwargs: Any) -> None:
    return None


def _first_argument(value: Any, *args: Any, **kwargs: Any) -> Any:
    return value


@contextlib.contextmanager
def rank_local(trainer: Any) -> Iterator[None]:
    """Inside a trial no rank waits for another: gradient sync, buffer broadcast and Lightning's
    barriers/reductions are turned off, so a rank that alone runs out of memory cannot deadlock."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    strategy = trainer.strategy
    wrapped: Any = getattr(strategy, "model", None)  # DistributedDataParallel, or None
    saved_sync = getattr(wrapped, "require_backward_grad_sync", None)
    saved_broadcast = getattr(wrapped, "broadcast_buffers", None)
    stubs = {
        "barrier": _no_barrier,
        "reduce": _first_argument,
        "reduce_boolean_decision": _first_argument,
        "broadcast": _first_argument,
    }
    for name, stub in stubs.items():
        setattr(strategy, name, stub)
    if saved_sync is not None:
        wrapped.require_backward_grad_sync = False
    if saved_broadcast is not None:
        wrapped.broadcast_buffers = False
    try:
        with compat.no_per_step_sigterm_broadcast(trainer):
            yield
    finally:
        for name in stubs:
            delattr(strategy, name)  # the class's methods show through again
        if saved_sync is not None:
            wrapped.require_backward_grad_sync = saved_sync
        if saved_broadcast is not None:
            wrapped.broadcast_buffers = saved_broadcast
