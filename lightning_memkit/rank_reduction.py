"""Readings across ranks: a side gloo group so the reduction never touches the GPU stream.

Every rank sends a vector of the same length (missing values as -1), so ranks whose probes
differ (NVML off on one node, say) still agree on the collective's shape; the group has a
timeout, so a rank that stops reducing turns into an error, never a hang. Every side group memkit
makes (:func:`side_group`) is destroyed by its owner when it is done (:func:`release_group`), so a
job of many fits does not accumulate process groups (each holds sockets and a thread per peer).
"""

from __future__ import annotations

import contextlib
import datetime
import warnings

import torch
import torch.distributed as dist

from lightning_memkit.accounting.process import keep_out_of_readings
from lightning_memkit.records import StepReading

__all__ = ["ReadingReducer", "side_group", "release_group"]

_MISSING = -1


def side_group(timeout_s: float) -> dist.ProcessGroup:
    """A new gloo process group of every rank, with its own timeout (seconds): memkit's calls on it
    never interleave with the strategy's collectives (FSDP's all-gathers run on the default group),
    and a rank that never arrives is an error after ``timeout_s``, not a hang. Every rank must call
    it at the same point (``new_group`` is collective). Give it back with :func:`release_group`."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def release_group(group: dist.ProcessGroup | None) -> None:
    """Destroy a group :func:`side_group` made (a local call on each rank: no collective). Nothing
    happens for ``None``, or when torch.distributed was torn down already (the group went with it)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(ValueError, RuntimeError):  # destroyed already (the whole world, or twice)
        dist.destroy_process_group(group)


def _encode(reading: StepReading) -> torch.Tensor:
    return torch.tensor(
        [
            _MISSING if getattr(reading, name) is None else int(getattr(reading, name))
            for name in StepReading.value_fields()
        ],
        dtype=torch.int64,
    )


def _decode(vector: torch.Tensor, step: int, stage: str, rank: int) -> StepReading:
    values = {
        name: (None if int(v) == _MISSING else int(v))
        for name, v in zip(StepReading.value_fields(), vector.tolist(), strict=True)
    }
    return StepReading(step=step, stage=stage, rank=rank, **values)


class ReadingReducer:
    """Max (and optionally every rank's value) of a StepReading over the ranks.

    Build it on every rank at the same point (it creates its own gloo process group, so its
    calls never mix with the strategy's collectives) and :meth:`close` it when done. Outside
    torch.distributed it returns the reading unchanged.

    The tensors it hands to gloo are made once and reused: gloo's worker thread drops its reference to a
    collective's tensors at a moment that depends on scheduling (after the call returned), so a tensor made
    per call could still be alive when the next step's reading starts, and be counted on one rank and not
    another. They are memkit's, not the training's: whole-process readings leave them out.
    """

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.group: dist.ProcessGroup | None = None
        self.world_size = 1
        self.rank = 0
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not self.enabled:
            return
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # memkit's own group even when training's is gloo too: its calls never interleave with the strategy's
        # collectives (FSDP's all-gathers run on the default group), and its timeout is memkit's, not the
        # strategy's (Lightning's default: 30 minutes).
        self.group = side_group(timeout_s)
        size = len(StepReading.value_fields())
        self._vector = torch.empty(size, dtype=torch.int64)
        self._gathered = [torch.empty(size, dtype=torch.int64) for _ in range(self.world_size)]
        self._maximum = torch.empty(size, dtype=torch.int64)
        keep_out_of_readings(self._vector, self._maximum, *self._gathered)

    def close(self) -> None:
        """Destroy the side group (MemoryTracker does at teardown and after a failure); the reducer then
        returns readings unchanged. Safe to call twice."""
        group, self.group = self.group, None
        self.enabled = False
        release_group(group)

    def reduce(self, reading: StepReading, per_rank: bool = False) -> tuple[StepReading, list[StepReading]]:
        """Return (max over ranks with ``rank=-1``, every rank's reading if ``per_rank``)."""
        if not self.enabled:
            return reading, ([reading] if per_rank else [])
        self._vector.copy_(_encode(reading))
        try:
            if per_rank:
                dist.all_gather(self._gathered, self._vector, group=self.group)
                stacked = torch.stack(self._gathered)
                maximum = stacked.max(dim=0).values
                ranks = [_decode(row, reading.step, reading.stage, r) for r, row in enumerate(stacked)]
            else:
                maximum = self._maximum.copy_(self._vector)
                dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=self.group)
                ranks = []
        except Exception as error:  # noqa: BLE001 - a rank out of step: log locally, never hang or crash
            warnings.warn(
                f"memkit: cross-rank memory reduction failed ({error}); logging this rank's values only from now on.",
                RuntimeWarning,
                stacklevel=2,
            )
            self.enabled = False
            return reading, ([reading] if per_rank else [])
        return _decode(maximum, reading.step, reading.stage, -1), ranks
