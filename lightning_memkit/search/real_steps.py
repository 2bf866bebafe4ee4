"""A trial in fp16 (``16-mixed``) runs until its optimizer has really stepped.

Lightning's ``16-mixed`` scales the loss with a ``torch.amp.GradScaler``, whose first steps often find inf in the
scaled gradients (the initial scale, 2**16, is meant to be too large): it then skips ``optimizer.step`` and halves the
scale. A trial of a few steps can so end before Adam's state (two tensors per parameter) was ever allocated, and its
skipped steps, which run no optimizer, time faster than real ones. :class:`RealSteps` tells a skipped step from a real
one (the scale went down in its ``update``: a skip backs the scale off, a real step leaves it or grows it) and stops the
fit once the steps asked for have really stepped; the fit's ``max_steps`` leaves room for
:data:`MAX_SKIPPED_STEPS` skipped ones. :func:`real_step_seconds` keeps the timings of the real steps only.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

__all__ = ["MAX_SKIPPED_STEPS", "RealSteps", "real_step_seconds"]

#: the most optimizer steps a trial runs beyond those asked for, for those the GradScaler skipped: halving from its
#: initial 2**16, the scale reaches 1 in 16 skips
MAX_SKIPPED_STEPS = 24


class RealSteps(Callback):
    """Record, for every optimizer step of a fit, whether the precision plugin's GradScaler skipped it, and stop the
    fit once ``wanted`` steps were real (a fit without a GradScaler, or with a disabled one, skips none).

    Attributes:
        skipped: one flag per optimizer step, in order: ``True`` when the scaler skipped ``optimizer.step``.
    """

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.skipped: list[bool] = []
        self._scale: float | None = None  # the scale at the last step's end (or at the fit's start)
        self._stepped = False  # an optimizer step ran in this batch

    @property
    def real(self) -> int:
        """The optimizer steps that were not skipped."""
        return self.skipped.count(False)

    @staticmethod
    def _read(trainer: Any) -> float | None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return float(scaler.get_scale())  # one read of the device's scale per optimizer step (fp16 trials only)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._scale = self._read(trainer)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._stepped:  # a micro-batch that accumulated: no optimizer step yet
            return
        self._stepped = False
        scale = self._read(trainer)
        self.skipped.append(scale is not None and self._scale is not None and scale < self._scale)
        self._scale = scale
        if self.real >= self.wanted:
            trainer.should_stop = True  # at an optimizer step's end: the loop stops before the next batch


def real_step_seconds(step_seconds: list[float], skipped: list[bool], warmup: int) -> list[float]:
    """The timings of the real optimizer steps after the first ``warmup`` real ones: ``step_seconds[i]`` is step
    ``i``'s, ``skipped[i]`` whether the GradScaler skipped it (no flags: none was skipped)."""
    if not skipped:
        return list(step_seconds[warmup:])
    real = [seconds for seconds, skip in zip(step_seconds, skipped, strict=True) if not skip]
    return real[warmup:]
