"""Real Lightning runs of a candidate, timed: a quiet ``Trainer`` fit of a few optimizer steps on the same batch
(:func:`fit_steps`), a callback that times each step and stops a CPU timing once its steps add up to the seconds
asked (:class:`StepClock`), and a timing on a deep copy of the module (:func:`timed_step`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Callback, Trainer

from lightning_memkit._lightning_compat import attached_trainer, copy_module
from lightning_memkit.estimate.data.batches import converted_floats, preserved_rng, rebatch
from lightning_memkit.meter import training_state_tensors
from lightning_memkit.plan.cuda_trial import cuda_device, release
from lightning_memkit.plan.result import trainer_kwargs
from lightning_memkit.plan.space import Candidate
from lightning_memkit.quiet_lightning import quiet_lightning
from lightning_memkit.search.real_steps import MAX_SKIPPED_STEPS, RealSteps
from lightning_memkit.timing import StepTimer

__all__ = [
    "MAX_TIMED_STEPS",
    "TIMED_SECONDS",
    "TIMED_STEPS",
    "WARMUP_STEPS",
    "StepClock",
    "copy_of",
    "fit_steps",
    "timed_step",
    "timing_fit",
]

#: optimizer steps run before the timed ones in a real trial
WARMUP_STEPS = 1
#: optimizer steps timed in a real trial (their median), at least
TIMED_STEPS = 4
#: CPU: a trial's timing goes on past TIMED_STEPS until its timed steps add up to this many seconds (at most
#: MAX_TIMED_STEPS): a CPU's speed drifts by tens of percent over fractions of a second, and a few 15 ms steps
#: measured one phase of it, not the configuration
TIMED_SECONDS = 1.0
#: the most optimizer steps a trial times
MAX_TIMED_STEPS = 200


class _Batches:
    """The same batch ``count`` times: the trial's training data (no loader time in the timing)."""

    def __init__(self, batch: Any, count: int) -> None:
        self.batch, self.count = batch, count

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.count):
            yield self.batch

    def __len__(self) -> int:
        return self.count


class StepClock(Callback):
    """Times every optimizer step of a fit with a :class:`~lightning_memkit.timing.StepTimer` (CUDA events on CUDA,
    ``perf_counter`` elsewhere): a window from the start of its first micro-batch to the end of its last. On CPU,
    when ``seconds`` is given, it stops the fit once ``timed`` steps after ``warmup`` have run and add up to
    ``seconds`` (the fit's ``max_steps`` is the cap)."""

    def __init__(self, accumulation: int, device: Any, warmup: int = 0, timed: int = 0, seconds: float = 0.0) -> None:
        self.accumulation, self.warmup, self.timed, self.seconds = accumulation, warmup, timed, seconds
        self.timer = StepTimer(device)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.accumulation == 0:
            self.timer.cancel()  # a step that raised left its window open
            self.timer.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.accumulation or not self.timer.running:
            return
        self.timer.stop()
        if self.seconds > 0 and self.timer.source != "cuda_events":
            timed = self.timer.times_s()[self.warmup :]
            if len(timed) >= self.timed and sum(timed) >= self.seconds:
                trainer.should_stop = True  # at an optimizer step's end: the loop stops before the next batch

    def step_seconds(self) -> list[float]:
        """Seconds of each optimizer step timed, in order (on CUDA, read once the fit has ended)."""
        return self.timer.times_s()


def fit_steps(
    module: Any,
    candidate: Candidate,
    batch: Any,
    device_type: str,
    steps: int,
    accumulation: int,
    clock: Any,
    guard: Any,
) -> list[bool]:
    """``steps`` optimizer steps of ``accumulation`` micro-batches of ``batch`` with a real Trainer in the candidate's
    precision and checkpointing (under ``guard``, a MemoryBudget, when given; ``module``, a copy, is converted to a
    true half precision's dtype in place before), on the plan's CUDA device
    (:func:`cuda_device`) or the CPU. In ``16-mixed`` the fit goes on until ``steps`` optimizer steps were real, at
    most :data:`~lightning_memkit.search.real_steps.MAX_SKIPPED_STEPS` more (the GradScaler skips a step whose gradients
    overflow: it allocates no optimizer state); returns whether each optimizer step was skipped (empty in the other
    precisions)."""
    cuda = device_type == "cuda"
    kwargs = trainer_kwargs(candidate, "gpu" if cuda else "cpu")
    gate = RealSteps(steps) if kwargs["precision"] == "16-mixed" else None
    most = steps + (MAX_SKIPPED_STEPS if gate is not None else 0)
    callbacks = ([clock] if clock is not None else []) + kwargs["callbacks"] + ([gate] if gate is not None else [])
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=[cuda_device().index] if cuda else 1,
        max_steps=most,
        accumulate_grad_batches=accumulation,
        precision=kwargs["precision"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    half = candidate.mode.true_half_dtype()
    if half is not None:
        # what Lightning's HalfPrecision does at fit start (the module) and to every batch, done here on the host, as
        # a user's fit does it before anything reaches the device: the budget counts the half-precision step only
        module.to(dtype=half)
        batch = converted_floats(batch, half)
    data = _Batches(batch, most * accumulation)
    try:
        if guard is not None:
            guard.adopt(training_state_tensors(module, (), batch), "state")
            with guard:
                trainer.fit(module, train_dataloaders=data)
        else:
            trainer.fit(module, train_dataloaders=data)
    finally:
        module.trainer = None  # the trainer (and its optimizers' state) goes with this call
        del trainer, data
    return gate.skipped if gate is not None else []


def copy_of(module: Any) -> Any:
    """A deep copy of ``module`` without its Trainer (the Trainer, its loops and optimizers are not copied), whose
    compiled step methods (``trainer.fit(torch.compile(model))``) run the copy, compiled as the original's
    (:func:`~lightning_memkit._lightning_compat.copy_module`)."""
    attached = attached_trainer(module)
    copied = copy_module(module, {id(attached): None} if attached is not None else {})
    copied.trainer = None
    return copied


def timing_fit(
    copied: Any, candidate: Candidate, micro: Any, device_type: str, warmup: int, timed: int, seconds: float
) -> list[float]:
    """``warmup`` optimizer steps, then at least ``timed`` timed ones (on CPU, until they add up to ``seconds``, at
    most :data:`MAX_TIMED_STEPS`) of ``candidate`` on ``copied``: the timed steps' seconds."""
    cuda = device_type == "cuda"
    timing = 0.0 if cuda else seconds
    steps = warmup + (max(timed, MAX_TIMED_STEPS) if timing > 0 else timed)
    clock = StepClock(candidate.accumulation, cuda_device() if cuda else None, warmup, timed, timing)
    fit_steps(copied, candidate, micro, device_type, steps, candidate.accumulation, clock, None)
    return clock.step_seconds()[warmup:]


def timed_step(
    module: Any, candidate: Candidate, batch: Any, device_type: str, warmup: int, timed: int, seconds: float = 0.0
) -> list[float]:
    """The seconds of the timed optimizer steps of ``candidate`` (see :func:`timing_fit`) on a deep copy of
    ``module``, no memory budget: the rounds that time a plan's trials again, side by side."""
    cuda = device_type == "cuda"
    with preserved_rng(), quiet_lightning():
        copied = copy_of(module)
        micro = rebatch(batch, candidate.micro_batch)
        timed_seconds = timing_fit(copied, candidate, micro, device_type, warmup, timed, seconds)
        del copied, micro
    release(cuda)
    return timed_seconds
