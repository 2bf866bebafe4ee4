"""Which measured training steps read the accountant's exact per-step peak, which costs a call per aten op.

The first steps of a fit, one logged step in n, and every step whose batch is the largest of the fit so far.
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.data.worst_batch import batch_nbytes

__all__ = ["ALWAYS_PEAKED_STEPS", "PeakSchedule"]

#: how many measured training steps at the start of a run always get the accountant's exact peak
ALWAYS_PEAKED_STEPS = 2


class PeakSchedule:
    """MemoryTracker's ``tensor_peak_every_n_steps`` rule, step by step.

    The peak is read on the run's first two measured training steps (no optimizer state yet, then all of it) and,
    with ``every_n_steps=1``, on the first two steps Lightning logs, then on at most one step in
    ``tensor_peak_every_n_steps``, only on steps whose readings the loggers will get: with ``every_n_steps=1``,
    steps Lightning writes (``log_every_n_steps``); else every n-th measured step. Besides these, a measured step
    whose batch is larger, in bytes of its tensors, than every batch of the measured steps before it in this fit
    gets the peak too, logged by Lightning or not, so the run peak is the longest padded batch's step (batches that
    change shape); with gradient accumulation a larger later micro-batch switches the accountant on for the rest of
    its optimizer step. A step whose peak is higher for another reason than its batch's bytes can still be missed.

    Args:
        every_n_steps: the tracker measures every n-th step.
        tensor_peak_every_n_steps: of the steps the loggers get, at most one in this many reads the peak.
    """

    def __init__(self, every_n_steps: int, tensor_peak_every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self.tensor_peak_every_n_steps = tensor_peak_every_n_steps
        self.reset()

    def reset(self) -> None:
        """A new fit: its first steps get the peak again, and "larger than every batch before" starts over."""
        self.last_peak_step: int | None = None
        self.peak_steps_taken = 0
        self.logged_peak_steps = 0  # peaked steps whose readings the loggers got (every_n_steps=1)
        # the largest batch (bytes of its tensors) of the measured steps so far in this fit: a larger one gets the peak
        self.largest_batch_bytes: int | None = None
        # whether the open training window reads the accountant's peak, and whether it was switched on at a
        # later micro-batch of the window (then the caller, not the meter, activates it at each micro-batch)
        self.window_peaked = False
        self.peaked_from_micro_batch = False

    def _peak_this_step(self, step: int, loggers: bool, log_every_n_steps: int) -> bool:
        n = self.tensor_peak_every_n_steps
        if self.peak_steps_taken < ALWAYS_PEAKED_STEPS:
            # A run's first measured steps always get the peak, logged or not: step 0 (no optimizer
            # state yet) and the first step with all of it, so the run peak covers training even when
            # Lightning logs no step of a short run (log_every_n_steps defaults to 50).
            return True
        if self.every_n_steps == 1 and loggers:
            # only steps Lightning writes, at most one in n
            every = log_every_n_steps
            if not every or (step + 1) % every:
                return False
            # the first two logged steps always get it, so the step-peak line has two points even in a
            # short or sparsely logged run (12 steps, log_every_n_steps=5: steps 4 and 9)
            return (
                self.logged_peak_steps < ALWAYS_PEAKED_STEPS
                or self.last_peak_step is None
                or step - self.last_peak_step >= n
                or step < self.last_peak_step
            )
        return step % (self.every_n_steps * n) == 0

    def peak_step(self, step: int, loggers: bool, log_every_n_steps: int) -> bool:
        """Whether the measured step ``step`` reads the peak by the schedule (``loggers``: the run has loggers,
        which write every ``log_every_n_steps``-th step); a step that does counts toward the schedule."""
        if not self._peak_this_step(step, loggers, log_every_n_steps):
            return False
        # the every-n schedule counts only its own steps: a step peaked for its batch does not move it
        self.last_peak_step = step
        self.peak_steps_taken += 1
        every = log_every_n_steps if loggers else 0
        self.logged_peak_steps += bool(every) and (step + 1) % every == 0
        return True

    def largest_batch_yet(self, batch: Any) -> bool:
        """Whether ``batch`` (a measured step's batch or micro-batch) is larger, in bytes of its tensors, than every
        one measured before in this fit; it becomes the one to beat."""
        size = batch_nbytes(batch)
        if self.largest_batch_bytes is not None and size <= self.largest_batch_bytes:
            return False
        self.largest_batch_bytes = size
        return True

    def open_window(self, step: int, loggers: bool, log_every_n_steps: int, batch: Any, sized: bool) -> bool:
        """A measured training step's window opens: whether it reads the peak, by the schedule or because its batch
        is the largest yet (``sized``: the accountant measures, so batch sizes matter; CUDA's peak is read every
        step anyway)."""
        peak = self.peak_step(step, loggers, log_every_n_steps)
        # a batch larger than any before is where the run peak most likely is: its step pays the accountant
        # too, logged by Lightning or not (the run summary reads every measured step)
        larger = sized and self.largest_batch_yet(batch)
        self.window_peaked = peak or larger
        self.peaked_from_micro_batch = False
        return self.window_peaked

    def later_micro_batch(self, batch: Any, sized: bool) -> bool:
        """Gradient accumulation: whether a later micro-batch of a window that reads no peak is the largest batch
        yet, so the accountant is switched on from here to the window's close (the step's peak is then exact from
        this micro-batch on, the earlier micro-batches' part of it not counted op by op)."""
        if not (sized and self.largest_batch_yet(batch)) or self.window_peaked:
            return False
        self.window_peaked = self.peaked_from_micro_batch = True
        return True

    def close_window(self) -> None:
        """The training window closed (its optimizer step ran)."""
        self.window_peaked = self.peaked_from_micro_batch = False
