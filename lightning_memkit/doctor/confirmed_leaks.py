"""A leak reported only once it is confirmed: still there after a full collection, and not freed at the epoch's end.

MemoryTracker's leak watch: :class:`~lightning_memkit.doctor.leaks.LeakWatcher`'s rising floor, then these checks.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from lightning_memkit.doctor.leaks import LeakReport, LeakWatcher
from lightning_memkit.records import StepReading
from lightning_memkit.units import format_bytes

__all__ = ["LeakConfirmer", "leak_warning"]

#: the live bytes now, measured as a reading was (CUDA's allocated bytes, or the CPU accountant), or None
LiveBytesNow = Callable[[StepReading], "int | None"]


def _still_grown(found: LeakReport, now: int) -> bool:
    """Whether at least half of the growth ``found`` saw is still there ``now`` (not garbage the collector freed)."""
    base = min(b for _, b in found.live_bytes_at_start) if found.live_bytes_at_start else now
    return now - base >= found.bytes_per_step * (found.last_step - found.first_step) // 2


def gradient_bytes(module: Any) -> int:
    """Bytes of the distinct storages of ``module``'s parameters' ``.grad`` (0 for none)."""
    seen, total = set(), 0
    for parameter in module.parameters() if module is not None else ():
        grad = parameter.grad
        if grad is None or grad.layout is not torch.strided:
            continue
        storage = grad.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += int(storage.nbytes())
    return total


class LeakConfirmer:
    """Watches the live bytes at the end of measured training steps and confirms a rising floor before it is a leak.

    The live bytes are every live tensor of the process (CUDA's allocated bytes, or the CPU reading). Their floor
    (the least bytes from a step on) must rise ``window`` times and still be rising, judged when an epoch ends and
    when training ends, so growth every few steps is a leak (the rule is the doctor's:
    :func:`~lightning_memkit.doctor.leaks.rising_floor`). Tensors in reference cycles stay alive until the
    collector reaches them, which can look like growth for a few steps: a leak found during the run must survive
    one full collection. At the run's end, after the epoch-end
    hooks, what those hooks and the end of training freed must not undo the growth, so memory held for an epoch
    (a list of the epoch's losses) is never called a leak.

    Args:
        window: rises of the floor that make a leak (>= 2).
        warmup_steps: measured steps left out first (gradients and optimizer state appear there).
    """

    def __init__(self, window: int, warmup_steps: int = 2) -> None:
        self.watcher = LeakWatcher(window=window, warmup_steps=warmup_steps)
        self._last_reading: StepReading | None = None
        self._epoch_end_bytes: int | None = None
        self._gradient_bytes_at_epoch_end = 0

    def reset(self) -> None:
        """A new run."""
        self.watcher.reset()
        self._last_reading = self._epoch_end_bytes = None

    def observe(
        self, reading: StepReading, epoch: int, live_bytes_now: LiveBytesNow, distributed: bool
    ) -> LeakReport | None:
        """Take a measured training step's reading; returns a leak once found and confirmed, else None.

        ``distributed``: the readings are the maximum over ranks, and this rank's bytes now are not comparable.
        """
        live = reading.allocated_bytes if reading.allocated_bytes is not None else reading.tensor_bytes
        if live is None:
            return None
        self._last_reading = reading
        found = self.watcher.observe(reading.step, live, epoch=epoch)
        if found is None:
            return None
        gc.collect()  # rare: only when the floor rose
        now = live_bytes_now(reading)
        if not distributed and now is not None and not _still_grown(found, now):
            self.watcher.reset()  # it was garbage; keep watching
            self.watcher.warmup_steps = 0
            return None
        return found

    def note_epoch_end(self, live_bytes_now: LiveBytesNow, module: Any) -> None:
        """The live bytes when an epoch's steps are done, before the module's epoch-end hooks run."""
        if self._last_reading is not None:
            self._epoch_end_bytes = live_bytes_now(self._last_reading)
            self._gradient_bytes_at_epoch_end = gradient_bytes(module)

    def forget_run_end(self) -> None:
        """The run ended and is not judged (no watch, a leak already reported, nothing measured)."""
        self._last_reading = self._epoch_end_bytes = None

    def finish(self, live_bytes_now: LiveBytesNow, module: Any, distributed: bool) -> LeakReport | None:
        """The run ended, after the last epoch's end: judge every measured step (after one full collection)."""
        reading, ended = self._last_reading, self._epoch_end_bytes
        self.forget_run_end()
        if reading is None:
            return None
        gc.collect()
        now = live_bytes_now(reading)
        freed = None
        if now is not None and ended is not None:
            # both this rank's own measures (comparable under DDP too); gradients Lightning dropped
            # after the last step are not memory the run let go of
            freed = ended - now - max(0, self._gradient_bytes_at_epoch_end - gradient_bytes(module))
        return self.watcher.finish(None if distributed else now, step=reading.step, freed_at_end=freed)


def leak_warning(found: LeakReport, every_n_steps: int) -> str:
    """What MemoryTracker warns of a confirmed leak."""
    every = "" if every_n_steps == 1 else f" (a measured step is every {every_n_steps} steps)"
    return (
        f"memkit MemoryTracker: memory leak? the floor of live tensor memory at the end of the measured steps "
        f"grows by {format_bytes(found.bytes_per_step)} ({found.bytes_per_step} bytes) per measured step, steps "
        f"{found.first_step}..{found.last_step}{every}, and was not freed at the epoch's end: a leak that ends in "
        "an out-of-memory error. MemoryDoctor() or `memkit doctor` names the code that keeps it, and who holds it."
    )
